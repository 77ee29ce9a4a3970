"""Chapter 28: learning from rewards — GRPO's group sampling, advantages and clipped loss.

Group Relative Policy Optimisation (Shao et al. 2024) needs no value network: each prompt is
answered ``G`` times by the policy being trained (:func:`sample_group`), each answer is scored
by a reward function, and an answer's *advantage* is its reward measured against its own
group's (:func:`group_advantages`). The loss (:func:`grpo_loss`) is PPO's clipped surrogate
per token, plus β times the k3 estimate of the KL divergence to a frozen reference model
(:func:`k3_kl`), summed over the completion tokens in one of the ways TRL's ``loss_type`` names
(:data:`LOSS_TYPES`). Every piece equals TRL 1.16's ``GRPOTrainer`` on the same inputs
(``tests/test_tuning_grpo.py``).

Shapes: ``B`` completions (``B = prompts · G``, each prompt's ``G`` answers next to each
other), ``P`` prompt length, ``T`` completion length (padded on the right, ``completion_mask``
True at the real tokens, the ``<eos>`` included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer_tutorial.checks import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_optional_int,
    check_tensor,
)
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.sampling import generate

# How group_advantages divides: by each group's standard deviation (GRPO), by the whole
# batch's (Hu et al.'s REINFORCE++ style), or not at all (Dr. GRPO: the division favours
# groups whose rewards barely differ, with a 0/1 reward the prompts nearly always solved or
# nearly always failed). TRL's scale_rewards.
SCALE_REWARDS = ("group", "batch", "none")
# How grpo_loss turns per-token losses into one number (TRL's loss_type): "grpo" averages each
# completion's tokens, then the completions (a long answer's tokens weigh less); "bnpo" and
# "dapo" average all the batch's tokens at once (they differ in TRL only when one generation
# batch is split, over gradient-accumulation steps or processes: "dapo" then divides by the
# whole generation batch's tokens, "bnpo" by each piece's); "dr_grpo" divides the sum by B
# times a fixed max_completion_length, so no length is favoured.
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
STD_EPS = 1e-4  # added to the standard deviation, as TRL does


@dataclass(frozen=True)
class GroupSample:
    """``G`` sampled completions of each prompt, as the loss reads them.

    ``prompt_ids`` ``(B, P)``, ``completion_ids`` ``(B, T)`` (padded after ``<eos>``),
    ``completion_mask`` ``(B, T)`` bool (True: a sampled token, the ``<eos>`` included) and
    ``logprobs`` ``(B, T)``: the sampling policy's log-probability of each token (0 at
    padding), the "old" log-probabilities of the clipped ratio.
    """

    prompt_ids: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    logprobs: Tensor


def completion_logprobs(
    model: LanguageModel, prompt_ids: Tensor, completion_ids: Tensor, *, temperature: float = 1.0
) -> Tensor:
    """The log-probability of each completion token given everything before it, ``(B, T)``,
    from one forward pass over prompt and completion (the logits divided by ``temperature``,
    as the sampler's were). Padding after ``<eos>`` gets numbers too: mask them."""
    check_tensor("prompt_ids", prompt_ids, kind="int", dims=2, shape="(B, P)")
    check_tensor("completion_ids", completion_ids, kind="int", dims=2, shape="(B, T)")
    check_number("temperature", temperature, low=0.0, low_open=True)
    if prompt_ids.size(0) != completion_ids.size(0):
        raise ValueError(
            f"prompt_ids and completion_ids must have as many rows, got {prompt_ids.size(0)} "
            f"and {completion_ids.size(0)}"
        )
    P, T = prompt_ids.size(1), completion_ids.size(1)
    logits = model(torch.cat([prompt_ids, completion_ids], dim=1))  # (B, P + T, V)
    logits = logits[:, P - 1 : P + T - 1] / temperature  # (B, T, V): the scores of each token
    return F.log_softmax(logits, dim=-1).gather(-1, completion_ids[..., None]).squeeze(-1)


def completion_mask(completion_ids: Tensor, eos_id: int) -> Tensor:
    """True at each completion's real tokens ``(B, T)``: up to and including its first
    ``eos_id`` (all of it when it has none)."""
    is_eos = (completion_ids == eos_id).long()
    return (is_eos.cumsum(1) - is_eos) == 0  # no <eos> before this token


@torch.no_grad()
def sample_group(
    model: LanguageModel,
    prompt_ids: Tensor,
    group_size: int,
    max_new_tokens: int,
    *,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> GroupSample:
    """Sample ``group_size`` completions of each prompt ``(N, P)`` (no padding), each prompt's
    next to each other (``B = N · group_size`` rows), with the log-probabilities the sampling
    policy gave them (``model`` in ``eval()``)."""
    check_int("group_size", group_size, at_least=1)
    prompts = prompt_ids.repeat_interleave(group_size, dim=0)  # (B, P)
    ids = generate(
        model,
        prompts,
        max_new_tokens,
        temperature=temperature,
        eos_id=eos_id,
        pad_id=pad_id,
        generator=generator,
    )
    completion = ids[:, prompts.size(1) :]  # (B, T)
    mask = completion_mask(completion, eos_id)
    logprobs = completion_logprobs(model, prompts, completion, temperature=temperature)
    return GroupSample(prompts, completion, mask, logprobs.masked_fill(~mask, 0.0))


def group_advantages(rewards: Tensor, group_size: int, *, scale_rewards: str = "group") -> Tensor:
    """Each completion's reward minus its group's mean, divided by the standard deviation
    (Bessel-corrected, plus :data:`STD_EPS`) of its group (``"group"``), of the whole batch
    (``"batch"``), or not divided (``"none"``). ``rewards`` ``(B,)``, each group's
    ``group_size`` rewards next to each other → ``(B,)``. A group whose rewards are all equal
    gets advantages 0: it teaches nothing."""
    check_tensor("rewards", rewards, kind="float", dims=1, shape="(B,)")
    check_int("group_size", group_size, at_least=2)
    check_choice("scale_rewards", scale_rewards, SCALE_REWARDS)
    if rewards.numel() % group_size:
        raise ValueError(
            f"rewards must hold whole groups: {rewards.numel()} rewards is not a multiple of "
            f"group_size={group_size}"
        )
    groups = rewards.view(-1, group_size)  # (B / G, G)
    advantages = (groups - groups.mean(dim=1, keepdim=True)).view(-1)  # (B,)
    if scale_rewards == "group":
        std = groups.std(dim=1, keepdim=True).expand_as(groups).reshape(-1)
    elif scale_rewards == "batch":
        std = rewards.std()
    else:
        return advantages
    return advantages / (std + STD_EPS)


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Schulman's k3 estimate of KL(π ‖ π_ref) at each sampled token:
    ``exp(r) − r − 1`` with ``r = log π_ref − log π``. Never negative, unbiased for tokens
    sampled from π, and low-variance."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def clipped_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
) -> Tensor:
    """PPO's clipped objective per token, as a loss ``(B, T)``: ``−min(ρ A, clip(ρ, 1 − ε_low,
    1 + ε_high) A)`` with ``ρ = π / π_old`` and ``A`` each row's advantage ``(B,)``. Once the
    ratio has moved ε past 1 in the direction the advantage rewards, the token's gradient is
    0. ``epsilon_high`` None: ``epsilon_low`` (DAPO raises it to let rare tokens grow)."""
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    check_number("epsilon_low", epsilon_low, low=0.0)
    check_number("epsilon_high", epsilon_high, low=0.0)
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    advantages = advantages[:, None]  # (B, 1)
    return -torch.min(ratio * advantages, clipped * advantages)


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    ref_logprobs: Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "grpo",
    max_completion_length: int | None = None,
    kl_bias_correction: bool = True,
) -> Tensor:
    """GRPO's loss: the clipped surrogate plus ``beta`` times the k3 KL to the reference, per
    token, reduced over the real tokens as ``loss_type`` says (:data:`LOSS_TYPES`).

    Args:
        logprobs: ``(B, T)`` the policy's log-probabilities (with gradients).
        old_logprobs: ``(B, T)`` the sampling policy's (:attr:`GroupSample.logprobs`).
        advantages: ``(B,)`` (:func:`group_advantages`).
        completion_mask: ``(B, T)`` bool, True at the completion's real tokens.
        ref_logprobs: ``(B, T)`` the frozen reference's; needed when ``beta`` > 0.
        max_completion_length: ``"dr_grpo"``'s constant divisor (the sampling budget ``T``
            when None).
        kl_bias_correction: multiply the KL term by the ratio π / π_old (TRL's default,
            DeepSeek-V3.2's): the tokens were sampled from π_old, and k3 is unbiased only for
            tokens sampled from π. It changes the gradient even on-policy, where the ratio is 1.
    """
    check_choice("loss_type", loss_type, LOSS_TYPES)
    check_number("beta", beta, low=0.0)
    check_bool("kl_bias_correction", kl_bias_correction)
    check_tensor("completion_mask", completion_mask, kind="bool", dims=2, shape="(B, T)")
    check_tensor("advantages", advantages, kind="float", dims=1, shape="(B,)")
    if advantages.size(0) != completion_mask.size(0):  # one would broadcast to every row
        raise ValueError(
            f"advantages must hold one value a completion, {completion_mask.size(0)}, got "
            f"{advantages.size(0)}"
        )
    if beta > 0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs, the reference model's log-probabilities")
    tokens = [("logprobs", logprobs), ("old_logprobs", old_logprobs)]
    for name, value in tokens + ([("ref_logprobs", ref_logprobs)] if beta > 0 else []):
        check_tensor(name, value, kind="float", dims=2, shape="(B, T)")
        if value.shape != completion_mask.shape:
            raise ValueError(
                f"{name} must have completion_mask's shape {tuple(completion_mask.shape)}, "
                f"got {tuple(value.shape)}"
            )
    check_optional_int("max_completion_length", max_completion_length, at_least=1)
    per_token = clipped_surrogate(
        logprobs, old_logprobs, advantages, epsilon_low=epsilon_low, epsilon_high=epsilon_high
    )  # (B, T)
    if beta > 0:
        kl = k3_kl(logprobs, ref_logprobs)  # (B, T)
        if kl_bias_correction:
            kl = kl * torch.exp(logprobs - old_logprobs)
        per_token = per_token + beta * kl
    mask = completion_mask.to(per_token.dtype)
    total = per_token * mask
    if loss_type == "grpo":  # each completion's mean, then their mean
        return (total.sum(1) / mask.sum(1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":  # a constant divisor: no length favoured
        length = max_completion_length or completion_mask.size(1)
        return total.sum() / (completion_mask.size(0) * length)
    return total.sum() / mask.sum().clamp(min=1.0)  # "bnpo", "dapo": every token weighs alike
