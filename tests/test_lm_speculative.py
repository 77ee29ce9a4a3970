"""Chapter 23: speculative decoding gives the target's greedy tokens whatever the draft (another
model, the target itself, a draft that always disagrees) and any k; the rejection rule makes the
first emitted tokens' distribution the target's, by exact enumeration in float64 (1e-12), and
the sampler follows it for the first two tokens, through the bonus token (k = 1) and a rewind
after a rejection (k = 2); a draft of another vocabulary is refused."""

from __future__ import annotations

import copy
import itertools
from collections import Counter

import pytest
import torch

from helpers import raises
from transformer_tutorial.lm.config import LLAMA, QWEN3, LMConfig
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.sampling import generate
from transformer_tutorial.lm.speculative import (
    acceptance_probability,
    cut_at_eos,
    residual_distribution,
    speculative_generate,
)

V = 40


def _model(seed: int, vocab_size: int = V, d_model: int = 32, **style) -> LanguageModel:
    torch.manual_seed(seed)
    config = LMConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        n_heads=4,
        n_kv_heads=2,
        n_layers=2,
        d_ff=2 * d_model,
        max_len=64,
        **(style or LLAMA),
    )
    return LanguageModel(config).double().eval()


def _disagreeing(target: LanguageModel) -> LanguageModel:
    """The target with its output rows rolled by one: its most likely token is always the
    target's plus one, so greedily it never agrees."""
    draft = copy.deepcopy(target)
    draft.config = target.config
    with torch.no_grad():
        draft.lm_head.weight = torch.nn.Parameter(target.lm_head.weight.roll(1, dims=0))
    return draft


@pytest.mark.parametrize("k", [1, 2, 3, 7])
@pytest.mark.parametrize("style", [LLAMA, QWEN3, dict(QWEN3, window=4)])
def test_greedy_gives_the_targets_tokens_whatever_the_draft(k, style):
    target = _model(0, **style)
    prompt = torch.randint(0, V, (1, 4), generator=torch.Generator().manual_seed(k))
    want = generate(target, prompt, 30, greedy=True)
    drafts = {"other": _model(1, d_model=16), "itself": target, "wrong": _disagreeing(target)}
    for name, draft in drafts.items():
        out = speculative_generate(target, draft, prompt, 30, k=k, greedy=True)
        assert torch.equal(out.ids, want), name
    assert speculative_generate(target, target, prompt, 30, k=k, greedy=True).acceptance_rate == 1
    wrong = speculative_generate(target, drafts["wrong"], prompt, 30, k=k, greedy=True)
    assert wrong.accepted == 0 and wrong.target_calls == 30


def test_greedy_stops_at_eos_as_generate():
    target, draft = _model(0), _model(1, d_model=16)
    prompt = torch.tensor([[3, 5]])
    free = generate(target, prompt, 30, greedy=True)[0, 2:].tolist()
    eos = free[5]
    want = generate(target, prompt, 30, greedy=True, eos_id=eos)
    got = speculative_generate(target, draft, prompt, 30, k=4, greedy=True, eos_id=eos)
    assert torch.equal(got.ids, want)


def _sharp(model: LanguageModel) -> LanguageModel:
    """Output weights 15 times larger: distributions far from uniform, and far apart."""
    with torch.no_grad():
        model.lm_head.weight.mul_(15)
    return model


def _probs(model: LanguageModel, ids: list[int]) -> torch.Tensor:
    return torch.softmax(model(torch.tensor([ids]))[0, -1].double(), -1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_rejection_rule_gives_the_targets_distribution_exactly(seed):
    """Enumerate every draft proposal (k = 2) and every branch of the rule, on a vocabulary of
    5: the distribution of the first two emitted tokens is p(x) p(y | x) to 1e-12."""
    target = _sharp(_model(seed, vocab_size=5))
    draft = _sharp(_model(seed + 10, vocab_size=5, d_model=16))
    prompt = [1, 3]
    p1, q1 = _probs(target, prompt), _probs(draft, prompt)
    got = torch.zeros(5, 5, dtype=torch.float64)
    for d1, d2 in itertools.product(range(5), repeat=2):
        p2, q2 = _probs(target, [*prompt, d1]), _probs(draft, [*prompt, d1])
        chance = q1[d1] * q2[d2]  # the draft proposes d1, d2
        a1, a2 = acceptance_probability(p1, q1, d1), acceptance_probability(p2, q2, d2)
        for y in range(5):
            # d1 rejected: x from the residual, then y from the target (the next round)
            x_dist = residual_distribution(p1, q1)
            for x in range(5):
                got[x, y] += chance * (1 - a1) * x_dist[x] * _probs(target, [*prompt, x])[y]
            # d1 accepted, d2 rejected: y from the residual after d1
            got[d1, y] += chance * a1 * (1 - a2) * residual_distribution(p2, q2)[y]
        got[d1, d2] += chance * a1 * a2  # both accepted (the bonus token comes third)
    want = torch.stack([p1[x] * _probs(target, [*prompt, x]) for x in range(5)])
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    assert (p1 - q1).abs().max() > 0.1  # the draft differs from the target


@pytest.mark.parametrize("k", [1, 2])
def test_the_sampler_follows_the_rule(k):
    """2,000 pairs of tokens sampled with a draft that differs: the frequencies of the 25 pairs
    are the target's p(x) p(y | x) (within 4.5 standard errors), not the draft's. At k = 1 the
    second token is the target's bonus token whenever the first proposal is accepted; at k = 2
    it is the second proposal or its residual, and a rejected first proposal rewinds both
    caches before the next round."""
    target = _sharp(_model(0, vocab_size=5))
    draft = _sharp(_model(10, vocab_size=5, d_model=16))
    prompt = [1, 3]
    p, q = _probs(target, prompt), _probs(draft, prompt)
    want = torch.stack([p[x] * _probs(target, [*prompt, x]) for x in range(5)])  # (x, y)
    drafts = torch.stack([q[x] * _probs(draft, [*prompt, x]) for x in range(5)])
    g = torch.Generator().manual_seed(0)
    n = 2000
    outs = [
        speculative_generate(target, draft, torch.tensor([prompt]), 2, k=k, generator=g)
        for _ in range(n)
    ]
    pairs = torch.tensor([o.ids[0, 2:].tolist() for o in outs])  # (n, 2)
    freq = torch.bincount(pairs[:, 0] * 5 + pairs[:, 1], minlength=25).double().view(5, 5) / n
    error = (want * (1 - want) / n).sqrt()
    assert ((freq - want).abs() < 4.5 * error + 1e-9).all(), (freq, want)
    assert ((freq - drafts).abs() > 4.5 * error).any()
    # every branch was taken often: (accepted, target calls) — at k = 1, (1, 1) is the bonus
    # token; at k = 2, (1, 1) a rejected second proposal and (·, 2) a rejected first one
    paths = Counter((o.accepted, o.target_calls) for o in outs)
    branches = {1: [(1, 1), (0, 2), (1, 2)], 2: [(2, 1), (1, 1), (0, 2), (1, 2)]}[k]
    assert set(paths) == set(branches) and min(paths.values()) > n // 20, paths


def test_the_rule_keeps_what_is_likelier_under_the_target():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.25, 0.6, 0.15], dtype=torch.float64)
    assert acceptance_probability(p, q, 0) == 1 and acceptance_probability(p, q, 1) == 0.5
    torch.testing.assert_close(
        residual_distribution(p, q), torch.tensor([5 / 6, 0, 1 / 6]).double()
    )
    assert torch.equal(residual_distribution(p, p), p)


def test_cut_at_eos_keeps_the_tokens_up_to_the_first_eos():
    assert cut_at_eos([4, 2, 7, 2], 2) == [4, 2]
    assert cut_at_eos([4, 7], 2) == [4, 7]
    assert cut_at_eos([4, 2], None) == [4, 2]


def test_bad_input_is_refused_by_name():
    target, prompt = _model(0), torch.tensor([[1, 2]])
    raises(
        lambda: speculative_generate(target, _model(1, vocab_size=41), prompt, 4, k=2),
        ValueError,
        "the draft's vocabulary (41 tokens) must be the target's (40)",
    )
    raises(lambda: speculative_generate(target, target, prompt, 4, k=0), ValueError, "k must be")
    raises(
        lambda: speculative_generate(target, target, prompt.expand(2, 2), 4, k=1),
        ValueError,
        "one row",
    )


# --- API probes (issue 42): each bad call, and what its error must say ------------------------

P3, Q3 = torch.tensor([0.5, 0.25, 0.25]), torch.full((3,), 1 / 3)
ONE = torch.tensor([[1, 2]])
SPECULATIVE_PROBES = {
    "eos_id outside the vocabulary": (
        lambda: speculative_generate(_model(0), _model(1), ONE, 4, k=2, eos_id=V),
        ValueError,
        f"eos_id={V} is no token of the model's vocabulary (0 to {V - 1})",
    ),
    "draft not a LanguageModel": (
        lambda: speculative_generate(_model(0), torch.nn.Linear(2, 2), ONE, 4, k=2),
        TypeError,
        "draft must be a LanguageModel, got Linear",
    ),
    "target not a LanguageModel": (
        lambda: speculative_generate(None, _model(0), ONE, 4, k=2),
        TypeError,
        "target must be a LanguageModel, got NoneType",
    ),
    "token outside p": (
        lambda: acceptance_probability(P3, Q3, 5),
        ValueError,
        "token=5 is outside the 3 tokens of p and q",
    ),
    "token a float": (
        lambda: acceptance_probability(P3, Q3, 1.0),
        TypeError,
        "token must be an int, got 1.0",
    ),
    "p and q of two vocabularies": (
        lambda: acceptance_probability(P3, torch.full((4,), 0.25), 1),
        ValueError,
        "p and q must be distributions over one vocabulary, got 3 and 4 tokens",
    ),
    "2-D distributions": (
        lambda: residual_distribution(P3[None], Q3[None]),
        ValueError,
        "p must be (V,), got shape (1, 3)",
    ),
    "integer distribution": (
        lambda: residual_distribution(torch.tensor([1, 0]), torch.tensor([0, 1])),
        TypeError,
        "p must be a floating-point tensor, got torch.int64",
    ),
}


@pytest.mark.parametrize(
    ("call", "error", "phrase"), SPECULATIVE_PROBES.values(), ids=SPECULATIVE_PROBES.keys()
)
def test_bad_calls_name_the_argument_and_what_is_valid(call, error, phrase):
    raises(call, error, phrase)
