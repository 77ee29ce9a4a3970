"""lm_pieces: each factory builds the piece its name chooses, with the config's sizes and eps;
rotary positions add nothing to the embeddings and enter attention as a module hook; the LLAMA
and QWEN3 choices are fixed and valid. (The whole model with each choice:
test_lm_model.py; equal to transformers' models: test_lm_gpt2_weights.py,
test_lm_hf_weights.py.)"""

from __future__ import annotations

import pytest
import torch

from helpers import raises
from transformer_tutorial.attention import MultiHeadAttention
from transformer_tutorial.embeddings import SinusoidalPositionalEncoding
from transformer_tutorial.feed_forward import SwiGLU
from transformer_tutorial.layers import ACTIVATIONS, FeedForward, LayerNorm
from transformer_tutorial.lm.config import LLAMA, QWEN3, LMConfig
from transformer_tutorial.lm.grouped_attention import GroupedQueryAttention
from transformer_tutorial.lm.pieces import (
    LearnedPositionalEmbedding,
    PositionsInAttention,
    make_attention,
    make_feed_forward,
    make_norm,
    make_positions,
    make_rotary,
)
from transformer_tutorial.lm.rope_scaling import RopeScaling, scaled_rotary
from transformer_tutorial.lm.rotary import RotaryPositions
from transformer_tutorial.norms import RMSNorm

SIZES = dict(vocab_size=11, d_model=16, n_heads=4, n_layers=1, d_ff=24, max_len=8)


def config(**changes) -> LMConfig:
    return LMConfig(**(SIZES | changes))


def test_norms_carry_the_configs_eps():
    layer, rms = make_norm(config(layer_norm_eps=1e-3)), make_norm(config(norm="rms"))
    assert isinstance(layer, LayerNorm) and layer.eps == 1e-3
    assert isinstance(rms, RMSNorm) and rms.eps == 1e-5 and rms.weight.shape == (16,)


def test_feed_forwards_follow_activation_and_bias():
    ff = make_feed_forward(config(activation="relu"))
    assert isinstance(ff, FeedForward) and ff.linear1.bias is not None
    gpt2 = make_feed_forward(config(dropout=0.25))  # the default: GPT-2's tanh GELU
    assert gpt2.activation is ACTIVATIONS["gelu_tanh"] and gpt2.dropout.p == 0.25
    swiglu = make_feed_forward(config(activation="swiglu"))
    assert isinstance(swiglu, SwiGLU) and swiglu.gate_proj.weight.shape == (24, 16)
    assert swiglu.gate_proj.bias is not None  # bias=True, GPT-2's default, reaches it
    assert make_feed_forward(config(activation="swiglu", bias=False)).up_proj.bias is None


def test_positions_and_attention_by_name():
    assert isinstance(make_positions(config()), LearnedPositionalEmbedding)
    assert isinstance(make_positions(config(positions="sinusoidal")), SinusoidalPositionalEncoding)
    assert isinstance(make_attention(config()), MultiHeadAttention)
    rope = config(attention="gqa", positions="rope", n_kv_heads=2, d_head=6, window=3)
    none_added = make_positions(rope).eval()
    x = torch.randn(2, 5, 16)
    assert isinstance(none_added, PositionsInAttention) and torch.equal(none_added(x, 3), x)
    attn = make_attention(rope)
    assert isinstance(attn, GroupedQueryAttention) and isinstance(attn.rotary, RotaryPositions)
    assert (attn.n_kv_heads, attn.d_head, attn.window) == (2, 6, 3)
    assert attn.rotary.rotary.max_len == 8 and attn.q_norm is None
    plain = make_attention(config(attention="gqa"))
    assert plain.rotary is None and plain.n_kv_heads == 4 and plain.q_proj.bias is not None


def test_attention_gets_the_configs_rope_scaling_and_partial_rotary():
    """Chapter 18's settings reach the hook: its tables are scaled_rotary's, not plain ones."""
    scaling = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=4)
    changes = dict(attention="gqa", positions="rope", d_head=8, rope_base=100.0, max_len=32)
    hook = make_attention(config(**changes, rope_scaling=scaling, partial_rotary_factor=0.5))
    expected = scaled_rotary(
        8, max_len=32, base=100.0, scaling=scaling, partial_rotary_factor=0.5
    ).rotary
    assert torch.equal(hook.rotary.rotary.cos, expected.cos)
    assert torch.equal(hook.rotary.rotary.sin, expected.sin)
    assert hook.rotary.rotary.cos.shape == (32, 4)  # 4 of 8 coordinates turn
    plain = make_attention(config(**changes)).rotary.rotary
    assert plain.cos.shape == (32, 8) and plain.attention_scaling == 1.0


def test_llama_and_qwen3_choices_are_fixed_and_valid():
    with pytest.raises(TypeError):
        LLAMA["norm"] = "layer"  # type: ignore[index]
    llama, qwen3 = config(**LLAMA), config(**QWEN3)
    assert set(QWEN3.items()) - set(LLAMA.items()) == {("qk_norm", True)}
    assert not llama.bias and not llama.tie_embeddings and qwen3.qk_norm
    assert isinstance(make_attention(qwen3).q_norm, RMSNorm)


# --- API probes (issue 42): each bad call, and what its error must say ------------------------

X3 = torch.randn(1, 3, 16)
MOE = dict(LLAMA) | dict(n_experts=4, n_experts_per_token=2, n_layers=2)
PIECES_PROBES = {
    "make_norm: a dict": (
        lambda: make_norm({"d_model": 16}),
        TypeError,
        "config must be an LMConfig, got dict",
    ),
    "make_feed_forward: a dict": (
        lambda: make_feed_forward({"d_model": 16}),
        TypeError,
        "config must be an LMConfig, got dict",
    ),
    "make_feed_forward: layer a float": (
        lambda: make_feed_forward(config(**MOE), 1.0),
        TypeError,
        "layer must be an int, got 1.0",
    ),
    "make_feed_forward: layer past the last": (
        lambda: make_feed_forward(config(**MOE), 7),
        ValueError,
        "layer must be 0 to 1 (n_layers), got 7",
    ),
    "make_feed_forward: layer -1": (
        lambda: make_feed_forward(config(**MOE), -1),
        ValueError,
        "layer must be at least 0, got -1",
    ),
    "make_positions: a dict": (
        lambda: make_positions({"positions": "rope"}),
        TypeError,
        "config must be an LMConfig, got dict",
    ),
    "make_rotary: a dict": (
        lambda: make_rotary({"positions": "rope"}),
        TypeError,
        "config must be an LMConfig, got dict",
    ),
    "make_rotary: checked not a bool": (
        lambda: make_rotary(config(), checked=1),
        TypeError,
        "checked must be True or False, got 1",
    ),
    "make_attention: a dict": (
        lambda: make_attention({"attention": "gqa"}),
        TypeError,
        "config must be an LMConfig, got dict",
    ),
    "make_attention: rotary not a RotaryPositions": (
        lambda: make_attention(config(), rotary="rope"),
        TypeError,
        "rotary must be a RotaryPositions (make_rotary) or None, got str",
    ),
    "learned: start a float": (
        lambda: LearnedPositionalEmbedding(8, 16)(X3, 1.0),
        TypeError,
        "start must be an int, got 1.0",
    ),
    "learned: start -1": (
        lambda: LearnedPositionalEmbedding(8, 16)(X3, -1),
        ValueError,
        "start must be at least 0, got -1",
    ),
    "learned: x of another width": (
        lambda: LearnedPositionalEmbedding(8, 16)(torch.randn(1, 3, 15)),
        ValueError,
        "x must be (B, T, D=16), got (1, 3, 15)",
    ),
    "learned: x without a batch": (
        lambda: LearnedPositionalEmbedding(8, 16)(torch.randn(3, 16)),
        ValueError,
        "x must be (B, T, D), got shape (3, 16)",
    ),
    "rope: start -1": (
        lambda: PositionsInAttention()(X3, -1),
        ValueError,
        "start must be at least 0, got -1",
    ),
    "rope: start a float": (
        lambda: PositionsInAttention()(X3, 1.5),
        TypeError,
        "start must be an int, got 1.5",
    ),
}


@pytest.mark.parametrize(
    ("call", "error", "phrase"), PIECES_PROBES.values(), ids=PIECES_PROBES.keys()
)
def test_bad_calls_name_the_argument_and_what_is_valid(call, error, phrase):
    raises(call, error, phrase)
