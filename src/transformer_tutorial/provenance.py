"""Where a run ran and from what code: the git commit, the CPU's name and the hardware facts
that run records (:mod:`~transformer_tutorial.records`), the LM comparison and the bench keep.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from transformer_tutorial import distributed


def git_commit() -> dict:
    """The package's git commit and whether the working tree has uncommitted changes
    (``{"commit": None}`` outside a git checkout, e.g. installed from a wheel)."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        )
        status = subprocess.run(
            ["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}
    if commit.returncode:
        return {"commit": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def cpu_name() -> str:
    """The CPU's model name, as ``/proc/cpuinfo`` gives it where there is one."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), ""
            )
    except OSError:
        return platform.processor()


def machine() -> dict:
    """The machine a record's numbers came from: platform, CPU name, cores, torch's threads."""
    return {
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages, rounded: how busy the machine was."""
    return [round(x, 2) for x in os.getloadavg()]


def hardware(device: torch.device, precision: str, *, compiled: bool = False) -> dict:
    """Where a run runs: device, CPU, threads, processes, and the precision it resolved
    (:func:`~transformer_tutorial.precision.resolve_precision`'s answer, not ``"auto"``)."""
    info = {
        "device": str(device),
        **machine(),
        "processes": distributed.world_size(),
        "precision": precision,
        "compiled": compiled,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def start_record(module: str) -> dict:
    """What an experiment's record opens with: the command that makes it (``python -m module``
    and its flags), the commit, the machine and its load, torch's version, the time."""
    return {
        "command": ["python", "-m", module, *sys.argv[1:]],
        "git": git_commit(),
        "hardware": {**machine(), "load_average_at_start": load_average()},
        "torch": torch.__version__,
        "started_at": _now(),
    }


def finish_record(record: dict) -> dict:
    """``record`` with when it finished and the machine's load by then."""
    record["finished_at"] = _now()
    record["hardware"]["load_average_at_end"] = load_average()
    return record
