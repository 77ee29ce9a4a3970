"""scripts/check_torch_version.py: `make check-torch` stops when pip replaced the torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_torch_version.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def test_the_installed_version_passes_silently():
    done = run(torch.__version__.split("+")[0])
    assert done.returncode == 0 and done.stdout == done.stderr == ""


def test_another_version_fails_in_one_line_that_names_both():
    done = run("2.5.1")
    assert done.returncode == 1 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert "asked for torch 2.5.1" in line and torch.__version__.split("+")[0] in line


def test_no_version_is_a_usage_error():
    assert run().returncode == 2
