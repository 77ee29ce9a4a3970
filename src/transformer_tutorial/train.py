"""Chapter 10: training — label smoothing, the warm-up schedule, and a resumable training loop.

Command line::

    python -m transformer_tutorial.train --config small --out runs/small --max-minutes 60

writes ``tokenizer.json``, ``last.pt`` (everything needed to resume), ``best.pt`` (the weights
with the lowest validation loss) and ``record.json`` (what was run, where, and how it went).
The chapters keep their runs in the cache, ``runs_dir() / name``, and find them with
:func:`find_checkpoint`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor, nn
from tqdm import tqdm

from transformer_tutorial.data import (
    PAD_ID, DatasetUnavailableError, cache_dir, collate, encode_pairs, load_split, load_tokenizer,
    pair_lengths, save_tokenizer, token_batches, train_tokenizer,
)
from transformer_tutorial.decode import bleu, translate
from transformer_tutorial.model import Transformer, TransformerConfig
from transformer_tutorial.runtime import get_device, set_seed

Pairs = Sequence[tuple[Sequence[int], Sequence[int]]]


# --- The loss and the learning rate ------------------------------------------------------------


def label_smoothing_loss(logits: Tensor, target: Tensor, *, smoothing: float,
                         ignore_index: int) -> Tensor:
    """Cross-entropy against a smoothed target: ``1 - smoothing`` on the true token plus
    ``smoothing`` spread evenly over all V tokens; positions where ``target == ignore_index``
    do not count. Equal to ``F.cross_entropy(logits, target, label_smoothing=smoothing,
    ignore_index=ignore_index)``.

    Shapes:
        logits ``(N, V)``, target ``(N,)`` → a scalar, the mean over counted positions.
    """
    logp = logits.log_softmax(dim=-1)  # (N, V)
    nll = -logp.gather(-1, target.clamp(min=0)[:, None]).squeeze(-1)  # (N,) -log p(true token)
    uniform = -logp.mean(dim=-1)  # (N,) cross-entropy against the uniform distribution
    loss = (1.0 - smoothing) * nll + smoothing * uniform
    keep = target != ignore_index
    return loss[keep].sum() / keep.sum()


def warmup_inverse_sqrt(step: int, *, warmup: int) -> float:
    """The learning-rate multiplier: up linearly to 1 at step ``warmup``, then down as 1/√step.

    ``step`` counts the optimizer steps already taken, as ``LambdaLR`` passes it (0 for the
    first). Times a peak learning rate; times :func:`paper_peak_lr` it is the paper's schedule.
    """
    step += 1
    return min(step / warmup, math.sqrt(warmup / step))


def paper_peak_lr(d_model: int, warmup: int, factor: float = 1.0) -> float:
    """The peak of the paper's learning rate, reached at ``step = warmup`` (section 5.3):

        lr = factor · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5)
    """
    return factor * d_model**-0.5 * warmup**-0.5


# --- Named configurations ------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    """A named recipe: the model's size and how to train it.

    The model uses one joint vocabulary, one embedding matrix shared by source, target and output
    layer when ``share_embeddings``. ``max_tokens`` is the padded size of a batch (longest pair ×
    pairs); ``lr`` the peak learning rate; ``eval_every`` also evaluates every so many steps
    (0: once an epoch); ``train_size`` and ``eval_size`` cut the training set and the test set
    used for BLEU (None: all).
    """

    name: str
    vocab_size: int = 8000
    d_model: int = 256
    n_heads: int = 8
    n_encoder_layers: int = 3
    n_decoder_layers: int = 3
    d_ff: int = 1024
    dropout: float = 0.1
    norm_first: bool = True
    share_embeddings: bool = True
    max_len: int = 256
    max_tokens: int = 4000
    lr: float = 1e-3
    warmup: int = 800
    label_smoothing: float = 0.1
    clip_norm: float = 1.0
    epochs: int = 100
    log_every: int = 20
    eval_every: int = 0
    checkpoint_every: int = 200
    train_size: int | None = None
    eval_size: int | None = None
    beam_size: int = 5
    alpha: float = 0.6

    def model_config(self, vocab_size: int) -> TransformerConfig:
        return TransformerConfig(
            vocab_size, vocab_size, d_model=self.d_model, n_heads=self.n_heads,
            n_encoder_layers=self.n_encoder_layers, n_decoder_layers=self.n_decoder_layers,
            d_ff=self.d_ff, dropout=self.dropout, max_len=self.max_len,
            norm_first=self.norm_first, pad_id=PAD_ID,
            share_embeddings=self.share_embeddings, tie_output=self.share_embeddings,
        )


CONFIGS = {
    # Seconds on a CPU: for tests and CI. Learns little.
    "tiny": TrainConfig("tiny", vocab_size=500, d_model=32, n_heads=2, n_encoder_layers=2,
                        n_decoder_layers=2, d_ff=64, max_len=128, max_tokens=1000, lr=3e-3,
                        warmup=20, epochs=2, log_every=5, eval_every=20, checkpoint_every=20,
                        train_size=2000, eval_size=50, beam_size=2),
    # Chapter 10's own run on a CPU, two minutes: small made narrower and shallower. It sees less
    # than one epoch, so no dropout, and many small batches at a higher learning rate.
    "chapter10": TrainConfig("chapter10", d_model=128, n_heads=4, n_encoder_layers=2,
                             n_decoder_layers=2, d_ff=512, dropout=0.0, max_tokens=1000, lr=3e-3,
                             warmup=50, log_every=5, eval_every=100, checkpoint_every=100,
                             eval_size=100),
    # The CPU reference, an hour on 2 cores: the baseline's model (d_model 256, 3+3 layers) with
    # batches of 3,000 tokens and a 400-step warm-up, so that the ~1,500 steps an hour allows are
    # not half spent warming up.
    "small": TrainConfig("small", max_tokens=3000, warmup=400),
    # The paper's base model and schedule (Table 3, section 5.3), for a GPU.
    "base": TrainConfig("base", d_model=512, n_heads=8, n_encoder_layers=6, n_decoder_layers=6,
                        d_ff=2048, norm_first=False, max_tokens=8000, lr=paper_peak_lr(512, 4000),
                        warmup=4000),
}


# --- Training -----------------------------------------------------------------------------------


def make_optimizer(
    model: nn.Module, config: TrainConfig
) -> tuple[torch.optim.Adam, torch.optim.lr_scheduler.LambdaLR]:
    """Adam with the paper's β = (0.9, 0.98), ε = 1e-9, and the warm-up schedule peaking at
    ``config.lr``."""
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, betas=(0.9, 0.98), eps=1e-9)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_inverse_sqrt(step, warmup=config.warmup)
    )
    return optimizer, schedule


@torch.no_grad()
def evaluate_loss(model: Transformer, pairs: Pairs, *, max_tokens: int, label_smoothing: float,
                  device: torch.device) -> float:
    """The mean loss per target token over ``pairs``, dropout off (training's criterion)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in token_batches(pair_lengths(pairs), max_tokens):
        src, tgt_in, tgt_out = (x.to(device) for x in collate([pairs[i] for i in batch]))
        with _autocast(device):
            logits = model(src, tgt_in)  # (B, T, V)
        total += F.cross_entropy(logits.float().flatten(0, 1), tgt_out.flatten(),
                                 ignore_index=PAD_ID, label_smoothing=label_smoothing,
                                 reduction="sum").item()
        count += int((tgt_out != PAD_ID).sum())
    model.train(was_training)
    return total / max(count, 1)


def _autocast(device: torch.device) -> torch.autocast:
    """bf16 mixed precision on CUDA; plain float32 everywhere else."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _rng_states() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _save(obj: dict, path: Path) -> None:
    """Write a checkpoint under a temporary name first, so a crash never leaves half a file."""
    part = path.with_name(path.name + ".part")
    torch.save(obj, part)
    os.replace(part, path)


def fit(
    config: TrainConfig,
    train_pairs: Pairs,
    val_pairs: Pairs,
    *,
    vocab_size: int,
    out_dir: Path | str,
    device: torch.device | str = "cpu",
    seed: int = 0,
    resume: bool = False,
    max_steps: int | None = None,
    max_minutes: float | None = None,
    progress: bool = True,
    tokenizer_file: str | None = None,
) -> tuple[Transformer, dict]:
    """Train a model of ``config`` on ``train_pairs``; checkpoint into ``out_dir``.

    Stops after ``config.epochs`` epochs, ``max_steps`` steps in all, or ``max_minutes`` of this
    call, whichever comes first, always with a validation loss and a saved checkpoint.
    ``out_dir/last.pt`` holds everything needed to resume: with ``resume=True`` training goes on
    exactly as if it had never stopped. ``out_dir/best.pt`` holds the weights with the lowest
    validation loss so far.

    Returns:
        The model (last weights) and the state: ``step``, ``epoch``, ``history``, ``stopped_by``…
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(device)
    set_seed(seed)
    model = Transformer(config.model_config(vocab_size)).to(device)
    optimizer, schedule = make_optimizer(model, config)
    batch_order = torch.Generator().manual_seed(seed)
    state = {
        "step": 0, "epoch": 0, "batch_in_epoch": 0, "epoch_start": batch_order.get_state(),
        "train_seconds": 0.0, "window": [0.0, 0], "epoch_sums": [0.0, 0],
        "best_val_loss": math.inf, "history": {"train": [], "val": [], "epochs": []},
    }
    if resume:
        saved = torch.load(out_dir / "last.pt", map_location="cpu", weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["scheduler"])
        state = saved["state"]
        _set_rng_states(saved["rng"])
    history = state["history"]
    lengths = pair_lengths(train_pairs)
    started, seconds_before = time.monotonic(), state["train_seconds"]
    deadline = math.inf if max_minutes is None else started + 60 * max_minutes

    def elapsed() -> float:
        return seconds_before + time.monotonic() - started

    def checkpoint() -> dict:
        return {"model": model.state_dict(), "model_config": asdict(model.config),
                "train_config": asdict(config), "tokenizer": tokenizer_file, "step": state["step"],
                "epochs_completed": state["epoch"]}

    def validate() -> float:
        val_loss = evaluate_loss(model, val_pairs, max_tokens=config.max_tokens,
                                 label_smoothing=config.label_smoothing, device=device)
        history["val"].append({"step": state["step"], "epoch": state["epoch"] + 1,
                               "val_loss": val_loss, "elapsed_s": round(elapsed(), 1)})
        if val_loss < state["best_val_loss"]:
            state["best_val_loss"] = val_loss
            _save({**checkpoint(), "val_loss": val_loss}, out_dir / "best.pt")
        return val_loss

    def save_last() -> None:
        state["train_seconds"] = elapsed()
        _save({**checkpoint(), "optimizer": optimizer.state_dict(),
               "scheduler": schedule.state_dict(), "state": state, "rng": _rng_states()},
              out_dir / "last.pt")

    model.train()
    stopped_by = "max_steps" if max_steps is not None and state["step"] >= max_steps else "epochs"
    while state["epoch"] < config.epochs and stopped_by == "epochs":
        batch_order.set_state(state["epoch_start"])
        batches = token_batches(lengths, config.max_tokens, generator=batch_order)
        bar = tqdm(total=len(batches), initial=state["batch_in_epoch"],
                   desc=f"epoch {state['epoch'] + 1}", disable=not progress, leave=False,
                   dynamic_ncols=True)
        for batch in batches[state["batch_in_epoch"]:]:
            src, tgt_in, tgt_out = (x.to(device) for x in collate([train_pairs[i] for i in batch]))
            with _autocast(device):
                logits = model(src, tgt_in)  # (B, T, V)
            loss = F.cross_entropy(logits.float().flatten(0, 1), tgt_out.flatten(),
                                   ignore_index=PAD_ID, label_smoothing=config.label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), config.clip_norm)
            optimizer.step()
            schedule.step()
            state["step"] += 1
            state["batch_in_epoch"] += 1
            tokens = int((tgt_out != PAD_ID).sum())
            loss_sum = loss.item() * tokens
            for sums in (state["window"], state["epoch_sums"]):
                sums[0] += loss_sum
                sums[1] += tokens
            bar.update()
            if state["step"] % config.log_every == 0:
                train_loss = state["window"][0] / state["window"][1]
                history["train"].append({"step": state["step"], "epoch": state["epoch"] + 1,
                                         "train_loss": train_loss, "lr": schedule.get_last_lr()[0],
                                         "elapsed_s": round(elapsed(), 1)})
                state["window"] = [0.0, 0]
                bar.set_postfix(loss=f"{train_loss:.3f}")
            if config.eval_every and state["step"] % config.eval_every == 0:
                validate()
            if config.checkpoint_every and state["step"] % config.checkpoint_every == 0:
                save_last()
            if max_steps is not None and state["step"] >= max_steps:
                stopped_by = "max_steps"
            elif time.monotonic() >= deadline:
                stopped_by = "max_minutes"
            if stopped_by != "epochs":
                break
        bar.close()
        if state["batch_in_epoch"] == len(batches):
            epoch_loss = state["epoch_sums"][0] / max(state["epoch_sums"][1], 1)
            val_loss = validate()
            history["epochs"].append({"epoch": state["epoch"] + 1, "step": state["step"],
                                      "train_loss": epoch_loss, "val_loss": val_loss,
                                      "elapsed_s": round(elapsed(), 1)})
            if progress:
                tqdm.write(f"epoch {state['epoch'] + 1}: step {state['step']}, train loss "
                           f"{epoch_loss:.3f}, val loss {val_loss:.3f}, {elapsed() / 60:.1f} min")
            state.update(epoch=state["epoch"] + 1, batch_in_epoch=0,
                         epoch_start=batch_order.get_state(), epoch_sums=[0.0, 0])
        elif not history["val"] or history["val"][-1]["step"] != state["step"]:
            validate()
        save_last()
    state["stopped_by"] = stopped_by
    return model, state


# --- Checkpoints and the whole run --------------------------------------------------------------


def load_model(
    path: Path | str, device: torch.device | str = "cpu"
) -> tuple[Transformer, Tokenizer | None, dict]:
    """Load a checkpoint written by :func:`fit`: the model (in eval mode), its tokenizer (found
    beside the checkpoint) or None, and the checkpoint's other entries."""
    path = Path(path)
    checkpoint = torch.load(path, map_location=device, weights_only=True)
    if not isinstance(checkpoint, dict) or not {"model", "model_config"} <= set(checkpoint):
        raise ValueError(
            "not a checkpoint written by transformer_tutorial.train (no model or model_config)"
        )
    try:
        config = TransformerConfig(**checkpoint["model_config"])
    except TypeError as err:
        raise ValueError(f"unknown model config {checkpoint['model_config']}: {err}") from None
    model = Transformer(config).to(device)
    model.load_state_dict(checkpoint["model"])
    tokenizer = (load_tokenizer(path.parent / checkpoint["tokenizer"])
                 if checkpoint.get("tokenizer") else None)
    return model.eval(), tokenizer, checkpoint


def _git_commit() -> dict:
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                                text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True,
                                text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}
    if commit.returncode:
        return {"commit": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def _hardware(device: torch.device) -> dict:
    info = {"device": str(device), "platform": platform.platform(), "cpu": _cpu_name(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def run(
    config: TrainConfig,
    *,
    out_dir: Path | str,
    device: torch.device | str = "cpu",
    seed: int = 0,
    resume: bool = False,
    max_steps: int | None = None,
    max_minutes: float | None = None,
    progress: bool = True,
    command: Sequence[str] = (),
) -> dict:
    """The whole experiment: data, tokenizer, :func:`fit`, then BLEU on test2016 with the best
    weights (greedy and beam search), all written to ``out_dir/record.json`` and returned."""
    wall_start = time.monotonic()
    git = _git_commit()  # the code as the run starts, not as it ends
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(device)
    train_src, train_tgt = (side[: config.train_size] for side in load_split("train"))
    val_src, val_tgt = load_split("val")
    test_src, test_tgt = (side[: config.eval_size] for side in load_split("test"))
    tokenizer_path = out_dir / "tokenizer.json"
    if resume:
        tokenizer = load_tokenizer(tokenizer_path)
    else:
        tokenizer = train_tokenizer(train_src + train_tgt, config.vocab_size)
        save_tokenizer(tokenizer, tokenizer_path)
    fits = [(s, t) for s, t in encode_pairs(tokenizer, train_src, train_tgt)
            if len(s) <= config.max_len and len(t) + 1 <= config.max_len]
    model, state = fit(config, fits, encode_pairs(tokenizer, val_src, val_tgt),
                       vocab_size=tokenizer.get_vocab_size(), out_dir=out_dir, device=device,
                       seed=seed, resume=resume, max_steps=max_steps, max_minutes=max_minutes,
                       progress=progress, tokenizer_file=tokenizer_path.name)

    best, _, best_checkpoint = load_model(out_dir / "best.pt", device)
    eval_start = time.monotonic()
    greedy = translate(best, tokenizer, test_src)
    beam = translate(best, tokenizer, test_src, beam_size=config.beam_size, alpha=config.alpha)
    record = {
        "command": list(command),
        "config": asdict(config),
        "model_config": asdict(model.config),
        "git": git,
        "hardware": _hardware(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seed": seed,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_pairs": len(fits),
        "steps": state["step"],
        "epochs_completed": state["epoch"],
        "stopped_by": state["stopped_by"],
        "train_time_s": round(state["train_seconds"], 1),
        "best": {"step": best_checkpoint["step"], "val_loss": best_checkpoint["val_loss"]},
        "history": state["history"],
        "test2016": {
            "sentences": len(test_src),
            "greedy": asdict(bleu(greedy, test_tgt)),
            f"beam{config.beam_size}": asdict(bleu(beam, test_tgt)),
            "eval_time_s": round(time.monotonic() - eval_start, 1),
        },
        "samples": [{"source": s, "reference": r, "greedy": g, f"beam{config.beam_size}": b}
                    for s, r, g, b in list(zip(test_src, test_tgt, greedy, beam))[:20]],
        "wall_time_s": round(time.monotonic() - wall_start, 1),
    }
    (out_dir / "record.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    return record


# --- Runs in the cache: the chapters' checkpoints and the reference record ----------------------

RUN_PREFERENCE = ("base", "small", "chapter10")


def runs_dir() -> Path:
    """Where the chapters keep trained runs: ``runs`` in the book's cache folder
    (:func:`transformer_tutorial.data.cache_dir`), one subfolder per run name."""
    return cache_dir() / "runs"


def find_checkpoint() -> Path | None:
    """``best.pt`` of the best finished run in :func:`runs_dir`, or None.

    Runs are preferred in the order of :data:`RUN_PREFERENCE`: ``base`` (the paper's model, on a
    GPU), ``small`` (the reference recipe), ``chapter10`` (chapter 10's quick CPU run). A run is
    finished once its folder holds ``best.pt``, ``tokenizer.json`` and ``record.json``.
    """
    for name in RUN_PREFERENCE:
        folder = runs_dir() / name
        if all((folder / f).is_file() for f in ("best.pt", "tokenizer.json", "record.json")):
            return folder / "best.pt"
    return None


def train_for_chapter(*, device: torch.device | str | None = None,
                      max_minutes: float | None = None, progress: bool = False) -> dict:
    """Chapter 10's run (chapter 11 calls it too when :func:`find_checkpoint` finds nothing).

    On a CUDA GPU the reference recipe ``small`` for ``max_minutes`` (default 10), saved as run
    ``small``; elsewhere the reduced ``chapter10`` config for ``max_minutes`` (default 2), saved as
    ``chapter10``. An earlier run of that name is replaced. Returns the run's record, which also
    lies in ``runs_dir() / name / "record.json"``.
    """
    device = get_device(device)
    config = CONFIGS["small"] if device.type == "cuda" else CONFIGS["chapter10"]
    if max_minutes is None:
        max_minutes = 10.0 if device.type == "cuda" else 2.0
    out_dir = runs_dir() / config.name
    shutil.rmtree(out_dir, ignore_errors=True)
    command = ["python", "-m", "transformer_tutorial.train", "--config", config.name,
               "--out", str(out_dir), "--max-minutes", f"{max_minutes:g}", "--device", device.type]
    return run(config, out_dir=out_dir, device=device, max_minutes=max_minutes,
               progress=progress, command=command)


def describe_run(record: dict) -> str:
    """What a run's ``record.json`` says, in a few aligned lines: command, hardware, code, model,
    training and BLEU on test2016. Absolute paths are cut to their last two parts, so the text
    reads the same on every machine."""

    def shown(arg: str) -> str:
        path = Path(arg)
        if not path.is_absolute():
            return arg
        return ("python" if path.name.startswith("python")
                else f"…/{path.parent.name}/{path.name}")

    hw, config, model = record["hardware"], record["config"], record["model_config"]
    epochs = record["epochs_completed"]
    threads = f"{hw['torch_threads']} torch thread{'s' if hw['torch_threads'] != 1 else ''}"
    device = hw.get("gpu") or f"{hw.get('cpu') or 'CPU'}, {hw['cpu_count']} cores, {threads}"
    git = record["git"]
    code = "git unknown"
    if git["commit"]:
        code = f"git {git['commit'][:10]}" + (" (uncommitted changes)" if git.get("dirty") else "")
    lines = [
        ("command", " ".join(shown(a) for a in record["command"]) or "(not recorded)"),
        ("hardware", f"{hw['device']}: {device}"),
        ("software", f"{code}, torch {record['torch']}, Python {record['python']}"),
        ("model", f"{record['parameters']:,} parameters: d_model {model['d_model']}, "
                  f"{model['n_encoder_layers']}+{model['n_decoder_layers']} layers, "
                  f"{model['n_heads']} heads, "
                  f"d_ff {model['d_ff']}, {'pre' if model['norm_first'] else 'post'}-norm, "
                  f"vocabulary {model['src_vocab_size']:,}"),
        ("training", f"{record['steps']:,} steps of ~{config['max_tokens']:,} tokens, "
                     f"{epochs} full epoch{'s' if epochs != 1 else ''} of "
                     f"{record['train_pairs']:,} pairs"),
        ("time", f"{record['train_time_s'] / 60:.1f} min of training "
                 f"(stopped by {record['stopped_by']})"),
        ("best", f"validation loss {record['best']['val_loss']:.3f} "
                 f"at step {record['best']['step']:,}"),
        ("wall time", f"{record['wall_time_s'] / 60:.1f} min in all, "
                      "data and evaluation included"),
    ]
    scores = record["test2016"]
    for name in ("greedy", f"beam{config['beam_size']}"):
        lines.append((f"BLEU {name}", f"{scores[name]['score']:.2f} "
                                      f"(lowercased {scores[name]['lowercase']:.2f}) "
                                      f"on {scores['sentences']:,} test2016 sentences"))
    lines.append(("signature", scores["greedy"]["signature"]))
    return "\n".join(f"{key:<12} {value}" for key, value in lines)


def load_reference_record() -> dict:
    """The record of the book's reference run
    (``python -m transformer_tutorial.train --config small``), shipped with the package as
    ``reference_run.json``; the repository keeps the same file as
    ``results/multi30k_de_en/record.json``."""
    text = (resources.files("transformer_tutorial").joinpath("reference_run.json")
            .read_text(encoding="utf-8"))
    return json.loads(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m transformer_tutorial.train",
        description="Train the Transformer on Multi30k German→English, "
                    "then score it with BLEU on test2016.",
    )
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small",
                        help="named recipe: tiny (seconds, for tests), "
                             "chapter10 (minutes on a CPU), "
                             "small (the CPU reference, ~1 h on 2 cores), "
                             "base (the paper's base model, for a GPU); default: %(default)s")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for tokenizer.json, last.pt, best.pt and record.json; "
                             "default: runs/CONFIG")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="stop training after this many minutes, then checkpoint and evaluate")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop when this many optimizer steps have been taken in all "
                             "(resumed runs included)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="train at most this many epochs; default: the config's")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its last.pt, "
                             "exactly where it stopped")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda, cuda:1, mps…; default: the best available")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed for initialisation, dropout and batch order; "
                             "default: %(default)s")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for PyTorch; default: PyTorch's choice")
    parser.add_argument("--eval-size", type=int, default=None,
                        help="score BLEU on the first N test sentences only; "
                             "default: the config's (all for small and base)")
    parser.add_argument("--beam", type=int, default=None,
                        help="beam size for the BLEU evaluation; default: the config's")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (logs and CI)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = CONFIGS[args.config]
    overrides = {"epochs": args.epochs, "eval_size": args.eval_size, "beam_size": args.beam}
    config = replace(config, **{k: v for k, v in overrides.items() if v is not None})
    out_dir = args.out or Path("runs") / args.config
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.resume and not (out_dir / "last.pt").exists():
        print(f"error: --resume: no checkpoint {out_dir / 'last.pt'} to resume from",
              file=sys.stderr)
        return 1
    if not args.resume and (out_dir / "last.pt").exists():
        print(f"error: {out_dir} already holds a run; pass --resume to continue it or "
              "choose another --out", file=sys.stderr)
        return 1
    if args.resume:
        saved = torch.load(out_dir / "last.pt", map_location="cpu",
                           weights_only=True)["train_config"]
        if saved["name"] != config.name:
            print(f"error: {out_dir} holds a {saved['name']!r} run, not {config.name!r}",
                  file=sys.stderr)
            return 1
    device = get_device(args.device)
    command = [sys.executable, "-m", "transformer_tutorial.train",
               *(sys.argv[1:] if argv is None else argv)]
    try:
        record = run(config, out_dir=out_dir, device=device, seed=args.seed, resume=args.resume,
                     max_steps=args.max_steps, max_minutes=args.max_minutes,
                     progress=not args.no_progress, command=command)
    except DatasetUnavailableError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    scores = record["test2016"]
    print(f"{record['steps']} steps, {record['train_time_s'] / 60:.1f} min, "
          f"stopped by {record['stopped_by']}; "
          f"best val loss {record['best']['val_loss']:.3f} at step {record['best']['step']}")
    for name in ("greedy", f"beam{config.beam_size}"):
        print(f"test2016 {name}: BLEU {scores[name]['score']:.2f}, "
              f"lowercased {scores[name]['lowercase']:.2f}")
    print(f"record: {out_dir / 'record.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
