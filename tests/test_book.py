"""The book is consistent: TOC ↔ chapters, Colab badge and setup cell, stored executed outputs."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from book import ROOT, colab_url, repository_url, toc_chapters, toc_files

CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))


def _source(cell) -> str:
    return cell.source if isinstance(cell.source, str) else "".join(cell.source)


def test_every_toc_entry_exists():
    for entry in toc_files():
        assert any((ROOT / f"{entry}{suffix}").exists() for suffix in (".ipynb", ".md")), (
            f"{entry} in _toc.yml has no file"
        )


def test_every_chapter_is_in_the_toc():
    listed = {p.resolve() for p in toc_chapters()}
    missing = [p.name for p in CHAPTERS if p.resolve() not in listed]
    assert not missing, f"chapters missing from _toc.yml: {missing}"


def test_chapters_are_numbered_in_toc_order():
    names = [p.name for p in toc_chapters()]
    assert names == sorted(names), f"_toc.yml order differs from the file numbering: {names}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_opens_with_badge_and_setup_cell(path: Path):
    nb = nbformat.read(path, as_version=4)
    badge, setup = nb.cells[0], nb.cells[1]
    assert badge.cell_type == "markdown" and _source(badge).lstrip().startswith("# "), (
        "cell 1: the chapter title"
    )
    assert f"]({colab_url(path)})" in _source(badge), (
        f"cell 1 needs the Colab badge linking to {colab_url(path)}"
    )
    code = _source(setup)
    assert setup.cell_type == "code", "cell 2 must be the setup cell"
    assert 'find_spec("transformer_tutorial") is None' in code, (
        "the setup cell installs only when the package is missing"
    )
    assert f'"git+{repository_url()}"' in code, (
        f"the setup cell must install git+{repository_url()}"
    )
    assert not setup.outputs, "outside Colab the setup cell prints nothing"


# What a chapter's code uses → what its setup cell must require, so that a Colab runtime with the
# wrong version stops at the top with the pip command instead of failing cells later.
NEEDS = {
    re.compile(r"^\s*(from|import) transformers\b", re.M): '"transformers>=5,<6"',
    re.compile(r"^\s*(from|import) peft\b", re.M): '"peft>=0.21,<1"',
    re.compile(r"^\s*(from|import) trl\b", re.M): '"trl>=1.16,<2"',
    re.compile(r"\bsharding\b|fully_shard"): '"torch>=2.6"',
}


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_setup_cell_requires_what_the_chapter_imports(path: Path):
    nb = nbformat.read(path, as_version=4)
    setup = _source(nb.cells[1])
    code = "\n".join(_source(c) for c in nb.cells[2:] if c.cell_type == "code")
    needed = {spec for pattern, spec in NEEDS.items() if pattern.search(code)}
    if needed & {'"transformers>=5,<6"', '"peft>=0.21,<1"', '"trl>=1.16,<2"'}:
        needed.add('"torch>=2.6"')  # transformers 5 runs on torch >= 2.6 only
        extra = "trl" if '"trl>=1.16,<2"' in needed else "hf"  # [trl] includes [hf]
        assert f'"transformer-tutorial[{extra}] @ "' in setup, f"install the [{extra}] extra"
    missing = [spec for spec in sorted(needed) if spec not in setup]
    assert not missing, f"the setup cell must call require(...) with {missing}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_is_executed_in_order_with_outputs(path: Path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code" and _source(c).strip()]
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"execute the chapter top to bottom once (execution counts {counts})"
    )
    assert sum(bool(c.outputs) for c in code) >= len(code) // 2, (
        "most code cells should show a stored output"
    )
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, "a stored output is an error traceback"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_reads_no_repository_paths(path: Path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not re.search(r"""["'](\.\./|data/|src/|chapters/)""", _source(cell)), (
                "chapters run alone in Colab: read data through transformer_tutorial, "
                "not repository paths"
            )


def _outputs_text(nb) -> str:
    """Every stored output of a notebook, as text (streams, plain-text results, errors)."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                parts.append(out.text)
            elif "data" in out and "text/plain" in out.data:
                parts.append(out.data["text/plain"])
    return "\n".join(parts)


EXERCISE = re.compile(r"^### Exercise (\d+)\.(\d+): \S", re.MULTILINE)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_ends_with_exercises_each_with_a_checked_hidden_solution(path: Path):
    nb = nbformat.read(path, as_version=4)
    chapter = int(path.name[:2])
    headings = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "markdown" and _source(c).lstrip().startswith("## ")
    ]
    assert headings and _source(nb.cells[headings[-1]]).lstrip().startswith("## Exercises"), (
        "the chapter's last section must be '## Exercises'"
    )
    exercises = [
        (i, EXERCISE.search(_source(c)))
        for i, c in enumerate(nb.cells)
        if c.cell_type == "markdown" and EXERCISE.search(_source(c))
    ]
    assert 2 <= len(exercises) <= 4, f"{len(exercises)} exercises; each chapter has 2 to 4"
    numbers = [(int(m[1]), int(m[2])) for _, m in exercises]
    assert numbers == [(chapter, k) for k in range(1, len(numbers) + 1)], numbers
    for i, match in exercises:
        solution = nb.cells[i + 1]
        title = f"# @title Solution {match[1]}.{match[2]} "
        assert solution.cell_type == "code" and _source(solution).startswith(title), (
            f"exercise {match[1]}.{match[2]}: the next cell must be its solution, "
            f"starting with {title!r}"
        )
        tags = set(solution.metadata.get("tags", []))
        assert {"hide-cell", "solution"} <= tags, f"solution {match[1]}.{match[2]} tags: {tags}"
        assert solution.metadata.get("jupyter", {}).get("source_hidden"), "hidden in Jupyter"
        assert re.search(r"\bassert", _source(solution)), (
            f"solution {match[1]}.{match[2]} must check its answer with an assert"
        )
        images = [o for o in solution.outputs if "image/png" in o.get("data", {})]
        assert not images, "a collapsed solution must not draw a figure"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_guarded_numbers_in_prose_come_from_the_outputs(path: Path):
    """Each number a chapter's text states and lists in ``metadata.guarded_numbers`` is printed
    by one of its cells: editing the text or the code alone makes this fail."""
    nb = nbformat.read(path, as_version=4)
    guarded = nb.metadata.get("guarded_numbers", [])
    assert guarded, "list the numbers the prose cites in metadata.guarded_numbers"
    prose = "\n".join(_source(c) for c in nb.cells if c.cell_type == "markdown")
    outputs = _outputs_text(nb)
    assert not [n for n in guarded if n not in prose], "guarded numbers missing from the text"
    assert not [n for n in guarded if n not in outputs], "guarded numbers no cell prints"
