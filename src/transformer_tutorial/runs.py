"""Chapter 10: whole runs — train, score with BLEU, write the run's record; the runs cache.

:func:`run_experiment` is what ``python -m transformer_tutorial.train`` does: data, tokenizer,
:func:`~transformer_tutorial.trainer.fit`, then BLEU on test2016 with the best weights (or the
mean of the last checkpoints' weights, ``averaged.pt``), all kept in a :class:`RunRecord`
(``record.json``, :mod:`~transformer_tutorial.records`). The chapters keep their runs in the cache,
``runs_dir() / name``, and find them with :func:`find_checkpoint`.
"""

from __future__ import annotations

import platform
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
from tokenizers import Tokenizer

from transformer_tutorial import distributed
from transformer_tutorial.checkpoint import average_checkpoints, load_model
from transformer_tutorial.configs import CONFIGS, RunOptions, TrainConfig
from transformer_tutorial.data import (
    encode_pairs,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)
from transformer_tutorial.decode import bleu, translate_sentences
from transformer_tutorial.model import Transformer
from transformer_tutorial.multi30k import cache_dir, load_split
from transformer_tutorial.pair_loss import Pairs
from transformer_tutorial.precision import resolve_precision
from transformer_tutorial.provenance import git_commit, hardware
from transformer_tutorial.records import (
    RECORD_SAMPLES,
    Averaged,
    BestCheckpoint,
    History,
    RunRecord,
    TestScores,
    beam_search_name,
)
from transformer_tutorial.run_folder import AVERAGED, BEST, TOKENIZER, RunFolder
from transformer_tutorial.runtime import get_device
from transformer_tutorial.trainer import evaluate_loss, fit

# Chapter 10's own run, by device type: a number of steps, so that every machine of a kind trains
# the same model and the page's numbers hold on it, with a time limit for slow ones. On a CPU 600
# steps of `chapter10` (a minute or two on 2 cores); on a GPU the reference recipe `small` for
# its own 3,600 steps (minutes on a recent GPU, judged from an H200 run of an earlier recipe:
# this one has not run on a GPU yet; on a slow one the time limit ends its decay earlier).
CHAPTER_STEPS = {"cuda": None, "cpu": 600}  # None: the recipe's own length
CHAPTER_MINUTES = {"cuda": 10.0, "cpu": 10.0}


def _prepare_data(
    config: TrainConfig, out_dir: Path, resume: bool
) -> tuple[Tokenizer, Pairs, Pairs, tuple[list[str], list[str]]]:
    """The tokenizer (learned on the training split, or the run's own when resuming), the
    encoded training pairs that fit ``max_len`` and validation pairs, and the test sentences
    to score (sources, references). Under ``torchrun`` rank 0 learns the tokenizer and the other
    ranks read it."""
    train_src, train_tgt = (side[: config.train_size] for side in load_split("train"))
    val_src, val_tgt = load_split("val")
    tokenizer_path = RunFolder(out_dir).tokenizer
    if not resume and distributed.is_main():
        save_tokenizer(train_tokenizer(train_src + train_tgt, config.vocab_size), tokenizer_path)
    distributed.barrier()  # the other ranks read the tokenizer rank 0 wrote
    tokenizer = load_tokenizer(tokenizer_path)
    max_len = config.model.max_len
    train_pairs = [  # the pairs that fit the model's max_len
        (s, t)
        for s, t in encode_pairs(tokenizer, train_src, train_tgt)
        if len(s) <= max_len and len(t) + 1 <= max_len
    ]
    test = tuple(side[: config.eval_size] for side in load_split("test"))
    return tokenizer, train_pairs, encode_pairs(tokenizer, val_src, val_tgt), test


def _score(
    model: Transformer, tokenizer: Tokenizer, config: TrainConfig, src: list[str], refs: list[str]
) -> tuple[TestScores, list[dict]]:
    """BLEU of greedy and beam search on ``src``, and the first :data:`RECORD_SAMPLES`
    translations beside their references."""
    start = time.monotonic()
    greedy = translate_sentences(model, tokenizer, src)
    beam = translate_sentences(
        model, tokenizer, src, beam_size=config.beam_size, alpha=config.alpha
    )
    beam_name = beam_search_name(config.beam_size)
    scores = TestScores(
        sentences=len(src),
        greedy=bleu(greedy, refs),
        beam=bleu(beam, refs),
        beam_name=beam_name,
        eval_time_s=round(time.monotonic() - start, 1),
    )
    rows = list(zip(src, refs, greedy, beam, strict=True))[:RECORD_SAMPLES]
    samples = [{"source": s, "reference": r, "greedy": g, beam_name: b} for s, r, g, b in rows]
    return scores, samples


def _average_snapshots(
    config: TrainConfig, out_dir: Path, val_pairs: Pairs, options: RunOptions
) -> tuple[Transformer, list[int], float]:
    """Write ``averaged.pt``, the mean of the weights in ``snapshots/``; returns that model, the
    steps averaged and the mean's validation loss."""
    folder = RunFolder(out_dir)
    folder.save(average_checkpoints(folder.snapshots()), folder.averaged)
    model, _, saved = load_model(folder.averaged, options.device)
    val_loss = evaluate_loss(
        model,
        val_pairs,
        max_tokens=config.max_tokens,
        label_smoothing=config.label_smoothing,
        device=torch.device(options.device),
        precision=options.precision,
    )
    return model, saved["averaged_steps"], val_loss


def _score_run(
    config: TrainConfig,
    tokenizer: Tokenizer,
    test: tuple[list[str], list[str]],
    val_pairs: Pairs,
    out_dir: Path,
    options: RunOptions,
) -> tuple[BestCheckpoint, str, TestScores, list[dict], Averaged | None]:
    """Score a trained run on ``test`` (sources, references): its best checkpoint, the weights
    scored (``best.pt``, or with ``config.average_last`` above 1 ``averaged.pt``), their BLEU
    and samples, and what averaging changed (None without it)."""
    best, _, saved = load_model(RunFolder(out_dir).best, options.device)
    best_checkpoint = BestCheckpoint(saved["step"], saved["val_loss"])
    if config.average_last <= 1:
        return (best_checkpoint, BEST, *_score(best, tokenizer, config, *test), None)
    model, steps, val_loss = _average_snapshots(config, out_dir, val_pairs, options)
    # What averaging gained: the best checkpoint alone, scored the same way
    alone, _ = _score(best, tokenizer, config, *test)
    scores, samples = _score(model, tokenizer, config, *test)
    return best_checkpoint, AVERAGED, scores, samples, Averaged(tuple(steps), val_loss, alone)


def _with_precision_resolved(options: RunOptions) -> RunOptions:
    """``options`` with ``"auto"`` precision made concrete for its device, once: the trainer, the
    averaged weights' validation and the record all read this one answer."""
    precision = resolve_precision(options.precision, torch.device(options.device))
    return replace(options, precision=precision)


def run_experiment(
    config: TrainConfig,
    *,
    out_dir: Path | str,
    options: RunOptions = RunOptions(),
    command: Sequence[str] = (),
) -> RunRecord | None:
    """The whole experiment: data, tokenizer, :func:`fit`, then BLEU on test2016 (greedy and beam
    search) of the best weights, or with ``config.average_last`` above 1 of their mean
    (:func:`_score_run`); the record is written to ``out_dir/record.json`` and returned.

    Under ``torchrun`` every rank trains; rank 0 alone learns the tokenizer, scores and writes
    the record, and the other ranks return None once training ends."""
    wall_start = time.monotonic()
    git = git_commit()  # the code as the run starts, not as it ends
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    options = _with_precision_resolved(options)
    device = torch.device(options.device)
    tokenizer, train_pairs, val_pairs, test = _prepare_data(config, out_dir, options.resume)
    model, state = fit(
        config,
        train_pairs,
        val_pairs,
        vocab_size=tokenizer.get_vocab_size(),
        out_dir=out_dir,
        options=options,
        tokenizer_file=TOKENIZER,
    )
    if not distributed.is_main():
        return None
    best, weights, test2016, samples, averaged = _score_run(
        config, tokenizer, test, val_pairs, out_dir, options
    )
    record = RunRecord(
        command=list(command),
        config=asdict(config),
        model_config=asdict(model.config),
        git=git,
        hardware=hardware(device, options.precision, compiled=options.compile),
        torch=torch.__version__,
        python=platform.python_version(),
        finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        seed=options.seed,
        parameters=sum(p.numel() for p in model.parameters()),
        train_pairs=len(train_pairs),
        steps=state.step,
        epochs_completed=state.epoch,
        stopped_by=state.stopped_by,
        train_time_s=round(state.train_seconds, 1),
        best=best,
        history=History.from_dict(state.history),
        test2016=test2016,
        samples=samples,
        wall_time_s=round(time.monotonic() - wall_start, 1),
        weights=weights,
        averaged=averaged,
    )
    record.save(RunFolder(out_dir).record)
    return record


RUN_PREFERENCE = ("base", "small", "chapter10")


def runs_dir() -> Path:
    """Where the chapters keep trained runs: ``runs`` in the book's cache folder
    (:func:`transformer_tutorial.multi30k.cache_dir`), one subfolder per run name."""
    return cache_dir() / "runs"


def find_checkpoint() -> Path | None:
    """The weights the best finished run in :func:`runs_dir` was scored with (its record's
    ``weights``: ``best.pt``, or ``averaged.pt``), or None.

    Runs are preferred in the order of :data:`RUN_PREFERENCE`: ``base`` (the paper's model, on a
    GPU), ``small`` (the reference recipe), ``chapter10`` (chapter 10's quick CPU run). A run is
    finished once its folder holds ``best.pt``, ``tokenizer.json`` and ``record.json``.
    """
    for name in RUN_PREFERENCE:
        folder = RunFolder(runs_dir() / name)
        if folder.is_finished():
            return folder.weights(RunRecord.load(folder.record).weights)
    return None


def train_for_chapter(
    *,
    device: torch.device | str | None = None,
    max_minutes: float | None = None,
    progress: bool = False,
) -> RunRecord:
    """Chapter 10's run (chapter 11 calls it too when :func:`find_checkpoint` finds nothing).

    On a CUDA GPU the reference recipe ``small``, its whole schedule, saved as run ``small``;
    elsewhere the reduced ``chapter10`` config for 600 steps, saved as ``chapter10``; either
    stops early after ``max_minutes`` (default 10; ``small``'s decay then ends at the last step
    that fits). An earlier run of that name is
    replaced. Returns the run's record, which also lies in ``runs_dir() / name / "record.json"``.
    """
    device = get_device(device)
    kind = "cuda" if device.type == "cuda" else "cpu"
    config = CONFIGS["small"] if kind == "cuda" else CONFIGS["chapter10"]
    max_steps = CHAPTER_STEPS[kind]
    if max_minutes is None:
        max_minutes = CHAPTER_MINUTES[kind]
    out_dir = runs_dir() / config.name
    shutil.rmtree(out_dir, ignore_errors=True)
    command = [
        "python",
        "-m",
        "transformer_tutorial.train",
        "--config",
        config.name,
        "--out",
        str(out_dir),
        "--max-minutes",
        f"{max_minutes:g}",
        *([] if max_steps is None else ["--max-steps", str(max_steps)]),
        "--device",
        device.type,
    ]
    options = RunOptions(
        device=str(device), max_steps=max_steps, max_minutes=max_minutes, progress=progress
    )
    return run_experiment(config, out_dir=out_dir, options=options, command=command)
