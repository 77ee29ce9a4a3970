"""Chapter 10: run records — what a run was, where it ran and how it went (:class:`RunRecord`,
``record.json``), told in a few lines by :func:`describe_run`; and the book's reference record,
shipped with the package (:func:`load_reference_record`).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from dataclasses import MISSING, asdict, dataclass, fields
from importlib import resources
from pathlib import Path

import torch

from transformer_tutorial import distributed

# How many test sentences a record keeps with their translations, to read.
RECORD_SAMPLES = 20


@dataclass
class RunRecord:
    """What a run was and how it went, as ``record.json`` stores it.

    ``test2016`` holds the BLEU scores of the weights in the file ``weights`` (``"best.pt"``, or
    ``"averaged.pt"`` for a recipe with ``average_last`` above 1). For those, ``averaged`` says
    ``{"steps": [...], "val_loss": ..., "best_test2016": {...}}``: the checkpoints averaged, the
    mean's validation loss and, to compare, ``best.pt``'s scores; otherwise it is None.
    """

    command: list[str]
    config: dict
    model_config: dict
    git: dict
    hardware: dict
    torch: str
    python: str
    finished_at: str
    seed: int
    parameters: int
    train_pairs: int
    steps: int
    epochs_completed: int
    stopped_by: str
    train_time_s: float
    best: dict
    history: dict
    test2016: dict
    samples: list[dict]
    wall_time_s: float
    weights: str = "best.pt"
    averaged: dict | None = None

    @property
    def beam_name(self) -> str:
        """The key of the beam-search scores in ``test2016`` and ``samples``, e.g. ``"beam5"``."""
        return f"beam{self.config['beam_size']}"

    @classmethod
    def load(cls, path: Path | str) -> RunRecord:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))

    @classmethod
    def from_json(cls, text: str) -> RunRecord:
        data = json.loads(text)  # fields with defaults came later: older records lack them
        return cls(
            **{f.name: data[f.name] for f in fields(cls) if f.name in data or f.default is MISSING}
        )

    def save(self, path: Path | str) -> None:
        text = json.dumps(asdict(self), indent=2, ensure_ascii=False) + "\n"
        Path(path).write_text(text, encoding="utf-8")


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


def hardware(device: torch.device, precision: str, *, compiled: bool = False) -> dict:
    """Where a run runs: device, CPU, threads, processes, and the precision it resolved
    (:func:`~transformer_tutorial.precision.resolve_precision`'s answer, not ``"auto"``)."""
    info = {
        "device": str(device),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "processes": distributed.world_size(),
        "precision": precision,
        "compiled": compiled,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def describe_run(record: RunRecord) -> str:
    """What a run's ``record.json`` says, in a few aligned lines: command, hardware, code, model,
    training and BLEU on test2016. Absolute paths are cut to their last two parts, so the text
    reads the same on every machine."""

    def shown(arg: str) -> str:
        path = Path(arg)
        if not path.is_absolute():
            return arg
        return "python" if path.name.startswith("python") else f"…/{path.parent.name}/{path.name}"

    hw, config, model = record.hardware, record.config, record.model_config
    epochs = record.epochs_completed
    threads = f"{hw['torch_threads']} torch thread{'s' if hw['torch_threads'] != 1 else ''}"
    device = hw.get("gpu") or f"{hw.get('cpu') or 'CPU'}, {hw['cpu_count']} cores, {threads}"
    if hw.get("processes", 1) > 1:
        device += f", {hw['processes']} processes (torchrun)"
    git = record.git
    code = "git unknown"
    if git["commit"]:
        code = f"git {git['commit'][:10]}" + (" (uncommitted changes)" if git.get("dirty") else "")
    lines = [
        ("command", " ".join(shown(a) for a in record.command) or "(not recorded)"),
        ("hardware", f"{hw['device']}: {device}"),
        ("software", f"{code}, torch {record.torch}, Python {record.python}"),
        (
            "model",
            f"{record.parameters:,} parameters: d_model {model['d_model']}, "
            f"{model['n_encoder_layers']}+{model['n_decoder_layers']} layers, "
            f"{model['n_heads']} heads, "
            f"d_ff {model['d_ff']}, {'pre' if model['norm_first'] else 'post'}-norm, "
            f"vocabulary {model['src_vocab_size']:,}",
        ),
        (
            "training",
            f"{record.steps:,} steps of ~{config['max_tokens']:,} tokens, "
            f"{epochs} full epoch{'s' if epochs != 1 else ''} of "
            f"{record.train_pairs:,} pairs",
        ),
        (
            "time",
            f"{record.train_time_s / 60:.1f} min of training (stopped by {record.stopped_by})",
        ),
        ("best", f"validation loss {record.best['val_loss']:.3f} at step {record.best['step']:,}"),
        *_scored_weights(record),
        ("wall time", f"{record.wall_time_s / 60:.1f} min in all, data and evaluation included"),
    ]
    scores = record.test2016
    for name in ("greedy", record.beam_name):
        lines.append(
            (
                f"BLEU {name}",
                f"{scores[name]['score']:.2f} "
                f"(lowercased {scores[name]['lowercase']:.2f}) "
                f"on {scores['sentences']:,} test2016 sentences",
            )
        )
    lines.append(("signature", scores["greedy"]["signature"]))
    return "\n".join(f"{key:<12} {value}" for key, value in lines)


def _scored_weights(record: RunRecord) -> list[tuple[str, str]]:
    """Which weights the BLEU lines below score, and what averaging them changed."""
    if not record.averaged:
        return [("scored", f"{record.weights}, the weights with the lowest validation loss")]
    steps, alone = record.averaged["steps"], record.averaged["best_test2016"][record.beam_name]
    n = len(steps)
    return [
        (
            "scored",
            f"{record.weights}, the mean of the last {n} checkpoint{'s' * (n != 1)} "
            f"(steps {steps[0]:,}–{steps[-1]:,})",
        ),
        (
            "averaging",
            f"validation loss {record.averaged['val_loss']:.3f}; "
            f"best.pt alone: BLEU {record.beam_name} {alone['score']:.2f}",
        ),
    ]


def load_reference_record() -> RunRecord:
    """The record of the book's reference run
    (``python -m transformer_tutorial.train --config small``), shipped with the package as
    ``reference_run.json``; the repository keeps the same file as
    ``results/multi30k_de_en/record.json``."""
    text = (
        resources.files("transformer_tutorial")
        .joinpath("reference_run.json")
        .read_text(encoding="utf-8")
    )
    return RunRecord.from_json(text)
