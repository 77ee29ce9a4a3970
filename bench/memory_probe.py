"""The attention section's CPU memory probe, run in a fresh process by the bench:

    python -m bench.memory_probe --dtype float32 64 128

First :func:`bench.memory.map_large_allocations` (so that each large tensor is mapped and
unmapped on its own, and the resident set follows the live tensors), then
:func:`bench.attention.attention_peaks` at each length; prints one JSON line,
``{"L": [written-out MiB, fused MiB], ...}``, or ``null`` where glibc's ``mallopt`` is not
available."""

from __future__ import annotations

import argparse
import json

import torch

from bench.attention import attention_peaks
from bench.memory import map_large_allocations

DTYPES = ("float32", "bfloat16", "float16")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memory_probe", description=__doc__)
    parser.add_argument("lengths", type=int, nargs="+", help="sequence lengths L")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    args = parser.parse_args(argv)
    peaks = None
    if map_large_allocations():
        peaks = attention_peaks(args.lengths, torch.device("cpu"), getattr(torch, args.dtype))
    print(json.dumps(peaks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
