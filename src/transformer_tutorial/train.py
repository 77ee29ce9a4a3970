"""The training command line (chapter 10): train a recipe of :mod:`configs` on Multi30k.

Command line::

    python -m transformer_tutorial.train --config small --out runs/small --max-minutes 60

and, the same command on N GPUs of one machine (chapter 12)::

    torchrun --nproc_per_node N -m transformer_tutorial.train --config base --out runs/base

writes ``tokenizer.json``, ``last.pt`` (everything needed to resume), ``best.pt`` (the weights
with the lowest validation loss), for recipes that average checkpoints ``snapshots/`` (the last
checkpoints' weights) and ``averaged.pt`` (their mean), and ``record.json`` (what was run,
where, and how it went).
The work is done by :func:`transformer_tutorial.runs.run_experiment`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from transformer_tutorial import distributed
from transformer_tutorial.checkpoint import CheckpointError, load_checkpoint
from transformer_tutorial.checks import ArgumentParser, device_arg, int_arg, number_arg
from transformer_tutorial.configs import CONFIGS, RunOptions, TrainConfig
from transformer_tutorial.multi30k import DatasetUnavailableError
from transformer_tutorial.precision import PRECISIONS
from transformer_tutorial.records import describe_run
from transformer_tutorial.run_folder import RunFolder
from transformer_tutorial.runs import run_experiment
from transformer_tutorial.runtime import get_device
from transformer_tutorial.train_state import TrainingInterrupted


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m transformer_tutorial.train",
        description="Train the Transformer on Multi30k German→English, "
        "then score it with BLEU on test2016. On N GPUs: "
        "torchrun --nproc_per_node N -m transformer_tutorial.train ... "
        "(each process trains on its share of the batches; rank 0 logs and writes the files).",
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
        help="folder for tokenizer.json, last.pt, best.pt, averaged.pt and record.json; "
        "default: runs/CONFIG",
    )
    parser.add_argument(
        "--max-minutes",
        type=number_arg(low=0.0, low_open=True),
        default=None,
        help="stop training after this many minutes, then checkpoint and evaluate; a recipe "
        "with a length (small) that the time cannot hold ends its learning-rate decay at the "
        "last step that fits, measured as it runs",
    )
    parser.add_argument(
        "--max-steps",
        type=int_arg(at_least=1),
        default=None,
        help="stop when this many optimizer steps have been taken in all (resumed runs included)",
    )
    parser.add_argument(
        "--epochs",
        type=int_arg(at_least=1),
        default=None,
        help="train at most this many epochs; default: the config's",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its last.pt, exactly where it stopped",
    )
    parser.add_argument(
        "--device",
        type=device_arg,
        default=None,
        help="cpu, cuda, cuda:1, mps…; default: the best available",
    )
    parser.add_argument(
        "--seed",
        type=int_arg(at_least=0),
        default=0,
        help="seed for initialisation, dropout and batch order; default: %(default)s",
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="auto",
        help="the forward pass's numbers: auto is bf16 on a GPU that has it natively, fp16 "
        "with loss scaling on other GPUs (T4, V100), fp32 on a CPU; default: %(default)s",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="run the training step through torch.compile (slower start, faster steps)",
    )
    parser.add_argument(
        "--threads",
        type=int_arg(at_least=1),
        default=None,
        help="CPU threads for PyTorch; default: PyTorch's choice",
    )
    parser.add_argument(
        "--eval-size",
        type=int_arg(at_least=1),
        default=None,
        help="score BLEU on the first N test sentences only; "
        "default: the config's (all for small and base)",
    )
    parser.add_argument(
        "--beam",
        type=int_arg(at_least=1),
        default=None,
        help="beam size for the BLEU evaluation; default: the config's",
    )
    parser.add_argument(
        "--average-last",
        type=int_arg(at_least=1),
        default=None,
        help="score the mean of the weights of the last N checkpoints (1: best.pt); "
        "default: the config's (5 for small)",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bars (logs and CI)"
    )
    return parser


class UsageError(Exception):
    """A mistake in the command line or in its files: shown as one line, no traceback."""


def _prepare(args: argparse.Namespace) -> tuple[TrainConfig, RunOptions, Path]:
    """The recipe, the options and the output folder, the folder checked before anything runs
    (the flags were checked by the parser), so that no hour of training ends in a bad folder."""
    overrides = {
        "epochs": args.epochs,
        "eval_size": args.eval_size,
        "beam_size": args.beam,
        "average_last": args.average_last,
    }
    # Each flag was checked by the parser (checks.py's converters); what only the recipe and
    # the options can check together (a precision this device lacks…) is checked here.
    try:
        config = replace(
            CONFIGS[args.config], **{k: v for k, v in overrides.items() if v is not None}
        )
        options = RunOptions(
            device=str(get_device(args.device)),
            seed=args.seed,
            resume=args.resume,
            max_steps=args.max_steps,
            max_minutes=args.max_minutes,
            progress=not args.no_progress,
            precision=args.precision,
            compile=args.compile,
        )
    except (TypeError, ValueError) as err:
        raise UsageError(str(err)) from None
    out_dir = args.out or Path("runs") / args.config
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--out {out_dir} is a file; name a folder for the run")
    last = RunFolder(out_dir).last
    if args.resume and not last.exists():
        raise UsageError(f"--resume: no checkpoint {last} to resume from")
    if not args.resume and last.exists():
        raise UsageError(
            f"{out_dir} already holds a run; pass --resume to continue it or choose another --out"
        )
    if args.resume:  # the recipe's name only: on the meta device no tensor is read from the
        # file, which the trainer loads once, as training starts
        saved = load_checkpoint(last, device="meta")["train_config"]
        if saved["name"] != config.name:
            raise UsageError(f"{out_dir} holds a {saved['name']!r} run, not {config.name!r}")
    return config, options, out_dir


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; expected failures print one line and return 1 (130 on Ctrl-C)."""
    args = build_parser().parse_args(argv)
    # The interpreter as `python`, not its path (sys.executable): a record says what to run,
    # not where this machine keeps its virtual environment.
    command = ["python", "-m", "transformer_tutorial.train"]
    command += sys.argv[1:] if argv is None else argv
    finished = False  # every rank waits for the others before leaving only after a clean run
    try:
        config, options, out_dir = _prepare(args)
        if args.threads:
            torch.set_num_threads(args.threads)
        # Under torchrun: join the other ranks; on GPUs each rank takes cuda:LOCAL_RANK.
        device = distributed.setup(torch.device(options.device))
        options = replace(options, device=str(device))
        record = run_experiment(config, out_dir=out_dir, options=options, command=command)
        finished = True
    except (UsageError, CheckpointError, DatasetUnavailableError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except TrainingInterrupted as stop:
        finished = True  # the ranks agreed to stop after the same step: all of them are here
        print(
            f"interrupted after step {stop.step}: {stop.checkpoint} holds it. Resume with: "
            f"python -m transformer_tutorial.train --config {args.config} "
            f"--out {stop.checkpoint.parent} --resume",
            file=sys.stderr,
        )
        return 130
    except KeyboardInterrupt:
        print(
            "interrupted before training started or while scoring; no new checkpoint was written",
            file=sys.stderr,
        )
        return 130
    finally:
        distributed.teardown(finished=finished)
    if record is None:  # a rank other than 0: rank 0 reports
        return 0
    print(describe_run(record))  # the record in a few lines, as chapter 10 shows it
    print(f"record: {RunFolder(out_dir).record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
