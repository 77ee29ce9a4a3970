"""experiments.comparison: the two compared models hold the same number of weights and differ
only in their choices; records merge; the shipped record holds both runs; bad names are refused.
(The training loop: test_experiments_harness; the corpus run itself: chapter 17 and its
record.)"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import bad_command_line, raises
from transformer_tutorial.experiments.comparison import (
    COMPARED,
    comparison_config,
    load_comparison_record,
    main,
)
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.model import LanguageModel


def test_both_sides_hold_the_same_weights_and_differ_only_in_their_choices():
    gpt2, llama = (comparison_config(name, 2000) for name in ("gpt2", "llama"))
    with torch.device("meta"):
        counts = [LanguageModel(c).num_parameters() for c in (gpt2, llama)]
    assert abs(counts[0] - counts[1]) / counts[0] < 0.01, counts
    assert gpt2 == LMConfig(
        vocab_size=2000, d_model=96, n_heads=4, n_layers=2, d_ff=384, max_len=80, dropout=0.1
    )  # chapter 13's model
    same = ("d_model", "n_heads", "n_layers", "max_len", "dropout", "tie_embeddings")
    assert all(getattr(gpt2, k) == getattr(llama, k) for k in same)
    assert (llama.norm, llama.activation, llama.positions, llama.attention) == (
        "rms",
        "swiglu",
        "rope",
        "gqa",
    )


def test_the_shipped_record_holds_both_runs_at_the_same_cpu_time():
    record = load_comparison_record()
    runs = record["runs"]
    assert set(runs) == set(COMPARED) and len(record["commands"]) == 2
    assert abs(runs["llama"]["cpu_seconds"] / runs["gpt2"]["cpu_seconds"] - 1) < 0.01
    for run in runs.values():
        assert run["steps"] == run["val"][-1][1] and len(run["train"]) == len(run["val"]) - 1


def test_records_merge(tmp_path):
    paths = []
    for name in COMPARED:
        path = tmp_path / f"{name}.json"
        record = {"command": ["--model", name], "seconds": 1.0, "runs": {name: {"steps": 3}}}
        path.write_text(json.dumps(record))
        paths.append(path)
    main(["--merge", *map(str, paths), "--out", str(tmp_path / "both.json")])
    merged = json.loads((tmp_path / "both.json").read_text())
    assert merged["seconds"] == 1.0 and set(merged["runs"]) == set(COMPARED)
    assert merged["commands"] == [["--model", name] for name in COMPARED]


@pytest.mark.parametrize(
    ("call", "error", "phrase"),
    [
        (lambda: comparison_config("gpt3", 10), ValueError, "name must be one of"),
    ],
)
def test_bad_input_is_refused(call, error, phrase):
    raises(call, error, phrase)


# --- the command line (issue 42): a bad flag is one line and exit status 2, never a traceback --


def cli_cases(tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "garbled.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"command": []}')
    out = str(tmp_path / "out.json")
    return {
        "no --model": (["--out", out], "error: --model is required unless --merge is given"),
        "--merge of a missing file": (
            ["--merge", str(tmp_path / "missing.json"), "--out", out],
            "error: argument --merge: cannot read",
        ),
        "--merge of a file that is not JSON": (
            ["--merge", str(tmp_path / "garbled.json"), "--out", out],
            "error: argument --merge: cannot read",
        ),
        "--merge of a JSON list": (
            ["--merge", str(tmp_path / "list.json"), "--out", out],
            "error: argument --merge:",
        ),
        "--merge of another record": (
            ["--merge", str(tmp_path / "other.json"), "--out", out],
            "error: argument --merge:",
        ),
        "--out a folder": (
            ["--model", "gpt2", "--out", str(tmp_path)],
            "error: argument --out:",
        ),
    }


CLI_NAMES = [
    "no --model",
    "--merge of a missing file",
    "--merge of a file that is not JSON",
    "--merge of a JSON list",
    "--merge of another record",
    "--out a folder",
]


@pytest.mark.parametrize("name", CLI_NAMES)
def test_a_bad_flag_is_one_line_and_exit_status_2(capsys, tmp_path, name):
    argv, line = cli_cases(tmp_path)[name]
    bad_command_line(capsys, main, argv, line)
