"""The training command line (chapter 10): train a recipe of :mod:`configs` on Multi30k.

Command line::

    python -m transformer_tutorial.train --config small --out runs/small --max-minutes 60

writes ``tokenizer.json``, ``last.pt`` (everything needed to resume), ``best.pt`` (the weights
with the lowest validation loss) and ``record.json`` (what was run, where, and how it went).
The work is done by :func:`transformer_tutorial.runs.run_experiment`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from transformer_tutorial.checkpoint import load_checkpoint
from transformer_tutorial.configs import CONFIGS
from transformer_tutorial.data import DatasetUnavailableError
from transformer_tutorial.runs import run_experiment
from transformer_tutorial.runtime import get_device
from transformer_tutorial.trainer import RunOptions


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m transformer_tutorial.train",
        description="Train the Transformer on Multi30k German→English, "
        "then score it with BLEU on test2016.",
    )
    parser.add_argument(
        "--config",
        choices=sorted(CONFIGS),
        default="small",
        help="named recipe: tiny (seconds, for tests), "
        "chapter10 (minutes on a CPU), "
        "small (the CPU reference, ~1 h on 2 cores), "
        "base (the paper's base model, for a GPU); default: %(default)s",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for tokenizer.json, last.pt, best.pt and record.json; default: runs/CONFIG",
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="stop training after this many minutes, then checkpoint and evaluate",
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="stop when this many optimizer steps have been taken in all (resumed runs included)",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="train at most this many epochs; default: the config's",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its last.pt, exactly where it stopped",
    )
    parser.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1, mps…; default: the best available"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed for initialisation, dropout and batch order; default: %(default)s",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for PyTorch; default: PyTorch's choice",
    )
    parser.add_argument(
        "--eval-size",
        type=int,
        default=None,
        help="score BLEU on the first N test sentences only; "
        "default: the config's (all for small and base)",
    )
    parser.add_argument(
        "--beam",
        type=int,
        default=None,
        help="beam size for the BLEU evaluation; default: the config's",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bars (logs and CI)"
    )
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
        print(
            f"error: --resume: no checkpoint {out_dir / 'last.pt'} to resume from", file=sys.stderr
        )
        return 1
    if not args.resume and (out_dir / "last.pt").exists():
        print(
            f"error: {out_dir} already holds a run; pass --resume to continue it or "
            "choose another --out",
            file=sys.stderr,
        )
        return 1
    if args.resume:
        saved = load_checkpoint(out_dir / "last.pt")["train_config"]
        if saved["name"] != config.name:
            print(
                f"error: {out_dir} holds a {saved['name']!r} run, not {config.name!r}",
                file=sys.stderr,
            )
            return 1
    device = get_device(args.device)
    command = [
        sys.executable,
        "-m",
        "transformer_tutorial.train",
        *(sys.argv[1:] if argv is None else argv),
    ]
    try:
        options = RunOptions(
            device=str(device),
            seed=args.seed,
            resume=args.resume,
            max_steps=args.max_steps,
            max_minutes=args.max_minutes,
            progress=not args.no_progress,
        )
        record = run_experiment(config, out_dir=out_dir, options=options, command=command)
    except DatasetUnavailableError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    scores = record.test2016
    print(
        f"{record.steps} steps, {record.train_time_s / 60:.1f} min, "
        f"stopped by {record.stopped_by}; "
        f"best val loss {record.best['val_loss']:.3f} at step {record.best['step']}"
    )
    for name in ("greedy", record.beam_name):
        print(
            f"test2016 {name}: BLEU {scores[name]['score']:.2f}, "
            f"lowercased {scores[name]['lowercase']:.2f}"
        )
    print(f"record: {out_dir / 'record.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
