"""Stored outputs that would differ on another machine, or not fit the website's column.

    python scripts/check_outputs.py                      # every chapter in _toc.yml
    python scripts/check_outputs.py chapters/19_*.ipynb  # some

Part of `make lint`. Two rules, each naming chapter and cell (the index in the notebook's cells
list, as nbval counts them too when it names a failing cell):

1. **No measured digits in a checked output.** A number below 1e-4 printed with a mantissa other
   than 1 (``3.1e-07``, ``0.000031``) is almost always a measured error: its digits change with
   the CPU's float order (MKL's code path, the thread count), and nbval compares them. Print the
   bound it was checked against (``within 1e-06``) instead, or move the figure into a cell of its
   own marked ``# NBVAL_IGNORE_OUTPUT``. Not counted: a number written literally in the cell's
   source (a bound the author chose, ``< 2e-6``) and the constants of the float formats
   (``torch.finfo``'s eps, tiny and max: they are the same on every machine).
2. **Every printed line fits the column.** A line of more than 99 characters scrolls sideways on
   the website (the column holds 99 characters, as `tests/test_website.py` checks for sources),
   and the reader misses its end; inside a collapsed cell (a solution, tagged ``hide-cell``) the
   column is narrower and holds 96. Ignored outputs count too: the website shows them.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from book import toc_chapters  # scripts/book.py, beside this file

WIDTH = 99
HIDDEN_WIDTH = 96  # a hide-cell's toggle box: 730 px at 12 px monospace, measured in Chromium
HIDDEN_TAGS = {"hide-cell", "hide-input", "hide-output"}
SMALL = 1e-4
IGNORE = "# NBVAL_IGNORE_OUTPUT"
# A number in scientific notation, or a decimal with at least four zeros after the point.
NUMBER = re.compile(r"(?<![\w.])(?:(\d+(?:\.\d+)?)[eE]([-+]?\d+)|0\.0{4,}\d+)(?![\w.])")
# A number literal in a cell's source: 2e-6, 1.5, .5, 3.
LITERAL = re.compile(r"(?<![\w.])(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
# torch.finfo's eps, tiny (smallest normal) and smallest subnormal of float64, float32,
# bfloat16 and float16: printed constants of the formats, not measurements.
FORMAT_CONSTANTS = [2.0**-52, 2.0**-1022, 2.0**-23, 2.0**-126, 2.0**-149, 2.0**-7, 2.0**-10]
FORMAT_CONSTANTS += [2.0**-14, 2.0**-24, 2.0**-133]


def _significand(text: str) -> str:
    """The significant digits of a printed number, without the point: '3.10e-07' → '31'."""
    digits = text.lower().split("e")[0].replace(".", "").lstrip("0").rstrip("0")
    return digits or "0"


def _same(value: float, reference: float, printed: str) -> bool:
    """``value`` as printed (``printed`` holds its digits) is ``reference`` rounded."""
    last_place = math.floor(math.log10(value)) + 1 - len(_significand(printed))
    return abs(value - reference) <= 0.501 * 10**last_place


def measured_numbers(source: str, text: str) -> list[str]:
    """The numbers in ``text`` that rule 1 counts as measured digits."""
    written = [float(m) for m in LITERAL.findall(source)]
    found = []
    for match in NUMBER.finditer(text):
        printed = match.group(0)
        value = float(printed)
        if not 0 < value < SMALL or _significand(printed) == "1":
            continue
        if any(_same(value, w, printed) for w in written if w):
            continue
        if any(_same(value, c, printed) for c in FORMAT_CONSTANTS):
            continue
        found.append(printed)
    return found


def output_text(output: dict) -> str:
    if "text" in output:
        return "".join(output["text"])
    return "".join(output.get("data", {}).get("text/plain", ""))


def problems(notebook: Path) -> list[str]:
    """Each breach of the two rules in ``notebook``, as 'chapter, cell N: what'."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    found = []
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        checked = not any(line.strip() == IGNORE for line in source.splitlines())
        where = f"{notebook.stem}, cell {index}"
        hidden = HIDDEN_TAGS & set(cell.get("metadata", {}).get("tags", []))
        width = HIDDEN_WIDTH if hidden else WIDTH
        for output in cell.get("outputs", []):
            text = output_text(output)
            if checked and (numbers := measured_numbers(source, text)):
                found.append(
                    f"{where}: measured digits in a checked output: {', '.join(numbers)} "
                    "(print the bound it was checked against, or mark the cell "
                    f"{IGNORE})"
                )
            for line in text.splitlines():
                if len(line) > width:
                    found.append(
                        f"{where}: a printed line of {len(line)} characters (at most {width} "
                        f"fit the website's column): {line[:60]!r}..."
                    )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every chapter")
    args = parser.parse_args(argv)
    notebooks = args.notebooks or toc_chapters()
    found = [problem for notebook in notebooks for problem in problems(notebook)]
    for problem in found:
        print(problem)
    print(f"{len(notebooks)} notebooks' outputs checked: {len(found)} problems")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
