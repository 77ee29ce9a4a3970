"""Chapter 10, a run's budget: which limit stops training first, and the last step a time limit
holds, measured at the pace of the recent steps on a fake clock. The whole run under a time
limit (decayed to zero, averaged, resumed) is tested in ``test_trainer.py``."""

from __future__ import annotations

import math

import pytest

from transformer_tutorial import budget
from transformer_tutorial.budget import PACE_WINDOW, SAFETY, Budget
from transformer_tutorial.optim import LinearDecay


@pytest.fixture
def clock(monkeypatch):
    """The seconds the budget reads: set ``clock[0]`` to move time."""
    now = [0.0]
    monkeypatch.setattr(budget.time, "monotonic", lambda: now[0])
    return now


def test_the_first_limit_that_holds_names_the_stop(clock):
    limits = Budget(max_steps=10, max_minutes=1.0, decay=LinearDecay(warmup=2, total=8))
    assert limits.stop_reason(5, interrupted=False) == ""
    assert limits.stop_reason(8, interrupted=False) == "steps"
    assert limits.stop_reason(10, interrupted=False) == "max_steps"
    assert limits.stop_reason(10, interrupted=True) == "interrupted"
    clock[0] = 60.0
    assert limits.stop_reason(5, interrupted=False) == "max_minutes"
    assert Budget().stop_reason(10**9, interrupted=False) == ""  # no limit at all


def test_elapsed_counts_the_earlier_sessions_too(clock):
    clock[0] = 100.0
    session = Budget(seconds_before=42.0)
    clock[0] = 103.5
    assert session.elapsed() == 45.5


def test_the_last_step_in_time_is_measured_at_the_pace_of_the_recent_steps(clock):
    limits = Budget(max_minutes=10.0)  # 600 s; a plan ends at 582
    assert limits.last_step_in_time(0) is None  # nothing timed yet
    clock[0] = 20.0  # 20 steps in 20 s
    assert limits.last_step_in_time(20) == 20 + math.floor((1 - SAFETY) * 600 - 20)
    for step in range(40, 20 * (PACE_WINDOW + 1), 20):  # the machine slows to 3 s a step
        clock[0] += 60.0
        in_time = limits.last_step_in_time(step)
    # The window has forgotten the fast steps: what is left, at 3 s a step.
    assert in_time == step + math.floor(((1 - SAFETY) * 600 - clock[0]) / 3.0)
    assert Budget().last_step_in_time(5) is None  # no time limit


def test_a_plan_stays_within_the_recipe_and_after_the_warm_up(clock):
    decay = LinearDecay(warmup=10, total=100)
    limits = Budget(max_minutes=1.0, decay=decay)  # a plan ends its steps at 58.2 s
    limits.plan(0, steps=100)
    clock[0] = 4.0
    limits.plan(4, steps=100)  # 1 s a step: 54 more
    assert decay.total == 4 + math.floor((1 - SAFETY) * 60 - 4) == 58
    clock[0] = 5.0
    limits.plan(40, steps=100)  # 1/8 s a step: 40 + 425 would pass the recipe's end
    assert decay.total == 100
    slow = LinearDecay(warmup=10, total=100)
    limits = Budget(max_minutes=1.0, decay=slow)
    limits.plan(0, steps=100)
    clock[0] = 56.0
    limits.plan(2, steps=100)  # 28 s a step: no more fit, yet the warm-up's end comes first
    assert slow.total == 11
    clock[0] = 80.0
    limits.plan(11, steps=100)  # the end reached: it stays
    assert slow.total == 11
    untimed = LinearDecay(warmup=10, total=100)
    limits = Budget(max_steps=50, decay=untimed)  # no time limit: the recipe's end
    limits.plan(0, steps=100)
    clock[0] = 1000.0
    limits.plan(20, steps=100)
    assert untimed.total == 100
