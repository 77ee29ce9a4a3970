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


class TrainingInterrupted(Exception):
    """Training stopped on Ctrl-C or SIGTERM after a whole step; ``last.pt`` holds that step."""

    def __init__(self, step: int, checkpoint: Path) -> None:
        super().__init__(f"interrupted after step {step}; {checkpoint} holds it")
        self.step, self.checkpoint = step, checkpoint
