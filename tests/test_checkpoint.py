"""Chapter 10's checkpoints: written atomically, read without running pickled code, a model back
from a file in eval mode with its tokenizer, and a CheckpointError that says what is wrong."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from transformer_tutorial.checkpoint import CheckpointError, load_model, save_atomic


def test_save_atomic_replaces_the_file_whole_and_leaves_no_part(tmp_path):
    path = tmp_path / "last.pt"
    save_atomic({"step": 1}, path)
    save_atomic({"step": 2}, path)
    assert torch.load(path, weights_only=True) == {"step": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_a_crash_while_saving_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_atomic({"step": 1}, path)

    def crash(obj, f):
        with open(f, "wb") as half:
            half.write(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_atomic({"step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"step": 1}


def test_load_model_gives_the_trained_model_in_eval_mode_with_its_tokenizer(tiny_checkpoint):
    model, tokenizer, checkpoint = load_model(tiny_checkpoint)
    assert not model.training
    assert asdict(model.config) == checkpoint["model_config"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, checkpoint["model"][name]), name
    assert tokenizer.get_vocab_size() == model.config.src_vocab_size
    assert {"step", "val_loss", "train_config"} <= set(checkpoint)


def test_load_model_without_a_tokenizer_gives_none(tiny_model, tmp_path):
    model = tiny_model()
    save_atomic(
        {"model": model.state_dict(), "model_config": asdict(model.config)}, tmp_path / "m.pt"
    )
    loaded, tokenizer, _ = load_model(tmp_path / "m.pt")
    assert tokenizer is None
    ids = torch.tensor([[4, 5, 6]])
    torch.testing.assert_close(loaded(ids, ids), model(ids, ids), atol=0, rtol=0)


def test_unreadable_checkpoints_raise_checkpoint_error(tiny_model, tmp_path):
    def error(path) -> str:
        with pytest.raises(CheckpointError) as info:
            load_model(path)
        assert info.value.__cause__ is None  # one clear message, not a chain of tracebacks
        return str(info.value)

    assert "checkpoint not found" in error(tmp_path / "nope.pt")
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    assert "not a checkpoint written by transformer_tutorial.train" in error(tmp_path / "junk.pt")
    torch.save({"weights": {}}, tmp_path / "other.pt")
    assert "no model or model_config" in error(tmp_path / "other.pt")
    torch.save({"model": {}, "model_config": {"d_model": 8, "flux": 1}}, tmp_path / "odd.pt")
    assert "model config" in error(tmp_path / "odd.pt")
    model = tiny_model()
    bigger = asdict(model.config) | {"d_ff": 64}
    torch.save({"model": model.state_dict(), "model_config": bigger}, tmp_path / "mismatch.pt")
    assert "weights do not fit the model config" in error(tmp_path / "mismatch.pt")


def test_loading_a_model_does_not_import_the_trainer(package_imports):
    """Translation needs the model and its checkpoint, never the training loop."""
    reached = package_imports("checkpoint")
    assert {"model", "data"} <= reached
    assert not reached & {"trainer", "runs", "optim", "configs"}
