"""Chapter 10's loss on translation pairs: the validation loss is training's criterion per
token with dropout off, and a batch's loss computed at the real target tokens only equals the
loss over every position with ``ignore_index`` (values and gradients). Ids outside the
vocabulary are refused where the pairs come in (``test_trainer.py``, with the trainer's)."""

from __future__ import annotations

import pytest
import torch

from transformer_tutorial.data import PAD_ID, collate
from transformer_tutorial.optim import translation_loss
from transformer_tutorial.pair_loss import batch_loss, evaluate_loss

VOCAB = 13  # the digit-reversal task's


@pytest.fixture(scope="module")
def pairs(digit_reversal):
    """(training pairs, validation pairs) of the digit-reversal task."""
    return digit_reversal.pairs(48, seed=1), digit_reversal.pairs(12, seed=2)


def test_evaluate_loss_is_the_training_criterion_per_token_with_dropout_off(pairs, tiny_model):
    model = tiny_model(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, dropout=0.5).train()
    val = pairs[1]
    loss = evaluate_loss(
        model, val, max_tokens=10_000, label_smoothing=0.1, device=torch.device("cpu")
    )
    assert model.training  # its mode is given back
    src, tgt_in, tgt_out = collate(val)
    with torch.no_grad():
        expected = translation_loss(
            model.eval()(src, tgt_in), tgt_out, smoothing=0.1, ignore_index=PAD_ID
        )
    assert loss == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_loss_without_padding_logits_equals_the_full_loss_and_gradients(
    pairs, tiny_model, seed, threads
):
    """The output layer and the loss run on the real target tokens only: the same loss and
    gradients (float32, to 1e-5 relative) as logits for every position and ``ignore_index``.
    With dropout on: both draw the same masks (they differ after the decoder only)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    batch = pairs[0][:16]
    model = tiny_model(seed=seed, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, dropout=0.1)
    model.train()
    results = []
    try:
        for padding_free in (True, False):
            torch.manual_seed(seed)
            model.zero_grad()
            if padding_free:
                loss, tokens = batch_loss(
                    model, batch, label_smoothing=0.1, device=torch.device("cpu"), precision="fp32"
                )
            else:
                src, tgt_in, tgt_out = collate(batch)
                loss = translation_loss(
                    model(src, tgt_in),
                    tgt_out,
                    smoothing=0.1,
                    ignore_index=PAD_ID,
                    reduction="sum",
                )
                tokens = int((tgt_out != PAD_ID).sum())
            loss.backward()
            results.append((loss.detach(), tokens, [p.grad.clone() for p in model.parameters()]))
    finally:
        torch.set_num_threads(before)
    (loss, tokens, grads), (full_loss, full_tokens, full_grads) = results
    assert tokens == full_tokens
    torch.testing.assert_close(loss, full_loss, rtol=1e-5, atol=0)
    for grad, full in zip(grads, full_grads, strict=True):
        torch.testing.assert_close(grad, full, rtol=1e-5, atol=1e-7)
