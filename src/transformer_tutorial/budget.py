"""Chapter 10: a run's budget — when training stops, the seconds it has trained, and, under a
time limit, the last step of a schedule that has one.

A recipe with ``steps`` decays its learning rate to zero at its last step
(:class:`~transformer_tutorial.optim.LinearDecay`). Under a time limit (``--max-minutes``) the
budget measures the pace of the steps as the run goes and ends the decay at the last step the
time holds, when that comes first (:meth:`Budget.plan`): a slower machine gets a shorter run
that still ends decayed, instead of one cut off at a high learning rate.
"""

from __future__ import annotations

import math
import time
from collections import deque

from transformer_tutorial import distributed
from transformer_tutorial.optim import LinearDecay

# The share of the time limit a plan leaves unused: room for what the pace of the recent steps
# does not foresee (a validation, a checkpoint, a machine that slows down). 3% of an hour is
# 108 s; the reference run's 3,600 steps took 57.0 min of it, inside the 58.2 a plan may use.
SAFETY = 0.03
# How many of the trainer's plans (one each ``log_every`` steps) the pace is measured over: a
# window of the recent steps, so a machine that slows down is seen within a few hundred steps.
PACE_WINDOW = 10


class Budget:
    """The limits of one session of a run: ``max_steps`` optimizer steps in all, ``max_minutes``
    of this session (None: no limit), and the last step of ``decay``, the schedule of a recipe
    with ``steps`` (None: the paper's, which has no end). Its clock starts now;
    ``seconds_before`` are the training seconds of the run's earlier sessions."""

    def __init__(
        self,
        *,
        max_steps: int | None = None,
        max_minutes: float | None = None,
        decay: LinearDecay | None = None,
        seconds_before: float = 0.0,
    ) -> None:
        self.max_steps, self.max_minutes, self.decay = max_steps, max_minutes, decay
        self.started, self.seconds_before = time.monotonic(), seconds_before
        seconds = math.inf if max_minutes is None else 60 * max_minutes
        self.deadline = self.started + seconds
        self.planned_end = self.started + (1 - SAFETY) * seconds  # where a plan ends its steps
        self.marks: deque[tuple[int, float]] = deque(maxlen=PACE_WINDOW)  # (step, time)

    def elapsed(self) -> float:
        """Seconds of training in this run, earlier sessions of a resumed run included."""
        return self.seconds_before + time.monotonic() - self.started

    def stop_reason(self, step: int, *, interrupted: bool) -> str:
        """Why training stops after ``step`` optimizer steps, or ``""`` to go on: a stop request,
        the step limit, the schedule's last step, the time limit (the first that holds)."""
        if interrupted:
            reason = "interrupted"
        elif self.max_steps is not None and step >= self.max_steps:
            reason = "max_steps"
        elif self.decay is not None and step >= self.decay.total:
            reason = "steps"  # the schedule has reached zero
        else:
            reason = "max_minutes" if time.monotonic() >= self.deadline else ""
        return reason

    def last_step_in_time(self, step: int) -> int | None:
        """The last step the time limit holds, after ``step`` steps: as many more as fit before
        :data:`SAFETY` of the limit is left, at the pace of the steps since the oldest of the
        last :data:`PACE_WINDOW` calls. None without a time limit, and at a session's first
        call (nothing timed yet)."""
        if self.max_minutes is None:
            return None
        now = time.monotonic()
        self.marks.append((step, now))
        first_step, first_time = self.marks[0]
        if step == first_step:
            return None
        seconds_a_step = (now - first_time) / (step - first_step)
        return step + math.floor((self.planned_end - now) / seconds_a_step)

    def plan(self, step: int, *, steps: int | None) -> None:
        """Under a time limit, end the decay at :meth:`last_step_in_time` — never past the
        recipe's ``steps``, and after one more step and the warm-up at least — the same step on
        every rank. The trainer calls it once each ``log_every`` steps."""
        if steps is None or self.decay is None or step >= self.decay.total:  # none, or reached
            return
        in_time = self.last_step_in_time(step)
        if in_time is None:
            return
        last = min(steps, max(in_time, step + 1, self.decay.warmup + 1))
        last = min(distributed.all_gather_object(last))  # every rank's plan: the earliest
        if last != self.decay.total:
            self.decay.end_at(step, last)
