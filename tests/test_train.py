"""The training command line, ``python -m transformer_tutorial.train``: its help, a tiny real run
on Multi30k that resumes, records itself and translates, and Ctrl-C that saves and says how to
resume; and bad inputs: every bad flag or folder refused before training in one line
(``error: ...``, exit 1, no traceback, in a real process too)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

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


def test_the_record_names_the_interpreter_python_not_its_path(tmp_path, monkeypatch):
    """A record says what to run, not where this machine keeps its virtual environment."""
    given = {}
    monkeypatch.setattr(train_cli, "run_experiment", lambda config, **kw: given.update(kw))
    argv = ["--config", "tiny", "--out", str(tmp_path / "run"), "--max-steps", "1"]
    assert train_cli.main(argv) == 0  # run_experiment's None: a rank that does not report
    assert given["command"] == ["python", "-m", "transformer_tutorial.train", *argv]


def test_refuses_to_overwrite_a_run_or_to_resume_another_recipe(tiny_checkpoint, capsys):
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
    common += ["--average-last", "2"]  # score the mean of the last 2 checkpoints' weights
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    first = subprocess.run(
        [sys.executable, "-m", "transformer_tutorial.train", *common, "--max-steps", "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert first.returncode == 0, first.stderr
    assert "BLEU greedy" in first.stdout and "BLEU beam2" in first.stdout  # records.describe_run
    assert "best.pt alone: BLEU beam2" in first.stdout
    again = [*common, "--max-steps", "5", "--resume"]
    assert train_cli.main(again) == 0  # in-process: faster
    record = json.loads((out / "record.json").read_text())
    assert record["steps"] == 5 and record["stopped_by"] == "max_steps"
    assert record["hardware"]["precision"] == "fp32"  # "auto", resolved once for the CPU
    assert record["command"] == ["python", "-m", "transformer_tutorial.train", *again]
    # The resumed run scored the mean of its snapshots: step 5's alone, as a run of 5 steps
    # without a stop would (tiny checkpoints every 20 steps; step 3's was dropped on resuming).
    assert record["weights"] == "averaged.pt" and record["averaged"]["steps"] == [5]
    assert set(record["averaged"]["best_test2016"]) >= {"greedy", "beam2"}
    assert torch.load(out / "averaged.pt", weights_only=True)["averaged_steps"] == [5]
    assert "best.pt alone: BLEU beam2" in capsys.readouterr().out
    greedy = record["test2016"]["greedy"]
    assert {"score", "lowercase", "signature"} <= set(greedy) and "beam2" in record["test2016"]
    assert record["history"]["train"] and record["history"]["val"] and len(record["samples"]) == 5
    capsys.readouterr()
    sentences = ["Ein Hund läuft.", "Zwei."]
    checkpoint = str(out / "best.pt")
    assert translate_cli.main(["--checkpoint", checkpoint, "--beam", "2", *sentences]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def train_command(out: Path, *args: str) -> list[str]:
    """The command line a user types to train the tiny recipe into ``out``."""
    return [
        sys.executable,
        "-m",
        "transformer_tutorial.train",
        "--config",
        "tiny",
        "--out",
        str(out),
        *args,
    ]


@pytest.mark.slow
@pytest.mark.corpus
def test_ctrl_c_saves_prints_how_to_resume_and_resume_works(multi30k_dir, tmp_path):
    out = tmp_path / "run"
    command = train_command(out, "--epochs", "50", "--no-progress", "--threads", "1")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "last.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.2)  # the first checkpoint: training is under way
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in err, err
    assert "interrupted after step" in err and f"--out {out} --resume" in err
    step = torch.load(out / "last.pt", weights_only=True)["step"]
    assert f"after step {step}:" in err
    resume = train_command(out, "--resume", "--max-steps", str(step + 2), "--no-progress")
    done = subprocess.run(resume, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{step + 2} steps" in done.stdout


# --- bad inputs: one line, nothing started: exit 2 for a flag (the parser), 1 for a file ------

TRAIN_CLI_ROWS = [
    (["--max-steps", "0"], 2, "error: argument --max-steps: must be at least 1, got 0"),
    (["--epochs", "0"], 2, "error: argument --epochs: must be at least 1, got 0"),
    (["--beam", "0"], 2, "error: argument --beam: must be at least 1, got 0"),
    (["--beam", "two"], 2, "error: argument --beam: must be an int, got 'two'"),
    (["--eval-size", "0"], 2, "error: argument --eval-size: must be at least 1, got 0"),
    (["--max-minutes", "-1"], 2, "error: argument --max-minutes: must be greater than 0.0"),
    (["--max-minutes", "nan"], 2, "error: argument --max-minutes: must be greater than 0.0"),
    (["--threads", "-1"], 2, "error: argument --threads: must be at least 1, got -1"),
    (["--seed", "-1"], 2, "error: argument --seed: must be at least 0, got -1"),
    (["--device", "bogus"], 2, "error: argument --device: device 'bogus' is not a device name"),
    (["--config", "huge"], 2, "error: argument --config: invalid choice: 'huge'"),
    (["--resume"], 1, "error: --resume: no checkpoint"),
]


@pytest.mark.parametrize(("argv", "code", "phrase"), TRAIN_CLI_ROWS, ids=lambda a: str(a))
def test_bad_flags_are_refused_before_training(tmp_path, capsys, monkeypatch, argv, code, phrase):
    started = []
    monkeypatch.setattr(train_cli, "run_experiment", lambda *a, **k: started.append(1))
    try:
        got = train_cli.main(["--config", "tiny", "--out", str(tmp_path / "run"), *argv])
    except SystemExit as stop:  # the parser's refusal
        got = stop.code
    err = capsys.readouterr().err
    assert got == code and not started
    assert err.count("\n") == 1 and err.startswith(phrase), err


def test_a_file_as_out_and_a_corrupt_last_checkpoint_are_refused(tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    assert train_cli.main(["--config", "tiny", "--out", str(a_file)]) == 1
    assert f"--out {a_file} is a file" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "last.pt").write_bytes(os.urandom(100))
    assert train_cli.main(["--config", "tiny", "--out", str(tmp_path / "run"), "--resume"]) == 1
    assert "not a checkpoint written by transformer_tutorial.train" in capsys.readouterr().err


@pytest.mark.slow  # a fresh interpreter importing torch: ~5 s
def test_errors_show_no_traceback_in_a_real_process(tmp_path):
    """The in-process tests above see main()'s return value; this one sees what a user sees."""
    command = train_command(tmp_path / "run", "--beam", "0")
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "error: argument --beam: must be at least 1, got 0"
    assert not (tmp_path / "run").exists()
