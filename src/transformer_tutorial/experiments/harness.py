"""What the measured runs share: the record's reader and writer, the validation loss, and the
one time-budgeted training loop (chapter 13's recipe) every run trains with.

:func:`train_for` trains a language model for a budget of seconds, wall-clock
(``clock="wall"``: chapters 17, 18 and 23) or the process's CPU time (``clock="cpu"``:
chapter 20), or a number of steps if that comes first, and records the validation loss along
it. A run whose model adds a loss of its own (chapter 20's load-balancing loss) passes it as
``aux_loss``. :func:`load_record` reads a committed record, :func:`write_record` writes one.

Shapes: sentences are lists of ids ``<bos> … <eos>``; batches ``(B, T)`` padded at the end.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from transformer_tutorial import data
from transformer_tutorial.checks import check_int, check_number, check_optional_int
from transformer_tutorial.lm.model import LanguageModel, next_token_loss
from transformer_tutorial.records import shipped_record

CLOCKS = ("wall", "cpu")  # what a budget of seconds counts
# Runs the model on a batch: its logits and the auxiliary loss (None: none for this model).
AuxLoss = Callable[[LanguageModel, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


def load_record(name: str) -> dict:
    """The committed record of the run kept in ``results/<name>/record.json``, shipped with the
    package (:func:`~transformer_tutorial.records.shipped_record`)."""
    return shipped_record(f"results/{name}/record.json")


def write_record(path: Path, record: dict) -> None:
    """Write ``record`` to ``path`` as the committed records are (JSON, one-space indent)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


def validation_loss(model: LanguageModel, val_batch: torch.Tensor) -> float:
    """Mean next-token loss on ``val_batch`` in eval mode, padding ignored."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        loss = next_token_loss(model(val_batch), val_batch, ignore_index=data.PAD_ID).item()
    model.train(was_training)
    return loss


def train_for(
    model: LanguageModel,
    train_ids: Sequence[Sequence[int]],
    val_batch: torch.Tensor,
    *,
    seconds: float,
    clock: str = "wall",
    max_steps: int | None = None,
    evaluations: int = 10,
    max_tokens: int = 1024,
    lr: float = 3e-3,
    warmup: int = 30,
    seed: int = 0,
    aux_loss: AuxLoss | None = None,
    aux_weight: float = 0.0,
) -> dict:
    """Train ``model`` for ``seconds`` of training time on ``clock`` (validation not counted),
    or ``max_steps`` steps if that comes first, with chapter 13's recipe (AdamW, warm-up,
    clipping); the learning rate decays linearly to 10% over the budget (the time, or the
    steps), and the validation loss is measured ``evaluations`` times along it. With
    ``aux_loss``, each step runs the model through it and adds ``aux_weight`` × its auxiliary
    loss (where it returns one) to the next-token loss.

    Returns the part of a record the committed records keep: ``{"steps", "tokens", "val":
    [[seconds on clock, step, loss], ...], "train": [mean loss of each block of steps between
    evaluations]}``, with ``aux_loss`` ``"aux"`` (the mean auxiliary loss of each block, None
    where there was none), and the times: on the wall clock ``"train_seconds"`` (the steps')
    and ``"cpu_seconds"`` (the process's CPU time over the whole loop, validations included: on
    a shared machine, what the wall-clock budget actually bought); on the CPU clock
    ``"cpu_seconds"`` (the steps', the budget) and ``"wall_seconds"`` (the steps').
    """
    check_number("seconds", seconds, low=0.0, low_open=True)
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    check_int("evaluations", evaluations, at_least=1)
    check_optional_int("max_steps", max_steps, at_least=1)
    check_number("aux_weight", aux_weight, low=0.0)

    def progress() -> float:  # the share of the budget used
        used = wall if clock == "wall" else cpu
        return max(used / seconds, 0.0 if max_steps is None else step / max_steps)

    torch.manual_seed(seed)
    lengths = [len(s) for s in train_ids]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    history: dict = {"val": [[0.0, 0, validation_loss(model, val_batch)]], "train": []}
    if aux_loss is not None:
        history["aux"] = []
    step = tokens = 0
    wall, cpu, loop_start, block, aux_block = 0.0, 0.0, time.process_time(), [], []
    batches: list = []
    model.train()
    while progress() < 1.0:
        if not batches:  # a new epoch of length-bucketed batches
            g = torch.Generator().manual_seed(seed + step)
            batches = list(data.token_batches(lengths, max_tokens, generator=g))
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup) * max(0.1, 1 - progress())
        batch = data.pad_batch([train_ids[i] for i in batches.pop()])
        if aux_loss is None:
            logits, aux = model(batch), None
        else:
            logits, aux = aux_loss(model, batch)
        loss = next_token_loss(logits, batch, ignore_index=data.PAD_ID)
        total = loss
        if aux is not None:
            total = loss + aux_weight * aux
            aux_block.append(aux.item())
        optimizer.zero_grad()
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        wall += time.perf_counter() - wall_start
        cpu += time.process_time() - cpu_start
        step, tokens = step + 1, tokens + int((batch != data.PAD_ID).sum())
        block.append(loss.item())
        if progress() >= min(1.0, len(history["val"]) / evaluations):
            used = wall if clock == "wall" else cpu
            history["val"].append([round(used, 2), step, validation_loss(model, val_batch)])
            history["train"].append(sum(block) / len(block))
            if aux_loss is not None:
                history["aux"].append(sum(aux_block) / len(aux_block) if aux_block else None)
            block, aux_block = [], []
    model.eval()
    if clock == "wall":
        times = dict(train_seconds=wall, cpu_seconds=time.process_time() - loop_start)
    else:
        times = dict(cpu_seconds=cpu, wall_seconds=wall)
    return dict(steps=step, tokens=tokens, **times, **history)
