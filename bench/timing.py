"""Timing: calls taken in turns, so that a busy machine slows every contender alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a CUDA call returns before its kernel ends)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn()`` takes, the device's queued work included."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def interleaved(
    fns: dict[str, Callable[[], object]], repeats: int, warmup: int, device: torch.device
) -> dict[str, dict]:
    """Time each function ``repeats`` times after ``warmup`` untimed runs, taking turns (the
    order flips every round).

    Returns per name: wall-clock median and spread (max - min) / median, CPU-time median (this
    process's, all threads), the timed runs, and the first call's time (compile time shows
    there)."""
    names = list(fns)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    first: dict[str, float] = {}
    for round_ in range(warmup + repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            start_cpu = time.process_time()
            elapsed = timed_call(fns[name], device)
            first.setdefault(name, elapsed)
            if round_ >= warmup:
                wall[name].append(elapsed)
                cpu[name].append(time.process_time() - start_cpu)
    out = {}
    for n in names:
        median = statistics.median(wall[n])
        out[n] = {
            "median_s": median,
            "spread": (max(wall[n]) - min(wall[n])) / median,
            "cpu_median_s": statistics.median(cpu[n]),
            "first_s": first[n],
            "times_s": wall[n],
        }
    return out
