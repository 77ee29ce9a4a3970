"""The training command line, ``python -m transformer_tutorial.train``: its help, its refusals,
and a tiny real run on Multi30k that resumes, records itself and translates."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from transformer_tutorial import train as train_cli
from transformer_tutorial import translate as translate_cli
from transformer_tutorial.configs import CONFIGS


def test_help_explains_every_flag_and_states_the_true_defaults(capsys, help_entries):
    with pytest.raises(SystemExit) as exit_info:
        train_cli.main(["--help"])
    assert exit_info.value.code == 0
    entries = help_entries(capsys.readouterr().out)
    assert all(entries.values()), [flag for flag, text in entries.items() if not text]
    flags = {invocation.split()[0].rstrip(",") for invocation in entries}
    used_by_the_book = {
        "--config",
        "--out",
        "--max-minutes",
        "--max-steps",
        "--resume",
        "--device",
        "--seed",
        "--eval-size",
        "--beam",
        "--no-progress",
    }
    assert used_by_the_book <= flags
    assert f"--config {{{','.join(sorted(CONFIGS))}}}" in entries  # every recipe is offered
    defaults = vars(train_cli.build_parser().parse_args([]))
    for invocation, text in entries.items():
        stated = re.search(r"default: ([\w.]+)", text)
        dest = invocation.split()[0].lstrip("-").replace("-", "_")
        if stated and defaults.get(dest) is not None:
            assert str(defaults[dest]) == stated.group(1), invocation


def test_unknown_config_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_cli.main(["--config", "huge"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'huge'" in capsys.readouterr().err


def test_refuses_to_resume_nothing_or_to_overwrite_a_run(tiny_checkpoint, tmp_path, capsys):
    assert train_cli.main(["--config", "tiny", "--out", str(tmp_path), "--resume"]) == 1
    assert "no checkpoint" in capsys.readouterr().err
    run = str(tiny_checkpoint.parent)
    assert train_cli.main(["--config", "tiny", "--out", run]) == 1
    assert "already holds a run" in capsys.readouterr().err
    assert train_cli.main(["--config", "small", "--out", run, "--resume"]) == 1
    assert "holds a 'tiny' run" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.corpus
def test_tiny_run_end_to_end_resumes_records_and_translates(multi30k_dir, tmp_path, capsys):
    out = tmp_path / "tiny"
    common = ["--config", "tiny", "--out", str(out), "--eval-size", "5", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    first = subprocess.run(
        [sys.executable, "-m", "transformer_tutorial.train", *common, "--max-steps", "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert first.returncode == 0, first.stderr
    assert "test2016 greedy: BLEU" in first.stdout
    assert train_cli.main([*common, "--max-steps", "5", "--resume"]) == 0  # in-process: faster
    record = json.loads((out / "record.json").read_text())
    assert record["steps"] == 5 and record["stopped_by"] == "max_steps"
    assert record["command"][1:] == [
        "-m",
        "transformer_tutorial.train",
        *common,
        "--max-steps",
        "5",
        "--resume",
    ]
    greedy = record["test2016"]["greedy"]
    assert {"score", "lowercase", "signature"} <= set(greedy) and "beam2" in record["test2016"]
    assert record["history"]["train"] and record["history"]["val"] and len(record["samples"]) == 5
    capsys.readouterr()
    sentences = ["Ein Hund läuft.", "Zwei."]
    checkpoint = str(out / "best.pt")
    assert translate_cli.main(["--checkpoint", checkpoint, "--beam", "2", *sentences]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
