"""experiments.moe_balancing: the same seed gives the same weights and batches with and
without the bias update; the update moves only the correction bias (never at step size 0) and
evens the load within a short run; the batches follow a skewed chain; imbalance's measures by
hand; the record shipped with the package equals the results file and shows the load evening
out."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from helpers import bad_command_line, raises
from transformer_tutorial.experiments import moe_balancing
from transformer_tutorial.experiments.moe_balancing import (
    STEP_SIZES,
    batches,
    imbalance,
    load_balancing_record,
    train,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "moe_balancing" / "record.json"


def mean_cv(run: dict, last: int) -> float:
    return sum(load["cv"] for load in run["load"][-last:]) / last


def test_the_update_evens_the_load_and_moves_only_the_bias():
    """60 steps: the same start; without the update the bias stays 0; with it the biases move
    and the last loads are more even than without."""
    without, with_update = train(0.0, steps=60, every=10), train(0.001, steps=60, every=10)
    assert without["load"][0] == with_update["load"][0]
    assert without["bias"] == [0.0] * 8 and any(b != 0.0 for b in with_update["bias"])
    assert mean_cv(with_update, 3) < mean_cv(without, 3)


def test_imbalance_by_hand():
    out = imbalance(torch.tensor([6, 2, 2, 2]))  # mean 3, std √3
    assert out == {"counts": [6, 2, 2, 2], "cv": round(3**0.5 / 3, 4), "max_violation": 1.0}


def test_batches_are_skewed_and_fixed_by_the_seed():
    first, again = next(batches(0)), next(batches(0))
    assert torch.equal(first, again) and not torch.equal(first, next(batches(1)))
    counts = torch.bincount(next(batches(2, batch=(64, 32))).flatten(), minlength=64)
    mean = counts.float().mean()
    assert counts.max() > 2 * mean and counts.min() < mean / 4  # 103 and 5 times, mean 32


def test_bad_arguments_are_refused_by_name():
    raises(lambda: train(-0.1, steps=1), ValueError, "step_size")
    raises(lambda: train(0.0, steps=0), ValueError, "steps")


def test_the_shipped_record_equals_the_results_file_and_shows_the_load_evening_out():
    record = load_balancing_record()
    assert record == json.loads(RESULTS.read_text(encoding="utf-8"))
    assert record["command"][:3] == ["python", "-m", "transformer_tutorial.lm.moe_balancing"]
    assert "python -m transformer_tutorial.experiments.moe_balancing" in record["note"]  # now
    runs = record["runs"]
    assert set(runs) == set(STEP_SIZES) and record["cpu_seconds"] < 60
    assert runs["without"]["load"][0] == runs["with"]["load"][0]  # the same start
    # over the last 100 steps: the update's load at least twice as even as none's
    assert 2 * mean_cv(runs["with"], 5) < mean_cv(runs["without"], 5)


def test_main_writes_a_record(tmp_path, monkeypatch):
    monkeypatch.setattr(moe_balancing, "STEPS", 2)
    monkeypatch.setattr(moe_balancing, "run", lambda: {"without": train(0.0, steps=2)})
    moe_balancing.main(["--out", str(tmp_path / "r.json")])
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["runs"]["without"]["steps"] == 2 and "finished_at" in record


def test_a_bad_flag_is_one_line_and_exit_status_2(capsys, tmp_path):
    """An --out that is a folder was found only when the record was written, after the runs."""
    bad_command_line(
        capsys, moe_balancing.main, ["--out", str(tmp_path)], "error: argument --out:"
    )
    bad_command_line(capsys, moe_balancing.main, [], "error: the following arguments are required")
