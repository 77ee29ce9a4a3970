"""Chapter 10: the training loop — batches, steps, validation, resumable checkpoints.

:class:`Trainer` is handed a model (a :class:`~transformer_tutorial.model.Transformer`), a
recipe (:class:`~transformer_tutorial.configs.TrainConfig`), encoded pairs of id sequences and
its options, and writes into a :class:`~transformer_tutorial.run_folder.RunFolder`:

- ``last.pt``: everything needed to resume (weights, optimizer, schedule, :class:`TrainState`,
  random number generators), saved every ``checkpoint_every`` steps and when training stops;
- ``best.pt``: the weights with the lowest validation loss so far;
- ``snapshots/``: with ``config.average_last`` above 1, the weights of the last
  ``average_last`` checkpoints, to average.

:func:`fit` builds the recipe's model and hands it over. The losses come from
:mod:`~transformer_tutorial.pair_loss`, :class:`TrainState` from ``train_state``, when to stop
(and, under a time limit, the last step of a recipe's schedule) from ``budget``.

It also runs as one of several processes under ``torchrun`` (chapter 12,
:mod:`~transformer_tutorial.distributed`): each rank trains on its share of the batches, the
loss is normalised over the global batch, and only rank 0 validates and writes files.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from transformer_tutorial import distributed
from transformer_tutorial.allocator import keep_freed_memory
from transformer_tutorial.budget import Budget
from transformer_tutorial.checkpoint import load_checkpoint, restore_rng_states, rng_states
from transformer_tutorial.configs import RunOptions, TrainConfig
from transformer_tutorial.data import pair_lengths, token_batches
from transformer_tutorial.dropout import cheap_masks_pay, with_cheap_dropout
from transformer_tutorial.model import Transformer
from transformer_tutorial.optim import make_optimizer
from transformer_tutorial.pair_loss import Pairs, batch_loss, check_pair_ids, evaluate_loss
from transformer_tutorial.precision import grad_scaler, resolve_precision
from transformer_tutorial.run_folder import RunFolder
from transformer_tutorial.runtime import StopRequest, catch_stop_signals, set_seed
from transformer_tutorial.train_state import TrainingInterrupted, TrainState


class Trainer:
    """One training run of ``model`` with the recipe ``config`` on ``train_pairs``, as ``options``
    say, into ``folder`` (:meth:`fit` runs it); on a CPU where cheaper dropout masks pay
    (:mod:`~transformer_tutorial.dropout`), ``model``'s dropouts are swapped for them in place,
    and on any CPU the process keeps freed memory for the next step
    (:mod:`~transformer_tutorial.allocator`)."""

    def __init__(
        self,
        model: Transformer,
        config: TrainConfig,
        train_pairs: Pairs,
        val_pairs: Pairs,
        *,
        folder: RunFolder | Path | str,
        options: RunOptions,
        tokenizer_file: str | None = None,
    ) -> None:
        self.config, self.train_pairs, self.val_pairs = config, train_pairs, val_pairs
        self.folder = folder if isinstance(folder, RunFolder) else RunFolder(Path(folder))
        self.options, self.tokenizer_file = options, tokenizer_file
        self.device = device = torch.device(options.device)
        self.rank, self.world_size = distributed.rank(), distributed.world_size()
        self.model = model.to(device)
        for name, pairs in (("train_pairs", train_pairs), ("val_pairs", val_pairs)):
            check_pair_ids(name, pairs, self.model.config)
        self.precision = resolve_precision(options.precision, device)
        self.scaler = grad_scaler(self.precision, device)
        self.optimizer, self.schedule = make_optimizer(
            self.model, lr=config.lr, warmup=config.warmup, total_steps=config.steps
        )
        # What the training step calls: the model, wrapped for DDP and compiled where asked; the
        # plain self.model is what checkpoints save (no wrapper prefixes) and validation runs.
        if cheap_masks_pay(device) and not options.compile:
            with_cheap_dropout(self.model)
        if device.type == "cpu":  # each step's large tensors reuse pages instead of faulting
            keep_freed_memory()
        self.train_model: nn.Module = self.model
        if self.world_size > 1:
            ids = [device.index] if device.type == "cuda" else None
            self.train_model = DistributedDataParallel(self.model, device_ids=ids)
            torch.manual_seed(options.seed + self.rank)  # same initial weights, own dropout masks
        if options.compile:
            self.train_model = torch.compile(self.train_model)
        self.batch_order = torch.Generator().manual_seed(options.seed)
        self.state = TrainState(epoch_start=self.batch_order.get_state())
        # The loss and token sums of the steps not yet added to self.state: they stay on the
        # device, read back once per log_every steps (each read makes the host wait for it).
        self.unread = torch.zeros(2, device=device)
        self.lengths = pair_lengths(train_pairs)
        self.budget = Budget(  # decay: a recipe's optim.LinearDecay, whose end it may move
            max_steps=options.max_steps,
            max_minutes=options.max_minutes,
            decay=self.schedule.lr_lambdas[0] if config.steps is not None else None,
        )
        self.stop_request = StopRequest()  # Ctrl-C or SIGTERM: stop after the current step

    def resume(self) -> None:
        """Continue from the folder's ``last.pt`` exactly where it stopped."""
        saved = load_checkpoint(self.folder.last)
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.schedule.load_state_dict(saved["scheduler"])
        if saved.get("scaler") and self.scaler.is_enabled():  # fp16 then and now
            self.scaler.load_state_dict(saved["scaler"])
        self.state = TrainState(**saved["state"])
        rank_rng = saved.get("rank_rng", [])
        if len(rank_rng) == self.world_size:
            restore_rng_states(rank_rng[self.rank])
        else:  # saved by a single process or another number of ranks
            restore_rng_states(saved["rng"])
            if self.rank:
                torch.manual_seed(self.options.seed + self.rank + self.state.step)
        self.budget.seconds_before = self.state.train_seconds
        if self.rank == 0:  # the run goes on: the snapshot of where it stopped was off schedule
            self.folder.drop_snapshots_off_schedule(self.state.step, self.config.checkpoint_every)

    def _checkpoint(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "model_config": asdict(self.model.config),
            "train_config": asdict(self.config),
            "tokenizer": self.tokenizer_file,
            "step": self.state.step,
            "epochs_completed": self.state.epoch,
        }

    def save_last(self) -> None:
        """Write ``last.pt``, all that resuming needs: each rank sends its RNG states, 0 writes."""
        self.read_losses()
        self.state.train_seconds = self.budget.elapsed()
        rank_rng = distributed.all_gather_object(rng_states())
        if self.rank:
            return
        extra = {"rank_rng": rank_rng} if self.world_size > 1 else {}
        self.folder.save(
            {
                **self._checkpoint(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.schedule.state_dict(),
                "scaler": self.scaler.state_dict(),
                "precision": self.precision,
                "state": asdict(self.state),
                "rng": rank_rng[0],
                **extra,
            },
            self.folder.last,
        )

    def save_snapshot(self) -> None:
        """Keep this step's weights in ``snapshots/`` for averaging, and the newest
        ``config.average_last`` of them only (rank 0 writes; nothing when it is 1)."""
        if self.config.average_last < 2 or self.rank:
            return
        self.folder.save_snapshot(
            self._checkpoint(), self.state.step, keep=self.config.average_last
        )

    def validate(self) -> float:
        """The validation loss now (rank 0; NaN on the others); ``best.pt`` when it is lowest."""
        if self.rank:
            return math.nan
        state = self.state
        val_loss = evaluate_loss(
            self.model,
            self.val_pairs,
            max_tokens=self.config.max_tokens,
            label_smoothing=self.config.label_smoothing,
            device=self.device,
            precision=self.precision,
        )
        state.log("val", self.budget.elapsed(), val_loss=val_loss)
        if val_loss < state.best_val_loss:
            state.best_val_loss = val_loss
            self.folder.save({**self._checkpoint(), "val_loss": val_loss}, self.folder.best)
        return val_loss

    def train_step(self, batch: Sequence[int]) -> tuple[Tensor, Tensor]:
        """One optimizer step on the pairs ``batch`` (this rank's share of the global batch);
        returns the global batch's summed loss and target tokens, left on the device."""
        loss_sum, tokens = batch_loss(
            self.train_model,
            [self.train_pairs[i] for i in batch],
            label_smoothing=self.config.label_smoothing,
            device=self.device,
            precision=self.precision,
        )
        # The mean over the target tokens of the global batch: DDP averages the ranks' gradients,
        # so each rank's sum is scaled by world_size / global tokens (1 / tokens on one process).
        totals = torch.stack([loss_sum.detach(), torch.full_like(loss_sum, tokens)])
        global_loss_sum, global_tokens = distributed.all_reduce_sum(totals)  # no read back
        loss = loss_sum * (self.world_size / global_tokens)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()  # fp16: the loss scaled up so gradients stay > 0
        self.scaler.unscale_(self.optimizer)  # true gradients again, before clipping them
        nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip_norm)
        self.scaler.step(self.optimizer)  # fp16: skipped when a gradient overflowed
        self.scaler.update()
        self.schedule.step()
        return global_loss_sum, global_tokens

    def read_losses(self) -> None:
        """Add the unread steps' loss and token sums to the state: one read from the device."""
        loss_sum, tokens = self.unread.tolist()
        self.state.add_loss(loss_sum, round(tokens))
        self.unread.zero_()

    def _after_step(self, bar: tqdm) -> None:
        """Log, validate and checkpoint on the config's schedule."""
        config, state = self.config, self.state
        if state.step % config.log_every == 0:
            self.read_losses()
            lr = self.schedule.get_last_lr()[0]
            train_loss = state.log_window(self.budget.elapsed(), lr=lr)
            bar.set_postfix(loss=f"{train_loss:.3f}")
            self.budget.plan(state.step, steps=config.steps)  # under a time limit
        if config.eval_every and state.step % config.eval_every == 0:
            self.validate()
        if config.checkpoint_every and state.step % config.checkpoint_every == 0:
            self.save_snapshot()  # first: a crash before last.pt redoes the step, and its snapshot
            self.save_last()

    def _end_epoch(self, progress: bool) -> None:
        self.read_losses()
        state, val_loss = self.state, self.validate()
        elapsed, next_start = self.budget.elapsed(), self.batch_order.get_state()
        epoch_loss = state.end_epoch(elapsed, val_loss=val_loss, next_start=next_start)
        if progress:
            tqdm.write(
                f"epoch {state.epoch}: step {state.step}, train loss "
                f"{epoch_loss:.3f}, val loss {val_loss:.3f}, {elapsed / 60:.1f} min"
            )

    def run_epoch(self, should_stop: Callable[[], str], progress: bool) -> str:
        """Train the rest of the current epoch, or until ``should_stop()`` names a reason;
        returns that reason, or ``""`` when the epoch ended."""
        state = self.state
        self.batch_order.set_state(state.epoch_start)
        batches = distributed.shard_batches(
            token_batches(self.lengths, self.config.max_tokens, generator=self.batch_order),
            rank=self.rank,
            world_size=self.world_size,
        )
        stopped_by = ""
        with tqdm(
            total=len(batches),
            initial=state.batch_in_epoch,
            leave=False,
            desc=f"epoch {state.epoch + 1}",
            disable=not progress,
            dynamic_ncols=True,
        ) as bar:
            for batch in batches[state.batch_in_epoch :]:
                self.unread += torch.stack(self.train_step(batch))
                state.step += 1
                state.batch_in_epoch += 1
                bar.update()
                self._after_step(bar)
                stopped_by = should_stop()
                if stopped_by:
                    break
        if state.batch_in_epoch == len(batches):
            self._end_epoch(progress)
        return stopped_by

    def fit(self) -> TrainState:
        """Train until ``config.epochs`` or ``config.steps`` (or the last step ``max_minutes``
        holds, :meth:`Budget.plan`) or the options' ``max_steps`` or ``max_minutes``, then
        validate and save ``last.pt``."""
        state, options = self.state, self.options

        def should_stop() -> str:
            reason = self.budget.stop_reason(
                state.step, interrupted=bool(self.stop_request.reason)
            )
            return distributed.agree_on_stop(reason, self.device)  # every rank stops together

        self.model.train()
        progress = options.progress and self.rank == 0
        # A resumed run may already be at a step limit; a time budget always gets one step.
        limited = options.max_steps is not None or self.config.steps is not None
        stopped_by = should_stop() if limited else ""
        with catch_stop_signals(self.stop_request):
            while not stopped_by and state.epoch < self.config.epochs:
                stopped_by = self.run_epoch(should_stop, progress)
                if not stopped_by:
                    self.save_last()
        if stopped_by == "interrupted":
            self.save_last()
            raise TrainingInterrupted(state.step, self.folder.last)
        if not state.history["val"] or state.history["val"][-1]["step"] != state.step:
            self.validate()
        self.save_snapshot()
        self.save_last()
        state.stopped_by = stopped_by or "epochs"
        return state


def fit(
    config: TrainConfig,
    train_pairs: Pairs,
    val_pairs: Pairs,
    *,
    vocab_size: int,
    out_dir: Path | str,
    options: RunOptions = RunOptions(),
    tokenizer_file: str | None = None,
) -> tuple[Transformer, TrainState]:
    """Train a new model of ``config`` for ``vocab_size`` tokens (seeded by ``options.seed``) on
    ``train_pairs`` as ``options`` say; checkpoint into ``out_dir``, always ending with a
    validation loss and a saved ``last.pt``.

    Returns:
        The model (last weights) and the :class:`TrainState`.
    """
    folder = RunFolder(Path(out_dir))
    folder.create()
    set_seed(options.seed)  # the same initial weights on every rank
    model = Transformer(config.model_config(vocab_size))
    trainer = Trainer(
        model,
        config,
        train_pairs,
        val_pairs,
        folder=folder,
        options=options,
        tokenizer_file=tokenizer_file,
    )
    if options.resume:
        trainer.resume()
    return trainer.model, trainer.fit()
