"""tuning.grpo_run: the task and its two rewards by hand (exact match; recall, which a
completion filling its budget games), the warm-up makes the model partly right, a short GRPO
run moves the policy away from its reference and records every measure each step, the
recall reward is gamed within a short run, and the shipped record equals the results file."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from helpers import raises
from transformer_tutorial.tuning import grpo_run
from transformer_tutorial.tuning.grpo_run import (
    EOS,
    MEASURES,
    PAD,
    answers,
    digit_recall,
    exact_match,
    held_out_accuracy,
    held_out_prompts,
    load_grpo_record,
    prompts,
    train_grpo,
    warmed_up_model,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "grpo_digits" / "record.json"


def test_prompts_answers_and_rewards_by_hand():
    prompt = torch.tensor([[4, 5, 6, 2], [7, 7, 3, 2]])  # "123>", "440>"
    assert answers(prompt).tolist() == [[6, 5, 4, EOS], [3, 7, 7, EOS]]
    completion = torch.tensor([[6, 5, 4, EOS, PAD, PAD], [7, 3, 7, 7, 3, 7]])
    mask = torch.tensor([[True] * 4 + [False] * 2, [True] * 6])
    assert exact_match(prompt, completion, mask).tolist() == [1.0, 0.0]
    assert digit_recall(prompt, completion, mask).tolist() == [1.0, 1.0]  # order, length unchecked
    assert digit_recall(
        prompt, torch.tensor([[4, EOS]] * 2), torch.ones(2, 2, dtype=torch.bool)
    ).tolist() == pytest.approx([1 / 3, 0.0])
    batch = prompts(5, 4, torch.Generator().manual_seed(0))
    assert batch.shape == (5, 5) and (batch[:, -1] == grpo_run.SEP).all()
    assert ((batch[:, :-1] >= grpo_run.DIGIT0) & (batch[:, :-1] < grpo_run.DIGIT0 + 10)).all()


def test_a_short_run_records_each_step_and_leaves_the_reference():
    model = warmed_up_model(0, steps=20)
    start = copy.deepcopy(model)
    out = train_grpo(model, "exact", steps=6, every=3, seed=1)
    assert out["steps"] == 6 and set(out["per_step"]) == set(MEASURES)
    assert all(len(values) == 6 for values in out["per_step"].values())
    assert out["per_step"]["kl"][0] == 0.0 and out["per_step"]["kl"][-1] > 0  # on-policy, then not
    assert [e["step"] for e in out["held_out"]] == [0, 3, 6]
    assert any(
        not torch.equal(a, b) for a, b in zip(model.parameters(), start.parameters(), strict=True)
    )


@pytest.mark.slow
def test_the_warmup_is_partly_right_and_the_recall_reward_is_gamed():
    model = warmed_up_model(0)
    accuracy = held_out_accuracy(model, held_out_prompts(0))
    assert 0.1 < accuracy < 0.5
    out = train_grpo(model, "recall", steps=60, every=60)
    steps = out["per_step"]
    assert sum(steps["length"][-10:]) / 10 > sum(steps["length"][:10]) / 10 + 2
    assert out["held_out"][-1]["exact"] < accuracy / 2


def test_bad_arguments_are_refused_by_name():
    model = warmed_up_model(0, steps=1)
    raises(lambda: train_grpo(model, "length"), ValueError, "reward")
    raises(lambda: train_grpo(model, "exact", steps=0), ValueError, "steps")


def test_the_shipped_record_equals_the_results_file_and_shows_the_curves():
    record = load_grpo_record()
    assert record == json.loads(RESULTS.read_text(encoding="utf-8"))
    assert record["command"][:3] == ["python", "-m", "transformer_tutorial.tuning.grpo_run"]
    for run in record["runs"]["exact"]:  # exact match learnt on held-out prompts
        assert run["held_out"][-1]["exact"] > run["held_out"][0]["exact"] + 0.1
    for gamed, honest in zip(record["runs"]["recall"], record["runs"]["exact"], strict=True):
        # Gamed: over the last 50 steps, 2 tokens longer than exact match's, exact match lost.
        assert gamed["seed"] == honest["seed"]
        length, honest_length = gamed["per_step"]["length"], honest["per_step"]["length"]
        assert sum(length[-50:]) / 50 > sum(honest_length[-50:]) / 50 + 2
        assert gamed["held_out"][-1]["exact"] < 0.05


@pytest.mark.slow
def test_main_writes_a_record_with_its_command(tmp_path, monkeypatch):
    out = tmp_path / "record.json"
    argv = ["--out", str(out), "--seeds", "0", "--steps", "2", "--max-minutes", "5"]
    monkeypatch.setattr("sys.argv", ["grpo_run", *argv])
    grpo_run.main(argv)
    record = json.loads(out.read_text(encoding="utf-8"))
    assert record["command"] == ["python", "-m", "transformer_tutorial.tuning.grpo_run", *argv]
    assert set(record["runs"]) == {"exact", "recall"}
    assert [run["steps"] for run in record["runs"]["exact"]] == [2]
