"""Sections 1 and 2: the training step and the inference forward, ours ÷ ``nn.Transformer``, and
the training step compiled; beside each training step, its model FLOPs utilisation.

Ours trains as the trainer does, with logits at the real target tokens only (what
``nn.Transformer`` cannot do) and, on a CPU where they pay, dropout masks drawn a quarter as
often, the attention weights' included (:mod:`transformer_tutorial.dropout`); its FLOPs are
counted on that step, so its MFU counts the work it does: the output layer's skipped padding is
not counted, the padded positions the encoder and decoder still compute are. Neither saving is
out of ``nn.Transformer``'s reach (a wrapper could index the real tokens, and
``with_cheap_dropout`` would swap its ``nn.Dropout`` modules) except the masks of its attention
weights: the bench gives them to ours only because the trainer uses them. On a CPU
both sides run with freed memory kept (:mod:`transformer_tutorial.allocator`), as the trainer
does.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from bench.cli import Settings
from bench.mfu import add_mfu, measure_peaks
from bench.models import TrainStep, build_pair, forward_fn, make_batch
from bench.timing import interleaved
from transformer_tutorial.data import PAD_ID
from transformer_tutorial.dropout import cheap_masks_pay, with_cheap_dropout
from transformer_tutorial.flops import count_flops
from transformer_tutorial.optim import translation_loss
from transformer_tutorial.precision import autocast

# The two sides: the prefix of their keys in a row, and their names in the timings.
KEYS = {"ours": "ours", "torch": "nn.Transformer"}
SIDES = tuple(KEYS.values())


class PaddingFreeStep(TrainStep):
    """Our training step as :func:`transformer_tutorial.pair_loss.batch_loss` runs it: the output
    layer and the loss on the real target tokens only."""

    def __init__(self, model: nn.Module, ids: Tensor, precision: str) -> None:
        super().__init__(model, ids, precision)
        self.real = (self.tgt_out != PAD_ID).flatten().nonzero().squeeze(1)  # (N,)
        self.target = self.tgt_out.flatten()[self.real]  # (N,)

    def forward_backward(self) -> None:
        self.model.train()
        with autocast(self.precision, self.src.device):
            logits = self.model(self.src, self.tgt_in, logits_at=self.real, check_ids=False)
        loss = translation_loss(logits, self.target, smoothing=0.1, ignore_index=PAD_ID)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()


# Each side's training step.
STEPS = {"ours": PaddingFreeStep, "nn.Transformer": TrainStep}


def ratio_row(config: str, ids: Tensor, timed: dict) -> dict:
    """One table row: each side's median and spread, and the throughput ratio ours ÷ theirs."""
    ours, theirs = (timed[name] for name in SIDES)
    return {
        "config": config,
        "length": ids.size(2),
        "sentences": ids.size(1),
        "ours_ms": 1e3 * ours["median_s"],
        "torch_ms": 1e3 * theirs["median_s"],
        "ours_spread": ours["spread"],
        "torch_spread": theirs["spread"],
        "ratio": theirs["median_s"] / ours["median_s"],
        # A tiny --quick step can take less CPU time than the clock resolves: no ratio then.
        "cpu_ratio": (
            theirs["cpu_median_s"] / ours["cpu_median_s"] if ours["cpu_median_s"] > 0 else math.nan
        ),
    }


def describe(kind: str, row: dict) -> str:
    """The line printed for a row of ``kind`` (train_step, forward, compiled)."""
    mfu = f"  MFU {row['ours_mfu']:.1%} / {row['torch_mfu']:.1%}" if "ours_mfu" in row else ""
    return (
        f"  {kind:<10} {row['config']:<5} L={row['length']:<3} B={row['sentences']:<4} ours "
        f"{row['ours_ms']:8.1f} ms  nn.Transformer {row['torch_ms']:8.1f} ms  "
        f"throughput ratio {row['ratio']:.2f}{mfu}"
    )


def train_row(
    s: Settings, config: str, models: tuple[nn.Module, nn.Module], ids: Tensor, peaks: dict
) -> tuple[dict, dict[str, int]]:
    """Section 1 for one batch: the row (with MFU) and each side's counted FLOPs a step."""
    steps = {name: STEPS[name](m, ids, s.precision) for name, m in zip(SIDES, models, strict=True)}
    flops = {key: count_flops(steps[name].forward_backward) for key, name in KEYS.items()}
    row = ratio_row(config, ids, interleaved(steps, s.repeats, s.warmup, ids.device))
    add_mfu(row, flops, peaks)
    return row, flops


def forward_row(
    s: Settings, config: str, models: tuple[nn.Module, nn.Module], ids: Tensor
) -> dict:
    """Section 2 for one batch."""
    fns = {name: forward_fn(m, ids, s.precision) for name, m in zip(SIDES, models, strict=True)}
    return ratio_row(config, ids, interleaved(fns, s.repeats, s.warmup, ids.device))


def compiled_row(s: Settings, config: str, ids: Tensor) -> dict | str:
    """Compiled ours vs compiled nn.Transformer, and ours compiled vs ours eager; the reason as
    a str where ``torch.compile`` fails."""
    ours, theirs, _ = build_pair(config, ids.device)
    fns = {
        "ours eager": PaddingFreeStep(ours, ids, s.precision),
        "ours": PaddingFreeStep(torch.compile(ours), ids, s.precision),
        "nn.Transformer": TrainStep(torch.compile(theirs), ids, s.precision),
    }
    try:
        timed = interleaved(fns, s.repeats, 2, ids.device)
    except Exception as err:  # a missing compiler, an unsupported backend: say so, go on
        return f"torch.compile failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    row = ratio_row(config, ids, timed)
    for key, name in KEYS.items():
        row[f"{key}_compile_s"] = timed[name]["first_s"] - timed[name]["median_s"]
    row["ours_compiled_vs_eager"] = timed["ours eager"]["median_s"] / timed["ours"]["median_s"]
    return row


def bench_models(s: Settings, device: torch.device) -> dict:
    """Sections 1 and 2, and the compiled train step, one model pair per config."""
    peaks = measure_peaks(s, device)
    out = {"peaks": peaks, "train_step": [], "forward": [], "compiled": []}
    out["compile_skipped"] = None if s.compile_cells else "--quick or --no-compile"
    # Whether ours trains with the cheap masks, as the trainer does here (eager rows only): the
    # table's and the plot's labels say so.
    out["ours_cheap_dropout"] = cheap_masks_pay(device)
    for config in s.configs:
        ours, theirs, vocab = build_pair(config, device)
        if out["ours_cheap_dropout"]:  # as the trainer trains there (not compiled)
            with_cheap_dropout(ours)
        for length in s.lengths:
            ids = make_batch(vocab, max(s.tokens[config] // length, 1), length, device)
            row, flops = train_row(s, config, (ours, theirs), ids, peaks)
            out["train_step"].append(row)
            print(describe("train_step", row), flush=True)
            out["forward"].append(forward_row(s, config, (ours, theirs), ids))
            print(describe("forward", out["forward"][-1]), flush=True)
            if (config, length) not in s.compile_cells or out["compile_skipped"]:
                continue
            row = compiled_row(s, config, ids)
            if isinstance(row, str):
                out["compile_skipped"] = row
                print(f"  compiled: skipped, {row}", flush=True)
                continue
            add_mfu(row, flops, peaks)  # the same products as the eager step
            out["compiled"].append(row)
            print(
                f"{describe('compiled', row)}  (ours compiled ÷ eager "
                f"{row['ours_compiled_vs_eager']:.2f}; compile time ours "
                f"{row['ours_compile_s']:.0f} s, nn.Transformer {row['torch_compile_s']:.0f} s)",
                flush=True,
            )
    return out
