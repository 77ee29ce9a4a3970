"""lm_layer: the decoder-only layer equals PyTorch's encoder layer under a causal mask (both
``norm_first`` values), and with chapter 16's attention it continues from a cache without
changing it. (The whole model: test_lm_model.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import to_device
from transformer_tutorial.copy_weights import copy_encoder_layer
from transformer_tutorial.lm.config import LLAMA, LMConfig
from transformer_tutorial.lm.layer import DecoderOnlyLayer
from transformer_tutorial.masks import causal_mask

B, T, D, H, D_FF = 3, 9, 16, 4, 32
ATOL = 1e-5


def tiny(**changes) -> LMConfig:
    sizes = dict(vocab_size=23, d_model=D, n_heads=H, n_layers=1, d_ff=D_FF, max_len=12)
    return LMConfig(**(sizes | dict(dropout=0.0) | changes))


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_layer_equals_pytorch_encoder_layer_with_a_causal_mask(norm_first, activation, device):
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(
        D, H, D_FF, 0.0, activation, batch_first=True, norm_first=norm_first
    ).eval()
    ours = DecoderOnlyLayer(tiny(norm_first=norm_first, activation=activation)).eval()
    copy_encoder_layer(ours, ref)
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(2))
    ours, ref, x = to_device((ours, ref, x), device)
    # The reference is the layer's written-out computation: in eval mode under no_grad PyTorch
    # would take its fused "fast path", whose GELU on CUDA differs from the exact one by ~1e-4
    # (measured on an H200), so the fast path is off while the reference runs.
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            expected = ref(x, src_mask=causal_mask(T, device=device), is_causal=True)
            got, kv = ours(x)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)
    assert kv.k.shape == kv.v.shape == (B, H, T, D // H)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grouped_layer_continues_from_a_cache_it_leaves_unchanged(seed):
    """Chapter 16's attention in the layer: the last positions after a cache of the first ones
    give the whole sequence's outputs, and the cache passed in still holds only the first."""
    torch.manual_seed(seed)
    layer = DecoderOnlyLayer(tiny(**LLAMA, n_kv_heads=2)).eval()
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed + 10))
    with torch.no_grad():
        whole, _ = layer(x)
        first, past = layer(x[:, :5])
        k_before = past.k.clone()
        rest, after = layer(x[:, 5:], past)
    torch.testing.assert_close(torch.cat([first, rest], 1), whole, atol=ATOL, rtol=ATOL)
    assert past.seen == 5 and torch.equal(past.k, k_before)
    assert after.seen == T and after.k.shape == (B, 2, T, D // H)
