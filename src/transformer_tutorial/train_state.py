"""Chapter 10: where training stands — the state ``last.pt`` saves so that a resumed run goes on
exactly, and the interruption that says which step it holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from torch import Tensor


@dataclass
class TrainState:
    """Where training stands; saved in ``last.pt`` so that a resumed run goes on exactly.

    ``epoch`` counts finished epochs, ``batch_in_epoch`` the batches done in the current one,
    whose order is drawn from ``epoch_start`` (the batch-order generator's state when it began).
    The loss sums cover the current logging window and the current epoch.
    """

    epoch_start: Tensor
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    train_seconds: float = 0.0
    window_loss: float = 0.0
    window_tokens: int = 0
    epoch_loss: float = 0.0
    epoch_tokens: int = 0
    best_val_loss: float = math.inf
    stopped_by: str = ""
    history: dict[str, list[dict]] = field(
        default_factory=lambda: {"train": [], "val": [], "epochs": []}
    )

    def add_loss(self, loss_sum: float, tokens: int) -> None:
        self.window_loss += loss_sum
        self.window_tokens += tokens
        self.epoch_loss += loss_sum
        self.epoch_tokens += tokens

    def log(self, kind: str, elapsed: float, **values: float) -> None:
        """Add a line to ``history[kind]``: where training stands, ``values``, ``elapsed``."""
        line = {"step": self.step, "epoch": self.epoch + 1, **values}
        self.history[kind].append({**line, "elapsed_s": round(elapsed, 1)})

    def log_window(self, elapsed: float, *, lr: float) -> float:
        """Log the logging window's mean training loss and ``lr``, start a new window; returns
        that loss."""
        train_loss = self.window_loss / self.window_tokens
        self.log("train", elapsed, train_loss=train_loss, lr=lr)
        self.window_loss, self.window_tokens = 0.0, 0
        return train_loss

    def end_epoch(self, elapsed: float, *, val_loss: float, next_start: Tensor) -> float:
        """Log the epoch's mean training loss beside ``val_loss``, then start the next epoch,
        whose batch order is drawn from ``next_start``; returns that loss."""
        epoch_loss = self.epoch_loss / max(self.epoch_tokens, 1)
        self.log("epochs", elapsed, train_loss=epoch_loss, val_loss=val_loss)
        self.epoch, self.batch_in_epoch, self.epoch_start = self.epoch + 1, 0, next_start
        self.epoch_loss, self.epoch_tokens = 0.0, 0
        return epoch_loss


class TrainingInterrupted(Exception):
    """Training stopped on Ctrl-C or SIGTERM after a whole step; ``last.pt`` holds that step."""

    def __init__(self, step: int, checkpoint: Path) -> None:
        super().__init__(f"interrupted after step {step}; {checkpoint} holds it")
        self.step, self.checkpoint = step, checkpoint
