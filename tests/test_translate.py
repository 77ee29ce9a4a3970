"""The translation command line, ``python -m transformer_tutorial.translate``: its help, one
translation a line for arguments or standard input, and a clear error for every bad input."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest
import torch

from transformer_tutorial import translate as translate_cli

SENTENCES = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau liest."]


def test_help_explains_every_flag_and_states_the_true_defaults(capsys, help_entries):
    with pytest.raises(SystemExit) as exit_info:
        translate_cli.main(["--help"])
    assert exit_info.value.code == 0
    entries = help_entries(capsys.readouterr().out)
    assert all(entries.values()), [flag for flag, text in entries.items() if not text]
    flags = {invocation.split()[0].rstrip(",") for invocation in entries}
    assert {"TEXT", "--checkpoint", "--beam", "--max-len", "--alpha", "--device"} <= flags
    defaults = vars(translate_cli.build_parser().parse_args(["--checkpoint", "x.pt"]))
    checked = 0
    for invocation, text in entries.items():
        stated = re.search(r"default: ([\w.]+)", text)
        dest = invocation.split()[0].lstrip("-").replace("-", "_")
        if stated and defaults.get(dest) is not None:
            assert str(defaults[dest]) == stated.group(1), invocation
            checked += 1
    assert checked >= 2  # --beam and --alpha


@pytest.mark.slow  # a fresh interpreter importing torch: ~5 s
def test_one_translation_a_line_for_arguments(tiny_checkpoint):
    """The real command, as a reader types it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = ["--checkpoint", str(tiny_checkpoint), "--beam", "1", "--max-len", "5", *SENTENCES]
    result = subprocess.run(
        [sys.executable, "-m", "transformer_tutorial.translate", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == len(SENTENCES)


def stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


def test_one_translation_a_line_for_standard_input(tiny_checkpoint, monkeypatch, capsys):
    stdin(monkeypatch, "\n".join(SENTENCES).encode() + b"\n")
    assert translate_cli.main(["--checkpoint", str(tiny_checkpoint), "--beam", "2"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(SENTENCES)


def test_bad_input_is_a_clear_error(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    checkpoint = str(tiny_checkpoint)

    def error(*argv: str) -> str:
        assert translate_cli.main(list(argv)) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "Traceback" not in err
        return err

    assert "checkpoint not found" in error("--checkpoint", str(tmp_path / "nope.pt"), "Hund")
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    assert "not a checkpoint written by" in error("--checkpoint", str(tmp_path / "junk.pt"), "x")
    torch.save({"model": {}, "model_config": {"d_model": 8}}, tmp_path / "odd.pt")
    assert "model config" in error("--checkpoint", str(tmp_path / "odd.pt"), "Hund")
    assert "argument 1 has" in error("--checkpoint", checkpoint, "Hund " * 30)
    too_long = error("--checkpoint", checkpoint, "--max-len", "99", "Hund")
    assert "max_len=99 must be between 1 and the model's max_len=24" in too_long
    assert "--beam must be at least 1" in error("--checkpoint", checkpoint, "--beam", "0", "x")
    stdin(monkeypatch, b"Ein Hund.\n\nZwei.\n")
    assert "line 2 is empty" in error("--checkpoint", checkpoint)
    stdin(monkeypatch, b"")
    assert "no text" in error("--checkpoint", checkpoint)


def test_translating_does_not_import_the_trainer(package_imports):
    reached = package_imports("translate")
    assert {"checkpoint", "decode"} <= reached
    assert not reached & {"trainer", "runs", "optim"}
