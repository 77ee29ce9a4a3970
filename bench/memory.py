"""Peak memory of one call: CUDA's allocator statistics, or on a CPU the resident set, which
glibc must be told to give back (:func:`map_large_allocations`)."""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from pathlib import Path

import torch

from transformer_tutorial.allocator import M_TRIM_THRESHOLD, glibc_mallopt

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def _rss_bytes(field: str) -> int:
    match = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    if match is None:
        raise OSError(f"/proc/self/status has no {field}")
    return int(match.group(1)) * 1024


def map_large_allocations(threshold: int = 64 * 1024) -> bool:
    """Make glibc give every allocation of ``threshold`` bytes or more its own mapping, returned
    to the system when it is freed, so that the resident set follows the live tensors.

    By default glibc raises that threshold as large blocks are freed (up to 32 MiB) and keeps
    freed memory for reuse: after the training benchmarks, a 128 MiB score tensor fits in memory
    the process already holds, and the resident set does not move (the peaks read 0). It costs
    a page fault for every fresh page, so it is for a process that measures memory, not time:
    the opposite of :func:`transformer_tutorial.allocator.keep_freed_memory`, which the
    benchmark's own process calls. False where this is not glibc."""
    mallopt = glibc_mallopt()
    if mallopt is None:
        return False
    ok = mallopt(M_MMAP_THRESHOLD, threshold) and mallopt(M_TRIM_THRESHOLD, threshold)
    ctypes.CDLL(None).malloc_trim(0)  # give back what is already free
    return bool(ok)


def peak_memory(fn: Callable[[], object], device: torch.device) -> int | None:
    """Bytes the call needs at its peak above what was in use before it.

    CUDA: the caching allocator's peak. CPU (Linux, glibc): the peak resident set size, reset
    through ``/proc/self/clear_refs`` before the call; :func:`map_large_allocations` must have
    run, so that large tensors are mapped and unmapped one by one. None where neither works."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = _rss_bytes("VmRSS")
        fn()
        return _rss_bytes("VmHWM") - before
    except OSError:
        return None
