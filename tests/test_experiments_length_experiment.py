"""experiments.length_experiment: streams cut into windows, the loss per position equals the
mean next-token loss, the scalings are the ones the record names, and the shipped record loads
whole (the run itself: chapter 18 and results/rope_scaling)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import bad_command_line, raises
from transformer_tutorial.experiments.length_experiment import (
    FINE_TUNED,
    MULTIPLES,
    SCALINGS,
    TRAIN_LEN,
    cut_windows,
    experiment_config,
    load_length_record,
    loss_per_position,
    main,
    token_stream,
)
from transformer_tutorial.lm.model import LanguageModel, next_token_loss

ROOT = Path(__file__).resolve().parents[1]


def test_streams_join_sentences_and_windows_drop_the_incomplete_last():
    sentences = [[1, 2], [3], [4, 5, 6]]
    assert token_stream(sentences) == [1, 2, 3, 4, 5, 6]
    shuffled = token_stream(sentences, seed=3)
    assert sorted(shuffled) == [1, 2, 3, 4, 5, 6] and shuffled == token_stream(sentences, seed=3)
    assert torch.equal(cut_windows(list(range(7)), 3), torch.tensor([[0, 1, 2], [3, 4, 5]]))
    raises(lambda: cut_windows([1, 2], 3), ValueError, "fewer than one window of 3")


def test_loss_per_position_averages_to_the_next_token_loss():
    torch.manual_seed(0)
    config = experiment_config(30, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32, dropout=0.0)
    model = LanguageModel(config).eval()
    windows = torch.randint(0, 30, (5, 12))
    curve = loss_per_position(model, windows, batch_size=2)
    assert curve.shape == (11,)
    expected = next_token_loss(model(windows), windows)
    torch.testing.assert_close(curve.mean().float(), expected, atol=1e-5, rtol=1e-5)


def test_the_scalings_reach_the_longest_length_from_the_trained_one():
    longest = TRAIN_LEN * max(MULTIPLES)
    assert experiment_config(100).max_len == longest
    assert SCALINGS["none"] is None and set(FINE_TUNED) <= set(SCALINGS)
    for name in ("linear", "yarn"):
        assert SCALINGS[name].factor * TRAIN_LEN == longest
        LanguageModel(experiment_config(100, rope_scaling=SCALINGS[name]))  # a valid model


def test_the_shipped_record_loads_and_is_the_results_copy():
    record = load_length_record()
    shipped = ROOT / "results" / "rope_scaling" / "record.json"
    if shipped.exists():  # in the repository, not in an installed wheel
        assert json.loads(shipped.read_text()) == record
    methods = [*SCALINGS, *(f"{name}+fine-tune" for name in FINE_TUNED)]
    assert list(record["evaluations"]) == methods
    for result in record["evaluations"].values():
        assert list(result["mean"]) == [str(n) for n in MULTIPLES]
        assert len(result["per_position"]) == TRAIN_LEN * max(MULTIPLES) - 1
    assert record["base"]["config"]["max_len"] == TRAIN_LEN * max(MULTIPLES)
    assert record["train_command"][2] == "transformer_tutorial.length_experiment"  # as recorded
    assert "python -m transformer_tutorial.experiments.length_experiment" in record["note"]
    assert record["fine_tune_seconds"] == pytest.approx(
        max(r["train_seconds"] for r in record["fine_tunes"].values()), rel=0.05
    )


# --- the command line (issue 42): a bad flag is one line and exit status 2, never a traceback --


def a_state(tmp: Path) -> str:
    (tmp / "base.pt").write_bytes(b"")
    return str(tmp / "base.pt")


LENGTH_CLI_PROBES = {  # name: (argv from tmp_path, the line)
    "extend without the trained weights": (
        lambda tmp: ["--stage", "extend", "--state", str(tmp / "no.pt"), "--out", str(tmp / "r")],
        "error: argument --state:",
    ),
    "extend without the training stage's record": (
        lambda tmp: ["--stage", "extend", "--state", a_state(tmp), "--out", str(tmp / "r.json")],
        "error: argument --out: cannot read",
    ),
    "--out a folder": (
        lambda tmp: ["--stage", "train", "--state", str(tmp / "s.pt"), "--out", str(tmp)],
        "error: argument --out:",
    ),
}


@pytest.mark.parametrize(
    ("argv", "line"), LENGTH_CLI_PROBES.values(), ids=LENGTH_CLI_PROBES.keys()
)
def test_a_bad_flag_is_one_line_and_exit_status_2(capsys, tmp_path, argv, line):
    bad_command_line(capsys, main, argv(tmp_path), line)
