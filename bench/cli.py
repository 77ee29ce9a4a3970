"""The command line: its arguments, what a run measures (:class:`Settings`), and the run's
description written with the results."""

from __future__ import annotations

import argparse
import platform
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

import bench
from transformer_tutorial.checks import ArgumentParser, device_arg, int_arg, number_arg
from transformer_tutorial.precision import DTYPES
from transformer_tutorial.provenance import cpu_name, git_commit, hardware

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_or_cuda(text: str) -> torch.device:
    """An argparse ``type``: a CPU or CUDA device this machine has."""
    device = torch.device(device_arg(text))
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu or cuda, got {text!r}")
    return device


def existing_file(text: str) -> Path:
    """An argparse ``type``: a file that exists."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return Path(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, each checked by its converter: a mistake is one line and exit status 2
    (:class:`transformer_tutorial.checks.ArgumentParser`)."""
    parser = ArgumentParser(
        prog="python -m bench",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--device", type=cpu_or_cuda, default="cpu", help="cpu (default) or cuda")
    add("--threads", type=int_arg(at_least=1), default=2, help="CPU threads (default 2)")
    add("--repeats", type=int_arg(at_least=1), default=5, help="timed runs a measurement")
    add("--warmup", type=int_arg(at_least=0), default=1, help="untimed runs first")
    add("--quick", action="store_true", help="tiny sizes: a smoke test")
    add("--no-compile", action="store_true", help="skip torch.compile")
    add("--precision", choices=["bf16", "fp32"], default="bf16", help="on CUDA (CPU: fp32)")
    add("--sentences", type=int_arg(at_least=1), default=200, help="test2016 sentences, beam")
    add("--checkpoint", type=existing_file, help="trained model (default: cached run)")
    add(
        "--peak-tflops",
        type=number_arg(low=0.0, low_open=True),
        help="data-sheet peak for MFU where the table has none",
    )
    add("--out", type=Path, default=RESULTS, help="results folder")
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Settings:
    """What one run measures: full (CPU or CUDA) or --quick."""

    quick: bool
    precision: str  # "bf16" (CUDA, the default there) or "fp32"
    repeats: int
    warmup: int
    configs: tuple[str, ...]
    lengths: tuple[int, ...]
    tokens: dict[str, int]  # tokens a batch (sentences = tokens // length)
    compile_cells: tuple[tuple[str, int], ...]
    compile_decoding: bool  # section 12's compiled decoding rows (lm.compiled.CompiledSteps)
    decode_config: str
    decode_tokens: tuple[int, ...]
    attention_lengths: tuple[int, ...]
    beam_sentences: int
    checkpoint: Path | None
    matmul_size: int  # the square matrix product the peak is measured on
    peak_flops: float | None  # --peak-tflops, as FLOP/s
    llama_config: str  # a model of bench/llama.py's MODELS
    llama_repeats: int  # timed runs of a measurement at that model's size (≤ repeats)
    llama_train_shapes: tuple[tuple[int, int], ...]  # (sentences, length) a training step
    llama_prompts: tuple[tuple[int, int], ...]  # (sentences, length) generation continues
    llama_new_tokens: tuple[int, ...]  # tokens generated
    draft_k: int  # tokens the draft proposes a round (speculative decoding)
    tiled_lengths: tuple[int, ...]  # L of the tiled attention against F.sdpa

    @classmethod
    def from_args(cls, args: argparse.Namespace, device: torch.device) -> Settings:
        cuda, quick = device.type == "cuda", args.quick
        configs = ("tiny",) if quick else ("small", "base")
        lengths = (8, 16) if quick else (16, 32, 64)
        # Compiling takes minutes on a CPU: there only `small` at one length.
        compile_cells = () if args.no_compile or quick else (("small", 32),)
        if cuda and not args.no_compile:
            compile_cells = tuple((c, n) for c in configs for n in lengths)
        # Small enough for 10 minutes on 2 cores; a GPU wants large batches.
        tokens = {"tiny": 128, "small": 1024, "base": 512}
        if cuda:
            tokens = dict.fromkeys(tokens, 8192)
        return cls(
            quick=quick,
            precision=args.precision if cuda else "fp32",
            repeats=args.repeats,
            warmup=args.warmup,
            configs=configs,
            lengths=lengths,
            tokens=tokens,
            compile_cells=compile_cells,
            compile_decoding=not args.no_compile,
            decode_config="tiny" if quick else ("base" if cuda else "small"),
            decode_tokens=(4, 8) if quick else (16, 32, 64, 128),
            attention_lengths=(64, 128) if quick else (128, 256, 512, 1024, 2048),
            beam_sentences=4 if quick else args.sentences,
            checkpoint=args.checkpoint,
            matmul_size=256 if quick else (16384 if cuda else 2048),
            peak_flops=None if args.peak_tflops is None else 1e12 * args.peak_tflops,
            # Chapter 17's GPT-2-small-sized capstone (sections 6, 9 and 10). On 2 CPU cores a
            # generation of 128 tokens at batch 8 takes seconds a side: 3 timed runs at most
            # keep `make bench` within 10 minutes. Training batches are (sentences, length).
            llama_config="tiny" if quick else "capstone",
            llama_repeats=args.repeats if cuda or quick else min(args.repeats, 3),
            llama_train_shapes=(
                ((2, 16),) if quick else (((8, 512), (16, 1024)) if cuda else ((4, 128),))
            ),
            llama_prompts=(
                ((2, 4),) if quick else (((1, 32), (8, 32)) if cuda else ((1, 8), (8, 8)))
            ),
            llama_new_tokens=(8,) if quick else ((128, 512) if cuda else (128,)),
            # A short k suits section 9's drafts: the copy draft's proposals after its first
            # rejection are wasted steps, and the early exit's are all rejected.
            draft_k=2,
            tiled_lengths=(
                (64, 100) if quick else ((1024, 4096) if cuda else (256, 512, 1024, 2048))
            ),
        )

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    def warmup_after_check(self) -> int:
        """Untimed runs left once a float32 check has run the timed call itself (in float32,
        the timed precision, it is one untimed run already)."""
        return max(self.warmup - 1, 0) if self.precision == "fp32" else self.warmup


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def run_meta(settings: Settings, device: torch.device, argv: list[str] | None) -> dict:
    """Where and how the run measured: device, versions, threads, precision, commit, command."""
    return {
        "device": device.type,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "precision": "bf16 autocast" if settings.precision == "bf16" else "fp32",
        "repeats": settings.repeats,
        "llama_repeats": settings.llama_repeats,
        "quick": settings.quick,
        "commit": git_commit()["commit"],
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)]),
        "hardware": hardware(
            device,
            settings.precision,
            compiled=bool(settings.compile_cells) or settings.compile_decoding,
        ),
    }
