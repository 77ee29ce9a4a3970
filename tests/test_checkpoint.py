"""Chapter 10's checkpoints: written atomically, read without running pickled code, a model back
from a file in eval mode with its tokenizer; and bad inputs: every kind of unreadable file raises
one CheckpointError (no chained traceback) that says what is wrong."""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest
import torch

from helpers import raises
from transformer_tutorial.checkpoint import (
    CheckpointError,
    average_checkpoints,
    load_model,
    save_atomic,
)


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


def test_averaged_weights_are_the_mean_of_the_checkpoints_and_the_rest_is_the_last(
    tiny_model, tmp_path
):
    models = [tiny_model(seed) for seed in range(3)]
    paths = []
    for step, model in enumerate(models, start=1):
        paths.append(tmp_path / f"step-{step}.pt")
        extra = {"count": torch.tensor(step)}  # an integer tensor is not averaged
        checkpoint = {"model": {**model.state_dict(), **extra}, "model_config": {}, "step": step}
        save_atomic(checkpoint, paths[-1])
    averaged = average_checkpoints(paths)
    assert averaged["step"] == 3  # the rest of the checkpoint is the last one's
    assert averaged["averaged_steps"] == [1, 2, 3]
    weights = averaged["model"]
    assert torch.equal(weights["count"], torch.tensor(3))
    for name, tensor in models[0].state_dict().items():
        expected = sum(m.state_dict()[name].double() for m in models) / 3
        torch.testing.assert_close(weights[name], expected.float(), rtol=0, atol=1e-7)
        assert weights[name].dtype == tensor.dtype
    name = next(n for n, t in models[0].state_dict().items() if t.dim() == 2)
    assert not torch.equal(weights[name], models[-1].state_dict()[name])  # differs from the last
    raises(lambda: average_checkpoints([]), ValueError, "needs at least one checkpoint")
    save_atomic({"model": tiny_model(d_ff=16).state_dict(), "model_config": {}}, paths[0])
    raises(lambda: average_checkpoints(paths), CheckpointError, "differ in name or shape")


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


def test_loading_a_model_does_not_import_the_trainer(package_imports):
    """Translation needs the model and its checkpoint, never the training loop."""
    reached = package_imports("checkpoint")
    assert {"model", "data"} <= reached
    assert not reached & {"trainer", "runs", "optim", "configs"}


# --- bad inputs: every kind of unreadable checkpoint --------------------------------------------


def _bigger_config(path, model) -> None:
    bigger = asdict(model.config) | {"d_ff": 64}
    torch.save({"model": model.state_dict(), "model_config": bigger}, path)


CHECKPOINT_ROWS = [
    ("missing", lambda path, model: None, "checkpoint not found"),
    (
        "empty",
        lambda path, model: path.write_bytes(b""),
        "not a checkpoint written by transformer_tutorial.train (EOFError)",
    ),
    (
        "random bytes",
        lambda path, model: path.write_bytes(os.urandom(200)),
        "not a checkpoint written by transformer_tutorial.train",
    ),
    (
        "text",
        lambda path, model: path.write_text("not a checkpoint"),
        "not a checkpoint written by transformer_tutorial.train",
    ),
    (
        "a tensor, not a dict",
        lambda path, model: torch.save(torch.zeros(3), path),
        "(no model or model_config)",
    ),
    (
        "a dict without model",
        lambda path, model: torch.save({"weights": {}}, path),
        "no model or model_config",
    ),
    (
        "unknown config field",
        lambda path, model: torch.save(
            {"model": {}, "model_config": {"d_model": 8, "flux": 1}}, path
        ),
        "model config",
    ),
    ("weights of another size", _bigger_config, "weights do not fit the model config"),
]


@pytest.mark.parametrize(
    ("write", "phrase"), [r[1:] for r in CHECKPOINT_ROWS], ids=[r[0] for r in CHECKPOINT_ROWS]
)
def test_an_unreadable_checkpoint_raises_one_checkpoint_error(tiny_model, tmp_path, write, phrase):
    path = tmp_path / "model.pt"
    write(path, tiny_model())
    error = raises(lambda: load_model(path), CheckpointError, phrase)
    assert error.__cause__ is None  # one clear message, not a chain of tracebacks
