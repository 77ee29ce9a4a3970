"""scripts/check_outputs.py (part of `make lint`): measured digits and wide lines in outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import check_outputs
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_outputs.py"


def notebook(
    tmp_path: Path, source: str, output: str, name: str = "07_example", tags: tuple = ()
) -> Path:
    cell = {
        "cell_type": "code",
        "execution_count": 1,
        "id": "c001",
        "metadata": {"tags": list(tags)},
        "source": source.splitlines(keepends=True),
        "outputs": [{"name": "stdout", "output_type": "stream", "text": [output]}],
    }
    intro = {"cell_type": "markdown", "id": "c000", "metadata": {}, "source": ["# 7. Example"]}
    path = tmp_path / f"{name}.ipynb"
    path.write_text(json.dumps({"cells": [intro, cell], "metadata": {}, "nbformat": 4}))
    return path


def run(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, paths)], capture_output=True, text=True
    )


def test_a_printed_measured_error_fails_naming_chapter_and_cell(tmp_path):
    path = notebook(tmp_path, 'print(f"max |Δlogit| {gap:.1e}")', "max |Δlogit| 3.1e-07\n")
    done = run(path)
    assert done.returncode == 1
    assert "07_example, cell 1: measured digits in a checked output: 3.1e-07" in done.stdout


@pytest.mark.parametrize(
    "printed", ["3.1e-07", "2e-07", "7.50e-08", "0.000031", "9.4E-06", "tensor([4.2e-09])"]
)
def test_every_spelling_of_a_small_measured_number_counts(printed):
    assert check_outputs.measured_numbers("print(gap)", f"gap {printed}\n")


@pytest.mark.parametrize(
    ("source", "printed"),
    [
        ("print(gap)", "within 1e-06"),  # a bound: mantissa 1
        ('print(f"< {2e-6}")', "< 2e-06"),  # a bound written in the cell's source
        ("print(torch.finfo(torch.float32).eps)", "1.19e-07"),  # float32's machine epsilon
        ("print(torch.finfo(torch.float16).tiny)", "6.1e-05"),  # float16's smallest normal
        ("print(loss)", "loss 0.0030 after 2.5e+03 steps"),  # not below 1e-4
        ("print(x)", "0.0 and 0e+00"),  # zero
    ],
)
def test_bounds_constants_and_larger_numbers_pass(source, printed):
    assert check_outputs.measured_numbers(source, printed) == []


def test_a_constant_is_recognised_only_at_its_printed_precision():
    # 3e-08 is not float16's smallest subnormal 5.96e-08, though both round to 'e-08'
    assert check_outputs.measured_numbers("print(g)", "3e-08") == ["3e-08"]
    assert check_outputs.measured_numbers("print(g)", "5.96e-08") == []


def test_an_ignored_cell_may_print_measured_digits_but_not_wide_lines(tmp_path):
    source = "# NBVAL_IGNORE_OUTPUT\nprint(gap)"
    assert run(notebook(tmp_path, source, "3.1e-07\n")).returncode == 0
    done = run(notebook(tmp_path, source, "x" * 100 + "\n"))
    assert done.returncode == 1 and "a printed line of 100 characters" in done.stdout


def test_a_line_of_99_characters_fits(tmp_path):
    assert run(notebook(tmp_path, "print(s)", "x" * 99 + "\n")).returncode == 0


def test_a_collapsed_solution_holds_96(tmp_path):
    tags = ("hide-cell", "solution")
    assert run(notebook(tmp_path, "print(s)", "x" * 96 + "\n", tags=tags)).returncode == 0
    done = run(notebook(tmp_path, "print(s)", "x" * 97 + "\n", tags=tags))
    assert done.returncode == 1 and "at most 96 fit" in done.stdout
