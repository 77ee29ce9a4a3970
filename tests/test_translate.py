"""The translation command line, ``python -m transformer_tutorial.translate``: its help, one
translation a line for arguments or standard input; and bad inputs: every bad flag, text or
checkpoint folder is one line (``error: ...``), exit 1, nothing on standard output."""

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


def test_translating_does_not_import_the_trainer(package_imports):
    reached = package_imports("translate")
    assert {"checkpoint", "decode"} <= reached
    assert not reached & {"trainer", "runs", "optim"}


# --- bad inputs: one line, exit 1, nothing on standard output -----------------------------------


def one_line_error(capsys, argv: list[str], code: int = 1) -> str:
    """Run the command in-process; it must fail with one ``error: ...`` line, no output and
    exit status ``code`` (2: the parser refused a flag; 1: the input or the files)."""
    try:
        got = translate_cli.main(argv)
    except SystemExit as stop:  # the parser's refusal
        got = stop.code
    out, err = capsys.readouterr()
    assert got == code and not out, out
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


FLAG_ROWS = [
    (["--beam", "0"], "error: argument --beam: must be at least 1, got 0"),
    (["--max-len", "0"], "error: argument --max-len: must be at least 1, got 0"),
    (["--alpha", "-1"], "error: argument --alpha: must be at least 0.0, got -1.0"),
    (["--alpha", "inf"], "error: argument --alpha: must be at least 0.0, got inf"),
    (["--device", "bogus"], "error: argument --device: device 'bogus' is not a device name"),
]


@pytest.mark.parametrize(("argv", "phrase"), FLAG_ROWS, ids=str)
def test_bad_flags_are_refused_by_the_parser(tiny_checkpoint, capsys, argv, phrase):
    argv = ["--checkpoint", str(tiny_checkpoint), *argv, "Ein Hund."]
    assert one_line_error(capsys, argv, code=2).startswith(phrase)


TRANSLATE_CLI_ROWS = [
    ([], b"Ein \xff Hund\n", "standard input is not UTF-8 text (byte 0xff at offset 4)"),
    ([], b"", "no text: pass German sentences"),
    ([], b"Ein Hund.\n\nEine Katze.\n", "line 2 is empty"),
    (["--max-len", "99", "Ein Hund."], None, "max_len=99 must be between 1 and the model's"),
    (["Hund " * 30], None, "argument 1 has"),
]


@pytest.mark.parametrize(("argv", "data", "phrase"), TRANSLATE_CLI_ROWS, ids=str)
def test_bad_flags_and_text_are_one_line_errors(
    tiny_checkpoint, capsys, monkeypatch, argv, data, phrase
):
    stdin(monkeypatch, data or b"")
    err = one_line_error(capsys, ["--checkpoint", str(tiny_checkpoint), *argv])
    assert phrase in err, err


FOLDER_ROWS = [
    ("missing", lambda checkpoint, tokenizer: checkpoint.unlink(), "checkpoint not found"),
    ("empty", lambda checkpoint, tokenizer: checkpoint.write_bytes(b""), "(EOFError)"),
    (
        "random",
        lambda checkpoint, tokenizer: checkpoint.write_bytes(os.urandom(300)),
        "not a checkpoint written",
    ),
    (
        "odd model config",
        lambda checkpoint, tokenizer: torch.save(
            {"model": {}, "model_config": {"d_model": 8}}, checkpoint
        ),
        "model config",
    ),
    ("no tokenizer", lambda checkpoint, tokenizer: tokenizer.unlink(), "tokenizer not found"),
    (
        "bad tokenizer",
        lambda checkpoint, tokenizer: tokenizer.write_text("{ not json"),
        "cannot read the tokenizer",
    ),
]


@pytest.mark.parametrize(
    ("damage", "phrase"), [r[1:] for r in FOLDER_ROWS], ids=[r[0] for r in FOLDER_ROWS]
)
def test_an_unreadable_checkpoint_folder_is_a_one_line_error(
    tiny_checkpoint, tmp_path, capsys, damage, phrase
):
    folder = tmp_path / "run"
    folder.mkdir()
    checkpoint, tokenizer = folder / "best.pt", folder / "tokenizer.json"
    checkpoint.write_bytes(tiny_checkpoint.read_bytes())
    tokenizer.write_bytes((tiny_checkpoint.parent / "tokenizer.json").read_bytes())
    damage(checkpoint, tokenizer)
    err = one_line_error(capsys, ["--checkpoint", str(checkpoint), "Ein Hund."])
    assert phrase in err, err
