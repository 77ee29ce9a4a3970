"""Chapter 23: speculative decoding — a small draft model proposes, the target verifies.

Each round the draft proposes ``k`` tokens one by one; the target reads them all in one call,
which gives its distribution after each; the tokens are accepted left to right while the rule
allows, and the target's own next token follows the last accepted one, so a round emits 1 to
``k + 1`` tokens for one call of the target. Greedy: a proposal is accepted when it is the
target's most likely token, so the output is the target's greedy output whatever the draft
proposes. Sampling (Leviathan et al. 2023; Chen et al. 2023): a proposal ``x`` drawn from the
draft's ``q`` is accepted with probability ``min(1, p(x) / q(x))``, and after a rejection the
token is drawn from ``max(0, p - q)`` normalised, which makes each emitted token's
distribution exactly the target's ``p``.

Shapes: a prompt ``(1, T0)``; distributions ``(V,)`` in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from transformer_tutorial.checks import check_bool, check_int, check_tensor, check_type
from transformer_tutorial.lm.cache import LMCache
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.sampling import (
    check_prompt,
    check_sampling,
    check_stop_ids,
    filter_logits,
    sample,
)


def _check_distributions(p: Tensor, q: Tensor) -> None:
    """``p`` and ``q``: float distributions over one vocabulary, ``(V,)`` each."""
    check_tensor("p", p, kind="float", dims=1, shape="(V,)")
    check_tensor("q", q, kind="float", dims=1, shape="(V,)")
    if p.shape != q.shape:
        raise ValueError(
            f"p and q must be distributions over one vocabulary, got {len(p)} and {len(q)} tokens"
        )


def acceptance_probability(p: Tensor, q: Tensor, token: int) -> Tensor:
    """``min(1, p(token) / q(token))``: the chance that a proposal drawn from ``q`` is kept."""
    _check_distributions(p, q)
    check_int("token", token, at_least=0)
    if token >= len(p):
        raise ValueError(f"token={token} is outside the {len(p)} tokens of p and q")
    return torch.clamp(p[token] / q[token], max=1.0)


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """``max(0, p - q)`` normalised: what a rejected proposal is replaced by. Where ``p == q``
    nothing is ever rejected, and ``p`` itself is returned."""
    _check_distributions(p, q)
    rest = (p - q).clamp(min=0.0)
    total = rest.sum()
    return p if total == 0 else rest / total


@dataclass(frozen=True)
class SpeculativeOutput:
    """The ids (prompt included) and how the rounds went: tokens proposed, tokens accepted,
    and calls of the target (one a round)."""

    ids: Tensor
    proposed: int
    accepted: int
    target_calls: int

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.proposed, 1)


def check_one_prompt(model: LanguageModel, prompt: Tensor, max_new_tokens: int, k: int) -> None:
    """``prompt`` one row ``(1, T0)`` that ``max_new_tokens`` more keep inside ``model``'s
    ``max_len``, and ``k >= 1`` tokens verified a round."""
    check_prompt(model, prompt, max_new_tokens)
    if prompt.size(0) != 1:
        raise ValueError(f"prompt must be one row (1, T0), got {tuple(prompt.shape)}")
    check_int("k", k, at_least=1)


def cut_at_eos(tokens: list[int], eos_id: int | None) -> list[int]:
    """``tokens`` up to their first ``eos_id``, included (all of them when None or absent)."""
    return tokens[: tokens.index(eos_id) + 1] if eos_id in tokens else tokens


def _check_models(target: LanguageModel, draft: LanguageModel) -> None:
    """Two language models over one vocabulary."""
    check_type("target", target, LanguageModel, "a LanguageModel")
    check_type("draft", draft, LanguageModel, "a LanguageModel")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"the draft's vocabulary ({draft.config.vocab_size} tokens) must be the target's "
            f"({target.config.vocab_size}): it proposes the target's token ids"
        )


@dataclass(frozen=True)
class _Rule:
    """How both models choose a token (greedily, or by sampling the filtered distribution) and
    how the target accepts the draft's."""

    greedy: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    generator: torch.Generator | None

    def choose(self, logits: Tensor) -> tuple[int, Tensor]:
        """A token for ``logits`` ``(V,)``, and the distribution ``(V,)`` it comes from."""
        filtered = filter_logits(
            logits.double(), temperature=self.temperature, top_k=self.top_k, top_p=self.top_p
        )
        probs = torch.softmax(filtered, -1)
        token = logits.argmax() if self.greedy else sample(probs.log(), self.generator)
        return int(token), probs

    def verify(self, logits: Tensor, proposals: list[int], qs: list[Tensor]) -> tuple[int, int]:
        """How many ``proposals`` the target accepts, left to right, given its ``logits``
        ``(n + 1, V)`` after each, and the token that follows the last one accepted: the
        target's own after a rejection (from the residual when sampling), else its next."""
        for i, token in enumerate(proposals):
            best, p = self.choose(logits[i])
            if self.greedy:
                keep = token == best
            else:
                u = torch.rand((), generator=self.generator, dtype=torch.float64, device=p.device)
                keep = bool(u < acceptance_probability(p, qs[i], token))
            if not keep:
                residual = residual_distribution(p, qs[i])
                return i, best if self.greedy else int(sample(residual.log(), self.generator))
        return len(proposals), self.choose(logits[len(proposals)])[0]


def _propose(
    draft: LanguageModel, cache: LMCache, pending: list[int], n: int, rule: _Rule, device
) -> tuple[list[int], list[Tensor]]:
    """The draft reads its ``pending`` tokens and proposes ``n`` tokens, one call each: the
    tokens and the distributions ``q`` they were drawn from."""
    proposals, qs, feed = [], [], pending
    for _ in range(n):
        logits, cache = draft.step(torch.tensor([feed], device=device), cache)
        token, q = rule.choose(logits[0, -1])
        proposals.append(token)
        qs.append(q)
        feed = [token]
    return proposals, qs


@torch.no_grad()
def speculative_generate(
    target: LanguageModel,
    draft: LanguageModel,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    k: int,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> SpeculativeOutput:
    """Continue ``prompt`` ``(1, T0)`` by up to ``max_new_tokens`` tokens of ``target``, the
    ``draft`` proposing ``k`` at a time: the tokens
    :func:`~transformer_tutorial.lm.sampling.generate` gives greedily, or samples from its
    distribution (same filters, applied to both models). Both models keep
    preallocated caches, rewound past the rejected proposals."""
    _check_models(target, draft)
    check_one_prompt(target, prompt, max_new_tokens, k)
    check_bool("greedy", greedy)
    check_sampling(temperature, top_k, top_p)
    check_stop_ids(target, eos_id=eos_id)
    total = prompt.size(1) + max_new_tokens
    if total > draft.config.max_len:
        raise ValueError(f"{total} positions exceed the draft's max_len={draft.config.max_len}")
    rule = _Rule(greedy, temperature, top_k, top_p, generator)
    ids, device = prompt[0].tolist(), prompt.device
    t_cache = target.new_cache(1, "preallocated", max_len=total)
    d_cache = draft.new_cache(1, "preallocated", max_len=total)
    t_pending, d_pending = ids, ids  # the tokens each cache has not read yet
    proposed = accepted = calls = 0
    while len(ids) < total:
        n_draft = min(k, total - len(ids))
        # 1) the draft proposes n_draft tokens, one call each
        proposals, qs = _propose(draft, d_cache, d_pending, n_draft, rule, device)
        # 2) the target reads the pending tokens and every proposal in one call
        logits, t_cache = target.step(
            torch.tensor([t_pending + proposals], device=device), t_cache
        )
        calls += 1
        # 3) accept left to right; the target's token follows the last accepted one
        n, nxt = rule.verify(logits[0, len(t_pending) - 1 :], proposals, qs)
        proposed, accepted = proposed + n_draft, accepted + n
        ids = ids + cut_at_eos([*proposals[:n], nxt], eos_id)[: total - len(ids)]
        if eos_id is not None and ids[-1] == eos_id:
            break
        # 4) the caches forget the rejected proposals
        t_cache.rewind(n_draft - n)
        t_pending = [nxt]
        if n < n_draft:
            d_cache.rewind(n_draft - 1 - n)
            d_pending = [nxt]
        else:  # the draft never read its last proposal
            d_pending = [proposals[-1], nxt]
    return SpeculativeOutput(torch.tensor([ids], device=device), proposed, accepted, calls)
