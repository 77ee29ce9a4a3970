"""speculative_comparison: the target is larger than the draft and shares its vocabulary; the
shipped record holds both runs and the measured decoding, whose greedy tokens were checked;
bad names are refused."""

from __future__ import annotations

import pytest

from helpers import bad_command_line, raises
from transformer_tutorial.experiments.speculative_comparison import (
    KS,
    comparison_config,
    load_comparison_record,
    main,
)
from transformer_tutorial.lm.model import LanguageModel


def test_the_target_is_four_times_the_draft():
    target, draft = (LanguageModel(comparison_config(n, 2000)) for n in ("target", "draft"))
    assert target.config.vocab_size == draft.config.vocab_size
    assert target.num_parameters() > 4 * draft.num_parameters()


def test_the_shipped_record_holds_both_runs_and_the_measurement():
    record = load_comparison_record()
    assert set(record["runs"]) == {"target", "draft"}
    decoding = record["decoding"]
    for k in KS:
        measured = decoding[f"k={k}"]
        assert 0 < measured["acceptance_rate"] < 1
        assert measured["target_calls"] < decoding["tokens"]
        assert measured["speed_up"] == decoding["seconds_alone"] / measured["seconds"]


def test_bad_names_are_refused():
    raises(lambda: comparison_config("huge", 10), ValueError, "name must be one of")


# --- the command line (issue 42): a bad flag is one line and exit status 2, never a traceback --


def runs_without_weights(tmp):
    for name in ("draft", "target"):
        (tmp / f"{name}.json").write_text('{"command": [], "run": {}}')
    return tmp


SPECULATIVE_CLI_PROBES = {  # name: (argv from tmp_path, the line)
    "no --model": (
        lambda tmp: ["--out", str(tmp / "o.json")],
        "error: --model is required unless --measure is given",
    ),
    "--measure of a folder without the runs": (
        lambda tmp: ["--measure", str(tmp), "--out", str(tmp / "o.json")],
        "error: argument --measure: cannot read",
    ),
    "--measure of runs without weights": (
        lambda tmp: ["--measure", str(runs_without_weights(tmp)), "--out", str(tmp / "o.json")],
        "error: argument --measure:",
    ),
    "--out a folder": (
        lambda tmp: ["--model", "draft", "--out", str(tmp)],
        "error: argument --out:",
    ),
}


@pytest.mark.parametrize(
    ("argv", "line"), SPECULATIVE_CLI_PROBES.values(), ids=SPECULATIVE_CLI_PROBES.keys()
)
def test_a_bad_flag_is_one_line_and_exit_status_2(capsys, tmp_path, argv, line):
    bad_command_line(capsys, main, argv(tmp_path), line)
