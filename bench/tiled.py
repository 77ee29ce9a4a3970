"""Section 11: chapter 22's tiled attention
(:func:`~transformer_tutorial.lm.tiled_attention.tiled_attention`, FlashAttention-2's algorithm
written in PyTorch) against ``F.scaled_dot_product_attention``: causal self-attention, forward
(no gradients) and forward + backward, at a few lengths.

A report, with no goal: the tiled function is a teaching implementation, a Python loop over
tiles of 64 × 64 that launches a few small operations per tile, where F.sdpa is one fused
kernel. Float32 on both sides (B=1, H=8, Dh=64); the outputs and the gradients are compared
before any timing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.cli import Settings
from bench.timing import interleaved
from transformer_tutorial.lm.tiled_attention import tiled_attention

SIDES = {"tiled": "tiled_attention", "sdpa": "F.sdpa"}
SHAPE = {"batch": 1, "heads": 8, "d_head": 64}
RTOL = 1e-4  # float32, the sums in other orders: ~1e-6 of the largest; a wrong tile: ~1


def _attend(side: str, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    if side == "tiled":
        return tiled_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _call(side: str, qkv: tuple[Tensor, ...], mode: str) -> Callable[[], object]:
    """The timed call: ``"forward"`` without gradients, or ``"train"``, forward and backward
    (the gradients of the queries, keys and values)."""

    def run() -> object:
        if mode == "forward":
            with torch.no_grad():
                return _attend(side, *qkv)
        out = _attend(side, *qkv)
        return torch.autograd.grad(out, qkv, torch.ones_like(out))

    return run


def _difference(a: Tensor, b: Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def bench_tiled(s: Settings, device: torch.device) -> dict:
    """Section 11: at each length, outputs and gradients compared, then both modes timed in
    turns; ratio = tiled time ÷ F.sdpa time (> 1: the tiled loop is slower)."""
    B, H, Dh = SHAPE.values()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for L in s.tiled_lengths:
        qkv = tuple(
            torch.randn(B, H, L, Dh, generator=gen).to(device).requires_grad_() for _ in range(3)
        )
        out = {side: _call(side, qkv, "forward")() for side in SIDES}
        grads = {side: _call(side, qkv, "train")() for side in SIDES}
        out_diff = _difference(out["tiled"], out["sdpa"])
        grad_diff = max(_difference(a, b) for a, b in zip(*grads.values(), strict=True))
        for mode in ("forward", "train"):
            fns = {name: _call(side, qkv, mode) for side, name in SIDES.items()}
            timed = interleaved(fns, s.repeats, s.warmup, device)
            tiled, sdpa = (timed[name] for name in SIDES.values())
            row = {
                "mode": mode,
                "L": L,
                "tiled_ms": 1e3 * tiled["median_s"],
                "sdpa_ms": 1e3 * sdpa["median_s"],
                "tiled_spread": tiled["spread"],
                "sdpa_spread": sdpa["spread"],
                "ratio": tiled["median_s"] / sdpa["median_s"],
                "fp32_output_diff": out_diff,
                "fp32_grad_diff": grad_diff,
                "same_output": out_diff <= RTOL and grad_diff <= RTOL,
            }
            rows.append(row)
            print(
                f"  {mode:<7} L={L:<5}: tiled_attention {row['tiled_ms']:8.2f} ms  F.sdpa "
                f"{row['sdpa_ms']:8.2f} ms  ratio tiled ÷ F.sdpa {row['ratio']:.1f}  (fp32 "
                f"outputs differ by {out_diff:.0e}, gradients by {grad_diff:.0e} of the largest)",
                flush=True,
            )
    return {**SHAPE, "causal": True, "rows": rows}
