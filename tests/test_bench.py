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


def test_bench_bad_arguments_exit_1_with_one_line():
    done = _run("--threads=0")
    assert done.returncode == 1
    assert done.stderr.strip() == "bench.py: --threads must be at least 1, got 0"
