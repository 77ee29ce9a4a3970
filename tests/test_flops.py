"""flops.py: FlopCounterMode's count of a Linear layer is 2·B·in·out forward and 3× that with
the backward; the CPU's fused attention counts what the written-out attention counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transformer_tutorial.attention import scaled_dot_product_attention
from transformer_tutorial.flops import attention_flops, count_flops


def test_linear_counts_two_flops_per_multiply_add_and_three_times_that_with_backward():
    batch, d_in, d_out = 6, 10, 7
    layer = nn.Linear(d_in, d_out)
    x = torch.randn(batch, d_in, requires_grad=True)
    forward = count_flops(lambda: layer(x))
    assert forward == 2 * batch * d_in * d_out
    # backward: grad @ Wᵀ for the input and gradᵀ @ x for the weight, each as large again
    assert count_flops(lambda: layer(x).sum().backward()) == 3 * forward


def test_elementwise_operators_count_nothing():
    x = torch.randn(8, 16)
    assert count_flops(lambda: F.layer_norm(x.softmax(-1), (16,)).relu()) == 0


@pytest.mark.parametrize("mask", [False, True])
def test_fused_attention_counts_what_the_written_out_attention_counts(mask):
    B, H, L, S, Dh = 2, 3, 5, 7, 4
    q = torch.randn(B, H, L, Dh, requires_grad=True)
    k, v = (torch.randn(B, H, S, Dh, requires_grad=True) for _ in range(2))
    attn_mask = torch.rand(L, S) < 0.7 if mask else None
    attn_mask = None if attn_mask is None else attn_mask.index_fill(1, torch.tensor([0]), True)

    def fused():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)

    def written_out():
        blocked = None if attn_mask is None else ~attn_mask
        return scaled_dot_product_attention(q, k, v, attn_mask=blocked)[0]

    forward = attention_flops(q.shape, k.shape, v.shape)
    assert forward == 2 * B * H * L * S * (Dh + Dh)
    assert count_flops(fused) == count_flops(written_out) == forward
    assert count_flops(lambda: fused().sum().backward()) == 3 * forward
    assert count_flops(lambda: written_out().sum().backward()) == 3 * forward


def test_count_flops_needs_a_callable():
    with pytest.raises(TypeError, match="fn must be a callable"):
        count_flops(torch.ones(2))
