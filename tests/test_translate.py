"""The command lines: help, a tiny training run and its resume, translation, and clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from transformer_tutorial import train as train_cli
from transformer_tutorial import translate as translate_cli
from transformer_tutorial.data import encode_pairs, save_tokenizer, train_tokenizer
from transformer_tutorial.train import CONFIGS, fit

pytestmark = pytest.mark.usefixtures("single_thread")


def cli(module: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m transformer_tutorial.<module> args``, one thread: the runs are tiny, and
    on a busy shared CPU spinning worker threads only slow them down."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", f"transformer_tutorial.{module}", *args], input=stdin,
                          capture_output=True, text=True, env=env, timeout=300)


def assert_clean_error(result: subprocess.CompletedProcess, code: int, message: str) -> None:
    assert result.returncode == code, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


SENTENCES = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau liest ein Buch."]
TRANSLATIONS = ["A man rides a bike.", "Two dogs play in the snow.", "A woman reads a book."]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint of one training step on three sentences, written by the real ``fit``."""
    folder = tmp_path_factory.mktemp("run")
    tokenizer = train_tokenizer(SENTENCES + TRANSLATIONS, vocab_size=80)
    save_tokenizer(tokenizer, folder / "tokenizer.json")
    pairs = encode_pairs(tokenizer, SENTENCES, TRANSLATIONS)
    config = replace(CONFIGS["tiny"], max_len=24)
    fit(config, pairs, pairs, vocab_size=tokenizer.get_vocab_size(), out_dir=folder, max_steps=1,
        progress=False, tokenizer_file="tokenizer.json")
    return folder / "best.pt"


@pytest.mark.parametrize("module", [train_cli, translate_cli])
def test_help_documents_every_flag(module, capsys):
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    shown = capsys.readouterr().out
    for action in module.build_parser()._actions:
        assert action.help, action.dest
        for flag in action.option_strings:
            assert flag in shown


def test_train_rejects_an_unknown_config():
    assert_clean_error(cli("train", "--config", "huge"), 2, "invalid choice: 'huge'")


def test_train_refuses_to_resume_nothing_or_to_overwrite_a_run(checkpoint, tmp_path, capsys):
    assert train_cli.main(["--config", "tiny", "--out", str(tmp_path), "--resume"]) == 1
    assert "no checkpoint" in capsys.readouterr().err
    assert train_cli.main(["--config", "tiny", "--out", str(checkpoint.parent)]) == 1
    assert "already holds a run" in capsys.readouterr().err
    assert train_cli.main(["--config", "small", "--out", str(checkpoint.parent), "--resume"]) == 1
    assert "holds a 'tiny' run" in capsys.readouterr().err


def test_tiny_training_run_resumes_and_translates(multi30k_dir, tmp_path, capsys):
    out = tmp_path / "tiny"
    common = ["--config", "tiny", "--out", str(out), "--eval-size", "5", "--no-progress", "--threads", "1"]
    first = cli("train", *common, "--max-steps", "3")
    assert first.returncode == 0, first.stderr
    assert "test2016 greedy: BLEU" in first.stdout
    assert train_cli.main([*common, "--max-steps", "5", "--resume"]) == 0  # in-process: saves a start-up
    record = json.loads((out / "record.json").read_text())
    assert record["steps"] == 5 and record["stopped_by"] == "max_steps"
    assert {"command", "git", "hardware", "torch", "wall_time_s", "parameters", "history", "samples"} <= set(record)
    assert {"score", "lowercase", "signature"} <= set(record["test2016"]["greedy"]) and "beam2" in record["test2016"]
    assert record["history"]["train"] and record["history"]["val"] and len(record["samples"]) == 5
    capsys.readouterr()
    assert translate_cli.main(["--checkpoint", str(out / "best.pt"), "--beam", "2", "Ein Hund läuft.", "Zwei."]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_translate_arguments_one_line_each(checkpoint):
    result = cli("translate", "--checkpoint", str(checkpoint), "--beam", "1", "--max-len", "5", *SENTENCES)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == len(SENTENCES)


def test_translate_rejects_an_empty_line(checkpoint):
    assert_clean_error(cli("translate", "--checkpoint", str(checkpoint), stdin="Ein Hund.\n\nZwei.\n"), 1,
                       "line 2 is empty")


def test_translate_other_bad_input(checkpoint, tmp_path, capsys, monkeypatch):
    def error(*argv: str) -> str:
        assert translate_cli.main(["--checkpoint", *argv]) == 1
        return capsys.readouterr().err

    assert "checkpoint not found" in error(str(tmp_path / "nope.pt"), "Hund")
    assert "argument 1 has" in error(str(checkpoint), "Hund " * 30)
    too_long = error(str(checkpoint), "--max-len", "99", "Hund")
    assert "max_len=99 must be between 1 and the model's max_len=24" in too_long
    assert "--beam must be at least 1" in error(str(checkpoint), "--beam", "0", "Hund")
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    assert "not a checkpoint written by transformer_tutorial.train" in error(str(tmp_path / "junk.pt"), "Hund")
    torch.save({"model": {}, "model_config": {"d_model": 8, "flux": 1}}, tmp_path / "odd.pt")
    assert "unknown model config" in error(str(tmp_path / "odd.pt"), "Hund")
    monkeypatch.setattr(sys, "stdin", open(os.devnull))
    assert "no text" in error(str(checkpoint))
