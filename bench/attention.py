"""Section 5: one self-attention call (B=1, H=8, Dh=64), forward, no grad, written out (the
chapter 3 function) and fused (``F.scaled_dot_product_attention``): time and peak memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.memory import peak_memory
from bench.timing import interleaved
from transformer_tutorial.attention import scaled_dot_product_attention

if TYPE_CHECKING:  # the memory probe imports this module: it needs none of the CLI
    from bench.cli import Settings

ATTENTION_SHAPE = {"batch": 1, "heads": 8, "d_head": 64}


@torch.no_grad()
def written_out_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return scaled_dot_product_attention(q, k, v)[0]


@torch.no_grad()
def fused_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v)


def qkv(length: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Random queries, keys and values ``(B, H, L, Dh)`` of :data:`ATTENTION_SHAPE`."""
    B, H, Dh = ATTENTION_SHAPE.values()
    return torch.randn(3, B, H, length, Dh, device=device, dtype=dtype).unbind(0)


def attention_peaks(lengths: list[int], device: torch.device, dtype: torch.dtype) -> dict:
    """``{L: [written-out peak, fused peak]}`` in MiB (None where not measurable)."""
    peaks = {}
    for L in lengths:
        q, k, v = qkv(L, device, dtype)
        found = [
            peak_memory(partial(fn, q, k, v), device)
            for fn in (written_out_attention, fused_attention)
        ]
        peaks[L] = [None if peak is None else peak / 2**20 for peak in found]
    return peaks


def cpu_attention_peaks(lengths: list[int], dtype: torch.dtype) -> dict:
    """:func:`attention_peaks` on the CPU, measured by ``python -m bench.memory_probe`` in a
    fresh process: there every large tensor is mapped and unmapped on its own from the start,
    while this process's allocator holds memory the earlier sections freed and would reuse
    unseen. ``{}`` (and a printed reason) where the probe cannot measure."""
    dtype_name = str(dtype).removeprefix("torch.")
    command = [sys.executable, "-m", "bench.memory_probe", "--dtype", dtype_name]
    done = subprocess.run(
        [*command, *map(str, lengths)],
        cwd=Path(__file__).resolve().parents[1],  # where `bench` is a package
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())},
    )
    found = json.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 else None
    if not found:
        reason = (done.stderr.strip().splitlines() or ["glibc's mallopt unavailable"])[-1]
        print(f"  memory not measured: {reason}", flush=True)
        return {}
    return {int(L): peaks for L, peaks in found.items()}


def bench_attention(s: Settings, device: torch.device) -> list[dict]:
    """Section 5 at each of ``s.attention_lengths``: the two outputs equal, the two timed in
    turns, and their peak memory (on the CPU from :func:`cpu_attention_peaks`)."""
    B, H, _ = ATTENTION_SHAPE.values()
    lengths = list(s.attention_lengths)
    if device.type == "cuda":
        peaks = attention_peaks(lengths, device, s.dtype)
    else:
        peaks = cpu_attention_peaks(lengths, s.dtype)
    rows = []
    for L in lengths:
        q, k, v = qkv(L, device, s.dtype)
        written = partial(written_out_attention, q, k, v)
        fused = partial(fused_attention, q, k, v)
        torch.testing.assert_close(written(), fused(), atol=1e-2, rtol=1e-2)
        timed = interleaved({"written": written, "fused": fused}, s.repeats, 1, device)
        written_peak, fused_peak = peaks.get(L, (None, None))
        rows.append(
            {
                "L": L,
                **ATTENTION_SHAPE,
                "score_tensor_mib": B * H * L * L * s.dtype.itemsize / 2**20,
                "written_ms": 1e3 * timed["written"]["median_s"],
                "fused_ms": 1e3 * timed["fused"]["median_s"],
                "written_peak_mib": written_peak,
                "fused_peak_mib": fused_peak,
            }
        )
        print(_describe(rows[-1]), flush=True)
    return rows


def _describe(row: dict) -> str:
    written, fused = row["written_peak_mib"], row["fused_peak_mib"]
    memory = (
        "memory not measured" if written is None else f"peak {written:7.1f} vs {fused:6.1f} MiB"
    )
    return (
        f"  attention L={row['L']:<5} written-out {row['written_ms']:8.2f} ms  fused "
        f"{row['fused_ms']:8.2f} ms  {memory} (scores {row['score_tensor_mib']:.1f} MiB)"
    )
