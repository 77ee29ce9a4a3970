"""What chapters 10 and 11 rely on: runs in the cache, find_checkpoint's order, the chapter's own
run, the shipped reference record, greedy decoding with a minimum length, and training time."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from transformer_tutorial import train
from transformer_tutorial.data import cache_dir, data_dir
from transformer_tutorial.decode import greedy_decode
from transformer_tutorial.model import Transformer, TransformerConfig
from transformer_tutorial.train import CONFIGS, find_checkpoint, load_reference_record, runs_dir, train_for_chapter

pytestmark = pytest.mark.usefixtures("single_thread")

ROOT = Path(__file__).resolve().parents[1]
RESULTS_RECORD = ROOT / "results" / "multi30k_de_en" / "record.json"
PACKAGE_RECORD = ROOT / "src" / "transformer_tutorial" / "reference_run.json"
RUN_FILES = ("best.pt", "tokenizer.json", "record.json")


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    monkeypatch.setenv("TRANSFORMER_TUTORIAL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_runs_live_in_the_cache_folder(monkeypatch, tmp_path):
    for name in ("MULTI30K_DIR", "TRANSFORMER_TUTORIAL_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "transformer_tutorial"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert runs_dir() == tmp_path / "xdg" / "transformer_tutorial" / "runs"
    monkeypatch.setenv("TRANSFORMER_TUTORIAL_CACHE", str(tmp_path / "cache"))
    assert runs_dir() == tmp_path / "cache" / "runs" and data_dir() == tmp_path / "cache" / "multi30k"
    monkeypatch.setenv("MULTI30K_DIR", str(tmp_path / "m30k"))
    assert runs_dir() == tmp_path / "cache" / "runs"  # the corpus may live elsewhere, the runs do not move


def make_run(name: str, files=RUN_FILES) -> Path:
    folder = runs_dir() / name
    folder.mkdir(parents=True, exist_ok=True)
    for f in files:
        (folder / f).write_text("{}")
    return folder / "best.pt"


def test_find_checkpoint_prefers_base_then_small_then_chapter10(cache):
    assert train.RUN_PREFERENCE == ("base", "small", "chapter10")
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


def test_chapter10_config_is_a_reduced_small():
    chapter, small = CONFIGS["chapter10"], CONFIGS["small"]
    assert 128 <= chapter.d_model <= 256
    assert (chapter.n_encoder_layers, chapter.n_decoder_layers) == (2, 2)
    same = ("vocab_size", "norm_first", "share_embeddings", "label_smoothing", "clip_norm", "beam_size")
    assert [getattr(chapter, k) for k in same] == [getattr(small, k) for k in same]
    assert chapter.train_size is None  # the whole training set; the time budget bounds the run


@pytest.mark.parametrize(("device", "name", "minutes"), [("cpu", "chapter10", 2.0), ("cuda", "small", 10.0)])
def test_train_for_chapter_picks_its_config_from_the_hardware(cache, monkeypatch, device, name, minutes):
    calls = []
    monkeypatch.setattr(train, "run", lambda config, **kwargs: calls.append((config, kwargs)) or {"ok": True})
    old = make_run(name)
    assert train_for_chapter(device=device) == {"ok": True}
    assert not old.exists(), "an earlier run of the same name is replaced"
    (config, kwargs), = calls
    assert config == CONFIGS[name] and kwargs["max_minutes"] == minutes
    assert kwargs["out_dir"] == runs_dir() / name and kwargs["device"] == torch.device(device)
    assert kwargs["command"][:5] == ["python", "-m", "transformer_tutorial.train", "--config", name]
    train_for_chapter(device=device, max_minutes=0.5)
    assert calls[-1][1]["max_minutes"] == 0.5


def test_reference_record_ships_with_the_package_and_equals_the_results_file():
    assert PACKAGE_RECORD.read_bytes() == RESULTS_RECORD.read_bytes()
    record = load_reference_record()
    assert record == json.loads(RESULTS_RECORD.read_text(encoding="utf-8"))


def test_reference_record_has_what_the_chapters_show():
    record = load_reference_record()
    keys = {"command", "config", "git", "hardware", "parameters", "steps", "epochs_completed", "train_time_s",
            "wall_time_s", "best", "history", "test2016", "samples"}
    assert keys <= set(record)
    beam = f"beam{record['config']['beam_size']}"
    for search in ("greedy", beam):
        assert {"score", "lowercase", "signature"} <= set(record["test2016"][search])
    assert record["history"]["train"] and record["history"]["val"]
    assert {"step", "train_loss", "lr"} <= set(record["history"]["train"][0])
    assert {"step", "val_loss"} <= set(record["history"]["val"][0])
    assert len(record["samples"]) == min(20, record["test2016"]["sentences"])
    assert {"source", "reference", "greedy", beam} <= set(record["samples"][0])


def test_describe_run_shows_the_record_without_local_paths():
    record = load_reference_record()
    record["command"] = ["/home/someone/.venv/bin/python", "-m", "transformer_tutorial.train", "--out",
                         "/home/someone/.cache/transformer_tutorial/runs/chapter10"]
    text = train.describe_run(record)
    assert "python -m transformer_tutorial.train --out …/runs/chapter10" in text and "/home" not in text
    beam = f"beam{record['config']['beam_size']}"
    for key in ("hardware", "model", "training", "time", "best", "BLEU greedy", f"BLEU {beam}", "signature"):
        assert f"\n{key} " in f"\n{text}"
    assert f"{record['test2016']['greedy']['score']:.2f} (lowercased" in text
    assert f"{record['epochs_completed']} full epochs of" in text  # the reference ran > 1 epoch
    record["epochs_completed"] = 1
    assert "1 full epoch of" in train.describe_run(record)


def eos_loving_model(vocab_size: int = 10) -> Transformer:
    """A random model whose output layer prefers <eos> (id 2) at every step."""
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size, vocab_size, d_model=16, n_heads=2, n_encoder_layers=1,
                               n_decoder_layers=1, d_ff=32, dropout=0.0, max_len=32, norm_first=True)
    model = Transformer(config).eval()
    with torch.no_grad():
        model.generator.bias[2] = 50.0
    return model


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_min_len_rules_out_eos_until_then(use_cache):
    model = eos_loving_model()
    src = torch.tensor([[5, 6, 7], [8, 9, 0]])
    ids = dict(bos_id=1, eos_id=2, pad_id=0, use_cache=use_cache)
    assert greedy_decode(model, src, max_len=8, **ids).tolist() == [[2], [2]]
    out = greedy_decode(model, src, max_len=8, min_len=4, **ids)
    assert out.shape == (2, 5) and (out[:, :4] != 2).all() and (out[:, 4] == 2).all()
    exactly = greedy_decode(model, src, max_len=6, min_len=6, **ids)
    assert exactly.shape == (2, 6) and (exactly != 2).all()


def test_greedy_min_len_cached_equals_recomputed():
    model = eos_loving_model(vocab_size=12)
    with torch.no_grad():
        model.generator.bias[2] = 0.0
        model.generator.weight.mul_(4.0)
    src = torch.tensor([[3, 4, 5, 6], [7, 8, 0, 0], [9, 10, 11, 0]])
    ids = dict(bos_id=1, eos_id=2, pad_id=0)
    cached = greedy_decode(model, src, max_len=16, min_len=16, use_cache=True, **ids)
    assert torch.equal(cached, greedy_decode(model, src, max_len=16, min_len=16, use_cache=False, **ids))
    assert cached.shape == (3, 16)


def test_training_time_is_counted_once(tmp_path, monkeypatch):
    """With a clock that ticks one second per reading, the recorded training time cannot exceed
    the number of readings (counting the time before a checkpoint twice would)."""
    clock = itertools.count()
    readings = []
    monkeypatch.setattr(train.time, "monotonic", lambda: readings.append(1) or float(next(clock)))
    config = replace(CONFIGS["tiny"], vocab_size=12, max_tokens=20, epochs=2, log_every=2, eval_every=3,
                     checkpoint_every=2)
    pairs = [([4, 5, 6], [6, 5, 4]), ([7, 8], [8, 7]), ([9, 10, 11, 4], [4, 11, 10, 9])] * 6
    _, state = train.fit(config, pairs, pairs[:3], vocab_size=12, out_dir=tmp_path, progress=False)
    assert state["step"] > 2 * config.checkpoint_every
    assert 0 < state["train_seconds"] <= len(readings)
    elapsed = [e["elapsed_s"] for e in state["history"]["train"]]
    assert elapsed == sorted(elapsed) and elapsed[-1] <= len(readings)
