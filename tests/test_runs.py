"""Chapter 10's runs: the runs cache, which checkpoint the chapters find, the chapter's own run,
the run record (saved, loaded, described) and the reference record shipped with the package."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from transformer_tutorial import runs
from transformer_tutorial.configs import CONFIGS
from transformer_tutorial.data import cache_dir
from transformer_tutorial.runs import (
    RunRecord,
    describe_run,
    find_checkpoint,
    load_reference_record,
    runs_dir,
    train_for_chapter,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS_RECORD = ROOT / "results" / "multi30k_de_en" / "record.json"
RUN_FILES = ("best.pt", "tokenizer.json", "record.json")


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


def make_run(name: str, files=RUN_FILES) -> Path:
    folder = runs_dir() / name
    folder.mkdir(parents=True, exist_ok=True)
    for f in files:
        (folder / f).write_text("{}")
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
    for name, f in itertools.product(("base", "small"), RUN_FILES):
        (runs_dir() / name / f).unlink(missing_ok=True)
    assert find_checkpoint() == chapter


@pytest.mark.parametrize(
    ("device", "name", "minutes"), [("cpu", "chapter10", 2.0), ("cuda", "small", 10.0)]
)
def test_train_for_chapter_picks_its_recipe_from_the_hardware(
    cache, monkeypatch, device, name, minutes
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
    command = kwargs["command"]
    assert command[:5] == ["python", "-m", "transformer_tutorial.train", "--config", name]
    assert command[command.index("--max-minutes") + 1] == f"{minutes:g}"
    train_for_chapter(device=device, max_minutes=0.5)
    assert calls[-1][1]["options"].max_minutes == 0.5


def test_the_reference_record_ships_with_the_package_and_equals_the_results_file():
    assert load_reference_record() == RunRecord.load(RESULTS_RECORD)


def test_a_record_survives_saving_and_loading(tmp_path):
    record = load_reference_record()
    record.save(tmp_path / "record.json")
    assert RunRecord.load(tmp_path / "record.json") == record


def test_the_reference_record_has_what_the_chapters_show():
    record = load_reference_record()
    beam = record.beam_name
    assert beam == f"beam{record.config['beam_size']}"
    for search in ("greedy", beam):
        assert {"score", "lowercase", "signature"} <= set(record.test2016[search])
    assert {"step", "train_loss", "lr"} <= set(record.history["train"][0])
    assert {"step", "val_loss"} <= set(record.history["val"][0])
    assert len(record.samples) == min(runs.RECORD_SAMPLES, record.test2016["sentences"])
    assert {"source", "reference", "greedy", beam} <= set(record.samples[0])


def test_describe_run_shows_the_record_without_local_paths():
    record = replace(
        load_reference_record(),
        command=[
            "/home/someone/.venv/bin/python",
            "-m",
            "transformer_tutorial.train",
            "--out",
            "/home/someone/.cache/transformer_tutorial/runs/chapter10",
        ],
    )
    text = describe_run(record)
    assert "python -m transformer_tutorial.train --out …/runs/chapter10" in text
    assert "/home" not in text
    keys = ("hardware", "model", "training", "time", "best", "BLEU greedy", "signature")
    for key in (*keys, f"BLEU {record.beam_name}"):
        assert f"\n{key} " in f"\n{text}"
    assert f"{record.test2016['greedy']['score']:.2f} (lowercased" in text
    assert f"{record.epochs_completed} full epochs of" in text  # the reference ran > 1 epoch
    assert "1 full epoch of" in describe_run(replace(record, epochs_completed=1))
