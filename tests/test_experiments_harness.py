"""experiments.harness: the shared training loop keeps its budget (steps, wall-clock or CPU
seconds), lowers the loss and records it; it computes exactly what the two loops it replaced
computed (chapter 17's ``comparison.train_for`` and chapter 20's
``moe_comparison.train_for_cpu``: their numbers, stored below), so their committed records stay
its records; records are read from the package and written as committed; bad input is refused.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest
import torch

from helpers import raises
from transformer_tutorial import data
from transformer_tutorial.experiments import harness
from transformer_tutorial.experiments.moe_comparison import balancing_loss
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.model import LanguageModel

V = 40
ROOT = Path(__file__).resolve().parents[1]


def sentences(n: int, seed: int = 0) -> list[list[int]]:
    """``<bos>`` and a run of counting tokens ``<eos>``: easy to learn."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        start = torch.randint(4, 20, (1,), generator=g).item()
        rows.append([data.BOS_ID, *range(start, start + 6), data.EOS_ID])
    return rows


def test_a_step_budget_is_kept_and_the_loss_falls():
    torch.manual_seed(0)
    model = LanguageModel(
        LMConfig(vocab_size=V, d_model=32, n_heads=4, n_layers=1, d_ff=64, max_len=16, dropout=0.0)
    )
    val = data.pad_batch(sentences(20, seed=1))
    result = harness.train_for(
        model, sentences(200), val, seconds=60.0, max_steps=120, evaluations=4, max_tokens=128
    )
    assert result["steps"] == 120 and len(result["val"]) == 5 and len(result["train"]) == 4
    steps = [s for _, s, _ in result["val"]]
    assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == 120
    first, last = result["val"][0][2], result["val"][-1][2]
    assert last < first - 1.0, (first, last)
    assert not model.training and "aux" not in result


@pytest.mark.parametrize("clock", harness.CLOCKS)
def test_a_time_budget_is_kept_on_either_clock(clock):
    model = LanguageModel(
        LMConfig(vocab_size=V, d_model=16, n_heads=2, n_layers=1, d_ff=32, max_len=16)
    )
    val = data.pad_batch(sentences(4, seed=1))
    result = harness.train_for(
        model, sentences(50), val, seconds=0.3, clock=clock, evaluations=2, max_tokens=64
    )
    spent = result["train_seconds" if clock == "wall" else "cpu_seconds"]
    assert spent >= 0.3 and result["steps"] >= 1 and result["val"][-1][0] >= 0.3
    other = {"wall": "cpu_seconds", "cpu": "wall_seconds"}[clock]
    assert result[other] > 0


# --- the loops it replaced: their numbers, for the same seed and a clock that ticks -----------


def tick_clocks(monkeypatch):
    """Both clocks advance by one second a call: a training step then takes exactly one second
    on either, and the budget, the schedule and the evaluations fall on the same steps on any
    machine."""
    for name in ("perf_counter", "process_time"):
        monkeypatch.setattr(time, name, itertools.count().__next__)


def tiny(**changes) -> LanguageModel:
    torch.manual_seed(0)
    sizes = dict(vocab_size=V, d_model=16, n_heads=2, n_layers=2, d_ff=32, max_len=16)
    return LanguageModel(LMConfig(**(sizes | changes)))


SWIGLU = dict(activation="swiglu", bias=False)
MOE = dict(SWIGLU, n_experts=4, n_experts_per_token=2, moe_d_ff=16, router_aux_loss_coef=0.01)
TRAIN = dict(evaluations=3, max_tokens=96, warmup=2)
# What comparison.train_for returned (commit cd6d4dc's test ran both loops side by side):
# 7 ticks of wall clock; and 5 steps within 100.
WALL = {
    "steps": 7,
    "tokens": 608,
    "train_seconds": 7.0,
    "val": [
        [0.0, 0, 3.6923298835754395],
        [3.0, 3, 3.5777900218963623],
        [5.0, 5, 3.5421016216278076],
        [7.0, 7, 3.528949499130249],
    ],
    "train": [3.661306858062744, 3.559252619743347, 3.535753846168518],
}
STEPS = {
    "steps": 5,
    "tokens": 416,
    "train_seconds": 5.0,
    "val": [
        [0.0, 0, 3.6923298835754395],
        [2.0, 2, 3.6116790771484375],
        [4.0, 4, 3.568434953689575],
        [5.0, 5, 3.5608179569244385],
    ],
    "train": [3.68143630027771, 3.597583770751953, 3.565572738647461],
}
# What moe_comparison.train_for_cpu returned: 6 ticks of CPU, the mixture and a dense model.
CPU_MOE = {
    "steps": 6,
    "tokens": 512,
    "cpu_seconds": 6.0,
    "wall_seconds": 6.0,
    "val": [
        [0.0, 0, 3.69181489944458],
        [2.0, 2, 3.6255009174346924],
        [4.0, 4, 3.567683458328247],
        [6.0, 6, 3.5438034534454346],
    ],
    "train": [3.673352599143982, 3.6184722185134888, 3.574191689491272],
    "aux": [2.00188672542572, 2.0007362365722656, 2.0017738342285156],
}
CPU_DENSE = {
    "steps": 6,
    "tokens": 512,
    "cpu_seconds": 6.0,
    "wall_seconds": 6.0,
    "val": [
        [0.0, 0, 3.7063679695129395],
        [2.0, 2, 3.6453192234039307],
        [4.0, 4, 3.5878162384033203],
        [6.0, 6, 3.5636215209960938],
    ],
    "train": [3.673972964286804, 3.6282222270965576, 3.585995078086853],
    "aux": [None, None, None],
}


def same_numbers(got: dict, want: dict) -> None:
    """Every key of ``want`` in ``got``: counts and times exactly, losses to float32's
    rounding (another CPU or PyTorch may sum in another order; a changed recipe moves them by
    far more)."""
    for key, value in want.items():
        if key == "val":  # [seconds, step, loss]: the seconds and steps exact
            assert [row[:2] for row in got[key]] == [row[:2] for row in value]
            got_loss, want_loss = [row[2] for row in got[key]], [row[2] for row in value]
            assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=0), key
        elif key == "aux" and None in value:
            assert got[key] == value
        else:
            assert got[key] == pytest.approx(value, rel=1e-5, abs=0), key


@pytest.mark.parametrize(
    ("budget", "want"), [(dict(seconds=7.0), WALL), (dict(seconds=100.0, max_steps=5), STEPS)]
)
def test_on_the_wall_clock_it_gives_what_comparison_train_for_gave(monkeypatch, budget, want):
    train, val = sentences(64), data.pad_batch(sentences(8, seed=1))
    tick_clocks(monkeypatch)
    same_numbers(harness.train_for(tiny(), train, val, **TRAIN, **budget), want)


@pytest.mark.parametrize(("changes", "want"), [(MOE, CPU_MOE), (SWIGLU, CPU_DENSE)])
def test_on_the_cpu_clock_it_gives_what_train_for_cpu_gave(monkeypatch, changes, want):
    train, val = sentences(64), data.pad_batch(sentences(8, seed=1))
    tick_clocks(monkeypatch)
    got = harness.train_for(
        tiny(**changes),
        train,
        val,
        seconds=6.0,
        clock="cpu",
        aux_loss=balancing_loss,
        aux_weight=0.01,
        **TRAIN,
    )
    same_numbers(got, want)


# --- records ---------------------------------------------------------------------------------


def test_load_record_reads_the_committed_record():
    for name in (
        "lm_comparison",
        "moe_comparison",
        "moe_balancing",
        "rope_scaling",
        "speculative",
    ):
        committed = ROOT / "results" / name / "record.json"
        assert harness.load_record(name) == json.loads(committed.read_text(encoding="utf-8"))
    raises(lambda: harness.load_record("no_such_run"), FileNotFoundError, "no_such_run")


def test_write_record_writes_what_load_reads_back(tmp_path):
    record = {"note": "é", "runs": {"a": [1, 2.5, None]}}
    path = tmp_path / "deeper" / "record.json"
    harness.write_record(path, record)
    text = path.read_text()
    assert json.loads(text) == record and text == json.dumps(record, indent=1) + "\n"


@pytest.mark.parametrize(
    ("kwargs", "phrase"),
    [
        (dict(seconds=0.0), "seconds must be"),
        (dict(seconds=1.0, max_steps=0), "max_steps"),
        (dict(seconds=1.0, clock="gpu"), "clock must be one of"),
        (dict(seconds=1.0, evaluations=0), "evaluations"),
        (dict(seconds=1.0, aux_weight=-1.0), "aux_weight"),
    ],
)
def test_bad_input_is_refused_and_the_model_untouched(kwargs, phrase):
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    raises(lambda: harness.train_for(model, [], None, **kwargs), ValueError, phrase)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
