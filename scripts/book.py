"""Facts about the book read from its own files, shared by tests and scripts.

It lives in ``scripts/`` so that both import it as plain ``book`` without editing ``sys.path``:
a script run as ``python scripts/NAME.py`` has its own folder on ``sys.path`` already, and pytest
adds ``scripts`` through ``pythonpath`` in ``pyproject.toml``. (The alternative, a ``tests``
package imported as ``tests.book``, would need every script run with ``python -m`` from the
repository root, and a top-level package named ``tests`` can collide with one installed by
another project.)
"""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent  # scripts/ → the repository


def config() -> dict:
    return yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))


def repository_url() -> str:
    return config()["repository"]["url"].rstrip("/")


def colab_url(notebook: Path) -> str:
    """The Colab address of a chapter, built from the repository URL in ``_config.yml``."""
    repo = config()["repository"]
    owner_repo = repository_url().removeprefix("https://github.com/")
    rel = notebook.resolve().relative_to(ROOT).as_posix()
    return f"https://colab.research.google.com/github/{owner_repo}/blob/{repo['branch']}/{rel}"


def toc_files() -> list[str]:
    """Every file named in ``_toc.yml``, root first, without suffix, in reading order."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    files = [toc["root"]]

    def walk(entries: list[dict]) -> None:
        for entry in entries:
            if "file" in entry:
                files.append(entry["file"])
            walk(entry.get("sections", []))
            walk(entry.get("chapters", []))

    walk(toc.get("chapters", []))
    for part in toc.get("parts", []):
        walk(part.get("chapters", []))
    return files


def toc_chapters() -> list[Path]:
    """The notebooks of the TOC, in reading order."""
    return [ROOT / f"{f}.ipynb" for f in toc_files() if (ROOT / f"{f}.ipynb").exists()]
