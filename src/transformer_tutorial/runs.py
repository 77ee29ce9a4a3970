"""Chapter 10: whole runs — train, score with BLEU, record what was run where; the runs cache.

:func:`run_experiment` is what ``python -m transformer_tutorial.train`` does: data, tokenizer,
:func:`~transformer_tutorial.trainer.fit`, then BLEU on test2016 with the best weights (or the
mean of the last checkpoints' weights, ``averaged.pt``), all kept in a :class:`RunRecord`
(``record.json``). The chapters keep their runs in the cache,
``runs_dir() / name``, and find them with :func:`find_checkpoint`.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path

import torch
from tokenizers import Tokenizer

from transformer_tutorial import distributed
from transformer_tutorial.checkpoint import average_checkpoints, load_model, save_atomic
from transformer_tutorial.configs import CONFIGS, RunOptions, TrainConfig
from transformer_tutorial.data import (
    cache_dir,
    encode_pairs,
    load_split,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)
from transformer_tutorial.decode import bleu, translate_sentences
from transformer_tutorial.model import Transformer, TransformerConfig
from transformer_tutorial.precision import resolve_precision
from transformer_tutorial.runtime import get_device
from transformer_tutorial.trainer import evaluate_loss, fit, snapshot_paths

# How many test sentences a record keeps with their translations, to read.
RECORD_SAMPLES = 20
# Chapter 10's own run: minutes of training by device type.
CHAPTER_MINUTES = {"cuda": 10.0, "cpu": 2.0}


@dataclass
class RunRecord:
    """What a run was and how it went, as ``record.json`` stores it."""

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
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    def save(self, path: Path | str) -> None:
        text = json.dumps(asdict(self), indent=2, ensure_ascii=False) + "\n"
        Path(path).write_text(text, encoding="utf-8")


def _git_commit() -> dict:
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


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), ""
            )
    except OSError:
        return platform.processor()


def _hardware(device: torch.device, options: RunOptions) -> dict:
    info = {
        "device": str(device),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "processes": distributed.world_size(),
        "precision": resolve_precision(options.precision, device),
        "compiled": options.compile,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


TOKENIZER_FILE = "tokenizer.json"


def _prepare_data(
    config: TrainConfig, out_dir: Path, resume: bool
) -> tuple[Tokenizer, list[tuple[list[int], list[int]]], list[tuple[list[int], list[int]]]]:
    """The tokenizer (learned on the training split, or the run's own when resuming) and the
    encoded training pairs that fit ``max_len`` and validation pairs. Under ``torchrun`` rank 0
    learns the tokenizer and the other ranks read it."""
    train_src, train_tgt = (side[: config.train_size] for side in load_split("train"))
    val_src, val_tgt = load_split("val")
    tokenizer_path = out_dir / TOKENIZER_FILE
    if not resume and distributed.is_main():
        save_tokenizer(train_tokenizer(train_src + train_tgt, config.vocab_size), tokenizer_path)
    distributed.barrier()  # the other ranks read the tokenizer rank 0 wrote
    tokenizer = load_tokenizer(tokenizer_path)
    max_len = config.model.max_len
    fits = [
        (s, t)
        for s, t in encode_pairs(tokenizer, train_src, train_tgt)
        if len(s) <= max_len and len(t) + 1 <= max_len
    ]
    return tokenizer, fits, encode_pairs(tokenizer, val_src, val_tgt)


def _score(
    model: Transformer, tokenizer: Tokenizer, config: TrainConfig, src: list[str], refs: list[str]
) -> tuple[dict, list[dict]]:
    """BLEU of greedy and beam search on ``src``, and the first :data:`RECORD_SAMPLES`
    translations beside their references."""
    start = time.monotonic()
    greedy = translate_sentences(model, tokenizer, src)
    beam = translate_sentences(
        model, tokenizer, src, beam_size=config.beam_size, alpha=config.alpha
    )
    beam_name = f"beam{config.beam_size}"
    scores = {
        "sentences": len(src),
        "greedy": asdict(bleu(greedy, refs)),
        beam_name: asdict(bleu(beam, refs)),
        "eval_time_s": round(time.monotonic() - start, 1),
    }
    rows = list(zip(src, refs, greedy, beam, strict=True))[:RECORD_SAMPLES]
    samples = [{"source": s, "reference": r, "greedy": g, beam_name: b} for s, r, g, b in rows]
    return scores, samples


def _average_snapshots(
    config: TrainConfig, out_dir: Path, val_pairs: list, device: torch.device, precision: str
) -> tuple[Transformer, dict]:
    """Write ``averaged.pt``: the mean of the weights in ``snapshots/``, with its validation
    loss; returns that model and what the record says of it."""
    paths = snapshot_paths(out_dir)
    checkpoint = average_checkpoints(paths)
    model = Transformer(TransformerConfig(**checkpoint["model_config"])).to(device)
    model.load_state_dict(checkpoint["model"])
    val_loss = evaluate_loss(
        model,
        val_pairs,
        max_tokens=config.max_tokens,
        label_smoothing=config.label_smoothing,
        device=device,
        precision=precision,
    )
    steps = [int(path.stem.removeprefix("step-")) for path in paths]
    save_atomic({**checkpoint, "val_loss": val_loss, "averaged_steps": steps}, out_dir / AVERAGED)
    return model.eval(), {"steps": steps, "val_loss": val_loss}


AVERAGED = "averaged.pt"


def run_experiment(
    config: TrainConfig,
    *,
    out_dir: Path | str,
    options: RunOptions = RunOptions(),
    command: Sequence[str] = (),
) -> RunRecord | None:
    """The whole experiment: data, tokenizer, :func:`fit`, then BLEU on test2016 (greedy and beam
    search) with the best weights, or with ``config.average_last`` above 1 the averaged weights
    (``averaged.pt``; the best weights are scored too, to compare), written to
    ``out_dir/record.json`` and returned.

    Under ``torchrun`` every rank trains; rank 0 alone learns the tokenizer, scores and writes
    the record, and the other ranks return None once training ends."""
    wall_start = time.monotonic()
    git = _git_commit()  # the code as the run starts, not as it ends
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(options.device)
    tokenizer, fits, val_pairs = _prepare_data(config, out_dir, options.resume)
    test_src, test_tgt = (side[: config.eval_size] for side in load_split("test"))
    model, state = fit(
        config,
        fits,
        val_pairs,
        vocab_size=tokenizer.get_vocab_size(),
        out_dir=out_dir,
        options=options,
        tokenizer_file=TOKENIZER_FILE,
    )
    if not distributed.is_main():
        return None

    best, _, best_checkpoint = load_model(out_dir / "best.pt", device)
    weights, scored, averaged = "best.pt", best, None
    if config.average_last > 1:
        precision = resolve_precision(options.precision, device)
        scored, averaged = _average_snapshots(config, out_dir, val_pairs, device, precision)
        weights = AVERAGED
        # What averaging gained: the best checkpoint alone, scored the same way
        averaged["best_test2016"], _ = _score(best, tokenizer, config, test_src, test_tgt)
    test2016, samples = _score(scored, tokenizer, config, test_src, test_tgt)
    record = RunRecord(
        command=list(command),
        config=asdict(config),
        model_config=asdict(model.config),
        git=git,
        hardware=_hardware(device, options),
        torch=torch.__version__,
        python=platform.python_version(),
        finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        seed=options.seed,
        parameters=sum(p.numel() for p in model.parameters()),
        train_pairs=len(fits),
        steps=state.step,
        epochs_completed=state.epoch,
        stopped_by=state.stopped_by,
        train_time_s=round(state.train_seconds, 1),
        best={"step": best_checkpoint["step"], "val_loss": best_checkpoint["val_loss"]},
        history=state.history,
        test2016=test2016,
        samples=samples,
        wall_time_s=round(time.monotonic() - wall_start, 1),
        weights=weights,
        averaged=averaged,
    )
    record.save(out_dir / "record.json")
    return record


RUN_PREFERENCE = ("base", "small", "chapter10")


def runs_dir() -> Path:
    """Where the chapters keep trained runs: ``runs`` in the book's cache folder
    (:func:`transformer_tutorial.data.cache_dir`), one subfolder per run name."""
    return cache_dir() / "runs"


def find_checkpoint() -> Path | None:
    """The scored weights (``averaged.pt`` or ``best.pt``) of the best finished run in
    :func:`runs_dir`, or None.

    Runs are preferred in the order of :data:`RUN_PREFERENCE`: ``base`` (the paper's model, on a
    GPU), ``small`` (the reference recipe), ``chapter10`` (chapter 10's quick CPU run). A run is
    finished once its folder holds ``best.pt``, ``tokenizer.json`` and ``record.json``.
    """
    for name in RUN_PREFERENCE:
        folder = runs_dir() / name
        if all((folder / f).is_file() for f in ("best.pt", TOKENIZER_FILE, "record.json")):
            averaged = folder / AVERAGED
            return averaged if averaged.is_file() else folder / "best.pt"
    return None


def train_for_chapter(
    *,
    device: torch.device | str | None = None,
    max_minutes: float | None = None,
    progress: bool = False,
) -> RunRecord:
    """Chapter 10's run (chapter 11 calls it too when :func:`find_checkpoint` finds nothing).

    On a CUDA GPU the reference recipe ``small`` for ``max_minutes`` (default 10), saved as run
    ``small``; elsewhere the reduced ``chapter10`` config for ``max_minutes`` (default 2), saved as
    ``chapter10``. An earlier run of that name is replaced. Returns the run's record, which also
    lies in ``runs_dir() / name / "record.json"``.
    """
    device = get_device(device)
    config = CONFIGS["small"] if device.type == "cuda" else CONFIGS["chapter10"]
    if max_minutes is None:
        max_minutes = CHAPTER_MINUTES["cuda" if device.type == "cuda" else "cpu"]
    out_dir = runs_dir() / config.name
    shutil.rmtree(out_dir, ignore_errors=True)
    command = [
        "python",
        "-m",
        "transformer_tutorial.train",
        "--config",
        config.name,
        "--out",
        str(out_dir),
        "--max-minutes",
        f"{max_minutes:g}",
        "--device",
        device.type,
    ]
    options = RunOptions(device=str(device), max_minutes=max_minutes, progress=progress)
    return run_experiment(config, out_dir=out_dir, options=options, command=command)


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
        ("scored", _scored_weights(record)),
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


def _scored_weights(record: RunRecord) -> str:
    """Which weights the BLEU lines below score, in words."""
    if not record.averaged:
        return f"{record.weights}, the best validation loss"
    steps, before = record.averaged["steps"], record.averaged["best_test2016"]
    return (
        f"{record.weights}, the mean of the weights at steps {', '.join(f'{s:,}' for s in steps)}:"
        f" validation loss {record.averaged['val_loss']:.3f}; best.pt alone: "
        f"{record.beam_name} BLEU {before[record.beam_name]['score']:.2f}"
    )


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
