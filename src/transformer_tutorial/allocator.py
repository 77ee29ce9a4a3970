"""Chapter 12: keep freed memory for the next step — glibc's ``malloc`` told not to hand memory
back to the kernel.

A training step allocates the same large tensors again and again: the logits alone are target
tokens × vocabulary floats, about 80 MB in a batch of the ``small`` recipe. glibc serves a block
that large — above 32 MiB, the most its adaptive ``mmap`` threshold reaches — with a fresh
``mmap`` and unmaps it when the tensor is freed; smaller blocks come from its heap, but what is
freed at the heap's top beyond a trim threshold goes back to the kernel as well. Either way the
next step's tensors start as untouched pages, and touching each 4 KiB page costs a page fault in
the kernel: a step of the ``small`` recipe took about 80,000 of them a second on 2 cores.
:func:`keep_freed_memory` calls ``mallopt`` so that every block comes from the heap
(``M_MMAP_MAX = 0``) and the heap is never trimmed (``M_TRIM_THRESHOLD = -1``): once the freed
blocks have merged into one the tensors fit, a step reuses pages already mapped. It is what the
environment variables ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...`` do, applied from inside
the process.

It governs the main arena, the one the main thread allocates from; a thread of its own gets
another arena, which still maps requests above its 64 MiB heap and can unmap whole heaps. The
trainer's CPU steps, forward and backward, allocate on the main thread.

The trainer and the benchmark call it on a CPU. It changes no number, only where the bytes
live; the process keeps its high-water mark of memory instead of giving it back between steps.
Where the C library is not glibc (macOS, Windows, musl) it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import resource
import sys
from collections.abc import Callable

# mallopt's parameter numbers, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
NO_TRIM = -1  # as M_TRIM_THRESHOLD: never give the heap's free top back ("disables trimming")


def glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None where this process's C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):  # musl's mallopt does nothing
            return None
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


def keep_freed_memory() -> bool:
    """Serve large blocks from the heap and keep freed memory mapped, for this whole process.

    Returns whether it was applied (False where the C library is not glibc). Calling it again
    changes nothing.
    """
    mallopt = glibc_mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, NO_TRIM))


def page_faults(fn: Callable[[], object]) -> int:
    """The minor page faults (a page touched for the first time) this process takes in ``fn()``."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
