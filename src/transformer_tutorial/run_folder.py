"""Chapter 10: a training run's folder — the one place that knows its files' names.

A run writes into one folder (``python -m transformer_tutorial.train --out FOLDER``):

- ``last.pt``: everything needed to resume, rewritten as training goes;
- ``best.pt``: the weights with the lowest validation loss so far;
- ``snapshots/step-NNNNNNN.pt``: the last checkpoints' weights, kept to average;
- ``averaged.pt``: their mean; ``tokenizer.json``; ``record.json``: how the run went.

:class:`RunFolder` names them, lists and prunes the snapshots, and writes every file atomically
(:func:`~transformer_tutorial.checkpoint.save_atomic`); the trainer, the experiment and the
command lines ask it rather than spell a file name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformer_tutorial.checkpoint import save_atomic

LAST, BEST, AVERAGED = "last.pt", "best.pt", "averaged.pt"
TOKENIZER, RECORD, SNAPSHOTS = "tokenizer.json", "record.json", "snapshots"


@dataclass(frozen=True)
class RunFolder:
    """The files of the run in ``path`` (which need not exist yet)."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def last(self) -> Path:
        return self.path / LAST

    @property
    def best(self) -> Path:
        return self.path / BEST

    @property
    def averaged(self) -> Path:
        return self.path / AVERAGED

    @property
    def tokenizer(self) -> Path:
        return self.path / TOKENIZER

    @property
    def record(self) -> Path:
        return self.path / RECORD

    def weights(self, name: str) -> Path:
        """The weights file a record names (``"best.pt"`` or ``"averaged.pt"``)."""
        if name not in (BEST, AVERAGED):
            raise ValueError(f"weights must be {BEST!r} or {AVERAGED!r}, got {name!r}")
        return self.path / name

    def is_finished(self) -> bool:
        """Whether training and scoring ended: best weights, tokenizer and record are there."""
        return all(f.is_file() for f in (self.best, self.tokenizer, self.record))

    def create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def save(self, checkpoint: dict, path: Path) -> None:
        """Write ``checkpoint`` to ``path`` (one of this folder's files) atomically."""
        save_atomic(checkpoint, path)

    # --- snapshots: the last checkpoints' weights, to average --------------------------------

    def snapshots(self) -> list[Path]:
        """The snapshots kept, oldest first."""
        return sorted((self.path / SNAPSHOTS).glob("step-*.pt"), key=snapshot_step)

    def save_snapshot(self, checkpoint: dict, step: int, *, keep: int) -> None:
        """Write step ``step``'s snapshot, then delete all but the newest ``keep``."""
        folder = self.path / SNAPSHOTS
        folder.mkdir(parents=True, exist_ok=True)
        save_atomic(checkpoint, folder / f"step-{step:07d}.pt")
        for old in self.snapshots()[:-keep]:
            old.unlink()

    def drop_snapshots_off_schedule(self, step: int, every: int) -> None:
        """Resuming at ``step``: delete the snapshots taken after it, and the one taken when the
        run stopped off the ``every``-step schedule, so the run goes on as if never stopped."""
        for path in self.snapshots():
            taken = snapshot_step(path)
            if taken > step or not (every and taken % every == 0):
                path.unlink()


def snapshot_step(path: Path) -> int:
    """The step a snapshot was taken at, from its name ``step-NNNNNNN.pt``."""
    return int(path.stem.removeprefix("step-"))
