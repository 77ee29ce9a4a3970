"""bench/bench.py (`make bench`): runs end to end on tiny sizes and writes its results; bad
arguments get one line and exit status 1. Benchmarks are scripts: nothing here asserts speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "bench.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, env=env, cwd=ROOT
    )


@pytest.mark.slow
def test_bench_quick_runs_every_section_and_writes_results(tmp_path, tiny_checkpoint):
    done = _run(
        "--quick",
        "--threads=1",
        "--repeats=1",
        "--warmup=0",
        f"--checkpoint={tiny_checkpoint}",
        f"--out={tmp_path}",
    )
    assert done.returncode == 0, done.stderr
    assert "1 threads (fixed)" in done.stdout
    [json_path] = tmp_path.glob("cpu-*-quick.json")
    assert json_path.with_suffix(".png").stat().st_size > 0
    results = json.loads(json_path.read_text())
    assert results["meta"]["threads"] == 1
    for kind in ("train_step", "forward"):
        assert [(r["config"], r["length"]) for r in results[kind]] == [("tiny", 8), ("tiny", 16)]
        assert all(r["ratio"] > 0 and r["ours_ms"] > 0 for r in results[kind])
    assert results["compiled"] == [] and results["compile_skipped"]
    assert [r["tokens"] for r in results["decode"]] == [4, 8]
    assert results["beam"]["sentences"] == 4
    assert results["beam"]["beam5_sentences_per_s"] > 0
    assert [r["L"] for r in results["attention"]] == [64, 128]
    if sys.platform == "linux":  # tiny sizes: measured, but too small to compare
        assert all(r["written_peak_mib"] is not None for r in results["attention"])


PEAK_SCRIPT = """
import sys, torch
sys.path.insert(0, "bench")
import bench
cpu = torch.device("cpu")
for mib in (20, 16):  # as the model benchmarks do: glibc raises its threshold, keeps freed memory
    scratch = torch.ones(mib * 2**18); del scratch
assert bench.map_large_allocations()
for _ in range(2):  # twice: the second call reuses nothing the first one freed
    big = bench.peak_memory(lambda: torch.ones(16 * 2**18).sum(), cpu) / 2**20  # 16 MiB
    small = bench.peak_memory(lambda: torch.ones(1024).sum(), cpu) / 2**20
    print(f"{big:.1f} {small:.1f}")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the resident set is read from /proc")
def test_peak_memory_sees_a_temporary_tensor_after_the_process_freed_larger_ones():
    """Without map_large_allocations the 16 MiB tensor reuses memory glibc kept: peak 0."""
    done = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    for line in done.stdout.splitlines():
        big, small = map(float, line.split())
        assert 15 <= big <= 20 and small < 2, done.stdout


def test_bench_bad_arguments_exit_1_with_one_line():
    done = _run("--threads=0")
    assert done.returncode == 1
    assert done.stderr.strip() == "bench.py: --threads must be at least 1, got 0"
