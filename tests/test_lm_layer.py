"""lm.layer: the decoder-only layer equals PyTorch's encoder layer under a causal mask (both
``norm_first`` values), and with every attention it continues from the cache it was given,
which it changes in place. (The whole model: test_lm_model.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import raises, to_device
from transformer_tutorial.copy_weights import copy_encoder_layer
from transformer_tutorial.lm.cache import SequenceBuffers
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
            cache = SequenceBuffers(ours.self_attn.cache_layout)
            got = ours(x, cache)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)
    assert (
        cache.buffers[0].shape == cache.buffers[1].shape == (B, H, T, D // H) and cache.seen == T
    )


MLA = dict(attention="mla", kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
ATTENTIONS = {
    "mha": {},
    "gqa": dict(LLAMA, n_kv_heads=2),
    "gqa-window": dict(LLAMA, n_kv_heads=1, window=4),
    "mla": dict(LLAMA, **MLA),
}


@pytest.mark.parametrize("kind", ["growing", "preallocated"])
@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("seed", [0, 1])
def test_layer_continues_from_the_cache_it_changes_in_place(seed, attention, kind):
    """Every attention answers the layer's one call: the last positions after a cache of the
    first ones give the whole sequence's outputs, and the cache given now holds them all."""
    torch.manual_seed(seed)
    layer = DecoderOnlyLayer(tiny(**ATTENTIONS[attention])).eval()
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed + 10))
    layout = layer.self_attn.cache_layout
    cache = (
        SequenceBuffers(layout) if kind == "growing" else SequenceBuffers.preallocate(layout, B, T)
    )
    with torch.no_grad():
        whole = layer(x)
        first = layer(x[:, :5], cache)
        assert cache.seen == 5
        rest = layer(x[:, 5:], cache)
    torch.testing.assert_close(torch.cat([first, rest], 1), whole, atol=ATOL, rtol=ATOL)
    assert cache.seen == T and cache.preallocated == (kind == "preallocated")


# --- API probes (issue 42): each bad call, and what its error must say ------------------------

XL = torch.randn(1, 3, D)
MOE = dict(LLAMA) | dict(n_experts=4, n_experts_per_token=2)
LAYER_PROBES = {
    "config a dict": (
        lambda: DecoderOnlyLayer({"d_model": D}),
        TypeError,
        "config must be an LMConfig, got dict",
    ),
    "layer a float": (
        lambda: DecoderOnlyLayer(tiny(**MOE), 0.0),
        TypeError,
        "layer must be an int, got 0.0",
    ),
    "layer past the last": (
        lambda: DecoderOnlyLayer(tiny(**MOE), 3),
        ValueError,
        "layer must be 0 to 0 (n_layers), got 3",
    ),
    "x a list": (
        lambda: DecoderOnlyLayer(tiny())([[0.0] * D]),
        TypeError,
        "x must be a Tensor (B, T_new, D), got list",
    ),
    "x of another width": (
        lambda: DecoderOnlyLayer(tiny())(torch.randn(1, 3, D - 1)),
        ValueError,
        f"x must be (B, T_new, D={D}), got (1, 3, {D - 1})",
    ),
    "integer x": (
        lambda: DecoderOnlyLayer(tiny())(XL.long()),
        TypeError,
        "x must be a floating-point tensor, got torch.int64",
    ),
    "padding mask one position too long": (
        lambda: DecoderOnlyLayer(tiny())(XL, padding_mask=torch.zeros(1, 4, dtype=torch.bool)),
        ValueError,
        "padding_mask must be (B, S_past + T_new) = (1, 0 + 3), True at padding, got (1, 4)",
    ),
    "padding mask a list": (
        lambda: DecoderOnlyLayer(tiny())(XL, padding_mask=[[False] * 3]),
        TypeError,
        "padding_mask must be a Tensor (B, S), got list",
    ),
    "router logits a tuple": (
        lambda: DecoderOnlyLayer(tiny(**MOE))(XL, router_logits=()),
        TypeError,
        "router_logits must be a list (the layer appends to it) or None, got tuple",
    ),
}


@pytest.mark.parametrize(
    ("call", "error", "phrase"), LAYER_PROBES.values(), ids=LAYER_PROBES.keys()
)
def test_bad_calls_name_the_argument_and_what_is_valid(call, error, phrase):
    raises(call, error, phrase)
