"""Chapter 28: GRPO on digit reversal, with a verifiable reward and one a policy can game.

The task is chapter 9's: reverse a string of :data:`LENGTHS` digits. A prompt is the digits
and ``>``; the right completion is the digits reversed and ``<eos>``. A tiny decoder-only
model (:data:`CONFIG`) is first trained for a few steps with the supervised loss on the
answer's tokens (:func:`supervised_warmup`), enough to be right now and then; GRPO
(:mod:`~transformer_tutorial.tuning.grpo`) then trains it against a reward
(:func:`train_grpo`), with a frozen copy as the reference of the KL term. Two rewards
(:data:`REWARDS`):

* ``"exact"`` (:func:`exact_match`): 1 if the completion is the reversed digits and
  ``<eos>``, else 0 — verifiable, and with nothing to game;
* ``"recall"`` (:func:`digit_recall`): the share of the answer's digits found anywhere in the
  completion — no check of length or order, as lazy verifiers often are. Emitting every digit,
  many times, scores 1: the policy learns to fill its whole budget (reward hacking).

Each step records the mean reward, the share of exact matches among the samples, the mean
completion length, the share that ran out of budget without ``<eos>`` and the k3 KL to the
reference; every :data:`EVERY` steps, greedy exact match on held-out prompts. ``python -m
transformer_tutorial.tuning.grpo_run --out FILE --max-minutes N`` writes the record.

Shapes: prompts ``(N, L + 1)``; samples as
:class:`~transformer_tutorial.tuning.grpo.GroupSample`.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer_tutorial.checks import ArgumentParser, check_choice, check_int, number_arg
from transformer_tutorial.lm.config import LLAMA, LMConfig
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.sampling import generate
from transformer_tutorial.provenance import finish_record, start_record
from transformer_tutorial.records import shipped_record
from transformer_tutorial.tuning.grpo import (
    completion_logprobs,
    completion_mask,
    group_advantages,
    grpo_loss,
    k3_kl,
    sample_group,
)

PAD, EOS, SEP = 0, 1, 2  # then the digits 0-9 as ids 3-12
DIGIT0 = 3
CONFIG = dict(
    LLAMA,
    vocab_size=DIGIT0 + 10,
    d_model=64,
    n_heads=4,
    n_layers=2,
    d_ff=128,
    max_len=24,
    dropout=0.0,
)
LENGTHS = (3, 6)  # the fewest and most digits of a prompt
BUDGET = 10  # max_new_tokens of a completion: room for 6 digits, <eos>, and more
GROUP = 8  # G completions of each prompt
PROMPTS = 8  # prompts a step
WARMUP_STEPS = 150  # supervised steps before GRPO
STEPS = 600
EVERY = 10  # steps between two held-out measurements
HELD_OUT = 256  # held-out prompts
SETTINGS = dict(beta=0.04, epsilon_low=0.2, epsilon_high=0.28, loss_type="dr_grpo")
ITERATIONS = 2  # updates on each sampled batch (TRL's num_iterations): the clip has work to do
LR = 3e-4
MEASURES = ("reward", "exact", "length", "truncated", "kl")  # recorded at each step
RECORD_FILE = "results/grpo_digits/record.json"  # the record, shipped with the package


def prompts(n: int, length: int, generator: torch.Generator) -> Tensor:
    """``n`` prompts of ``length`` random digits and ``>`` ``(n, length + 1)``."""
    digits = torch.randint(DIGIT0, DIGIT0 + 10, (n, length), generator=generator)
    return torch.cat([digits, torch.full((n, 1), SEP)], dim=1)


def answers(prompt_ids: Tensor) -> Tensor:
    """The right completions of ``prompt_ids``: the digits reversed and ``<eos>``."""
    reversed_digits = prompt_ids[:, :-1].flip(1)
    return torch.cat([reversed_digits, torch.full_like(reversed_digits[:, :1], EOS)], dim=1)


def _completions(completion_ids: Tensor, completion_mask: Tensor) -> list[list[int]]:
    return [ids[mask].tolist() for ids, mask in zip(completion_ids, completion_mask, strict=True)]


def exact_match(prompt_ids: Tensor, completion_ids: Tensor, completion_mask: Tensor) -> Tensor:
    """1.0 where the completion is exactly the reversed digits and ``<eos>``, else 0.0
    ``(B,)``."""
    wanted = answers(prompt_ids).tolist()
    got = _completions(completion_ids, completion_mask)
    return torch.tensor([float(w == g) for w, g in zip(wanted, got, strict=True)])


def digit_recall(prompt_ids: Tensor, completion_ids: Tensor, completion_mask: Tensor) -> Tensor:
    """The share of the answer's digits (counted with repeats) found anywhere in the completion
    ``(B,)``: no check of order or length — the reward a policy learns to game."""
    scores = []
    got_all = _completions(completion_ids, completion_mask)
    for prompt, got in zip(prompt_ids[:, :-1].tolist(), got_all, strict=True):
        found = sum(min(prompt.count(d), got.count(d)) for d in set(prompt))
        scores.append(found / len(prompt))
    return torch.tensor(scores)


REWARDS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "exact": exact_match,
    "recall": digit_recall,
}


def supervised_warmup(
    model: LanguageModel, steps: int, generator: torch.Generator, *, lr: float = 3e-3
) -> list[float]:
    """Train ``model`` for ``steps`` steps on the answer's tokens only (cross-entropy of the
    reversed digits and ``<eos>`` given the prompt); the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    model.train()
    for _ in range(steps):
        length = int(torch.randint(LENGTHS[0], LENGTHS[1] + 1, (1,), generator=generator))
        prompt = prompts(32, length, generator)
        answer = answers(prompt)
        logits = model(torch.cat([prompt, answer], dim=1))  # (B, P + A, V)
        predicted = logits[:, prompt.size(1) - 1 : -1]  # (B, A, V): the answer's scores
        loss = F.cross_entropy(predicted.flatten(0, 1), answer.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(round(loss.item(), 4))
    return losses


@torch.no_grad()
def held_out_accuracy(model: LanguageModel, held_out: list[Tensor]) -> float:
    """Greedy exact match on held-out prompts (one tensor a length)."""
    model.eval()
    right, total = 0, 0
    for prompt in held_out:
        ids = generate(model, prompt, BUDGET, greedy=True, eos_id=EOS, pad_id=PAD)
        completion = ids[:, prompt.size(1) :]
        right += int(exact_match(prompt, completion, completion_mask(completion, EOS)).sum())
        total += prompt.size(0)
    return right / total


def held_out_prompts(seed: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed + 1000)
    n = LENGTHS[1] - LENGTHS[0] + 1
    return [prompts(HELD_OUT // n, length, g) for length in range(LENGTHS[0], LENGTHS[1] + 1)]


def warmed_up_model(seed: int = 0, *, steps: int = WARMUP_STEPS) -> LanguageModel:
    """A model of :data:`CONFIG` after :func:`supervised_warmup` (the same for a seed)."""
    torch.manual_seed(seed)
    model = LanguageModel(LMConfig(**CONFIG))
    supervised_warmup(model, steps, torch.Generator().manual_seed(seed))
    return model


def train_grpo(
    model: LanguageModel,
    reward: str,
    *,
    steps: int = STEPS,
    seed: int = 0,
    every: int = EVERY,
    lr: float = LR,
    deadline: float | None = None,
    **settings,
) -> dict:
    """Train ``model`` in place with GRPO against ``REWARDS[reward]`` for ``steps`` steps
    (fewer if ``time.monotonic()`` passes ``deadline``), a frozen copy of it the reference.
    ``settings``: :func:`~transformer_tutorial.tuning.grpo.grpo_loss`'s (default
    :data:`SETTINGS`).

    Returns ``{"reward", "steps", "per_step": {"reward", "exact", "length", "truncated",
    "kl"} (lists, one value a step), "held_out": [{"step", "exact"}] every ``every`` steps}``.
    """
    check_choice("reward", reward, REWARDS)
    check_int("steps", steps, at_least=1)
    check_int("every", every, at_least=1)
    settings = {**SETTINGS, **settings}
    score = REWARDS[reward]
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    held_out = held_out_prompts(seed)
    per_step: dict[str, list[float]] = {k: [] for k in MEASURES}
    evaluations = [{"step": 0, "exact": held_out_accuracy(model, held_out)}]
    done = 0
    for step in range(1, steps + 1):
        if deadline is not None and time.monotonic() > deadline:
            break
        length = int(torch.randint(LENGTHS[0], LENGTHS[1] + 1, (1,), generator=generator))
        model.eval()
        sample = sample_group(
            model, prompts(PROMPTS, length, generator), GROUP, BUDGET, eos_id=EOS, pad_id=PAD,
            generator=generator,
        )  # fmt: skip
        mask = sample.completion_mask
        rewards = score(sample.prompt_ids, sample.completion_ids, mask)
        advantages = group_advantages(rewards, GROUP)
        with torch.no_grad():
            ref = completion_logprobs(reference, sample.prompt_ids, sample.completion_ids)
        model.train()
        for _ in range(ITERATIONS):
            logprobs = completion_logprobs(model, sample.prompt_ids, sample.completion_ids)
            loss = grpo_loss(
                logprobs, sample.logprobs, advantages, mask, ref_logprobs=ref,
                max_completion_length=BUDGET, **settings,
            )  # fmt: skip
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        kl = k3_kl(sample.logprobs, ref)[mask].mean()  # at the sampling policy
        lengths = mask.sum(1).float()
        ended = (sample.completion_ids == EOS).any(1)
        per_step["reward"].append(round(rewards.mean().item(), 4))
        per_step["exact"].append(
            round(exact_match(sample.prompt_ids, sample.completion_ids, mask).mean().item(), 4)
        )
        per_step["length"].append(round(lengths.mean().item(), 3))
        per_step["truncated"].append(round(1 - ended.float().mean().item(), 4))
        per_step["kl"].append(round(kl.item(), 5))
        done = step
        if step % every == 0:
            evaluations.append({"step": step, "exact": held_out_accuracy(model, held_out)})
    return {"reward": reward, "steps": done, "per_step": per_step, "held_out": evaluations}


def run(*, seeds: Sequence[int] = (0,), steps: int = STEPS, deadline: float | None = None) -> dict:
    """Both rewards from the same warmed-up model, for each seed: the record's ``"runs"``
    (``{reward: [one train_grpo result a seed]}``)."""
    runs: dict[str, list[dict]] = {name: [] for name in REWARDS}
    for seed in seeds:
        start = warmed_up_model(seed)
        for name in REWARDS:
            model = copy.deepcopy(start)
            result = train_grpo(model, name, steps=steps, seed=seed, deadline=deadline)
            runs[name].append(result | {"seed": seed})
    return runs


def load_grpo_record() -> dict:
    """The record shipped with the package (see ``results/grpo_digits``)."""
    return shipped_record(RECORD_FILE)


def main(argv: Sequence[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--max-minutes", type=number_arg(low=0.0, low_open=True), default=20.0)
    args = parser.parse_args(argv)
    record = start_record("transformer_tutorial.tuning.grpo_run")
    start = time.process_time()
    deadline = time.monotonic() + 60 * args.max_minutes
    record |= {
        "config": CONFIG,
        "settings": SETTINGS,
        "iterations": ITERATIONS,
        "lr": LR,
        "group": GROUP,
        "prompts_per_step": PROMPTS,
        "budget": BUDGET,
        "lengths": list(LENGTHS),
        "warmup_steps": WARMUP_STEPS,
    }
    record["runs"] = run(seeds=args.seeds, steps=args.steps, deadline=deadline)
    record["cpu_seconds"] = round(time.process_time() - start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(finish_record(record), indent=1) + "\n")


if __name__ == "__main__":
    main()
