"""run_folder.py: a run's files, named in one place; snapshots kept, pruned and dropped."""

from __future__ import annotations

import pytest
import torch

from transformer_tutorial.run_folder import RunFolder, snapshot_step


def test_the_files_of_a_run(tmp_path):
    folder = RunFolder(tmp_path / "run")
    names = [folder.last, folder.best, folder.averaged, folder.tokenizer, folder.record]
    assert [p.name for p in names] == [
        "last.pt",
        "best.pt",
        "averaged.pt",
        "tokenizer.json",
        "record.json",
    ]
    assert all(p.parent == tmp_path / "run" for p in names)
    assert folder.weights("averaged.pt") == folder.averaged
    with pytest.raises(ValueError) as info:
        folder.weights("x.pt")
    assert str(info.value) == "weights must be 'best.pt' or 'averaged.pt', got 'x.pt'"


def test_a_run_is_finished_once_scored(tmp_path):
    folder = RunFolder(str(tmp_path / "run"))  # a str is taken too
    folder.create()
    assert not folder.is_finished()
    for path in (folder.best, folder.tokenizer):
        path.write_text("x")
        assert not folder.is_finished()
    folder.record.write_text("{}")
    assert folder.is_finished()


def test_save_is_atomic_and_leaves_no_part_file(tmp_path):
    folder = RunFolder(tmp_path)
    folder.save({"step": 3, "w": torch.ones(2)}, folder.last)
    assert torch.load(folder.last, weights_only=True)["step"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_snapshots_keep_the_newest_and_resuming_drops_the_off_schedule_one(tmp_path):
    folder = RunFolder(tmp_path)
    assert folder.snapshots() == []
    for step in (4, 8, 10, 12):  # every 4 steps, and step 10 where a run stopped
        folder.save_snapshot({"step": step}, step, keep=3)
    assert [snapshot_step(p) for p in folder.snapshots()] == [8, 10, 12]
    assert folder.snapshots()[0].name == "step-0000008.pt"
    folder.drop_snapshots_off_schedule(10, every=4)  # resumed at step 10: 12 is later, 10 off
    assert [snapshot_step(p) for p in folder.snapshots()] == [8]
    folder.drop_snapshots_off_schedule(10, every=0)  # no schedule: none was on it
    assert folder.snapshots() == []
