"""provenance.py: the commit, the CPU and the hardware facts a run's record keeps."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from transformer_tutorial import provenance
from transformer_tutorial.provenance import cpu_name, git_commit, hardware


def test_hardware_keeps_the_resolved_precision_and_what_ran_it():
    info = hardware(torch.device("cpu"), "fp32", compiled=True)
    assert info["device"] == "cpu" and info["precision"] == "fp32" and info["compiled"] is True
    assert info["torch_threads"] == torch.get_num_threads() and info["processes"] == 1
    assert info["cpu"] == cpu_name() and "gpu" not in info  # a GPU's name only on a GPU


def test_git_commit_names_this_checkout_and_whether_it_has_changes():
    here = Path(provenance.__file__).resolve().parent
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True)
    if head.returncode:
        pytest.skip("the package does not lie in a git checkout here")
    info = git_commit()
    assert info["commit"] == head.stdout.strip() and re.fullmatch(r"[0-9a-f]{40}", info["commit"])
    assert isinstance(info["dirty"], bool)


def test_git_commit_outside_a_checkout_says_none(monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(provenance.subprocess, "run", no_git)
    assert git_commit() == {"commit": None}


def test_machine_and_load_average_are_what_the_records_keep():
    facts = provenance.machine()
    assert set(facts) == {"platform", "cpu", "cpu_count", "torch_threads"}
    assert facts["cpu"] == cpu_name() and facts["torch_threads"] == torch.get_num_threads()
    assert {k: hardware(torch.device("cpu"), "fp32")[k] for k in facts} == facts
    load = provenance.load_average()
    assert len(load) == 3 and all(x >= 0 and round(x, 2) == x for x in load)


def test_a_record_starts_and_finishes_with_where_and_when(monkeypatch):
    monkeypatch.setattr("sys.argv", ["ignored", "--model", "dense"])
    record = provenance.start_record("transformer_tutorial.lm.moe_comparison")
    module = "transformer_tutorial.lm.moe_comparison"
    assert record["command"] == ["python", "-m", module, "--model", "dense"]
    assert record["torch"] == torch.__version__ and "started_at" in record
    finished = provenance.finish_record(record)
    assert finished["finished_at"] >= finished["started_at"]
    assert len(finished["hardware"]["load_average_at_end"]) == 3
