"""Weight-only int8 (per output channel) and int4 (groups) quantization of linear layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import needs_compiler, raises
from transformer_tutorial.lm.config import LLAMA, LMConfig
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.quantization import (
    QuantizedLinear,
    dequantize_weight,
    quantize_linears,
    quantize_weight,
    round_trip_errors,
    weight_bytes,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("bits", "group_size"), [(8, None), (8, 16), (4, 32), (4, None)])
def test_round_trip_is_within_half_a_step_of_each_group(bits, group_size, dtype):
    """Rows from max |w| ≈ 0.001 to 3 in every float dtype: in fp16 a step of 0.001 / 127 lies
    below fp16's smallest normal number (6.1e-5), and in bf16 ``w / scale`` has 8 bits only,
    so the scale and the integers are computed in float32."""
    torch.manual_seed(0)
    w = torch.randn(24, 64)
    w = (w / w.abs().amax(1, keepdim=True) * torch.logspace(-3, 0.5, 24)[:, None]).to(dtype)
    w[3] = 0.0  # an all-zero row stays zero
    q, scale = quantize_weight(w, bits=bits, group_size=group_size)
    qmax = {8: 127, 4: 7}[bits]
    g = group_size or 64
    assert q.dtype == torch.int8 and scale.shape == (24, 64 // g)
    groups = w.double().reshape(24, 64 // g, g)
    step = (groups.abs().amax(-1) / qmax).repeat_interleave(g, dim=1)  # (24, 64): max|w| / qmax
    error = (dequantize_weight(q, scale).double() - w.double()).abs()
    # Half a step, and float32's rounding of w / s and of s · q (|q| ≤ 127, 2^-24 each).
    assert (error <= step * (0.5 + 127 * 2**-23)).all(), (error / step).nan_to_num().max()
    # the largest |w| of every group but the zero row's maps to ±qmax
    assert (q.reshape(24, 64 // g, g).abs().amax(-1) == qmax).sum() == 23 * (64 // g)
    assert not dequantize_weight(q, scale)[3].any()
    assert scale.dtype == torch.float32  # the module docstring says why, whatever w's dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_int8_kernel_equals_the_dequantized_matmul(dtype):
    """float32 and bf16 activations take the kernel (the float32 scale rounded to bf16 for it),
    fp16 the dequantizing path: each as close to the float64 product of the same integers and
    scales as ``F.linear`` in that dtype."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 96).to(dtype)
    quantized = QuantizedLinear(linear, bits=8)
    x = torch.randn(2, 5, 256).to(dtype)
    has_kernel = hasattr(torch.ops.aten, "_weight_int8pack_mm")
    assert quantized._uses_int8_kernel(x) == (has_kernel and dtype != torch.float16)
    exact = F.linear(x.double(), quantized.weight.double(), linear.bias.double())
    y, plain = quantized(x), F.linear(x, quantized.weight.to(dtype), linear.bias)
    assert y.dtype == dtype
    errors = [((t.double() - exact).norm() / exact.norm()).item() for t in (y, plain)]
    # The kernel against F.linear's own error in this dtype, both relative to float64: at most
    # 1.74 times in bf16 (the scale's rounding to 8 bits adds to the output's) and 1.81 in
    # float32 (two roundings of about 1e-7) over 50 seeds and three float orders.
    assert errors[0] <= 3 * errors[1], errors
    if dtype == torch.float32:
        x.requires_grad_(True)  # a gradient to x (LoRA upstream) takes the float path
        quantized(x).sum().backward()
        torch.testing.assert_close(x.grad, quantized.weight.sum(0).expand_as(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("group_size", [None, 32])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_one_row_product_equals_the_dequantized_matmul(group_size, dtype):
    """The one-row product ``torch.compile`` fuses (:meth:`QuantizedLinear._one_row`, called
    eagerly here): per group the row's dot product with the integers, times the scale, plus the
    bias, in float32 (float64 for float64) — rounded once to ``dtype``."""
    torch.manual_seed(0)
    quantized = QuantizedLinear(nn.Linear(128, 40), bits=8, group_size=group_size)
    x = torch.randn(1, 128).to(dtype)
    weight = dequantize_weight(quantized.qweight, quantized.scale.double())  # no rounding
    exact = F.linear(x.double(), weight, quantized.bias.double())
    y = quantized._one_row(x)
    assert y.shape == (1, 40) and y.dtype == dtype
    # float64: exact to its rounding; float32: its sums; bf16: one rounding of the result
    tol = {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 2**-8}[dtype]
    torch.testing.assert_close(y.double(), exact, rtol=tol, atol=tol * exact.abs().max().item())


@needs_compiler
def test_compiled_int8_layer_fuses_one_row_and_dequantizes_several():
    """Under ``torch.compile`` one row takes the one-row product — the generated code calls no
    int8 kernel and no matrix product, and its output is the eager ``_one_row``'s to float
    order — and several rows the dequantizing path: as close to float64 as the eager layer."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    quantized = QuantizedLinear(nn.Linear(96, 64).bfloat16(), bits=8)  # float32 scales
    compiled = torch.compile(quantized)
    with torch.no_grad():
        x = torch.randn(1, 96, dtype=torch.bfloat16)
        y, [code] = run_and_get_code(compiled, x)
        assert "int8pack" not in code and "mm(" not in code, code
        torch.testing.assert_close(y, quantized._one_row(x), rtol=2**-7, atol=1e-3)
        x = torch.randn(3, 96, dtype=torch.bfloat16)
        exact = F.linear(x.double(), quantized.weight.double(), quantized.bias.double())
        errors = [(y.double() - exact).norm() / exact.norm() for y in (compiled(x), quantized(x))]
        assert errors[0] <= 2 * errors[1] + 1e-3, errors
    torch._dynamo.reset()


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int8pack_mm"), reason="no int8 kernel")
def test_int8_kernel_scale_is_converted_once_and_follows_the_weights():
    """The kernel's scale in the activations' dtype is converted once a dtype and reused, the
    outputs bitwise those of a conversion on every call; an in-place change of the scales
    (``load_state_dict``) or a move (``.to``) is seen at the next call."""
    torch.manual_seed(0)
    quantized = QuantizedLinear(nn.Linear(64, 48, bias=False), bits=8)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        y = quantized(x)
        assert quantized._int8_scale(torch.bfloat16) is quantized._int8_scale(torch.bfloat16)
        fresh = torch.ops.aten._weight_int8pack_mm(
            x, quantized.qweight, quantized.scale[:, 0].bfloat16()
        )
        assert torch.equal(y, fresh)
        assert quantized(x.float()).dtype == torch.float32  # another dtype, its own scale
        other = QuantizedLinear(nn.Linear(64, 48, bias=False), bits=8)
        quantized.load_state_dict(other.state_dict())  # copies into the same scale tensor
        assert torch.equal(quantized(x), other(x))
        quantized.scale.mul_(2)
        assert torch.equal(quantized(x), 2 * other(x))
        moved = quantized.to(torch.float64)  # a new scale tensor (float64)
        assert torch.equal(moved(x), 2 * other(x))


@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
@pytest.mark.parametrize("out_features", [96, 50])  # 50: padded to 64 rows for the kernel
def test_int4_kernel_equals_the_dequantized_matmul(group_size, out_features):
    """bf16 activations take PyTorch's packed int4 kernel (rows padded to a multiple of 16):
    as close to the float64 product of the same integers and scales as bf16's F.linear; float32
    activations and training through the layer take the dequantizing path."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("this PyTorch has no CPU int4 kernel")
    torch.manual_seed(group_size + out_features)
    linear = nn.Linear(256, out_features).to(torch.bfloat16)
    quantized = QuantizedLinear(linear, bits=4, group_size=group_size)
    assert quantized.int4_packed is not None
    assert "int4_packed" not in quantized.state_dict()  # rebuilt from the integers, not saved
    x = torch.randn(3, 7, 256).to(torch.bfloat16)
    assert quantized._uses_int4_kernel(x) and not quantized._uses_int4_kernel(x.float())
    exact = F.linear(x.double(), quantized.weight.double(), linear.bias.double())
    y = quantized(x)
    plain = F.linear(x, quantized.weight.to(torch.bfloat16), linear.bias)
    assert y.shape == (3, 7, out_features) and y.dtype == torch.bfloat16
    errors = [((t.double() - exact).norm() / exact.norm()).item() for t in (y, plain)]
    assert errors[0] <= 3 * errors[1], errors  # the bf16 scales' rounding, as int8's kernel
    torch.testing.assert_close(quantized(x.float()), exact.float(), atol=1e-4, rtol=1e-4)


def test_int4_groups_the_kernel_does_not_take_dequantize():
    quantized = QuantizedLinear(nn.Linear(64, 32), bits=4, group_size=16)
    assert quantized.int4_packed is None
    x = torch.randn(2, 64).to(torch.bfloat16)
    assert not quantized._uses_int4_kernel(x)
    want = F.linear(x, quantized.weight.to(torch.bfloat16), quantized.bias.to(torch.bfloat16))
    torch.testing.assert_close(quantized(x), want)


def test_quantize_linears_swaps_every_linear_but_the_kept_and_leaves_the_model():
    torch.manual_seed(0)
    cfg = LMConfig(
        vocab_size=40,
        d_model=64,
        n_heads=4,
        n_layers=2,
        d_ff=128,
        max_len=16,
        dropout=0.0,
        **LLAMA,
    )
    model = LanguageModel(cfg).eval()
    ids = torch.randint(0, 40, (2, 10))
    before = model(ids)
    int8 = quantize_linears(model, bits=8)
    int4 = quantize_linears(model, bits=4, group_size=32)
    swapped = [n for n, m in int8.named_modules() if isinstance(m, QuantizedLinear)]
    assert len(swapped) == 2 * 7 and "lm_head" not in swapped
    assert isinstance(model.layers[0].ff.up_proj, nn.Linear)  # the original is untouched
    torch.testing.assert_close(model(ids), before, atol=0, rtol=0)
    errors8, errors4 = round_trip_errors(model, int8), round_trip_errors(model, int4)
    assert max(errors8.values()) < 0.01 < min(errors4.values()) < max(errors4.values()) < 0.2
    assert (int8(ids) - before).abs().max() < (int4(ids) - before).abs().max()
    floats = weight_bytes(model)
    linear = sum(
        m.weight.numel()
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n != "lm_head"
    )
    assert floats - weight_bytes(int8) == linear * 3 - 4 * sum(
        m.scale.numel() for m in int8.modules() if isinstance(m, QuantizedLinear)
    )
    assert weight_bytes(int4) < weight_bytes(int8) < floats


def test_bad_bits_and_group_sizes_are_refused_by_name():
    w = torch.randn(8, 48)
    raises(lambda: quantize_weight(w, bits=3), ValueError, "bits must be one of [4, 8], got 3")
    raises(
        lambda: quantize_weight(w, bits=4, group_size=32),
        ValueError,
        "group_size=32 does not divide the weight's 48 inputs",
    )
    raises(
        lambda: quantize_weight(w, bits=4, group_size=0),
        ValueError,
        "group_size must be at least 1, got 0",
    )
    raises(
        lambda: quantize_weight(w.long(), bits=8),
        TypeError,
        "weight must be a floating-point tensor, got torch.int64",
    )
    raises(
        lambda: quantize_linears(nn.Linear(4, 4), bits=2),
        ValueError,
        "bits must be one of [4, 8], got 2",
    )
    raises(
        lambda: QuantizedLinear(nn.Linear(48, 4), bits=4, group_size=64),
        ValueError,
        "group_size=64",
    )


# --- API probes (issue 42): each bad call, and what its error must say ------------------------

Q44 = torch.zeros(4, 4, dtype=torch.int8)
QUANTIZATION_PROBES = {
    "weight a list": (
        lambda: quantize_weight([[1.0]], bits=8),
        TypeError,
        "weight must be a Tensor (out, in), got list",
    ),
    "bits a float": (
        lambda: quantize_weight(torch.randn(4, 4), bits=8.0),
        TypeError,
        "bits must be an int, got 8.0 (float)",
    ),
    "bits a bool": (
        lambda: QuantizedLinear(nn.Linear(4, 4), bits=True),
        TypeError,
        "bits must be an int, got True (bool)",
    ),
    "group_size a float": (
        lambda: quantize_weight(torch.randn(4, 4), bits=4, group_size=2.0),
        TypeError,
        "group_size must be an int, got 2.0 (float)",
    ),
    "group_size a bool": (
        lambda: quantize_linears(nn.Sequential(nn.Linear(4, 4)), bits=4, group_size=True),
        TypeError,
        "group_size must be an int, got True (bool)",
    ),
    "a 3-d weight": (
        lambda: quantize_weight(torch.randn(2, 4, 4), bits=8),
        ValueError,
        "weight must be (out, in), got shape (2, 4, 4)",
    ),
    "a NaN weight": (
        lambda: quantize_weight(torch.tensor([[float("nan"), 1.0]]), bits=8),
        ValueError,
        "weight holds inf or NaN",
    ),
    "an infinite weight": (
        lambda: quantize_weight(torch.tensor([[float("inf"), 1.0]]), bits=4),
        ValueError,
        "weight holds inf or NaN",
    ),
    "scales for 3 rows of 4": (
        lambda: dequantize_weight(Q44, torch.ones(3, 1)),
        ValueError,
        "scale (3, 1) must be (out, G) for q (4, 4)",
    ),
    "3 groups of 4 inputs": (
        lambda: dequantize_weight(Q44, torch.ones(4, 3)),
        ValueError,
        "G groups dividing its inputs",
    ),
    "float integers": (
        lambda: dequantize_weight(Q44.float(), torch.ones(4, 1)),
        TypeError,
        "q must be int8 (quantize_weight's integers), got torch.float32",
    ),
    "a convolution": (
        lambda: QuantizedLinear(nn.Conv1d(4, 4, 1), bits=8),
        TypeError,
        "linear must be an nn.Linear, got Conv1d",
    ),
    "5 inputs for 4": (
        lambda: QuantizedLinear(nn.Linear(4, 4), bits=8)(torch.randn(2, 5)),
        ValueError,
        "x must be (..., in=4), got (2, 5)",
    ),
    "model an int": (
        lambda: quantize_linears(3, bits=8),
        TypeError,
        "model must be an nn.Module, got int",
    ),
    "keep a list": (
        lambda: quantize_linears(nn.Sequential(nn.Linear(4, 4)), bits=8, keep=["lm_head"]),
        TypeError,
        "keep must be a tuple of layer names such as ('lm_head',), got ['lm_head']",
    ),
    "another model's layers": (
        lambda: round_trip_errors(
            nn.Sequential(nn.Linear(4, 4)),
            quantize_linears(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), bits=8),
        ),
        ValueError,
        "quantized's layer '1' (4, 4) has no float layer of that name and shape in model",
    ),
    "count an int": (lambda: weight_bytes(3), TypeError, "model must be an nn.Module, got int"),
}


@pytest.mark.parametrize(
    ("call", "error", "phrase"), QUANTIZATION_PROBES.values(), ids=QUANTIZATION_PROBES.keys()
)
def test_bad_calls_name_the_argument_and_what_is_valid(call, error, phrase):
    raises(call, error, phrase)
