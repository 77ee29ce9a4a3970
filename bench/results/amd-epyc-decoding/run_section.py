"""One section of ``make bench`` alone, with ``python -m bench``'s settings, into a JSON record:

    PYTHONPATH=. python bench/results/amd-epyc-decoding/run_section.py 12 --threads=2 \\
        --repeats=3 --json=bench/results/amd-epyc-decoding/section-12.json [--batch1]

Section 8 (``bench.mla.bench_mla``) or 12 (``bench.roofline.bench_roofline``); ``--batch1``
times section 12's batch 1 only. The record keeps the command, OpenMP's wait policy and the
load average before and after (the machine these records come from was shared).
"""

from __future__ import annotations

import json
import os
import sys
import time

import bench.roofline
import torch
from bench.cli import Settings, parse_args, run_meta
from bench.mla import bench_mla
from bench.report import print_roofline_table

SECTIONS = {"8": ("mla", bench_mla), "12": ("roofline", bench.roofline.bench_roofline)}


def main(argv: list[str]) -> None:
    section, *rest = argv
    out = next(a.split("=", 1)[1] for a in rest if a.startswith("--json="))
    bench_args = [a for a in rest if not a.startswith("--json=") and a != "--batch1"]
    if "--batch1" in rest:
        full = bench.roofline.SHAPES["full"]
        bench.roofline.SHAPES["full"] = ((1,), *full[1:])
    args = parse_args(bench_args)
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    settings = Settings.from_args(args, device)
    meta = run_meta(settings, device, bench_args)
    meta["command"] = " ".join(["python", "bench/results/amd-epyc-decoding/run_section.py", *argv])
    meta["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "unset")
    meta["load_average_start"] = os.getloadavg()
    key, run = SECTIONS[section]
    start = time.perf_counter()
    result = run(settings, device)
    meta["seconds"] = time.perf_counter() - start
    meta["load_average_end"] = os.getloadavg()
    if key == "roofline":
        print_roofline_table(result)
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, key: result}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
