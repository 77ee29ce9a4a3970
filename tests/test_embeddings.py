"""Chapters 1 and 2: token embeddings and the sinusoidal positional encoding."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transformer_tutorial.embeddings import (
    SinusoidalPositionalEncoding,
    TokenEmbedding,
    sinusoidal_table,
)


def test_lookup_equals_one_hot_times_table_scaled_by_sqrt_d():
    torch.manual_seed(0)
    V, D = 11, 16
    embed = TokenEmbedding(V, D)
    ids = torch.randint(0, V, (3, 7))
    one_hot = F.one_hot(ids, V).float()  # (B, L, V)
    torch.testing.assert_close(
        embed(ids), one_hot @ embed.weight * math.sqrt(D), rtol=0, atol=1e-6
    )


def test_equals_nn_embedding_with_copied_weights_times_sqrt_d():
    torch.manual_seed(0)
    V, D = 13, 8
    ours = TokenEmbedding(V, D, padding_idx=0)
    ref = nn.Embedding(V, D, padding_idx=0)
    with torch.no_grad():
        ref.weight.copy_(ours.weight)
    ids = torch.randint(0, V, (2, 5))
    ours_out, ref_out = ours(ids), ref(ids)
    torch.testing.assert_close(ours_out, ref_out * math.sqrt(D), rtol=0, atol=1e-5)
    ours_out.sum().backward()
    ref_out.sum().backward()
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad * math.sqrt(D), rtol=0, atol=1e-5)


def test_padding_row_is_zero_and_gets_no_gradient():
    torch.manual_seed(0)
    V, D, pad = 10, 6, 3
    embed = TokenEmbedding(V, D, padding_idx=pad)
    assert torch.equal(embed.weight[pad], torch.zeros(D))
    ids = torch.tensor([[pad, 1, pad, 4]])
    out = embed(ids)
    assert torch.equal(out[0, 0], torch.zeros(D))
    (out**2).sum().backward()
    assert torch.equal(embed.weight.grad[pad], torch.zeros(D))
    assert embed.weight.grad[1].abs().sum() > 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(vocab_size=0, d_model=4), "must be positive"),
        (dict(vocab_size=5, d_model=-1), "must be positive"),
        (dict(vocab_size=5, d_model=4, padding_idx=5), "padding_idx=5"),
        (dict(vocab_size=5, d_model=4, padding_idx=-1), "padding_idx=-1"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TokenEmbedding(**kwargs)


def test_float_ids_raise_type_error():
    embed = TokenEmbedding(5, 4)
    with pytest.raises(TypeError, match="integer tensor"):
        embed(torch.tensor([[1.0, 2.0]]))
    assert embed(torch.tensor([[1, 2]], dtype=torch.int32)).shape == (1, 2, 4)


def test_table_matches_the_closed_form_at_many_positions_and_pairs():
    max_len, D = 2000, 64
    table = sinusoidal_table(max_len, D)
    assert table.shape == (max_len, D) and table.dtype == torch.float32
    rng = random.Random(0)
    for _ in range(2000):
        pos, i = rng.randrange(max_len), rng.randrange(D // 2)
        angle = pos / 10000 ** (2 * i / D)
        assert abs(table[pos, 2 * i].item() - math.sin(angle)) < 1e-6
        assert abs(table[pos, 2 * i + 1].item() - math.cos(angle)) < 1e-6


def rotation(k: int, d_model: int) -> torch.Tensor:
    """The block-diagonal map M_k with M_k @ PE(pos) == PE(pos + k)."""
    omega = 1.0 / 10000.0 ** (torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    c, s = torch.cos(k * omega), torch.sin(k * omega)
    return torch.block_diag(
        *[
            torch.stack([torch.stack([ci, si]), torch.stack([-si, ci])])
            for ci, si in zip(c, s, strict=True)
        ]
    )


@pytest.mark.parametrize("k", [1, 3, 17, 250])
def test_shift_by_k_is_a_fixed_rotation(k):
    D = 32
    table = sinusoidal_table(1500, D).double()
    M = rotation(k, D)
    pos = torch.arange(0, 1500 - k, 7)
    torch.testing.assert_close(table[pos] @ M.T, table[pos + k], rtol=0, atol=1e-5)
    torch.testing.assert_close(M @ M.T, torch.eye(D, dtype=torch.float64))


def test_table_is_a_non_persistent_buffer():
    pe = SinusoidalPositionalEncoding(8, max_len=20)
    assert "pe" in dict(pe.named_buffers())
    assert "pe" not in pe.state_dict()
    assert list(pe.parameters()) == []
    pe.load_state_dict({})  # nothing is expected from a checkpoint


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_output_keeps_the_input_dtype(dtype):
    pe = SinusoidalPositionalEncoding(8, max_len=20)
    x = torch.zeros(2, 5, 8, dtype=dtype)
    out = pe(x)
    assert out.dtype == dtype
    torch.testing.assert_close(
        out[0].float(), sinusoidal_table(5, 8), rtol=0, atol=1e-2 if dtype.itemsize == 2 else 1e-6
    )


def test_buffer_follows_the_module_to_another_device():
    pe = SinusoidalPositionalEncoding(8, max_len=20).to("meta")
    assert pe.pe.device.type == "meta"
    assert pe(torch.empty(2, 5, 8, device="meta")).device.type == "meta"


def test_start_shifts_the_positions():
    pe = SinusoidalPositionalEncoding(8, max_len=20)
    x = torch.zeros(1, 3, 8)
    torch.testing.assert_close(pe(x, start=4)[0], sinusoidal_table(20, 8)[4:7])


def test_too_long_sequence_raises():
    pe = SinusoidalPositionalEncoding(8, max_len=10)
    pe(torch.zeros(1, 10, 8))  # exactly max_len fits
    with pytest.raises(ValueError, match="beyond max_len=10"):
        pe(torch.zeros(1, 11, 8))
    with pytest.raises(ValueError, match="beyond max_len=10"):
        pe(torch.zeros(1, 2, 8), start=9)


def test_odd_d_model_raises():
    with pytest.raises(ValueError, match="d_model must be even"):
        SinusoidalPositionalEncoding(7)


def test_integer_input_raises():
    pe = SinusoidalPositionalEncoding(8, max_len=10)
    with pytest.raises(TypeError, match="floating-point"):
        pe(torch.zeros(1, 3, 8, dtype=torch.long))


def test_dropout_only_in_training():
    torch.manual_seed(0)
    pe = SinusoidalPositionalEncoding(16, max_len=10, dropout=0.5)
    x = torch.randn(2, 6, 16)
    assert not torch.equal(pe(x), x + pe.pe[:6])
    pe.eval()
    torch.testing.assert_close(pe(x), x + pe.pe[:6])
