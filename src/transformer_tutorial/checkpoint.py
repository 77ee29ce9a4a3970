"""Chapter 10: checkpoints — written atomically, loaded safely, a model back from a file.

A checkpoint is a plain dict of tensors and built-in types, so ``torch.load(...,
weights_only=True)`` reads it without running any pickled code. Loading a model for translation
needs this module and the model, never the trainer.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer

from transformer_tutorial.data import load_tokenizer
from transformer_tutorial.model import Transformer, TransformerConfig


class CheckpointError(ValueError):
    """A file is not a readable checkpoint of this package; the message says which and why."""


def save_atomic(obj: dict, path: Path | str) -> None:
    """Write a checkpoint under a temporary name first, so a crash never leaves half a file."""
    path = Path(path)
    part = path.with_name(path.name + ".part")
    torch.save(obj, part)
    os.replace(part, path)


def load_checkpoint(path: Path | str, device: torch.device | str = "cpu") -> dict:
    """The dict saved at ``path`` (tensors on ``device``), or a :class:`CheckpointError`."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        checkpoint = torch.load(path, map_location=device, weights_only=True)
    except Exception as err:  # a damaged file fails the unpickler in any way
        # (UnpicklingError, EOFError, IndexError, KeyError…): all mean "not a checkpoint"
        raise CheckpointError(
            f"cannot read {path}: not a checkpoint written by transformer_tutorial.train "
            f"({type(err).__name__})"
        ) from None
    if not isinstance(checkpoint, dict) or not {"model", "model_config"} <= set(checkpoint):
        raise CheckpointError(
            f"{path} is not a checkpoint written by transformer_tutorial.train "
            "(no model or model_config)"
        )
    return checkpoint


def load_model(
    path: Path | str, device: torch.device | str = "cpu"
) -> tuple[Transformer, Tokenizer | None, dict]:
    """Load a checkpoint written by the trainer: the model (in eval mode), its tokenizer (found
    beside the checkpoint) or None, and the checkpoint's other entries."""
    path = Path(path)
    checkpoint = load_checkpoint(path, device)
    try:
        config = TransformerConfig(**checkpoint["model_config"])
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: unusable model config: {err}") from None
    model = Transformer(config).to(device)
    try:
        model.load_state_dict(checkpoint["model"])
    except RuntimeError as err:
        raise CheckpointError(
            f"{path}: weights do not fit the model config: {str(err).splitlines()[0]}"
        ) from None
    tokenizer = None
    if checkpoint.get("tokenizer"):
        tokenizer = load_tokenizer(path.parent / checkpoint["tokenizer"])
    return model.eval(), tokenizer, checkpoint


def average_checkpoints(paths: Sequence[Path | str]) -> dict:
    """The checkpoint at ``paths[-1]`` with its weights replaced by the mean of the weights of
    all ``paths`` (the paper scores its base models so, section 6.1), and ``averaged_steps``, the
    checkpoints' steps. Each weight is averaged in float64 and stored in its own dtype; integer
    tensors, which are not weights, are taken from the last checkpoint."""
    if not paths:
        raise ValueError("average_checkpoints needs at least one checkpoint, got none")
    checkpoints = [load_checkpoint(path) for path in paths]
    last = checkpoints[-1]
    averaged = {}
    for name, tensor in last["model"].items():
        if not tensor.is_floating_point():
            averaged[name] = tensor
            continue
        try:
            stacked = torch.stack([c["model"][name].double() for c in checkpoints])
        except (KeyError, RuntimeError):
            raise CheckpointError(
                f"cannot average {', '.join(str(p) for p in paths)}: their weights differ in "
                f"name or shape ({name})"
            ) from None
        averaged[name] = stacked.mean(dim=0).to(tensor.dtype)
    return {**last, "model": averaged, "averaged_steps": [c.get("step") for c in checkpoints]}


def rng_states() -> dict:
    """Every random number generator's state, for ``last.pt``: resuming then draws the same
    dropout masks and batch noise as an uninterrupted run."""
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_states(states: dict) -> None:
    """Put back what :func:`rng_states` saved."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
