"""Execute chapters in place so their stored outputs match the package (authors run this).

    python scripts/execute_notebooks.py                      # every chapter in _toc.yml
    python scripts/execute_notebooks.py chapters/03_*.ipynb  # some

Each notebook runs in an empty temporary working directory, as in Colab, so a chapter that reads
files through relative repository paths fails here already. Timing metadata is not recorded, and
a cell's consecutive prints to one stream are stored as one output (how they arrive in pieces
depends on the machine's speed), so re-executing an unchanged chapter leaves git diff clean apart
from real output changes.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import nbformat
from book import toc_chapters  # scripts/book.py, beside this file: reads _toc.yml
from nbclient import NotebookClient


def merge_streams(outputs: list) -> list:
    """``outputs`` with each run of consecutive outputs to the same stream joined into one."""
    merged = []
    for output in outputs:
        previous = merged[-1] if merged else None
        if (
            output.get("output_type") == "stream"
            and previous is not None
            and previous.get("output_type") == "stream"
            and previous.get("name") == output.get("name")
        ):
            previous["text"] += output["text"]
        else:
            merged.append(output)
    return merged


def execute(path: Path, timeout: int) -> float:
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        NotebookClient(
            nb,
            timeout=timeout,
            kernel_name="python3",
            resources={"metadata": {"path": workdir}},
            record_timing=False,
        ).execute()
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = merge_streams(cell.outputs)
    nbformat.write(nb, path)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "notebooks", nargs="*", type=Path, help="notebooks to execute (default: all chapters)"
    )
    parser.add_argument("--timeout", type=int, default=1800, help="seconds allowed per cell")
    args = parser.parse_args()
    for path in args.notebooks or toc_chapters():
        seconds = execute(path, args.timeout)
        print(f"{path}: executed in {seconds:.0f} s", flush=True)


if __name__ == "__main__":
    main()
