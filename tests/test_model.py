"""Chapter 9: the whole Transformer — equal to nn.Transformer with our embeddings and generator,
causal, blind to padding, with shared weights that are one tensor, a frozen config, and a model
that learns to reverse digits (and fails to once the causal mask is gone)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import transformer_tutorial.layers as layers
from transformer_tutorial.masks import causal_mask
from transformer_tutorial.model import Transformer, TransformerConfig
from transformer_tutorial.reference import copy_transformer

PAD, BOS, EOS = 0, 1, 2
V_SRC, V_TGT = 11, 13
ATOL = 1e-5


def tiny_config(**changes) -> TransformerConfig:
    base = dict(src_vocab_size=V_SRC, tgt_vocab_size=V_TGT, d_model=16, n_heads=4, n_encoder_layers=2,
                n_decoder_layers=2, d_ff=32, dropout=0.0, max_len=32)
    return TransformerConfig(**(base | changes))


def tiny_model(seed: int = 0, **changes) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(tiny_config(**changes)).eval()


@pytest.fixture
def batch():
    """Token ids with padding on both sides: src (3, 7), tgt (3, 6)."""
    g = torch.Generator().manual_seed(0)
    src = torch.randint(3, V_SRC, (3, 7), generator=g)
    tgt = torch.randint(3, V_TGT, (3, 6), generator=g)
    tgt[:, 0] = BOS
    src[1, 5:] = PAD
    src[2, 3:] = PAD
    tgt[0, 4:] = PAD
    tgt[2, 5:] = PAD
    return src, tgt


# --- Equal to PyTorch ----------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("norm_first", [False, True])
def test_equals_nn_transformer_with_our_embeddings_and_generator(batch, norm_first):
    src, tgt = batch
    ours = tiny_model(norm_first=norm_first)
    c = ours.config
    torch.manual_seed(1)
    ref = nn.Transformer(c.d_model, c.n_heads, c.n_encoder_layers, c.n_decoder_layers, c.d_ff, 0.0,
                         batch_first=True, norm_first=norm_first).eval()
    ref.encoder.use_nested_tensor = False  # keep padded rows of the memory computed, as ours are
    if not norm_first:  # nn.Transformer ends both post-norm stacks with a LayerNorm; the paper does not
        ref.encoder.norm = None
        ref.decoder.norm = None
    copy_transformer(ours, ref)
    src_pad, tgt_pad = src == PAD, tgt == PAD
    with torch.no_grad():
        logits = ours(src, tgt)
        hidden = ref(ours.positional(ours.src_embed(src)), ours.positional(ours.tgt_embed(tgt)),
                     tgt_mask=causal_mask(tgt.size(1)), src_key_padding_mask=src_pad,
                     tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad, tgt_is_causal=True)
        expected = ours.generator(hidden)
    assert logits.shape == (3, 6, V_TGT)
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_post_norm_copy_refuses_nn_transformers_extra_final_norm():
    ours = tiny_model()
    c = ours.config
    ref = nn.Transformer(c.d_model, c.n_heads, c.n_encoder_layers, c.n_decoder_layers, c.d_ff, 0.0, batch_first=True)
    with pytest.raises(ValueError, match="final LayerNorm"):
        copy_transformer(ours, ref)


def test_encode_then_decode_equals_forward(batch):
    src, tgt = batch
    model = tiny_model()
    with torch.no_grad():
        memory = model.encode(src)
        assert memory.shape == (3, 7, model.config.d_model)
        logits = model.decode(tgt, memory, memory_key_padding_mask=src == PAD)
        torch.testing.assert_close(logits, model(src, tgt), atol=0, rtol=0)


# --- Invariants -----------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_first", [False, True])
def test_causal_changing_a_target_token_leaves_earlier_logits_unchanged(batch, norm_first):
    src, tgt = batch
    model = tiny_model(norm_first=norm_first)
    with torch.no_grad():
        before = model(src, tgt)
        for t in range(1, 4):
            changed = tgt.clone()
            changed[:, t] = changed[:, t] % (V_TGT - 3) + 3  # another real token
            after = model(src, changed)
            torch.testing.assert_close(after[:, :t], before[:, :t], atol=ATOL, rtol=0)
            assert not torch.allclose(after[:, t], before[:, t], atol=1e-3), f"position {t} must see its own token"


@pytest.mark.parametrize("norm_first", [False, True])
def test_appending_padding_leaves_real_logits_unchanged(batch, norm_first):
    src, tgt = batch
    model = tiny_model(norm_first=norm_first)
    more_src = F.pad(src, (0, 4), value=PAD)
    more_tgt = F.pad(tgt, (0, 3), value=PAD)
    with torch.no_grad():
        logits = model(src, tgt)
        for s, t in [(more_src, tgt), (src, more_tgt), (more_src, more_tgt)]:
            padded = model(s, t)[:, : tgt.size(1)]
            real = tgt != PAD
            torch.testing.assert_close(padded[real], logits[real], atol=ATOL, rtol=0)


def test_source_padding_is_ignored_whatever_it_holds(batch):
    """Padding masks come from pad_id: a different token under an explicit mask changes nothing."""
    src, tgt = batch
    model = tiny_model()
    src_pad = src == PAD
    noisy = src.masked_fill(src_pad, 5)
    with torch.no_grad():
        torch.testing.assert_close(model(noisy, tgt, src_key_padding_mask=src_pad), model(src, tgt), atol=ATOL, rtol=0)


# --- Shared weights, initialisation, configuration -------------------------------------------------


def test_shared_and_tied_weights_are_one_tensor():
    model = tiny_model(tgt_vocab_size=V_SRC, share_embeddings=True, tie_output=True)
    assert model.src_embed.weight is model.tgt_embed.weight is model.generator.weight
    D, V = model.config.d_model, V_SRC
    untied = tiny_model(tgt_vocab_size=V_SRC)
    n = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in untied.parameters()) - n == 2 * V * D
    # One tensor: the gradient of all three uses lands in one .grad.
    model.train()
    ids = torch.tensor([[BOS, 3, 4, 5]])
    model(ids, ids).sum().backward()
    assert model.src_embed.weight.grad is model.generator.weight.grad
    only_shared = tiny_model(tgt_vocab_size=V_SRC, share_embeddings=True)
    assert only_shared.src_embed.weight is only_shared.tgt_embed.weight
    assert only_shared.generator.weight is not only_shared.tgt_embed.weight
    only_tied = tiny_model(tie_output=True)
    assert only_tied.generator.weight is only_tied.tgt_embed.weight
    assert only_tied.src_embed.weight is not only_tied.tgt_embed.weight


@pytest.mark.parametrize("share, tie", [(False, False), (True, True), (False, True)])
def test_init_normal_embeddings_xavier_matrices_zero_biases_and_padding_rows(share, tie):
    """tensor2tensor's rule: embedding tables N(0, 1/D), every other matrix Xavier-uniform, biases 0."""
    V, D = 4000, 64  # a table of 256,000 draws pins its std down to well under 1%
    model = tiny_model(src_vocab_size=V, tgt_vocab_size=V, d_model=D, d_ff=128,
                       share_embeddings=share, tie_output=tie)
    tables = [model.src_embed.weight] + ([] if share else [model.tgt_embed.weight])
    assert (model.src_embed.weight is model.tgt_embed.weight) == share
    assert (model.generator.weight is model.tgt_embed.weight) == tie
    std = D ** -0.5
    for table in tables:
        assert torch.all(table[PAD] == 0)
        real = table[torch.arange(V) != PAD]
        assert abs(real.std().item() - std) < 0.02 * std  # Xavier would give √(2/(V+D)) ≈ 0.18 std
        assert abs(real.mean().item()) < 0.02 * std
        # Normal, not uniform: 68.3% of the draws lie within one std (a uniform of that std: 57.7%).
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


def test_config_is_frozen_and_validates():
    config = tiny_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.d_model = 32
    assert dataclasses.replace(config, d_model=32).d_model == 32
    with pytest.raises(ValueError, match="divisible"):
        tiny_config(d_model=18)
    with pytest.raises(ValueError, match="joint vocabulary"):
        tiny_config(share_embeddings=True)
    with pytest.raises(ValueError, match="pad_id"):
        tiny_config(pad_id=V_SRC)


def test_paper_base_parameter_count_on_meta_device():
    """d_model 512, 8 heads, 6 + 6 layers, d_ff 2048, a shared 37,000-token vocabulary, tied."""
    config = TransformerConfig(37_000, 37_000, share_embeddings=True, tie_output=True)
    with torch.device("meta"):
        model = Transformer(config)
        ref = nn.Transformer(512, 8, 6, 6, 2048, batch_first=True)
    D, F_, V = 512, 2048, 37_000
    attention, feed_forward, norm = 4 * (D * D + D), 2 * D * F_ + F_ + D, 2 * D
    encoder, decoder = 6 * (attention + feed_forward + 2 * norm), 6 * (2 * attention + feed_forward + 3 * norm)
    assert sum(p.numel() for p in model.parameters()) == V * D + encoder + decoder + V == 63_119_496
    # nn.Transformer: the same two stacks plus a final LayerNorm on each.
    assert sum(p.numel() for p in ref.parameters()) == encoder + decoder + 2 * norm


# --- The sanity task: reverse a sequence of digits --------------------------------------------------

DIGITS, MIN_LEN, MAX_LEN = 10, 3, 8
V_TASK = 3 + DIGITS


def reverse_batch(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """src (n, MAX_LEN) padded digits; tgt (n, MAX_LEN + 2) = <bos> reversed digits <eos>, padded."""
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (n,), generator=generator)
    digits = torch.randint(3, V_TASK, (n, MAX_LEN), generator=generator)
    positions = torch.arange(MAX_LEN)
    is_pad = positions >= lengths[:, None]
    src = digits.masked_fill(is_pad, PAD)
    reversed_ = src.gather(1, (lengths[:, None] - 1 - positions).clamp(min=0)).masked_fill(is_pad, PAD)
    tgt = torch.cat([torch.full((n, 1), BOS), reversed_, torch.full((n, 1), PAD)], dim=1)
    tgt[torch.arange(n), lengths + 1] = EOS
    return src, tgt


def greedy(model: Transformer, src: torch.Tensor, steps: int) -> torch.Tensor:
    with torch.no_grad():
        memory = model.encode(src)
        ys = torch.full((src.size(0), 1), BOS)
        for _ in range(steps):
            logits = model.decode(ys, memory, memory_key_padding_mask=src == PAD)
            ys = torch.cat([ys, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ys[:, 1:]


def train_and_score(steps: int, schedule_steps: int = 500) -> tuple[float, float]:
    """Train the chapter's small model for the first ``steps`` steps of a warm-up + linear-decay
    schedule of ``schedule_steps``; return (last loss, greedy exact match)."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    config = TransformerConfig(V_TASK, V_TASK, d_model=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=2,
                               d_ff=128, dropout=0.0, max_len=16, share_embeddings=True, tie_output=True)
    model = Transformer(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98), eps=1e-9, foreach=True)
    warmup = 30
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, (schedule_steps - s) / (schedule_steps - warmup)))
    for _ in range(steps):
        src, tgt = reverse_batch(32, generator)
        logits = model(src, tgt[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, V_TASK), tgt[:, 1:].reshape(-1), ignore_index=PAD)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()
    src, tgt = reverse_batch(500, torch.Generator().manual_seed(1234))
    out, gold = greedy(model, src, tgt.size(1) - 1), tgt[:, 1:]
    exact = ((out == gold) | (gold == PAD)).all(dim=1).float().mean().item()
    return loss.item(), exact


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matrices this small: splitting each product over threads costs more than it saves
    yield
    torch.set_num_threads(threads)


def test_reverse_batch_is_reversed_digits():
    src, tgt = reverse_batch(4, torch.Generator().manual_seed(0))
    for s, t in zip(src.tolist(), tgt.tolist()):
        digits = [x for x in s if x != PAD]
        assert t[: len(digits) + 2] == [BOS, *digits[::-1], EOS]
        assert set(t[len(digits) + 2 :]) <= {PAD}


def test_learns_to_reverse_digits(one_thread):
    loss, exact = train_and_score(500)
    assert loss < 0.05
    assert exact >= 0.99, f"greedy exact match {exact:.3f}"


def test_without_the_causal_mask_training_cheats_and_decoding_collapses(monkeypatch, one_thread):
    """Teacher forcing shows position t the target token t + 1: the loss falls, decoding fails."""
    monkeypatch.setattr(layers, "causal_mask", lambda q_len, k_len=None, *, device=None: torch.zeros(
        q_len, k_len or q_len, dtype=torch.bool, device=device))
    loss, exact = train_and_score(250)
    assert loss < 0.1
    assert exact < 0.1, f"greedy exact match {exact:.3f}"
