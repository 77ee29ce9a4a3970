"""Every chapter run alone, as a reader runs it in Colab; `make chapters` (part of `make test`).

Each chapter is copied alone into an empty folder and run under ``pytest --nbval`` (strict: its
stored outputs compared) against the package installed from a wheel, non-editable, as Colab has
it. This is the one part of the suite that pytest and make cannot express by themselves; the
book build, lint and the tests in ``tests/`` are make targets (see the Makefile).

    python scripts/run_tests.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from book import ROOT, toc_chapters  # scripts/book.py, beside this file

PY = sys.executable
# An optimisation, not a dependency: chapter 11 trains its own run when the cache has none, but
# run after chapter 10 (in that order, in one process) it finds chapter 10's run and reuses it.
SHARE_A_CHECKPOINT = ["10_translator", "11_decoding"]


def run(cmd: list[str], **kwargs) -> bool:
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, **kwargs).returncode == 0


def lax_off_the_cpu() -> list[str]:
    """nbval's options for the device ``TRANSFORMER_TUTORIAL_DEVICE`` names: stored outputs were
    computed on a CPU, so on another device only errors and failing asserts count (--nbval-lax)."""
    device = os.environ.get("TRANSFORMER_TUTORIAL_DEVICE", "")
    if device and device != "cpu":
        print(f"device {device}: chapters checked for errors and asserts only", flush=True)
        return ["--nbval-lax"]
    return []


def report_times(reports: list[Path]) -> None:
    """Each chapter's time, summed over its cells from pytest's JUnit reports."""
    seconds: dict[str, float] = defaultdict(float)
    for report in reports:
        if report.exists():
            for case in ET.parse(report).iter("testcase"):
                seconds[case.get("classname", "").split(".")[0]] += float(case.get("time", 0))
    line = ", ".join(f"{name.split('_')[0]} {s:.0f} s" for name, s in sorted(seconds.items()))
    print(f"chapter times (cells summed): {line}", flush=True)


def chapters_standalone() -> bool:
    with tempfile.TemporaryDirectory(prefix="chapters-") as tmp:
        tmp = Path(tmp)
        site, books = tmp / "site", tmp / "notebooks"
        wheel_dir = tmp / "wheel"
        if not run(
            [PY, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheel_dir), str(ROOT)]
        ):
            return False
        wheel = next(wheel_dir.glob("*.whl"))
        if not run(
            [PY, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)]
        ):
            return False
        # The wheel first on the path; what PYTHONPATH held already (a machine whose test tools
        # lie in a folder of their own) after it.
        path = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        env.setdefault("TRANSFORMER_TUTORIAL_CACHE", str(tmp / "cache"))
        where = subprocess.run(
            [PY, "-c", "import transformer_tutorial as t; print(t.__file__)"],
            env=env,
            cwd=tmp,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if not where.startswith(str(site)):
            print(f"the chapters would import the package from {where}, not the wheel", flush=True)
            return False
        print(f"chapters import transformer_tutorial from the wheel: {where}", flush=True)
        copies = []
        for chapter in toc_chapters():
            folder = books / chapter.stem  # one empty folder per chapter: nothing else beside it
            folder.mkdir(parents=True)
            shutil.copy(chapter, folder)
            copies.append(f"{chapter.stem}/{chapter.name}")  # relative to the pytest root
        (books / "pytest.ini").write_text("[pytest]\n")
        # Options as --name=value: a bare path after an option would count as a test path and
        # move pytest's root, and with it the node ids that xdist groups notebooks by.
        nbval = [
            PY, "-m", "pytest", "--nbval", "--nbval-current-env", "-p", "no:cacheprovider",
            f"--rootdir={books}", f"--nbval-sanitize-with={ROOT / 'nbval_sanitize.cfg'}", "-v",
            *lax_off_the_cpu(),
        ]  # fmt: skip
        # Two lanes at once. The chapters that share a run, one after the other in order, with
        # the torch threads they were executed with (their trained numbers depend on the
        # threads' summation order); beside them the rest two at a time, one thread each, or
        # CHAPTER_THREADS (`make portable` tries 2: their outputs must not depend on it).
        # Spinning OpenMP threads would steal the cores the other lane needs: they wait passively.
        ordered = sorted(c for c in copies if Path(c).stem in SHARE_A_CHECKPOINT)
        parallel = [c for c in copies if c not in ordered]
        passive = dict(env, OMP_WAIT_POLICY="PASSIVE")
        reports = [tmp / "parallel.xml", tmp / "ordered.xml"]
        log = tmp / "ordered.log"
        lane = None
        if ordered:
            command = [*nbval, f"--junitxml={reports[1]}", *ordered]
            print("$", " ".join(command), f"> {log.name}", flush=True)
            with log.open("w") as out:
                lane = subprocess.Popen(
                    command, cwd=books, env=passive, stdout=out, stderr=subprocess.STDOUT
                )
        ok = run(
            [*nbval, f"--junitxml={reports[0]}", "-n", "2", "--dist", "loadfile", *parallel],
            cwd=books,
            env=dict(passive, OMP_NUM_THREADS=os.environ.get("CHAPTER_THREADS", "1")),
        )
        if lane is not None:
            ok = lane.wait() == 0 and ok
            print(f"--- {', '.join(ordered)}, run beside them:", flush=True)
            print(log.read_text(), flush=True)
        report_times(reports)
        return ok


if __name__ == "__main__":
    sys.exit(0 if chapters_standalone() else 1)
