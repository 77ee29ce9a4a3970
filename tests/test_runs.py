"""Chapter 10's runs: the runs cache, which checkpoint the chapters find (the averaged weights
where a run has them), and the chapter's own run."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from transformer_tutorial import runs
from transformer_tutorial.configs import CONFIGS
from transformer_tutorial.multi30k import cache_dir
from transformer_tutorial.runs import find_checkpoint, runs_dir, train_for_chapter

RUN_FILES = ("best.pt", "tokenizer.json", "record.json")
RESULTS_RECORD = Path(__file__).resolve().parents[1] / "results" / "multi30k_de_en" / "record.json"


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    monkeypatch.setenv("TRANSFORMER_TUTORIAL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_runs_live_in_the_cache_folder_wherever_the_corpus_is(monkeypatch, tmp_path):
    for name in ("MULTI30K_DIR", "TRANSFORMER_TUTORIAL_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "transformer_tutorial"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert runs_dir() == tmp_path / "xdg" / "transformer_tutorial" / "runs"
    monkeypatch.setenv("TRANSFORMER_TUTORIAL_CACHE", str(tmp_path / "cache"))
    assert runs_dir() == tmp_path / "cache" / "runs"
    (tmp_path / "m30k").mkdir()
    monkeypatch.setenv("MULTI30K_DIR", str(tmp_path / "m30k"))
    assert runs_dir() == tmp_path / "cache" / "runs"  # the corpus may live elsewhere, runs do not


RECORD = json.loads(RESULTS_RECORD.read_text(encoding="utf-8"))


def make_run(name: str, files=RUN_FILES) -> Path:
    folder = runs_dir() / name
    folder.mkdir(parents=True, exist_ok=True)
    for f in files:
        (folder / f).write_text(json.dumps({**RECORD, "weights": "best.pt"}))
    return folder / "best.pt"


def test_find_checkpoint_prefers_base_then_small_then_chapter10(cache):
    assert find_checkpoint() is None
    make_run("tiny")  # not a chapter's run
    assert find_checkpoint() is None
    chapter = make_run("chapter10")
    assert find_checkpoint() == chapter
    make_run("small", files=("best.pt", "tokenizer.json"))  # still training: no record yet
    assert find_checkpoint() == chapter
    small = make_run("small")
    assert find_checkpoint() == small
    base = make_run("base")
    assert find_checkpoint() == base
    base.with_name("averaged.pt").write_text("{}")
    assert find_checkpoint() == base, "best.pt: the weights the record says were scored"
    base.with_name("record.json").write_text(json.dumps({**RECORD, "weights": "averaged.pt"}))
    assert find_checkpoint() == base.with_name("averaged.pt")
    for name, f in itertools.product(("base", "small"), RUN_FILES):
        (runs_dir() / name / f).unlink(missing_ok=True)
    assert find_checkpoint() == chapter


@pytest.mark.parametrize(
    ("device", "name", "steps", "minutes"),
    [("cpu", "chapter10", 600, 10.0), ("cuda", "small", None, 10.0)],
)
def test_train_for_chapter_picks_its_recipe_from_the_hardware(
    cache, monkeypatch, device, name, steps, minutes
):
    calls = []

    def run_experiment(config, **kwargs):
        calls.append((config, kwargs))
        return "the record"

    monkeypatch.setattr(runs, "run_experiment", run_experiment)
    if device == "cuda":  # a machine with one GPU, as far as the run's options can tell
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    old = make_run(name)
    assert train_for_chapter(device=device) == "the record"
    assert not old.exists(), "an earlier run of the same name is replaced"
    ((config, kwargs),) = calls
    assert config == CONFIGS[name]
    assert kwargs["out_dir"] == runs_dir() / name
    options = kwargs["options"]
    assert options.max_minutes == minutes and torch.device(options.device).type == device
    # A step budget, the same run on every machine of a kind: the options' or the recipe's own.
    assert options.max_steps == steps and (steps is not None or config.steps is not None)
    command = kwargs["command"]
    assert command[:5] == ["python", "-m", "transformer_tutorial.train", "--config", name]
    assert command[command.index("--max-minutes") + 1] == f"{minutes:g}"
    assert ("--max-steps" in command) == (steps is not None)
    if steps is not None:
        assert command[command.index("--max-steps") + 1] == str(steps)
    train_for_chapter(device=device, max_minutes=0.5)
    assert calls[-1][1]["options"].max_minutes == 0.5
