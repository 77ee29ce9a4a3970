"""Chapter 9: the whole Transformer — equal to PyTorch's with copied weights (both
``norm_first`` values), masks derived from ``pad_id``, shared weights that are one tensor,
tensor2tensor's initialisation, a frozen config, a model that learns to reverse digits (and
cheats once the causal mask is gone), and bad inputs: every config field and every model input
refused with a message that says what is wrong. The stacks are tested in ``test_stacks.py``."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import transformer_tutorial.layers as layers
from helpers import no_causal_mask, raises, tiny_config, to_device
from transformer_tutorial.copy_weights import copy_transformer
from transformer_tutorial.data import BOS_ID, PAD_ID
from transformer_tutorial.masks import causal_mask
from transformer_tutorial.model import Transformer, TransformerConfig

D = 16
ATOL = 1e-5


@pytest.fixture
def ids():
    """Token ids with padding on both sides: src (3, 7) over 11 tokens, tgt (3, 6) over 13."""
    g = torch.Generator().manual_seed(0)
    src = torch.randint(3, 11, (3, 7), generator=g)
    tgt = torch.randint(3, 13, (3, 6), generator=g)
    tgt[:, 0] = BOS_ID
    src[1, 5:] = PAD_ID
    src[2, 3:] = PAD_ID
    tgt[0, 4:] = PAD_ID
    tgt[2, 5:] = PAD_ID
    return src, tgt


# --- the whole model -----------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("norm_first", [False, True])
def test_equals_nn_transformer_with_our_embeddings_and_generator(
    ids, tiny_model, norm_first, device
):
    src, tgt = to_device(ids, device)
    ours = tiny_model(norm_first=norm_first)
    c = ours.config
    torch.manual_seed(1)
    ref = nn.Transformer(
        c.d_model,
        c.n_heads,
        c.n_encoder_layers,
        c.n_decoder_layers,
        c.d_ff,
        0.0,
        batch_first=True,
        norm_first=norm_first,
    ).eval()
    ref.encoder.use_nested_tensor = False  # keep padded rows of the memory computed, as ours are
    if not norm_first:  # nn.Transformer ends post-norm stacks with a LayerNorm; the paper does not
        ref.encoder.norm = None
        ref.decoder.norm = None
    copy_transformer(ours, ref)
    ours, ref = to_device((ours, ref), device)
    src_pad, tgt_pad = src == PAD_ID, tgt == PAD_ID
    with torch.no_grad():
        logits = ours(src, tgt)
        hidden = ref(
            ours.positional(ours.src_embed(src)),
            ours.positional(ours.tgt_embed(tgt)),
            tgt_mask=causal_mask(tgt.size(1), device=device),
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )
        expected = ours.generator(hidden)
    assert logits.shape == (3, 6, c.tgt_vocab_size)
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_encode_then_decode_equals_forward(ids, tiny_model):
    src, tgt = ids
    model = tiny_model()
    with torch.no_grad():
        memory = model.encode(src)
        assert memory.shape == (3, 7, model.config.d_model)
        logits = model.decode(tgt, memory, memory_key_padding_mask=src == PAD_ID)
        torch.testing.assert_close(logits, model(src, tgt), atol=0, rtol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_logits_at_are_the_full_logits_at_those_positions(ids, tiny_model, seed):
    """Training asks for the real target tokens' logits only: the same numbers, no padding."""
    src, tgt = ids
    model = tiny_model(seed=seed)
    at = (tgt != PAD_ID).flatten().nonzero().squeeze(1)  # (N,)
    with torch.no_grad():
        full = model(src, tgt)  # (B, T, V)
        some = model(src, tgt, logits_at=at)  # (N, V)
    assert some.shape == (len(at), model.config.tgt_vocab_size) and len(at) < tgt.numel()
    torch.testing.assert_close(some, full.flatten(0, 1)[at], atol=1e-6, rtol=0)


def test_check_ids_false_skips_the_range_check_only(tiny_model):
    """Ids checked where they were made skip the read back; shape and dtype are always checked."""
    model = tiny_model()
    with pytest.raises(IndexError):  # the embedding's own error: no range check was asked for
        model(torch.tensor([[3, 11]]), BAD_TGT[:1], check_ids=False)
    raises(
        lambda: model(BAD_SRC.float(), BAD_TGT, check_ids=False),
        TypeError,
        "src must hold integer token ids",
    )


@pytest.mark.parametrize("norm_first", [False, True])
def test_masks_come_from_pad_id_appended_padding_changes_nothing(ids, tiny_model, norm_first):
    """No mask is passed: the model finds padding by ``pad_id`` on both sides."""
    src, tgt = ids
    model = tiny_model(norm_first=norm_first)
    more_src = F.pad(src, (0, 4), value=PAD_ID)
    more_tgt = F.pad(tgt, (0, 3), value=PAD_ID)
    real = tgt != PAD_ID
    with torch.no_grad():
        logits = model(src, tgt)
        for s, t in [(more_src, tgt), (src, more_tgt), (more_src, more_tgt)]:
            padded = model(s, t)[:, : tgt.size(1)]
            torch.testing.assert_close(padded[real], logits[real], atol=ATOL, rtol=0)


def test_shared_and_tied_weights_are_one_tensor(tiny_model):
    V = 11
    model = tiny_model(tgt_vocab_size=V, share_embeddings=True, tie_output=True)
    assert model.src_embed.weight is model.tgt_embed.weight is model.generator.weight
    untied = tiny_model(tgt_vocab_size=V)
    n = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in untied.parameters()) - n == 2 * V * model.config.d_model
    # One tensor: the gradient of all three uses lands in one .grad.
    model.train()
    x = torch.tensor([[BOS_ID, 3, 4, 5]])
    model(x, x).sum().backward()
    assert model.src_embed.weight.grad is model.generator.weight.grad
    only_shared = tiny_model(tgt_vocab_size=V, share_embeddings=True)
    assert only_shared.src_embed.weight is only_shared.tgt_embed.weight
    assert only_shared.generator.weight is not only_shared.tgt_embed.weight
    only_tied = tiny_model(tie_output=True)
    assert only_tied.generator.weight is only_tied.tgt_embed.weight
    assert only_tied.src_embed.weight is not only_tied.tgt_embed.weight


@pytest.mark.parametrize("share, tie", [(False, False), (True, True), (False, True)])
def test_init_normal_embeddings_xavier_matrices_zero_biases_and_padding_rows(
    tiny_model, share, tie
):
    """tensor2tensor's rule: embedding tables N(0, 1/D), every other matrix Xavier-uniform,
    biases 0."""
    V, D = 4000, 64  # a table of 256,000 draws pins its std down to well under 1%
    model = tiny_model(
        src_vocab_size=V,
        tgt_vocab_size=V,
        d_model=D,
        d_ff=128,
        share_embeddings=share,
        tie_output=tie,
    )
    tables = [model.src_embed.weight] + ([] if share else [model.tgt_embed.weight])
    std = D**-0.5
    for table in tables:
        assert torch.all(table[PAD_ID] == 0)
        real = table[torch.arange(V) != PAD_ID]
        assert abs(real.std().item() - std) < 0.02 * std  # Xavier would give √(2/(V+D)) ≈ 0.18 std
        assert abs(real.mean().item()) < 0.02 * std
        # Normal, not uniform: 68.3% of draws lie within one std (a uniform of that std: 57.7%).
        assert abs((real.abs() < std).float().mean().item() - 0.6827) < 0.01
    for name, p in model.named_parameters():
        if any(p is table for table in tables):
            continue
        if p.dim() == 2:
            fan_out, fan_in = p.shape
            bound = math.sqrt(6 / (fan_in + fan_out))
            assert p.abs().max() <= bound, name
            assert p.abs().max() > 0.8 * bound, f"{name} does not fill its Xavier range"
        elif name.endswith("bias"):
            assert torch.all(p == 0), name
        else:  # LayerNorm gains
            assert torch.all(p == 1), name


def test_config_is_frozen_and_replace_validates_the_copy(tiny_model):
    config = tiny_model().config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.d_model = 32
    assert dataclasses.replace(config, d_model=32).d_model == 32
    raises(lambda: dataclasses.replace(config, d_model=18), ValueError, "divisible by n_heads=4")


def test_paper_base_parameter_count_on_meta_device():
    """d_model 512, 8 heads, 6 + 6 layers, d_ff 2048, a shared 37,000-token vocabulary, tied."""
    config = TransformerConfig(37_000, 37_000, share_embeddings=True, tie_output=True)
    with torch.device("meta"):
        model = Transformer(config)
        ref = nn.Transformer(512, 8, 6, 6, 2048, batch_first=True)
    D, F_, V = 512, 2048, 37_000
    attention, feed_forward, norm = 4 * (D * D + D), 2 * D * F_ + F_ + D, 2 * D
    encoder = 6 * (attention + feed_forward + 2 * norm)
    decoder = 6 * (2 * attention + feed_forward + 3 * norm)
    assert (
        sum(p.numel() for p in model.parameters()) == V * D + encoder + decoder + V == 63_119_496
    )
    # nn.Transformer: the same two stacks plus a final LayerNorm on each.
    assert sum(p.numel() for p in ref.parameters()) == encoder + decoder + 2 * norm


# --- bad inputs: every config field, every model input -----------------------------------------

CONFIG_ROWS = [
    ({"n_heads": 0}, ValueError, "n_heads must be at least 1, got 0"),
    ({"n_heads": 3}, ValueError, "d_model=16 must be divisible by n_heads=3"),
    ({"n_encoder_layers": -1}, ValueError, "n_encoder_layers must be at least 1, got -1"),
    ({"n_decoder_layers": 0}, ValueError, "n_decoder_layers must be at least 1, got 0"),
    ({"d_ff": -4}, ValueError, "d_ff must be at least 1, got -4"),
    ({"max_len": -1}, ValueError, "max_len must be at least 1, got -1"),
    ({"d_model": 15, "n_heads": 5}, ValueError, "d_model=15 must be even"),
    ({"d_model": 16.0}, TypeError, "d_model must be an int, got 16.0"),
    ({"src_vocab_size": 0}, ValueError, "src_vocab_size must be at least 1, got 0"),
    ({"tgt_vocab_size": True}, TypeError, "tgt_vocab_size must be an int"),
    ({"dropout": 1.5}, ValueError, "dropout must be in [0.0, 1.0), got 1.5"),
    ({"dropout": -0.1}, ValueError, "dropout must be in [0.0, 1.0)"),
    ({"dropout": float("nan")}, ValueError, "dropout must be in"),
    ({"layer_norm_eps": 0.0}, ValueError, "layer_norm_eps must be greater than 0.0"),
    (
        {"activation": "tanh"},
        ValueError,
        "activation must be one of ['gelu', 'gelu_tanh', 'relu']",
    ),
    ({"norm_first": "yes"}, TypeError, "norm_first must be True or False"),
    ({"pad_id": 20}, ValueError, "pad_id=20 is not an id of both vocabularies"),
    ({"pad_id": 11}, ValueError, "pad_id=11 is not an id of both vocabularies"),  # tgt's only
    ({"pad_id": -1}, ValueError, "pad_id must be at least 0"),
    ({"share_embeddings": True}, ValueError, "share_embeddings needs one joint vocabulary"),
]


@pytest.mark.parametrize(("changes", "error", "phrase"), CONFIG_ROWS, ids=str)
def test_transformer_config_refuses_bad_fields(changes, error, phrase):
    raises(lambda: tiny_config(**changes), error, phrase)


BAD_SRC = torch.tensor([[3, 4, 5, PAD_ID], [6, 7, 8, 9]])
BAD_TGT = torch.tensor([[BOS_ID, 3, 4], [BOS_ID, 5, PAD_ID]])
MODEL_INPUT_ROWS = [
    (
        "src id = V",
        lambda m: m(torch.tensor([[3, 11]]), BAD_TGT[:1]),
        ValueError,
        "valid ids are 0 to 10 (the vocabulary has 11 tokens)",
    ),
    (
        "negative tgt id",
        lambda m: m(BAD_SRC, torch.tensor([[1, -2, 3], [1, 2, 3]])),
        ValueError,
        "tgt holds ids from -2 to 3; valid ids are 0 to 12",
    ),
    (
        "float ids",
        lambda m: m(BAD_SRC.float(), BAD_TGT),
        TypeError,
        "src must hold integer token ids",
    ),
    (
        "1-D ids",
        lambda m: m(BAD_SRC[0], BAD_TGT),
        ValueError,
        "src must be token ids of shape (B, L)",
    ),
    (
        "batch mismatch",
        lambda m: m(BAD_SRC, BAD_TGT[:1]),
        ValueError,
        "src and tgt must hold the same number of sentences: src has 2 rows",
    ),
    (
        "too long",
        lambda m: m(torch.full((1, 40), 3), BAD_TGT[:1]),
        ValueError,
        "beyond max_len=32",
    ),
    (
        "memory width",
        lambda m: m.decode(BAD_TGT, torch.zeros(2, 4, 8)),
        ValueError,
        "memory must be the encoder's output (B, S, D) = (2, S, 16)",
    ),
    (
        "memory batch",
        lambda m: m.decode(BAD_TGT, torch.zeros(3, 4, 16)),
        ValueError,
        "memory must be the encoder's output",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "phrase"),
    [r[1:] for r in MODEL_INPUT_ROWS],
    ids=[r[0] for r in MODEL_INPUT_ROWS],
)
def test_model_refuses_bad_inputs(tiny_model, call, error, phrase):
    model = tiny_model()
    raises(lambda: call(model), error, phrase)


# --- the sanity task: reverse a sequence of digits -----------------------------------------------


def greedy(model: Transformer, src: torch.Tensor, steps: int) -> torch.Tensor:
    with torch.no_grad():
        memory = model.encode(src)
        ys = torch.full((src.size(0), 1), BOS_ID)
        for _ in range(steps):
            logits = model.decode(ys, memory, memory_key_padding_mask=src == PAD_ID)
            ys = torch.cat([ys, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ys[:, 1:]


def train_and_score(task, steps: int, schedule_steps: int = 500) -> tuple[float, float]:
    """Train the chapter's small model for the first ``steps`` steps of a warm-up + linear-decay
    schedule of ``schedule_steps``; return (last loss, greedy exact match)."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    V = task.vocab_size
    config = TransformerConfig(
        V,
        V,
        d_model=64,
        n_heads=4,
        n_encoder_layers=2,
        n_decoder_layers=2,
        d_ff=128,
        dropout=0.0,
        max_len=16,
        share_embeddings=True,
        tie_output=True,
    )
    model = Transformer(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98), eps=1e-9)
    warmup = 30

    def rate(s: int) -> float:
        return min((s + 1) / warmup, (schedule_steps - s) / (schedule_steps - warmup))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    for _ in range(steps):
        src, tgt = task.batch(32, generator)
        logits = model(src, tgt[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=PAD_ID)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()
    src, tgt = task.batch(500, torch.Generator().manual_seed(1234))
    out, gold = greedy(model, src, tgt.size(1) - 1), tgt[:, 1:]
    exact = ((out == gold) | (gold == PAD_ID)).all(dim=1).float().mean().item()
    return loss.item(), exact


def test_digit_reversal_batches_are_reversed_digits(digit_reversal):
    src, tgt = digit_reversal.batch(4, torch.Generator().manual_seed(0))
    for s, t in zip(src.tolist(), tgt.tolist(), strict=True):
        digits = [x for x in s if x != PAD_ID]
        assert t[: len(digits) + 2] == [BOS_ID, *digits[::-1], 2]
        assert set(t[len(digits) + 2 :]) <= {PAD_ID}


@pytest.mark.slow
def test_learns_to_reverse_digits(digit_reversal):
    loss, exact = train_and_score(digit_reversal, 500)
    assert loss < 0.05
    assert exact >= 0.99, f"greedy exact match {exact:.3f}"


@pytest.mark.slow
def test_without_the_causal_mask_training_cheats_and_decoding_collapses(
    digit_reversal, monkeypatch
):
    """Teacher forcing shows position t the target token t + 1: the loss falls, decoding fails."""
    monkeypatch.setattr(layers, "causal_mask", no_causal_mask)
    loss, exact = train_and_score(digit_reversal, 250)
    assert loss < 0.1
    assert exact < 0.1, f"greedy exact match {exact:.3f}"
