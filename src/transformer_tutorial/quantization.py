"""Chapter 24: weight-only quantization of a model's linear layers, int8 and int4.

Each weight ``(out, in)`` is cut into groups of ``group_size`` consecutive inputs of one output
row; a group keeps one float scale and integers ``q = round(w / scale)``, symmetric around 0:
``scale = max |w| / qmax`` with ``qmax`` 127 (int8) or 7 (int4), so ``q`` lies in ``[-127, 127]``
or ``[-7, 7]`` (inside int4's ``[-8, 7]``). int8 keeps one group per row (per output channel,
``group_size=None``); int4 needs smaller groups (32 to 128 inputs in practice). Both are stored
one integer per byte (``torch.int8``); where PyTorch's CPU int4 kernel can run, int4 also keeps a
copy packed two to a byte in the kernel's layout, which is what a forward pass reads, so its
memory is counted as packed (:func:`weight_bytes`). Activations stay in float: only the
weights shrink.

The scales and the integers are computed in float32 and the scales kept in float32, whatever
the weight's dtype, so that ``ŵ = scale · q`` is within half a step of ``w`` in every dtype. In
bf16, ``w / scale`` would keep 8 bits before the rounding, and a bf16 scale has 8 bits itself
(up to a quarter of a step off at ``q = 127``); in fp16, the scale of a row with max ``|w|``
below ``127 × 6.1e-5 ≈ 0.008`` (int8) falls below fp16's smallest normal number and loses its
bits. A float32 scale costs 4 bytes a row or group instead of 2: 0.4 % of an int8 row of 1,024
inputs instead of 0.2 %, and for int4 groups of 32 one bit a weight instead of half a bit.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_tutorial.checks import (
    check_choice,
    check_int,
    check_optional_int,
    check_tensor,
    check_type,
)

QMAX = {8: 127, 4: 7}
# Activations that take PyTorch's int8 kernel, which wants the scale in their dtype: float32
# as stored, bf16 rounded from it. fp16 takes the dequantizing path: an fp16 scale underflows
# (see above), and the CPU kernel was 10 times slower than fp16's F.linear where measured.
INT8_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# PyTorch's CPU int4 kernel: bf16 activations only (float32 ran 20 times slower than F.linear
# where measured), groups of these sizes, output rows a multiple of 16 (padded here).
INT4_KERNEL_GROUPS = (32, 64, 128, 256)
INT4_ROWS = 16


def _check(bits: int, group_size: int | None, in_features: int) -> int:
    """The group size to use (``in_features`` for None), or an error naming the argument."""
    check_int("bits", bits)
    check_choice("bits", bits, QMAX)
    check_optional_int("group_size", group_size, at_least=1)
    if group_size is None:
        return in_features
    if in_features % group_size:
        raise ValueError(
            f"group_size={group_size} does not divide the weight's {in_features} inputs"
        )
    return group_size


def _check_weight(weight: Tensor) -> None:
    """A float matrix of finite numbers (one read back: quantizing is done once)."""
    check_tensor("weight", weight, kind="float", dims=2, shape="(out, in)")
    if not bool(weight.isfinite().all()):
        raise ValueError("weight holds inf or NaN: its scales and integers would be NaN")


def quantize_weight(
    weight: Tensor, *, bits: int, group_size: int | None = None
) -> tuple[Tensor, Tensor]:
    """A float weight ``(out, in)`` → integers ``(out, in)`` int8 and scales
    ``(out, in // group_size)`` in float32, whatever the weight's dtype (the module docstring
    says why); ``group_size=None``: one scale per row."""
    _check_weight(weight)
    out, inp = weight.shape
    g = _check(bits, group_size, inp)
    groups = weight.float().reshape(out, inp // g, g)  # (out, G, g) in float32
    amax = groups.abs().amax(-1)  # (out, G)
    scale = torch.where(amax == 0, 1.0, amax) / QMAX[bits]  # an all-zero group stays zero
    q = torch.round(groups / scale[..., None]).clamp(-QMAX[bits], QMAX[bits])
    return q.to(torch.int8).reshape(out, inp), scale


def _check_quantized(q: Tensor, scale: Tensor) -> None:
    """int8 integers ``(out, in)`` and float scales ``(out, G)``, ``G`` dividing ``in``."""
    check_tensor("q", q, dims=2, shape="(out, in)")
    check_tensor("scale", scale, kind="float", dims=2, shape="(out, G)")
    if q.dtype != torch.int8:
        raise TypeError(f"q must be int8 (quantize_weight's integers), got {q.dtype}")
    if scale.size(0) != q.size(0) or scale.size(1) == 0 or q.size(1) % scale.size(1):
        raise ValueError(
            f"scale {tuple(scale.shape)} must be (out, G) for q {tuple(q.shape)}: one row a row "
            "of q, and G groups dividing its inputs"
        )


def dequantize_weight(q: Tensor, scale: Tensor) -> Tensor:
    """Integers ``(out, in)`` and scales ``(out, G)`` → the float weight they stand for, in
    the scales' dtype."""
    _check_quantized(q, scale)
    out, inp = q.shape
    groups = q.reshape(out, scale.size(1), -1).to(scale.dtype)  # (out, G, g)
    return (groups * scale[..., None]).reshape(out, inp)


class QuantizedLinear(nn.Module):
    """``nn.Linear`` with its weight held as integers and scales (the bias stays float).

    On the CPU, when no gradient must flow to ``x`` (the kernels have no backward), PyTorch's
    weight-only kernels run where this PyTorch has them: int8 with one scale per row
    (``_weight_int8pack_mm``) for float32 and bf16 activations, int4 in groups of 32 to 256
    (``_weight_int4pack_mm_for_cpu``, on a copy packed two to a byte at construction) for bf16
    activations. Otherwise (other devices, dtypes or groups, training through it) the weight is
    dequantized on each call and multiplied in the activations' dtype.

    Under ``torch.compile`` an int8 layer (any group size) given one row — a decoding step at
    batch 1 — computes each output as a dot product of the row with the integers, group by
    group, scaled in float32 (:meth:`_one_row`): the compiler fuses it into one loop that reads
    each int8 weight once, where the kernels above are calls it cannot see into (section 12 of
    ``make bench`` measures both).
    """

    def __init__(self, linear: nn.Linear, *, bits: int, group_size: int | None = None) -> None:
        super().__init__()
        check_type("linear", linear, nn.Linear, "an nn.Linear")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bits = bits
        self.group_size = _check(bits, group_size, linear.in_features)
        q, scale = quantize_weight(linear.weight.detach(), bits=bits, group_size=group_size)
        self.register_buffer("qweight", q)  # (out, in) int8
        self.register_buffer("scale", scale)  # (out, G)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias)
        packed = self._int4_packed() if self._packs_int4() else (None, None)
        self.register_buffer("int4_packed", packed[0], persistent=False)
        self.register_buffer("int4_scales", packed[1], persistent=False)
        self._int8_scale_cache: tuple | None = None  # see _int8_scale

    def _packs_int4(self) -> bool:
        return (
            self.bits == 4
            and self.group_size in INT4_KERNEL_GROUPS
            and self.qweight.device.type == "cpu"
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        )

    def _int4_packed(self) -> tuple[Tensor, Tensor]:
        """The int4 kernel's operands: ``q + 8`` in ``[1, 15]`` packed two to a byte, and
        (scale, zero = 0) per group and row ``(G, out', 2)`` in bf16, ``out'`` the rows padded
        to a multiple of 16 with zeros (``q + 8 = 8``, scale 0)."""
        pad = -self.out_features % INT4_ROWS
        q = F.pad(self.qweight.to(torch.int32) + 8, (0, 0, 0, pad), value=8)  # (out', in)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        scale = F.pad(self.scale, (0, 0, 0, pad)).t()  # (G, out')
        return packed, torch.stack([scale, torch.zeros_like(scale)], -1).to(torch.bfloat16)

    @property
    def weight(self) -> Tensor:
        """The float32 weight the integers stand for ``(out, in)`` (computed on each read)."""
        return dequantize_weight(self.qweight, self.scale)

    def _check_input(self, x: Tensor) -> None:
        check_tensor("x", x, kind="float")
        if x.dim() == 0 or x.size(-1) != self.in_features:
            raise ValueError(f"x must be (..., in={self.in_features}), got {tuple(x.shape)}")

    def _uses_int8_kernel(self, x: Tensor) -> bool:
        return (
            self.bits == 8
            and self.scale.size(1) == 1
            and x.device.type == "cpu"
            and x.dtype in INT8_KERNEL_DTYPES
            and hasattr(torch.ops.aten, "_weight_int8pack_mm")
            and not (x.requires_grad and torch.is_grad_enabled())  # the kernel has no backward
            and not torch.compiler.is_compiling()  # inductor's lowering of it fails (torch 2.13)
        )

    def _uses_int4_kernel(self, x: Tensor) -> bool:
        return (
            self.int4_packed is not None
            and x.device.type == "cpu"
            and x.dtype == torch.bfloat16
            and not (x.requires_grad and torch.is_grad_enabled())
        )

    def _int8_scale(self, dtype: torch.dtype) -> Tensor:
        """The int8 kernel's scale ``(out,)`` in the activations' dtype (the kernel wants it so),
        converted once for a scale tensor, its version (bumped by an in-place change,
        ``load_state_dict``'s too) and a dtype: converted on every call, it cost the capstone's
        85 layers 0.7-2 ms a decoding step."""
        version = None if self.scale.is_inference() else self.scale._version  # none kept there
        cached = self._int8_scale_cache  # (scale, version, dtype, converted) or None
        if cached is None or cached[0] is not self.scale or cached[1:3] != (version, dtype):
            converted = self.scale[:, 0].to(dtype)
            if version is not None:
                self._int8_scale_cache = (self.scale, version, dtype, converted)
            return converted
        return cached[3]

    def _one_row(self, row: Tensor) -> Tensor:
        """``(1, in)`` → ``(1, out)``: per output and group, the row's dot product with the
        integers, times the group's scale, summed over the groups, plus the bias — in float32
        (float64 for a float64 row), rounded once to the row's dtype. Written for
        ``torch.compile`` to fuse into one pass over the int8 weight (eagerly it would
        materialise the float weight)."""
        out, groups = self.out_features, self.scale.size(1)
        acc = torch.promote_types(row.dtype, torch.float32)
        x = row.to(acc).reshape(1, groups, -1)  # (1, G, g)
        q = self.qweight.reshape(out, groups, -1).to(acc)  # (out, G, g), fused: never stored
        y = ((x * q).sum(-1) * self.scale.to(acc)).sum(-1)  # (out,)
        if self.bias is not None:
            y = y + self.bias.to(acc)
        return y[None].to(row.dtype)  # (1, out)

    def forward(self, x: Tensor) -> Tensor:
        """``(..., in)`` → ``(..., out)``."""
        self._check_input(x)
        rows = x.reshape(-1, self.in_features)  # (N, in)
        if self.bits == 8 and rows.size(0) == 1 and torch.compiler.is_compiling():
            return self._one_row(rows).reshape(*x.shape[:-1], self.out_features)
        if self._uses_int8_kernel(x):
            y = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self._int8_scale(x.dtype))
        elif self._uses_int4_kernel(x):
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows, self.int4_packed, self.group_size, self.int4_scales.to(x.dtype)
            )[:, : self.out_features]  # (N, out): the padded rows dropped
        else:
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.weight.to(x.dtype), bias)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, group_size={self.group_size}"
        )


def quantize_linears(
    model: nn.Module,
    *,
    bits: int,
    group_size: int | None = None,
    keep: tuple[str, ...] = ("lm_head",),
) -> nn.Module:
    """A copy of ``model`` whose ``nn.Linear`` layers are :class:`QuantizedLinear` (the model
    itself is unchanged). Layers whose name ends with one of ``keep`` stay float: by default
    the output layer, which a tied model shares with the embedding."""
    check_type("model", model, nn.Module, "an nn.Module")
    if not isinstance(keep, (str, tuple)) or not all(isinstance(k, str) for k in keep):
        raise TypeError(f"keep must be a tuple of layer names such as ('lm_head',), got {keep!r}")
    _check(bits, group_size, group_size or 1)
    quantized = copy.deepcopy(model)
    for name, module in list(quantized.named_modules()):
        if isinstance(module, nn.Linear) and not name.endswith(keep):
            parent, _, child = name.rpartition(".")
            new = QuantizedLinear(module, bits=bits, group_size=group_size)
            setattr(quantized.get_submodule(parent), child, new)
    return quantized


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights: float parameters as stored, a :class:`QuantizedLinear` as its
    integers packed (``bits / 8`` bytes each) plus its scales and bias."""
    check_type("model", model, nn.Module, "an nn.Module")
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            total += m.qweight.numel() * m.bits // 8 + m.scale.numel() * m.scale.element_size()
            if m.bias is not None:
                total += m.bias.numel() * m.bias.element_size()
    return total


def round_trip_errors(model: nn.Module, quantized: nn.Module) -> dict[str, float]:
    """Each :class:`QuantizedLinear` of ``quantized``: its round-trip error
    ``‖W − Ŵ‖ / ‖W‖`` (Frobenius) against the float weight of the same name in ``model``."""
    check_type("model", model, nn.Module, "an nn.Module")
    check_type("quantized", quantized, nn.Module, "an nn.Module")
    errors = {}
    layers = dict(model.named_modules())
    for name, m in quantized.named_modules():
        if isinstance(m, QuantizedLinear):
            w = getattr(layers.get(name), "weight", None)
            if not isinstance(w, Tensor) or w.shape != m.qweight.shape:
                raise ValueError(
                    f"quantized's layer {name!r} {tuple(m.qweight.shape)} has no float layer of "
                    f"that name and shape in model: pass the model quantize_linears copied"
                )
            w = w.detach()
            errors[name] = ((w - m.weight).norm() / w.norm()).item()
    return errors
