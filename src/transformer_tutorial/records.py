"""Chapter 10: run records — what a run was, where it ran and how it went (:class:`RunRecord`,
``record.json``), told in a few lines by :func:`describe_run`; and the book's reference record,
shipped with the package (:func:`load_reference_record`). Every committed record the chapters
read is kept once, in the repository's ``results/`` (and ``bench/results/``), and read through
:func:`shipped_record`, from the package's copy when installed from a wheel.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from importlib import resources
from pathlib import Path

from transformer_tutorial.decode import BleuScore

# How many test sentences a record keeps with their translations, to read.
RECORD_SAMPLES = 20
# The repository's folders of records, and where a wheel keeps their copies inside the package
# (pyproject.toml maps each to a data package of its own); a checkout reads the folders.
SHIPPED_FOLDERS = {"results": "results", "bench/results": "bench_results"}
REFERENCE_BENCH = "bench/results/cpu-2.13.0+cpu.json"  # the ``make bench`` run the book quotes


def beam_search_name(beam_size: int) -> str:
    """How records name the scores of beam search with ``beam_size`` beams: ``"beam5"``."""
    return f"beam{beam_size}"


@dataclass(frozen=True)
class BestCheckpoint:
    """``best.pt``: the step with the lowest validation loss, and that loss."""

    step: int
    val_loss: float


@dataclass(frozen=True)
class TestScores:
    """BLEU on test2016 of greedy search and of beam search (``beam_name``, e.g. ``"beam5"``),
    on ``sentences`` sentences, and the seconds both took. ``record.json`` keeps the beam's
    scores under its name: ``{"sentences", "greedy", "beam5", "eval_time_s"}``."""

    sentences: int
    greedy: BleuScore
    beam: BleuScore
    beam_name: str
    eval_time_s: float

    def by_search(self) -> dict[str, BleuScore]:
        """The two scores by the name of their search: ``{"greedy": ..., "beam5": ...}``."""
        return {"greedy": self.greedy, self.beam_name: self.beam}

    def to_dict(self) -> dict:
        return {
            "sentences": self.sentences,
            **{name: asdict(score) for name, score in self.by_search().items()},
            "eval_time_s": self.eval_time_s,
        }

    @classmethod
    def from_dict(cls, data: dict, beam_name: str) -> TestScores:
        return cls(
            sentences=data["sentences"],
            greedy=BleuScore(**data["greedy"]),
            beam=BleuScore(**data[beam_name]),
            beam_name=beam_name,
            eval_time_s=data["eval_time_s"],
        )


@dataclass(frozen=True)
class Averaged:
    """``averaged.pt``: the steps of the checkpoints averaged, the mean's validation loss and, to
    compare, ``best.pt``'s scores on test2016."""

    steps: tuple[int, ...]
    val_loss: float
    best_test2016: TestScores

    def to_dict(self) -> dict:
        return {
            "steps": list(self.steps),
            "val_loss": self.val_loss,
            "best_test2016": self.best_test2016.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict, beam_name: str) -> Averaged:
        return cls(
            steps=tuple(data["steps"]),
            val_loss=data["val_loss"],
            best_test2016=TestScores.from_dict(data["best_test2016"], beam_name),
        )


@dataclass(frozen=True)
class TrainEntry:
    """A line of the training history: the mean training loss since the last line, and the
    learning rate."""

    step: int
    epoch: int
    train_loss: float
    lr: float
    elapsed_s: float


@dataclass(frozen=True)
class ValEntry:
    """A validation of the training history."""

    step: int
    epoch: int
    val_loss: float
    elapsed_s: float


@dataclass(frozen=True)
class EpochEntry:
    """The end of an epoch: its mean training loss and the validation loss after it."""

    step: int
    epoch: int
    train_loss: float
    val_loss: float
    elapsed_s: float


@dataclass(frozen=True)
class History:
    """How training went, line by line: the trainer's ``TrainState.history``, typed."""

    train: tuple[TrainEntry, ...]
    val: tuple[ValEntry, ...]
    epochs: tuple[EpochEntry, ...]

    @classmethod
    def from_dict(cls, data: dict[str, list[dict]]) -> History:
        return cls(
            train=tuple(TrainEntry(**e) for e in data["train"]),
            val=tuple(ValEntry(**e) for e in data["val"]),
            epochs=tuple(EpochEntry(**e) for e in data["epochs"]),
        )


@dataclass
class RunRecord:
    """What a run was and how it went, as ``record.json`` stores it.

    ``test2016`` holds the BLEU scores of the weights in the file ``weights`` (``"best.pt"``, or
    ``"averaged.pt"`` for a recipe with ``average_last`` above 1). For those, ``averaged`` says
    which checkpoints were averaged, the mean's validation loss and, to compare, ``best.pt``'s
    scores; otherwise it is None. ``config`` and ``model_config`` are the configs' own
    dictionaries (``dataclasses.asdict``), ``hardware`` is
    :func:`~transformer_tutorial.provenance.hardware`'s.
    """

    command: list[str]
    config: dict
    model_config: dict
    git: dict
    hardware: dict
    torch: str
    python: str
    finished_at: str
    seed: int
    parameters: int
    train_pairs: int
    steps: int
    epochs_completed: int
    stopped_by: str
    train_time_s: float
    best: BestCheckpoint
    history: History
    test2016: TestScores
    samples: list[dict]
    wall_time_s: float
    weights: str = "best.pt"
    averaged: Averaged | None = None

    @property
    def beam_name(self) -> str:
        """The name of the beam-search scores in ``test2016`` and ``samples``, e.g. ``"beam5"``."""
        return self.test2016.beam_name

    @classmethod
    def load(cls, path: Path | str) -> RunRecord:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))

    @classmethod
    def from_json(cls, text: str) -> RunRecord:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict) -> RunRecord:
        # fields with defaults came later: older records lack them
        values = {
            f.name: data[f.name] for f in fields(cls) if f.name in data or f.default is MISSING
        }
        beam_name = beam_search_name(values["config"]["beam_size"])
        averaged = values.get("averaged")
        return cls(
            **{
                **values,
                "best": BestCheckpoint(**values["best"]),
                "history": History.from_dict(values["history"]),
                "test2016": TestScores.from_dict(values["test2016"], beam_name),
                "averaged": None if averaged is None else Averaged.from_dict(averaged, beam_name),
            }
        )

    def to_json(self) -> str:
        """The record as ``record.json`` keeps it."""
        data = asdict(self) | {
            "test2016": self.test2016.to_dict(),
            "averaged": None if self.averaged is None else self.averaged.to_dict(),
        }
        return json.dumps(data, indent=2, ensure_ascii=False) + "\n"

    def save(self, path: Path | str) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")


def describe_run(record: RunRecord) -> str:
    """What a run's ``record.json`` says, in a few aligned lines: command, hardware, code, model,
    training and BLEU on test2016. Absolute paths are cut to their last two parts, so the text
    reads the same on every machine."""

    def shown(arg: str) -> str:
        path = Path(arg)
        if not path.is_absolute():
            return arg
        return "python" if path.name.startswith("python") else f"…/{path.parent.name}/{path.name}"

    hw, config, model = record.hardware, record.config, record.model_config
    epochs = record.epochs_completed
    threads = f"{hw['torch_threads']} torch thread{'s' if hw['torch_threads'] != 1 else ''}"
    device = hw.get("gpu") or f"{hw.get('cpu') or 'CPU'}, {hw['cpu_count']} cores, {threads}"
    if hw.get("processes", 1) > 1:
        device += f", {hw['processes']} processes (torchrun)"
    git = record.git
    code = "git unknown"
    if git["commit"]:
        code = f"git {git['commit'][:10]}" + (" (uncommitted changes)" if git.get("dirty") else "")
    lines = [
        ("command", " ".join(shown(a) for a in record.command) or "(not recorded)"),
        ("hardware", f"{hw['device']}: {device}"),
        ("software", f"{code}, torch {record.torch}, Python {record.python}"),
        (
            "model",
            f"{record.parameters:,} parameters: d_model {model['d_model']}, "
            f"{model['n_encoder_layers']}+{model['n_decoder_layers']} layers, "
            f"{model['n_heads']} heads, "
            f"d_ff {model['d_ff']}, {'pre' if model['norm_first'] else 'post'}-norm, "
            f"vocabulary {model['src_vocab_size']:,}",
        ),
        (
            "training",
            f"{record.steps:,} steps of ~{config['max_tokens']:,} tokens, "
            f"{epochs} full epoch{'s' if epochs != 1 else ''} of "
            f"{record.train_pairs:,} pairs",
        ),
        ("time", f"{record.train_time_s / 60:.1f} min of training (stopped by {_stop(record)})"),
        ("best", f"validation loss {record.best.val_loss:.3f} at step {record.best.step:,}"),
        *_scored_weights(record),
        ("wall time", f"{record.wall_time_s / 60:.1f} min in all, data and evaluation included"),
    ]
    scores = record.test2016
    for name, score in scores.by_search().items():
        lines.append(
            (
                f"BLEU {name}",
                f"{score.score:.2f} (lowercased {score.lowercase:.2f}) "
                f"on {scores.sentences:,} test2016 sentences",
            )
        )
    lines.append(("signature", scores.greedy.signature))
    return "\n".join(f"{key:<12} {value}" for key, value in lines)


def _stop(record: RunRecord) -> str:
    """Why training stopped; for a schedule ended early by a time limit, from which step."""
    recipe_steps = record.config.get("steps")
    if record.stopped_by == "steps" and recipe_steps and record.steps < recipe_steps:
        return f"steps: the schedule's end, moved from step {recipe_steps:,} to fit the time limit"
    return record.stopped_by


def _scored_weights(record: RunRecord) -> list[tuple[str, str]]:
    """Which weights the BLEU lines below score, and what averaging them changed."""
    averaged = record.averaged
    if averaged is None:
        return [("scored", f"{record.weights}, the weights with the lowest validation loss")]
    steps, alone = averaged.steps, averaged.best_test2016
    n = len(steps)
    return [
        (
            "scored",
            f"{record.weights}, the mean of the last {n} checkpoint{'s' * (n != 1)} "
            f"(steps {steps[0]:,}–{steps[-1]:,})",
        ),
        (
            "averaging",
            f"validation loss {averaged.val_loss:.3f}; "
            f"best.pt alone: BLEU {alone.beam_name} {alone.beam.score:.2f}",
        ),
    ]


def shipped_record(path: str) -> dict:
    """The JSON record the repository keeps at ``path`` (from its root, inside one of
    :data:`SHIPPED_FOLDERS`, e.g. ``"results/dpo/record.json"``): the package's copy when it
    was installed from a wheel, otherwise the checkout's own file."""
    folder = next((f for f in SHIPPED_FOLDERS if path.startswith(f + "/")), None)
    if folder is None:
        raise ValueError(f"path must lie in one of {sorted(SHIPPED_FOLDERS)}, got {path!r}")
    shipped = resources.files("transformer_tutorial").joinpath(SHIPPED_FOLDERS[folder])
    for part in path[len(folder) + 1 :].split("/"):
        shipped = shipped.joinpath(part)
    checkout = Path(__file__).resolve().parents[2] / path
    if shipped.is_file():
        return json.loads(shipped.read_text(encoding="utf-8"))
    if checkout.is_file():
        return json.loads(checkout.read_text(encoding="utf-8"))
    raise FileNotFoundError(f"{path!r}: neither the installed package nor a checkout holds it")


def load_reference_record() -> RunRecord:
    """The record of the book's reference run
    (``python -m transformer_tutorial.train --config small``), kept as
    ``results/multi30k_de_en/record.json`` and shipped with the package."""
    return RunRecord.from_dict(shipped_record("results/multi30k_de_en/record.json"))


def load_reference_bench() -> dict:
    """The results of ``make bench`` that the book quotes (the CPU the book was built on), kept
    in ``bench/results/`` named by its device and PyTorch version (:data:`REFERENCE_BENCH`) and
    shipped with the package."""
    return shipped_record(REFERENCE_BENCH)
