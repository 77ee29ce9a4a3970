"""The whole test suite, in the order a reader's trust needs it; `make test` runs this.

1. book      the website builds with warnings as errors (``jupyter-book build . -W -n``)
2. unit      ``pytest tests/``: the package, the book's consistency, the website in a browser
3. chapters  every chapter copied alone into an empty folder and run under ``pytest --nbval``
             (strict: stored outputs compared) against the package installed from a wheel,
             non-editable, as Colab has it

Every part runs even when an earlier one fails; the exit status is non-zero if any failed, and
the time each part took is printed at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from book import toc_chapters  # noqa: E402

PY = sys.executable
# Chapter 11 decodes with the checkpoint chapter 10 trains (both find it in the cache).
SHARE_A_CHECKPOINT = {"10_translator", "11_decoding"}


def run(cmd: list[str], **kwargs) -> bool:
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, **kwargs).returncode == 0


def build_book() -> bool:
    shutil.rmtree(ROOT / "_build", ignore_errors=True)
    return run([str(Path(PY).parent / "jupyter-book"), "build", str(ROOT), "-W", "-n", "--keep-going"], cwd=ROOT)


def unit_tests() -> bool:
    # Two test files at a time, one torch thread each: the tests assert values, not speed.
    return run([PY, "-m", "pytest", "-n", "2", "--dist", "loadfile", "tests/"], cwd=ROOT,
               env=dict(os.environ, OMP_NUM_THREADS="1"))


def chapters_standalone() -> bool:
    with tempfile.TemporaryDirectory(prefix="chapters-") as tmp:
        tmp = Path(tmp)
        site, books = tmp / "site", tmp / "notebooks"
        if not run([PY, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(tmp / "wheel"), str(ROOT)]):
            return False
        wheel = next((tmp / "wheel").glob("*.whl"))
        if not run([PY, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)]):
            return False
        env = dict(os.environ, PYTHONPATH=str(site))
        env.setdefault("TRANSFORMER_TUTORIAL_CACHE", str(tmp / "cache"))
        where = subprocess.run(
            [PY, "-c", "import transformer_tutorial as t; print(t.__file__)"],
            env=env, cwd=tmp, capture_output=True, text=True, check=True,
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
        nbval = [PY, "-m", "pytest", "--nbval", "--nbval-current-env", "-p", "no:cacheprovider",
                 f"--rootdir={books}", f"--nbval-sanitize-with={ROOT / 'nbval_sanitize.cfg'}", "-v"]
        # Chapters that share the translator's checkpoint run one after the other, in order;
        # the rest run two at a time, one torch thread each (their outputs do not depend on it).
        ordered = [c for c in copies if Path(c).stem in SHARE_A_CHECKPOINT]
        parallel = [c for c in copies if c not in ordered]
        ok = run([*nbval, "-n", "2", "--dist", "loadfile", *parallel], cwd=books, env=dict(env, OMP_NUM_THREADS="1"))
        if ordered:
            ok = run([*nbval, *ordered], cwd=books, env=env) and ok
        return ok


def main() -> int:
    parts = {"book": build_book, "unit": unit_tests, "chapters": chapters_standalone}
    wanted = sys.argv[1:] or list(parts)
    results = {}
    for name in wanted:
        print(f"\n===== {name} =====", flush=True)
        start = time.perf_counter()
        ok = parts[name]()
        results[name] = (ok, time.perf_counter() - start)
    print("\n===== summary =====")
    for name, (ok, seconds) in results.items():
        print(f"{name:<10} {'passed' if ok else 'FAILED':<7} {seconds:6.0f} s")
    print(f"{'total':<18} {sum(s for _, s in results.values()):6.0f} s")
    return 0 if all(ok for ok, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
