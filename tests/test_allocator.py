"""allocator.py: glibc's malloc keeps freed memory, so a step's large tensors stop faulting."""

from __future__ import annotations

import subprocess
import sys

import pytest

from transformer_tutorial.allocator import glibc_mallopt, keep_freed_memory, page_faults

# Allocate, touch and free a 64 MiB tensor ten times (16,384 pages of 4 KiB each time), after one
# untimed round; print the page faults the ten took.
SCRIPT = """
import sys, torch
from transformer_tutorial.allocator import keep_freed_memory, page_faults
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def rounds():
    for _ in range(10):
        torch.empty(16 * 2**20).fill_(1.0)
rounds()
print(page_faults(rounds))
"""

needs_glibc = pytest.mark.skipif(glibc_mallopt() is None, reason="the C library is not glibc")


def faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[-1])


@needs_glibc
def test_large_tensors_stop_faulting_once_freed_memory_is_kept():
    pages = 10 * 16 * 2**20 * 4 // 4096  # ten 64 MiB tensors in 4 KiB pages
    assert faults("default") > pages // 2  # each round's tensor is mapped afresh
    assert faults("keep") < pages // 100  # the first round's pages are reused


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
