"""Chapter 12: counting the floating-point operations of a call, for model FLOPs utilisation.

:func:`count_flops` runs a call under PyTorch's ``torch.utils.flop_counter.FlopCounterMode``,
which counts each matrix product, convolution and fused attention from its operands' shapes
(``2·m·k·n`` for an ``(m, k) @ (k, n)`` product, the multiply and the add): a count, not an
estimate from the parameter count. Every other operator counts 0 — softmax, layer norm,
dropout, the loss, and the optimizer's elementwise updates — which is what model FLOPs
utilisation means by the model's work.

On a CPU, ``F.scaled_dot_product_attention`` runs the operator
``_scaled_dot_product_flash_attention_for_cpu``, for which ``FlopCounterMode`` has no formula
(it counts the CUDA kernels only), so the fused attention of every layer would count 0.
:func:`count_flops` adds the formula for the CPU operator and its backward: the same two
matrix products (and four backward) that the written-out attention counts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

_aten = torch.ops.aten


def attention_flops(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    """FLOPs of attention's forward, ``Q Kᵀ`` and ``P V``: ``2·B·H·L·S·(Dh + Dv)``.

    Shapes: ``query_shape`` ``(B, H, L, Dh)``, ``key_shape`` ``(B, H, S, Dh)``,
    ``value_shape`` ``(B, H, S, Dv)`` (the other arguments of the operator are not used)."""
    batch, heads, length, d_head = query_shape
    keys, d_value = key_shape[-2], value_shape[-1]
    return 2 * batch * heads * length * keys * (d_head + d_value)


def attention_backward_flops(grad_shape, query_shape, key_shape, value_shape, *args, **kwargs):
    """FLOPs of attention's backward: four products (for ``dV``, ``dP``, ``dQ``, ``dK``), twice
    the forward's two."""
    return 2 * attention_flops(query_shape, key_shape, value_shape)


# The CPU's fused attention operators (present in every torch the book supports; looked up by
# name so that a build without them still imports).
_CPU_ATTENTION = {
    "_scaled_dot_product_flash_attention_for_cpu": attention_flops,
    "_scaled_dot_product_flash_attention_for_cpu_backward": attention_backward_flops,
}


def count_flops(fn: Callable[[], object]) -> int:
    """The floating-point operations ``fn()`` performs in matrix products, convolutions and
    attention, counted by ``FlopCounterMode`` as ``fn`` runs (on a CPU, fused attention too).

    Call a forward pass for its forward FLOPs; a forward and ``backward()`` for both (about 3×
    the forward: the backward of ``x @ W`` computes ``grad @ Wᵀ`` and ``xᵀ @ grad``)."""
    if not callable(fn):
        raise TypeError(f"fn must be a callable taking no arguments, got {type(fn).__name__}")
    mapping = {
        getattr(_aten, name): formula
        for name, formula in _CPU_ATTENTION.items()
        if hasattr(_aten, name)
    }
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        fn()
    return counter.get_total_flops()
