"""allocator.py: glibc's malloc keeps freed memory, so a step's large tensors stop faulting."""

from __future__ import annotations

import subprocess
import sys

import pytest

from transformer_tutorial.allocator import glibc_mallopt, keep_freed_memory, page_faults

# Allocate, touch and free a 64 MiB tensor twenty times; print each round's page faults. With
# 4 KiB pages a fresh tensor is 16,384 faults (with transparent huge pages set to "always", far
# fewer), so the test compares the two modes' last rounds, not a constant. Kept memory needs a
# few rounds before the heap has a free block the tensor fits (eight with glibc 2.35).
SCRIPT = """
import sys, torch
from transformer_tutorial.allocator import keep_freed_memory, page_faults
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def one_round():
    torch.empty(16 * 2**20).fill_(1.0)
print(*[page_faults(one_round) for _ in range(20)])
"""

needs_glibc = pytest.mark.skipif(glibc_mallopt() is None, reason="the C library is not glibc")


def faults(mode: str) -> list[int]:
    """Each of twenty rounds' page faults, in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True
    )
    return [int(n) for n in out.stdout.split()[-20:]]


@needs_glibc
def test_large_tensors_stop_faulting_once_freed_memory_is_kept():
    default, keep = faults("default"), faults("keep")
    # Every round maps its tensor afresh (how many faults varies by round where transparent huge
    # pages back some of them), and the kept memory's last rounds take a tenth of those at most.
    assert all(n > 0 for n in default)
    assert sum(keep[-4:]) < sum(default[-4:]) // 10  # the last rounds reuse mapped pages


@needs_glibc
def test_keep_freed_memory_applies_and_can_be_called_again():
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True


def test_without_glibc_it_does_nothing_and_says_so(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert glibc_mallopt() is None
    assert keep_freed_memory() is False


def test_page_faults_counts_the_pages_a_function_touches_first():
    import mmap

    def touch() -> None:  # an anonymous 4 MiB mapping, each page written once
        with mmap.mmap(-1, 4 * 2**20) as m:
            for offset in range(0, len(m), 4096):
                m[offset] = 1

    assert page_faults(touch) >= 4 * 2**20 // 4096
    assert page_faults(lambda: None) < 64
