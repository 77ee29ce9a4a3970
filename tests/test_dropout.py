"""dropout.py: nn.Dropout's operation with a mask drawn from a quarter of the random numbers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import tiny_config
from transformer_tutorial import dropout
from transformer_tutorial.attention import MultiHeadAttention, scaled_dot_product_attention
from transformer_tutorial.dropout import (
    CheapDropout,
    cheap_dropout,
    cheap_masks_pay,
    keep_mask,
    with_cheap_dropout,
)
from transformer_tutorial.model import Transformer


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_each_element_is_kept_with_probability_one_minus_p(p):
    torch.manual_seed(0)
    n = 2_000_000
    kept = keep_mask((n,), p, torch.device("cpu")).double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)  # the binomial's spread of the kept share
    assert abs(kept - (1 - p)) < 5 * sigma + 2**-16  # 2⁻¹⁶: p rounded to 15 bits


def test_neighbouring_elements_are_independent():
    """Four elements come from one 64-bit draw: each of the four keeps independently."""
    torch.manual_seed(0)
    keep = keep_mask((500_000, 4), 0.5, torch.device("cpu")).double()
    both = (keep[:, :, None] * keep[:, None, :]).mean(0)  # P(i and j kept), (4, 4)
    off_diagonal = both[~torch.eye(4, dtype=torch.bool)]
    assert torch.allclose(off_diagonal, torch.full_like(off_diagonal, 0.25), atol=0.005)
    assert torch.allclose(keep.mean(0), torch.full((4,), 0.5, dtype=torch.float64), atol=0.005)


def test_output_and_gradient_are_dropouts_for_the_mask_drawn():
    """Given the mask, the output and the gradient are exactly F.dropout's formula: kept
    elements scaled by 1 / (1 - p), the rest zero, and the same for the gradient."""
    p = 0.25
    x = torch.randn(64, 33, requires_grad=True)
    torch.manual_seed(3)
    out = cheap_dropout(x, p)
    torch.manual_seed(3)
    keep = keep_mask(x.shape, p, x.device)  # the same draws
    torch.testing.assert_close(out, torch.where(keep, x / (1 - p), 0.0), rtol=1e-6, atol=0)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    torch.testing.assert_close(
        x.grad, torch.where(keep, grad_out / (1 - p), 0.0), rtol=1e-6, atol=0
    )


def test_module_is_nn_dropout_when_evaluating_off_the_cpu_or_in_place():
    x = torch.randn(8, 16)
    drop = CheapDropout(0.5).eval()
    assert torch.equal(drop(x), x)
    assert isinstance(drop, nn.Dropout) and drop.p == 0.5
    torch.manual_seed(1)
    in_place = CheapDropout(0.5, inplace=True).train()(x.clone())
    torch.manual_seed(1)
    assert torch.equal(in_place, F.dropout(x.clone(), 0.5, training=True, inplace=True))
    torch.manual_seed(2)
    first = CheapDropout(0.5).train()(x)
    torch.manual_seed(2)
    assert torch.equal(first, CheapDropout(0.5).train()(x))  # the seed fixes the mask


def test_with_cheap_dropout_swaps_every_nn_dropout_and_keeps_the_model_equal_when_evaluating():
    torch.manual_seed(0)
    model = Transformer(tiny_config(dropout=0.2))
    plain = [m for m in model.modules() if type(m) is nn.Dropout]
    src, tgt = torch.randint(4, 11, (3, 7)), torch.randint(4, 13, (3, 6))
    before = model.eval()(src, tgt)
    assert with_cheap_dropout(model) is model
    swapped = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert len(swapped) == len(plain) > 0 and all(type(m) is CheapDropout for m in swapped)
    assert all(m.p == 0.2 for m in swapped)
    assert set(model.state_dict()) == set(Transformer(tiny_config(dropout=0.2)).state_dict())
    assert torch.equal(model.eval()(src, tgt), before)
    model.train()
    torch.manual_seed(5)
    one = model(src, tgt)
    torch.manual_seed(5)
    assert torch.equal(model(src, tgt), one) and not torch.equal(one, before)


def test_the_mask_is_four_15_bit_numbers_of_each_64_bit_draw_against_round_p():
    """keep_mask written out by hand from the same draws: element 4k + i keeps when bits
    16i .. 16i + 14 of draw k reach round(p · 2¹⁵) (little-endian int16 views)."""
    p, n = 0.3, 4 * 1000 + 3  # a length that is not a multiple of 4
    torch.manual_seed(7)
    words = torch.empty((n + 3) // 4, dtype=torch.int64).random_()
    chunks = torch.stack([(words >> (16 * i)) & 0x7FFF for i in range(4)], dim=1).flatten()[:n]
    torch.manual_seed(7)
    assert torch.equal(keep_mask((n,), p, torch.device("cpu")), chunks >= round(p * 2**15))


@pytest.mark.parametrize("p", [1 - 2**-17, 1.0])
def test_p_at_or_within_2_to_the_minus_16_of_one_keeps_nothing(p):
    x = torch.randn(1000, requires_grad=True)
    assert not keep_mask(x.shape, p, x.device).any()
    out = cheap_dropout(x, p)
    assert torch.equal(out, torch.zeros_like(x))
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_off_the_cpu_the_module_is_nn_dropout(monkeypatch):
    def refuse(*args):
        raise AssertionError("cheap_dropout ran off the CPU")

    monkeypatch.setattr(dropout, "cheap_dropout", refuse)
    out = CheapDropout(0.5).train()(torch.empty(4, 8, device="meta"))
    assert out.shape == (4, 8) and out.device.type == "meta"


@pytest.mark.parametrize(
    ("cpu", "mkl", "device", "pays"),
    [
        ("AMD EPYC 7B13", True, "cpu", True),  # PyTorch draws one number at a time there
        ("Intel(R) Xeon(R) Platinum 8481C", True, "cpu", False),  # MKL's vectorised draws
        ("Intel(R) Xeon(R) Platinum 8481C", False, "cpu", True),  # a torch without MKL
        ("AMD EPYC 7B13", True, "cuda", False),  # a GPU draws in bulk
    ],
)
def test_cheap_masks_pay_where_pytorch_draws_one_number_at_a_time(
    monkeypatch, cpu, mkl, device, pays
):
    monkeypatch.setattr(dropout, "cpu_name", lambda: cpu)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)
    assert cheap_masks_pay(torch.device(device)) is pays


def test_attention_drops_its_weights_with_the_cheap_mask_once_swapped():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2, dropout=0.3).train()
    assert mha.drop_weights is None  # PyTorch's fused kernel, nn.MultiheadAttention's masks
    with_cheap_dropout(mha)
    assert mha.drop_weights is cheap_dropout
    x = torch.randn(2, 5, 16)
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
    torch.manual_seed(1)
    out, _ = mha(x, x, x, attn_mask=causal)
    # The written-out attention, its weights dropped with the mask the same seed draws.
    q, kv = mha.project_qkv(x)
    torch.manual_seed(1)
    heads, _ = scaled_dot_product_attention(
        q, kv.k, kv.v, attn_mask=causal, dropout_p=0.3, dropout=cheap_dropout
    )
    expected = mha.out_proj(heads.transpose(1, 2).reshape(2, 5, 16))
    assert torch.allclose(out, expected, atol=1e-6)
    # The share of weights dropped is p, and evaluating drops none.
    torch.manual_seed(2)
    long = torch.randn(4, 200, 16)
    _, weights = mha(long, long, long, need_weights=True)
    dropped = (weights == 0).double().mean().item()
    assert abs(dropped - 0.3) < 5 * math.sqrt(0.3 * 0.7 / weights.numel())
    _, weights = mha.eval()(long, long, long, need_weights=True)
    assert (weights > 0).all()


def test_off_the_cpu_attention_leaves_its_weights_to_pytorchs_kernel():
    """On a GPU the fused kernel drops the weights itself: the cheap mask is not used there (the
    meta device stands in for one: shapes only)."""

    def must_not_run(weights, p):
        raise AssertionError("the cheap mask ran off the CPU")

    mha = MultiHeadAttention(16, 2, dropout=0.3).train().to("meta")
    mha.drop_weights = must_not_run
    x = torch.empty(2, 5, 16, device="meta")
    out, _ = mha(x, x, x)
    assert out.shape == (2, 5, 16) and out.device.type == "meta"
