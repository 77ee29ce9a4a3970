"""Chapter 10's run records: saved and loaded unchanged, described in a few lines without local
paths, and the reference record shipped with the package equal to the results file."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from transformer_tutorial import records
from transformer_tutorial.records import RunRecord, describe_run, load_reference_record

ROOT = Path(__file__).resolve().parents[1]
RESULTS_RECORD = ROOT / "results" / "multi30k_de_en" / "record.json"


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
    assert len(record.samples) == min(records.RECORD_SAMPLES, record.test2016["sentences"])
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


def test_a_record_written_before_averaging_existed_loads_with_best_pt_scored(tmp_path):
    data = json.loads(RESULTS_RECORD.read_text(encoding="utf-8"))
    data.pop("weights", None), data.pop("averaged", None)
    old = RunRecord.from_json(json.dumps(data))
    assert old.weights == "best.pt" and old.averaged is None
    del data["steps"]  # a field every record has
    with pytest.raises(KeyError, match="steps"):
        RunRecord.from_json(json.dumps(data))


def test_describe_run_says_which_weights_were_scored():
    record = load_reference_record()
    plain = replace(record, weights="best.pt", averaged=None)
    assert "\nscored       best.pt, the weights with the lowest validation loss\n" in describe_run(
        plain
    )
    averaged = replace(
        record,
        weights="averaged.pt",
        averaged={
            "steps": [1000, 1200, 1250],
            "val_loss": 2.5,
            "best_test2016": {"greedy": {"score": 30.0}, record.beam_name: {"score": 31.25}},
        },
    )
    text = describe_run(averaged)
    assert (
        "\nscored       averaged.pt, the mean of the last 3 checkpoints (steps 1,000–1,250)"
        in text
    )
    assert f"validation loss 2.500; best.pt alone: BLEU {record.beam_name} 31.25" in text
