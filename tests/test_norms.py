"""Chapter 14: RMSNorm equals ``torch.nn.RMSNorm`` (eps passed explicitly) and ``transformers``'
``LlamaRMSNorm`` (bit for bit, float32 and 16-bit, including where the up-cast happens); it is
LayerNorm without centring and bias; ``build_norm`` picks LayerNorm or RMSNorm."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import raises, to_device
from transformer_tutorial.layers import LayerNorm
from transformer_tutorial.norms import RMSNorm, build_norm

transformers_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
LlamaRMSNorm = transformers_llama.LlamaRMSNorm

ATOL = 1e-6


def _random_weight(*norms: nn.Module) -> None:
    """The same random weight in every norm (they start at 1, which would hide a swap)."""
    weight = torch.randn(norms[0].weight.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(weight)


@pytest.mark.parametrize("shape", [(7,), (3, 16), (2, 5, 64), (2, 3, 4, 512)])
@pytest.mark.parametrize("eps", [1e-6, 1e-5, 1e-2])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])
def test_rms_norm_equals_torch_with_eps_passed(shape, eps, scale, device):
    torch.manual_seed(0)
    ours, ref = RMSNorm(shape[-1], eps), nn.RMSNorm(shape[-1], eps=eps)
    _random_weight(ours, ref)
    ours, ref = to_device((ours, ref), device)
    x = scale * (torch.randn(*shape, device=device) + 0.5)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=ATOL, rtol=1e-5)


def test_rms_norm_gradients_equal_torch():
    torch.manual_seed(0)
    ours, ref = RMSNorm(32, 1e-5), nn.RMSNorm(32, eps=1e-5)
    _random_weight(ours, ref)
    x = 3 * torch.randn(4, 6, 32)
    target = torch.randn(4, 6, 32)
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    ((ours(x_ours) - target) ** 2).sum().backward()
    ((ref(x_ref) - target) ** 2).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, atol=1e-5, rtol=1e-5)


def test_torch_default_eps_is_not_llamas():
    """``nn.RMSNorm(D)`` without eps uses float32's machine epsilon (1.2e-7), not Llama's 1e-6:
    on activations of small scale the two disagree far beyond the tolerance above."""
    torch.manual_seed(0)
    x = 1e-3 * torch.randn(8, 64)
    default = nn.RMSNorm(64)
    assert default.eps is None
    with torch.no_grad():
        machine_eps = RMSNorm(64, torch.finfo(torch.float32).eps)(x)
        torch.testing.assert_close(default(x), machine_eps, atol=ATOL, rtol=1e-5)
        assert (default(x) - RMSNorm(64, 1e-6)(x)).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_equals_llama_bit_for_bit(dtype, device):
    """Same dtype for weight and input, as in a model cast with ``.to(dtype)``."""
    torch.manual_seed(0)
    ours, ref = RMSNorm(64, 1e-5), LlamaRMSNorm(64, eps=1e-5)
    _random_weight(ours, ref)
    ours, ref = to_device((ours.to(dtype), ref.to(dtype)), device)
    x = (3 * torch.randn(2, 9, 64, device=device) + 1).to(dtype)
    with torch.no_grad():
        out, expected = ours(x), ref(x)
    assert out.dtype == expected.dtype == dtype
    assert torch.equal(out, expected)


def test_rms_norm_float32_weight_on_bfloat16_input_returns_float32_like_llama():
    """The up-cast: statistics in float32, the normalised x cast back to bfloat16, then the
    float32 weight promotes the product to float32 (Llama's order, not a final cast)."""
    torch.manual_seed(0)
    ours, ref = RMSNorm(64, 1e-6), LlamaRMSNorm(64, eps=1e-6)
    _random_weight(ours, ref)
    x = torch.randn(3, 64).bfloat16()
    with torch.no_grad():
        out = ours(x)
        assert out.dtype == torch.float32
        assert torch.equal(out, ref(x))
        xf = x.float()
        normalised = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
        assert torch.equal(out, ours.weight * normalised)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_16_bit_matches_torch_within_one_rounding(dtype):
    """nn.RMSNorm computes in float32 too but multiplies by the weight before it rounds;
    ours (Llama's) rounds the normalised x first: at most a rounding step apart."""
    torch.manual_seed(0)
    ours, ref = RMSNorm(256, 1e-5), nn.RMSNorm(256, eps=1e-5)
    _random_weight(ours, ref)
    ours, ref = ours.to(dtype), ref.to(dtype)
    x = (2 * torch.randn(4, 8, 256)).to(dtype)
    with torch.no_grad():
        out, expected = ours(x), ref(x)
    assert out.dtype == expected.dtype == dtype
    step = torch.finfo(dtype).eps  # one rounding step, relative
    assert ((out.float() - expected.float()).abs() <= 2 * step * expected.float().abs()).all()


def test_rms_norm_keeps_float64():
    """Float64 statistics for a float64 input: features 1 + 1e-9·noise differ only below
    float32's resolution (6e-8 near 1), which a float32 up-cast rounds away entirely."""
    x = 1 + 1e-9 * torch.randn(
        4, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    norm = RMSNorm(64, 1e-6).double()
    with torch.no_grad():
        out = norm(x)
    expected = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, atol=1e-15, rtol=1e-14)
    assert out.std(-1).min() > 1e-10  # the noise survives


def test_rms_norm_is_layer_norm_without_centring_and_bias():
    torch.manual_seed(0)
    rms, layer = RMSNorm(16, 1e-5), LayerNorm(16, 1e-5)
    _random_weight(rms, layer)
    x = 2 * torch.randn(5, 16) + 3  # a mean far from 0
    centred = x - x.mean(-1, keepdim=True)
    with torch.no_grad():
        torch.testing.assert_close(rms(centred), layer(x), atol=1e-5, rtol=1e-5)
        assert (rms(x) - layer(x)).abs().max() > 0.5
        # invariant to rescaling, not to shifting
        torch.testing.assert_close(rms(7.5 * x), rms(x), atol=1e-5, rtol=1e-5)
        assert (rms(x + 1) - rms(x)).abs().max() > 0.1
        torch.testing.assert_close(layer(x + 1), layer(x), atol=1e-5, rtol=1e-5)


def test_rms_norm_output_has_rms_one_before_the_weight():
    x = 5 * torch.randn(6, 10, 128, generator=torch.Generator().manual_seed(0))
    y = RMSNorm(128, 1e-6)(x).detach()
    torch.testing.assert_close(y.pow(2).mean(-1).sqrt(), torch.ones(6, 10), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("kind", "cls"), [("layer", LayerNorm), ("rms", RMSNorm)])
def test_build_norm_chooses_the_norm(kind, cls):
    norm = build_norm(kind, 24, 1e-4)
    assert type(norm) is cls and norm.eps == 1e-4 and norm.weight.shape == (24,)
    expected = {"layer": {"weight", "bias"}, "rms": {"weight"}}[kind]
    assert {name for name, _ in norm.named_parameters()} == expected


def test_build_norm_layer_equals_torch_layer_norm():
    torch.manual_seed(0)
    ours, ref = build_norm("layer", 32, 1e-6), nn.LayerNorm(32, eps=1e-6)
    _random_weight(ours, ref)
    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)


BAD_NORMS = [
    (lambda: build_norm("batch", 8, 1e-5), ValueError, "kind must be one of ['layer', 'rms']"),
    (lambda: build_norm("rms", 8, 0.0), ValueError, "eps must be greater than 0.0, got 0.0"),
    (lambda: build_norm("layer", 8, -1e-5), ValueError, "eps must be greater than 0.0"),
    (lambda: build_norm("rms", 0, 1e-5), ValueError, "d_model must be at least 1, got 0"),
    (lambda: build_norm("rms", 8, "1e-5"), TypeError, "eps must be a number"),
    (lambda: build_norm("rms", 8.0, 1e-5), TypeError, "d_model must be an int"),
    (lambda: RMSNorm(8, eps=0), ValueError, "eps must be greater than 0.0, got 0"),
    (lambda: RMSNorm(8, eps=None), TypeError, "eps must be a number, got None"),
]


@pytest.mark.parametrize(
    ("call", "error", "phrase"), BAD_NORMS, ids=[phrase for *_, phrase in BAD_NORMS]
)
def test_bad_norm_arguments_are_refused(call, error, phrase):
    raises(call, error, phrase)
