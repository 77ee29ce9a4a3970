"""Chapter 10's training loop: a resumed run equals an uninterrupted one, checkpoints hold what
resuming needs, the time budget and the epochs stop it, training time is counted once, ids
outside the vocabulary are refused where the pairs come in, and a run stopped by Ctrl-C or
SIGTERM saves its step and resumes exactly; bad RunOptions are refused with a message that says
what is wrong. The losses themselves are tested in ``test_pair_loss.py``."""

from __future__ import annotations

import functools
import itertools
import math
import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers import raises
from transformer_tutorial import budget, trainer
from transformer_tutorial.checkpoint import average_checkpoints
from transformer_tutorial.configs import CONFIGS, RunOptions
from transformer_tutorial.data import pair_lengths, token_batches
from transformer_tutorial.dropout import CheapDropout
from transformer_tutorial.model import Transformer
from transformer_tutorial.run_folder import RunFolder, snapshot_step
from transformer_tutorial.trainer import (
    Trainer,
    TrainingInterrupted,
    TrainState,
    evaluate_loss,
    fit,
)

VOCAB = 13  # the digit-reversal task's
CONFIG = replace(
    CONFIGS["tiny"],
    max_tokens=60,
    epochs=3,
    log_every=2,
    eval_every=3,
    checkpoint_every=4,
)
SEED = 3


@pytest.fixture(scope="module")
def pairs(digit_reversal):
    """(training pairs, validation pairs) of the digit-reversal task."""
    return digit_reversal.pairs(48, seed=1), digit_reversal.pairs(12, seed=2)


def train(pairs, out_dir, **options) -> tuple[torch.nn.Module, TrainState]:
    train_pairs, val_pairs = pairs
    options = RunOptions(seed=SEED, progress=False, **options)
    return fit(CONFIG, train_pairs, val_pairs, vocab_size=VOCAB, out_dir=out_dir, options=options)


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(pairs, tmp_path):
    lengths = pair_lengths(pairs[0])
    first_epoch = len(
        token_batches(lengths, CONFIG.max_tokens, generator=torch.Generator().manual_seed(SEED))
    )
    total = first_epoch + 5
    straight, straight_state = train(pairs, tmp_path / "straight", max_steps=total)
    # Stop mid-epoch, then exactly at the end of the first epoch, then run to the end.
    for stop, resume in ((first_epoch - 2, False), (first_epoch, True), (total, True)):
        resumed, state = train(pairs, tmp_path / "resumed", max_steps=stop, resume=resume)
        assert state.step == stop and state.stopped_by == "max_steps"
    for (name, a), b in zip(
        straight.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    losses = [entry["train_loss"] for entry in straight_state.history["train"]]
    assert losses == [entry["train_loss"] for entry in state.history["train"]]
    assert [e["epoch"] for e in state.history["epochs"]] == [1]


def test_checkpoints_history_time_budget_and_epochs(pairs, tmp_path):
    _, state = train(pairs, tmp_path, max_minutes=1e-9)  # over after the first step
    assert state.step == 1 and state.stopped_by == "max_minutes"
    assert {"last.pt", "best.pt"} <= {p.name for p in tmp_path.iterdir()}
    last = torch.load(tmp_path / "last.pt", weights_only=True)
    resumable = {"model", "model_config", "train_config", "optimizer", "scheduler", "state", "rng"}
    assert resumable <= set(last)
    assert TrainState(**last["state"]).step == 1
    _, state = train(pairs, tmp_path, resume=True, max_steps=1)
    assert state.step == 1 and state.stopped_by == "max_steps"
    _, state = train(pairs, tmp_path, resume=True)
    assert state.stopped_by == "epochs" and state.epoch == CONFIG.epochs
    history = state.history
    assert len(history["epochs"]) == CONFIG.epochs and history["train"] and history["val"]
    assert all(math.isfinite(e["val_loss"]) for e in history["epochs"])
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    assert best["val_loss"] == min(e["val_loss"] for e in history["val"]) == state.best_val_loss
    assert history["epochs"][-1]["train_loss"] < history["epochs"][0]["train_loss"]


def test_the_last_checkpoints_weights_are_kept_for_averaging_and_resuming_keeps_the_same(
    pairs, tmp_path
):
    train_pairs, val_pairs = pairs

    def run(out_dir, config, max_steps, resume=False):
        options = RunOptions(seed=SEED, progress=False, max_steps=max_steps, resume=resume)
        return fit(
            config, train_pairs, val_pairs, vocab_size=VOCAB, out_dir=out_dir, options=options
        )

    run(tmp_path / "one", CONFIG, 10)
    assert not RunFolder(tmp_path / "one").snapshots()  # average_last=1: none kept
    config = replace(CONFIG, average_last=2)  # checkpoints every 4 steps, and the last one
    model, _ = run(tmp_path / "straight", config, 10)
    straight = RunFolder(tmp_path / "straight").snapshots()
    assert [p.name for p in straight] == ["step-0000008.pt", "step-0000010.pt"]
    last = torch.load(straight[-1], weights_only=True)
    assert last["step"] == 10 and "optimizer" not in last  # weights only, not resumable
    for name, tensor in model.state_dict().items():
        assert torch.equal(last["model"][name], tensor), name
    # Stopped at step 6 (off the schedule: a snapshot of step 6), then resumed to step 10: the
    # same snapshots as the uninterrupted run, step 6's dropped.
    run(tmp_path / "resumed", config, 6)
    assert [snapshot_step(p) for p in RunFolder(tmp_path / "resumed").snapshots()] == [4, 6]
    run(tmp_path / "resumed", config, 10, resume=True)
    resumed = RunFolder(tmp_path / "resumed").snapshots()
    assert [p.name for p in resumed] == [p.name for p in straight]
    for a, b in zip(straight, resumed, strict=True):
        weights_a = torch.load(a, weights_only=True)["model"]
        weights_b = torch.load(b, weights_only=True)["model"]
        assert all(torch.equal(weights_a[n], weights_b[n]) for n in weights_a), a.name


def test_training_time_is_counted_once(pairs, tmp_path, monkeypatch):
    """With a clock that ticks one second per reading, the recorded training time cannot exceed
    the number of readings (counting the time before a checkpoint twice would)."""
    clock = itertools.count()
    readings = []
    monkeypatch.setattr(budget.time, "monotonic", lambda: readings.append(1) or float(next(clock)))
    config = replace(CONFIG, epochs=2, checkpoint_every=2)
    train_pairs = pairs[0][:18]
    _, state = fit(
        config,
        train_pairs,
        pairs[1][:3],
        vocab_size=VOCAB,
        out_dir=tmp_path,
        options=RunOptions(progress=False),
    )
    assert state.step > 2 * config.checkpoint_every
    assert 0 < state.train_seconds <= len(readings)
    elapsed = [e["elapsed_s"] for e in state.history["train"]]
    assert elapsed == sorted(elapsed) and elapsed[-1] <= len(readings)


@pytest.mark.parametrize("where", ["train_pairs", "val_pairs", "evaluate_loss"])
def test_ids_outside_the_vocabulary_are_refused_where_they_come_in(pairs, tiny_model, where):
    train_pairs, val_pairs = pairs
    bad = [*val_pairs[:2], ([3, 4], [5, VOCAB, 6])]
    phrase = f"(targets) holds ids from 3 to {VOCAB}; valid ids are 0 to {VOCAB - 1}"
    if where == "evaluate_loss":
        model = tiny_model(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB)
        call = functools.partial(
            evaluate_loss, model, bad, max_tokens=100, label_smoothing=0.1, device="cpu"
        )
    else:
        given = {"train_pairs": train_pairs, "val_pairs": val_pairs, where: bad}
        call = functools.partial(
            Trainer,
            Transformer(CONFIG.model_config(VOCAB)),
            CONFIG,
            given["train_pairs"],
            given["val_pairs"],
            folder=Path("unused"),
            options=RunOptions(progress=False),
        )
    raises(call, ValueError, phrase)


@pytest.mark.slow
def test_compiled_training_gives_the_eager_losses_and_plain_checkpoints(pairs, tmp_path):
    """``compile=True`` wires torch.compile into the step. The compiler backend here is
    ``aot_eager`` (TorchDynamo's graph capture and AOTAutograd's joint forward–backward, run by
    eager kernels): the default, inductor, takes minutes to build C++ kernels on a CI CPU for every
    batch shape. No dropout: compiled dropout draws other random numbers than eager."""
    config = replace(CONFIG, model=replace(CONFIG.model, dropout=0.0), log_every=1)
    losses = {}
    aot_eager = functools.partial(torch.compile, backend="aot_eager")
    for compiled in (False, True):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch, "compile", aot_eager)
            fit(
                config,
                *pairs,
                vocab_size=VOCAB,
                out_dir=tmp_path / str(compiled),
                options=RunOptions(seed=SEED, progress=False, max_steps=3, compile=compiled),
            )
        last = torch.load(tmp_path / str(compiled) / "last.pt", weights_only=True)
        losses[compiled] = [e["train_loss"] for e in last["state"]["history"]["train"]]
        assert not any(name.startswith(("_orig_mod.", "module.")) for name in last["model"])
    assert len(losses[True]) == 3
    assert losses[True] == pytest.approx(losses[False], abs=1e-5)


# --- interruption: Ctrl-C or SIGTERM lose nothing -----------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_run_saves_its_step_and_resumes_exactly(pairs, tmp_path, monkeypatch, sig):
    config = replace(CONFIG, eval_every=0, checkpoint_every=0)  # only the interruption saves

    def run(out_dir: Path, **options):
        options = RunOptions(seed=SEED, progress=False, max_steps=12, **options)
        return fit(config, *pairs, vocab_size=VOCAB, out_dir=out_dir, options=options)

    straight, _ = run(tmp_path / "straight")
    step = Trainer.train_step
    # Whatever started pytest decides SIGINT's handler (nohup and background jobs inherit
    # SIG_IGN, a terminal gives Python's default_int_handler): the run must put it back.
    before = signal.getsignal(signal.SIGINT)

    def step_then_signal(self, batch):
        result = step(self, batch)
        if self.state.step == 4:  # the signal arrives during the fifth step
            os.kill(os.getpid(), sig)
        return result

    monkeypatch.setattr(Trainer, "train_step", step_then_signal)
    with pytest.raises(TrainingInterrupted) as info:
        run(tmp_path / "resumed")
    monkeypatch.undo()
    assert info.value.step == 5 and info.value.checkpoint == tmp_path / "resumed" / "last.pt"
    assert torch.load(info.value.checkpoint, weights_only=True)["step"] == 5
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored
    resumed, state = run(tmp_path / "resumed", resume=True)
    assert state.step == 12
    for (name, a), b in zip(
        straight.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


# --- bad inputs: RunOptions ---------------------------------------------------------------------

RUN_OPTIONS_ROWS = [
    ({"max_steps": 0}, ValueError, "max_steps must be at least 1, got 0"),
    ({"max_minutes": 0.0}, ValueError, "max_minutes must be greater than 0.0"),
    ({"seed": -1}, ValueError, "seed must be at least 0"),
    ({"device": "bogus"}, ValueError, "device 'bogus' is not a device name"),
]


@pytest.mark.parametrize(("changes", "error", "phrase"), RUN_OPTIONS_ROWS, ids=str)
def test_run_options_refuse_bad_values(changes, error, phrase):
    raises(lambda: RunOptions(**changes), error, phrase)


@pytest.mark.parametrize(("pays", "compiled"), [(True, False), (True, True), (False, False)])
def test_the_trained_model_draws_cheaper_dropout_masks_where_they_pay_unless_compiled(
    pairs, tmp_path, pays, compiled
):
    """Eager training where cheap masks pay swaps every nn.Dropout for CheapDropout (chapter
    12); compiled training keeps nn.Dropout, since the compiler draws its own random numbers."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "compile", lambda model: model)  # the wiring only, not a compiler
        patch.setattr(trainer, "cheap_masks_pay", lambda device: pays)  # whatever this CPU is
        model, _ = fit(
            CONFIG,
            *pairs,
            vocab_size=VOCAB,
            out_dir=tmp_path,
            options=RunOptions(seed=SEED, progress=False, max_steps=1, compile=compiled),
        )
    dropouts = {type(m) for m in model.modules() if isinstance(m, torch.nn.Dropout)}
    swapped = pays and not compiled
    assert CONFIG.model.dropout > 0 and dropouts == {CheapDropout if swapped else torch.nn.Dropout}


def test_a_recipe_with_steps_decays_to_zero_there_and_stops(pairs, tmp_path):
    train_pairs, val_pairs = pairs
    config = replace(CONFIG, warmup=2, steps=7, epochs=100)
    options = RunOptions(seed=SEED, progress=False)
    _, state = fit(
        config, train_pairs, val_pairs, vocab_size=VOCAB, out_dir=tmp_path, options=options
    )
    assert state.step == 7 and state.stopped_by == "steps"
    lrs = {e["step"]: e["lr"] for e in state.history["train"]}  # logged every 2 steps
    peak = config.lr
    assert lrs[2] == pytest.approx(peak) and lrs[4] == pytest.approx(peak * 3 / 5)
    assert lrs[6] == pytest.approx(peak / 5)


# --- a time limit on a recipe with steps: a shorter schedule, still decayed and averaged --------

BUDGETED = replace(CONFIG, warmup=2, steps=40, epochs=100, average_last=3)
SECONDS_A_STEP, LIMIT_S = 1.0, 30.0  # a machine on which 40 steps do not fit the limit


@pytest.fixture
def slow_machine(monkeypatch):
    """A fake clock that moves only when a step is taken, by SECONDS_A_STEP."""
    now = [0.0]
    monkeypatch.setattr(budget.time, "monotonic", lambda: now[0])
    step = Trainer.train_step

    def timed_step(self, batch):
        now[0] += SECONDS_A_STEP
        return step(self, batch)

    monkeypatch.setattr(Trainer, "train_step", timed_step)


def train_budgeted(pairs, out_dir, **options):
    options = RunOptions(seed=SEED, progress=False, **options)
    return fit(BUDGETED, *pairs, vocab_size=VOCAB, out_dir=out_dir, options=options)


def test_a_time_limit_ends_the_decay_at_the_last_step_that_fits_and_averages_there(
    pairs, tmp_path, slow_machine
):
    _, state = train_budgeted(pairs, tmp_path, max_minutes=LIMIT_S / 60)
    last_step = math.floor((1 - budget.SAFETY) * LIMIT_S / SECONDS_A_STEP)  # 29 of 40
    assert state.step == last_step < BUDGETED.steps and state.stopped_by == "steps"
    saved = torch.load(tmp_path / "last.pt", weights_only=True)
    assert saved["optimizer"]["param_groups"][0]["lr"] == 0.0  # fully decayed
    assert saved["scheduler"]["lr_lambdas"][0]["total"] == last_step  # the plan, to resume
    lrs = {e["step"]: e["lr"] for e in state.history["train"]}
    # Planned at step 4 (the first plan needs two timed log lines): until then the recipe's
    # decay to step 40, from there a straight line to zero after the last step, without a jump.
    assert lrs[4] == BUDGETED.lr * 36 / 38
    assert lrs[6] == pytest.approx(lrs[4] * (last_step - 6) / (last_step - 4))
    after_peak = [lr for step, lr in sorted(lrs.items()) if step >= BUDGETED.warmup]
    assert after_peak == sorted(after_peak, reverse=True)
    # The last average_last checkpoints, the last step's included, are averaged.
    snapshots = RunFolder(tmp_path).snapshots()
    steps = [*range(0, last_step, BUDGETED.checkpoint_every), last_step][-BUDGETED.average_last :]
    assert [snapshot_step(p) for p in snapshots] == steps == [24, 28, 29]
    assert average_checkpoints(snapshots)["averaged_steps"] == steps


def test_a_run_planned_by_a_time_limit_resumes_on_its_plan_exactly(pairs, tmp_path, slow_machine):
    """Stopped at step 10, resumed without a time limit: the plan saved in last.pt ends it at the
    same step, with the same weights and snapshots as the uninterrupted run."""
    straight, state = train_budgeted(pairs, tmp_path / "straight", max_minutes=LIMIT_S / 60)
    train_budgeted(pairs, tmp_path / "resumed", max_minutes=LIMIT_S / 60, max_steps=10)
    resumed, resumed_state = train_budgeted(pairs, tmp_path / "resumed", resume=True)
    assert resumed_state.step == state.step < BUDGETED.steps
    assert resumed_state.stopped_by == "steps"
    for (name, a), b in zip(
        straight.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    steps = [
        [snapshot_step(p) for p in RunFolder(tmp_path / run).snapshots()]
        for run in ("straight", "resumed")
    ]
    assert steps[0] == steps[1]
