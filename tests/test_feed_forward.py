"""Chapter 14: SwiGLU equals ``transformers``' ``LlamaMLP`` built from a ``LlamaConfig`` with its
weights loaded (bit for bit, float32 and bfloat16, with and without biases); Llama's hidden sizes;
a SwiGLU layer of 8/3 · D has the weights and FLOPs of the 4 · D ReLU layer;
``build_feed_forward`` picks the paper's layer or SwiGLU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from helpers import raises, to_device
from transformer_tutorial.feed_forward import (
    FEED_FORWARDS,
    SwiGLU,
    build_feed_forward,
    swiglu_hidden_size,
)
from transformer_tutorial.layers import FeedForward

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaMLP  # noqa: E402


def _llama_pair(d_model: int, d_ff: int, bias: bool) -> tuple[SwiGLU, LlamaMLP]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=d_model,
        intermediate_size=d_ff,
        num_attention_heads=4,
        hidden_act="silu",
        mlp_bias=bias,
    )
    ref = LlamaMLP(config)
    ours = SwiGLU(d_model, d_ff, bias=bias)
    ours.load_state_dict(ref.state_dict())  # strict: the same names and shapes
    return ours, ref


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_llama_mlp_bit_for_bit(bias, dtype, device):
    ours, ref = to_device(_llama_pair(48, 128, bias), device)
    ours, ref = ours.to(dtype), ref.to(dtype)
    x = torch.randn(3, 7, 48, device=device).to(dtype)
    with torch.no_grad():
        out, expected = ours(x), ref(x)
    assert out.dtype == dtype
    assert torch.equal(out, expected)


def test_swiglu_gradients_equal_llama_mlp():
    ours, ref = _llama_pair(32, 96, bias=False)
    x = torch.randn(2, 5, 32)
    target = torch.randn(2, 5, 32)
    ((ours(x) - target) ** 2).sum().backward()
    ((ref(x) - target) ** 2).sum().backward()
    for (name, p), (ref_name, q) in zip(
        ours.named_parameters(), ref.named_parameters(), strict=True
    ):
        assert name == ref_name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5)


def test_swiglu_is_the_papers_formula():
    """Shazeer (2020): FFN_SwiGLU(x) = (Swish_1(x W) ⊗ x V) W2, with Swish_1(z) = z σ(z)."""
    torch.manual_seed(0)
    ff = SwiGLU(8, 20)
    x = torch.randn(2, 5, 8)
    w, v, w2 = ff.gate_proj.weight.T, ff.up_proj.weight.T, ff.down_proj.weight.T
    gate = x @ w
    expected = (gate * torch.sigmoid(gate) * (x @ v)) @ w2
    with torch.no_grad():
        torch.testing.assert_close(ff(x), expected, atol=1e-6, rtol=1e-5)
    assert all(p.dim() == 2 for p in ff.parameters())  # no biases by default


def test_swiglu_dropout_only_in_training():
    torch.manual_seed(0)
    ff = SwiGLU(8, 32, dropout=0.5)
    x = torch.randn(2, 6, 8)
    assert torch.equal(ff.eval()(x), ff(x))
    ff.train()
    assert not torch.allclose(ff(x), ff(x))


@pytest.mark.parametrize(
    ("d_model", "multiple_of", "multiplier", "hidden"),
    [
        (4096, 256, None, 11008),  # Llama 2 7B
        (5120, 256, None, 13824),  # Llama 2 13B
        (8192, 4096, 1.3, 28672),  # Llama 2 70B, Llama 3 70B
        (4096, 1024, 1.3, 14336),  # Llama 3 8B
        (2048, 256, 1.5, 8192),  # Llama 3.2 1B
        (768, 256, None, 2048),  # exactly 8/3 · D
    ],
)
def test_swiglu_hidden_size_gives_llamas_widths(d_model, multiple_of, multiplier, hidden):
    got = swiglu_hidden_size(d_model, multiple_of=multiple_of, ffn_dim_multiplier=multiplier)
    assert got == hidden


def test_swiglu_hidden_size_is_the_smallest_multiple_not_below_two_thirds_of_4d():
    for d_model in range(1, 300):
        for multiple_of in (1, 8, 64):
            hidden = swiglu_hidden_size(d_model, multiple_of=multiple_of)
            assert hidden % multiple_of == 0
            assert hidden >= 8 * d_model // 3 > hidden - multiple_of


def _flops(module: torch.nn.Module, x: torch.Tensor) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        module(x)
    return counter.get_total_flops()


def test_swiglu_of_eight_thirds_d_costs_what_the_4d_relu_layer_costs():
    d_model = 768
    relu, swiglu = FeedForward(d_model, 4 * d_model), SwiGLU(d_model, 8 * d_model // 3)
    weights = [sum(p.numel() for p in m.parameters() if p.dim() == 2) for m in (relu, swiglu)]
    assert weights[0] == weights[1] == 8 * d_model**2
    x = torch.randn(1, 16, d_model)
    assert _flops(relu, x) == _flops(swiglu, x) == 2 * 16 * 8 * d_model**2


@pytest.mark.parametrize("kind", ["relu", "gelu", "gelu_tanh", "swiglu"])
def test_build_feed_forward_chooses_the_layer(kind):
    torch.manual_seed(0)
    ff = build_feed_forward(kind, 16, 40, dropout=0.25)
    x = torch.randn(2, 3, 16)
    if kind == "swiglu":
        assert type(ff) is SwiGLU and ff.gate_proj.out_features == 40
        expected = ff.down_proj(F.silu(ff.gate_proj(x)) * ff.up_proj(x))
    else:
        assert type(ff) is FeedForward and ff.linear1.out_features == 40
        act = {
            "relu": F.relu,
            "gelu": F.gelu,
            "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
        }
        expected = ff.linear2(act[kind](ff.linear1(x)))
    assert ff.dropout.p == 0.25
    with torch.no_grad():
        torch.testing.assert_close(ff.eval()(x), expected)


@pytest.mark.parametrize("kind", ["relu", "swiglu"])
@pytest.mark.parametrize("bias", [None, True, False])
def test_build_feed_forward_bias_defaults_to_the_kinds_own(kind, bias):
    ff = build_feed_forward(kind, 16, 40, bias=bias)
    has_bias = {p.dim() for p in ff.parameters()} == {1, 2}
    assert has_bias == (bias if bias is not None else kind != "swiglu")


BAD_FEED_FORWARDS = [
    (lambda: build_feed_forward("swish", 8, 16), f"kind must be one of {sorted(FEED_FORWARDS)}"),
    (lambda: build_feed_forward("swiglu", 8, 0), "d_ff must be at least 1, got 0"),
    (lambda: build_feed_forward("relu", 0, 16), "d_model must be at least 1, got 0"),
    (lambda: build_feed_forward("relu", 8, 16, dropout=1.0), "dropout must be in [0.0, 1.0)"),
    (lambda: SwiGLU(8, 16, dropout=-0.1), "dropout must be in [0.0, 1.0), got -0.1"),
    (lambda: swiglu_hidden_size(0), "d_model must be at least 1, got 0"),
    (lambda: swiglu_hidden_size(64, multiple_of=0), "multiple_of must be at least 1, got 0"),
    (lambda: swiglu_hidden_size(64, ffn_dim_multiplier=0.0), "ffn_dim_multiplier must be"),
]


@pytest.mark.parametrize(
    ("call", "phrase"), BAD_FEED_FORWARDS, ids=[phrase for _, phrase in BAD_FEED_FORWARDS]
)
def test_bad_feed_forward_arguments_are_refused(call, phrase):
    raises(call, ValueError, phrase)


def test_bias_must_be_a_bool():
    raises(lambda: SwiGLU(8, 16, bias=1), TypeError, "bias must be True or False, got 1")
    raises(lambda: build_feed_forward("relu", 8, 16, bias=0), TypeError, "bias must be True or")
