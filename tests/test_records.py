"""Chapter 10's run records: saved and loaded unchanged, described in a few lines without local
paths, and the reference record shipped with the package equal to the results file; every
record a chapter reads is kept once in the repository and found by an installed wheel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import raises
from transformer_tutorial import records
from transformer_tutorial.decode import BleuScore
from transformer_tutorial.records import (
    RunRecord,
    describe_run,
    load_reference_bench,
    load_reference_record,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS_RECORD = ROOT / "results" / "multi30k_de_en" / "record.json"


def test_the_reference_record_ships_with_the_package_and_equals_the_results_file():
    assert load_reference_record() == RunRecord.load(RESULTS_RECORD)


def test_the_reference_bench_ships_with_the_package_and_equals_its_results_file():
    bench = load_reference_bench()
    meta = bench["meta"]
    results_file = ROOT / "bench" / "results" / f"{meta['device']}-{meta['torch']}.json"
    assert bench == json.loads(results_file.read_text(encoding="utf-8"))
    assert not meta["quick"] and bench["train_step"]  # a full run, with the MFU chapter 12 shows
    assert all(0 < row["ours_mfu"] < 1 for row in bench["train_step"])


@pytest.mark.parametrize("name", ["record.json", "h200_chapter10_record.json"])
def test_a_record_is_written_back_as_it_was_read(name):
    """The typed record keeps ``record.json``'s layout: loaded and written again, the committed
    records come back byte for byte."""
    text = (RESULTS_RECORD.parent / name).read_text(encoding="utf-8")
    assert RunRecord.from_json(text).to_json() == text


@pytest.mark.parametrize(
    "path",
    [RESULTS_RECORD, RESULTS_RECORD.parent / "h200_chapter10_record.json"],
    ids=lambda p: p.name,
)
def test_committed_records_name_the_interpreter_python_not_its_path(path):
    """What to run, not where the machine that ran it kept its virtual environment."""
    assert RunRecord.load(path).command[:3] == ["python", "-m", "transformer_tutorial.train"]


def test_a_record_survives_saving_and_loading(tmp_path):
    record = load_reference_record()
    record.save(tmp_path / "record.json")
    assert RunRecord.load(tmp_path / "record.json") == record


def test_the_reference_record_has_what_the_chapters_show():
    record = load_reference_record()
    beam = record.beam_name
    assert beam == f"beam{record.config['beam_size']}"
    assert list(record.test2016.by_search()) == ["greedy", beam]
    assert record.history.train and record.history.val and record.history.epochs
    assert len(record.samples) == min(records.RECORD_SAMPLES, record.test2016.sentences)
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
    assert f"{record.test2016.greedy.score:.2f} (lowercased" in text
    assert f"{record.epochs_completed} full epochs of" in text  # the reference ran > 1 epoch
    assert "1 full epoch of" in describe_run(replace(record, epochs_completed=1))


def test_describe_run_says_when_a_time_limit_moved_the_schedules_end():
    record = load_reference_record()  # 3,600 steps, the recipe's own: stopped by steps
    assert "min of training (stopped by steps)\n" in describe_run(record)
    shortened = replace(record, steps=2050)
    assert (
        "(stopped by steps: the schedule's end, moved from step 3,600 to fit the time limit)"
        in describe_run(shortened)
    )


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
        averaged=records.Averaged(
            steps=(1000, 1200, 1250),
            val_loss=2.5,
            best_test2016=replace(
                record.test2016, greedy=BleuScore(30.0, 30.0, ""), beam=BleuScore(31.25, 31.5, "")
            ),
        ),
    )
    text = describe_run(averaged)
    assert (
        "\nscored       averaged.pt, the mean of the last 3 checkpoints (steps 1,000–1,250)"
        in text
    )
    assert f"validation loss 2.500; best.pt alone: BLEU {record.beam_name} 31.25" in text


# --- every committed record a chapter reads, kept once (results/, bench/results/) and shipped --

# The loaders the chapters call, and the repository file each reads.
CHAPTER_RECORDS = {
    "records.load_reference_record().to_json()": "results/multi30k_de_en/record.json",
    "records.load_reference_bench()": records.REFERENCE_BENCH,
    "comparison.load_comparison_record()": "results/lm_comparison/record.json",
    "length_experiment.load_length_record()": "results/rope_scaling/record.json",
    "moe_comparison.load_comparison_record()": "results/moe_comparison/record.json",
    "moe_balancing.load_balancing_record()": "results/moe_balancing/record.json",
    "speculative_comparison.load_comparison_record()": "results/speculative/record.json",
    "sft_run.load_sft_record(1)": "results/sft_translation/record.json",
    "sft_run.load_sft_record(4)": "results/sft_translation/record_x4.json",
    "dpo_run.load_dpo_record()": "results/dpo/record.json",
    "grpo_run.load_grpo_record()": "results/grpo_digits/record.json",
}
# Chapters 21-24 read make bench's records by their paths (records.shipped_record).
CHAPTER_RECORDS |= {
    f"records.shipped_record({path!r})": path
    for path in [
        "bench/results/intel-xeon/cpu-2.13.0+cpu.json",
        "bench/results/amd-epyc-decoding/sections-9-10-12.json",
        "bench/results/amd-epyc-decoding/section-9-copy-task.json",
        "bench/results/amd-epyc-decoding/section-8-fixed-part-1.json",
        "bench/results/amd-epyc-decoding/section-8-fixed-part-2.json",
        "bench/results/amd-epyc-decoding/section-8-fixed-part-3.json",
        "bench/results/amd-epyc-decoding/section-12-compiled.json",
        "bench/results/amd-epyc-decoding/section-12-compiled-2.json",
        "bench/results/amd-epyc-decoding/section-12-compiled-3.json",
        "bench/results/amd-epyc-decoding/section-12-compiled-passive.json",
    ]
}
IMPORTS = """
import json, sys
from transformer_tutorial import records
from transformer_tutorial.experiments import (
    comparison, length_experiment, moe_balancing, moe_comparison, speculative_comparison,
)
from transformer_tutorial.tuning import dpo_run, grpo_run, sft_run
"""


def test_shipped_record_reads_the_checkout_and_refuses_other_places():
    for path in CHAPTER_RECORDS.values():
        want = json.loads((ROOT / path).read_text(encoding="utf-8"))
        assert records.shipped_record(path) == want
    outside = "src/transformer_tutorial/reference_run.json"
    raises(lambda: records.shipped_record(outside), ValueError, "path must lie in one of")
    missing = "results/none/record.json"
    raises(lambda: records.shipped_record(missing), FileNotFoundError, repr(missing))


def test_the_package_ships_each_results_folder_as_a_data_package():
    """pyproject.toml lists every results/ folder holding a record (setuptools ships data files
    in listed packages only) and maps both folders of records into the package."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {p.parent.name for p in (ROOT / "results").glob("*/record.json")}
    listed = {p.rsplit(".", 1)[1] for p in setuptools["packages"] if ".results." in p}
    assert listed == folders
    mapped = {
        v: k.removeprefix("transformer_tutorial.") for k, v in setuptools["package-dir"].items()
    }
    assert all(mapped[folder] == name for folder, name in records.SHIPPED_FOLDERS.items())


def test_every_bench_record_a_chapter_names_is_one_the_tests_ship():
    """Each ``….json`` of bench/results/ that a chapter's code names — literally, or as an
    f-string with ``{i}`` over files that exist — is in CHAPTER_RECORDS (and so, by the wheel
    test, shipped): a chapter run from a wheel, as in Colab, finds it."""
    import glob
    import re

    named = set()
    for notebook in sorted((ROOT / "chapters").glob("*.ipynb")):
        cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        for name in re.findall(r"[\w.+{}/-]+\.json", code):
            pattern = re.sub(r"\{[^}]*\}", "*", name.split("/")[-1])
            named |= {
                Path(f).relative_to(ROOT).as_posix()
                for f in glob.glob(
                    str(ROOT / "bench" / "results" / "**" / pattern), recursive=True
                )
            }
    assert named, "no chapter names a bench record: the search is broken"
    assert named <= set(CHAPTER_RECORDS.values()), named - set(CHAPTER_RECORDS.values())


@pytest.mark.slow
def test_an_installed_wheel_finds_every_record_the_chapters_read(tmp_path):
    """Built as CI builds it (scripts/run_tests.py) and installed alone into an empty folder,
    the package reads each record from inside itself: equal to the repository's file, with no
    other JSON, weights or figures shipped."""
    wheels, site = tmp_path / "wheel", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(wheels), str(ROOT)], check=True)
    wheel = next(wheels.glob("*.whl"))
    data = [n for n in zipfile.ZipFile(wheel).namelist() if not n.endswith(".py")]
    data = [n for n in data if ".dist-info/" not in n]
    shipped = {n.removeprefix("transformer_tutorial/") for n in data}
    want = {path.replace("bench/results/", "bench_results/") for path in CHAPTER_RECORDS.values()}
    assert shipped == want | {"multi30k_sha256sums.txt"}
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True)
    script = (
        IMPORTS
        + f"""
assert records.__file__.startswith({str(site)!r}), records.__file__
for call in {list(CHAPTER_RECORDS)!r}:
    value = eval(call)
    print(json.dumps(json.loads(value) if isinstance(value, str) else value))
"""
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for line, path in zip(out, CHAPTER_RECORDS.values(), strict=True):
        assert json.loads(line) == json.loads((ROOT / path).read_text(encoding="utf-8")), path
