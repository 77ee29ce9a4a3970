"""sampling: top-k 1 is greedy, top-p keeps the smallest set reaching p (exactly at the
boundary), temperature towards 0 is greedy, the filters equal transformers' warpers, a seed
reproduces a sample, cached generation equals recomputing, EOS stops a row, and bad settings are
refused."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from helpers import raises
from transformer_tutorial.lm.config import LLAMA, LMConfig
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.sampling import (
    apply_temperature,
    filter_logits,
    generate,
    next_token,
    sample,
    top_k_filter,
    top_p_filter,
)

V = 17


def random_logits(rows: int = 64, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return scale * torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))


def tiny_lm(seed: int = 0, max_len: int = 24) -> LanguageModel:
    torch.manual_seed(seed)
    config = LMConfig(
        vocab_size=V, d_model=16, n_heads=2, n_layers=2, d_ff=32, max_len=max_len, dropout=0.0
    )
    lm = LanguageModel(config).eval()
    with torch.no_grad():  # larger weights than GPT-2's init: peaked, varied distributions
        for p in lm.parameters():
            p.mul_(8.0)
    return lm


def test_top_k_one_is_greedy():
    logits = random_logits()
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        sampled = next_token(logits, top_k=1, temperature=2.0, generator=g)
        assert torch.equal(sampled, logits.argmax(-1))
    assert torch.equal(next_token(logits, greedy=True), logits.argmax(-1))


def test_top_k_keeps_the_k_largest():
    logits = random_logits()
    kept = top_k_filter(logits, 5).isfinite()
    assert kept.sum(-1).eq(5).all()
    smallest_kept = logits.masked_fill(~kept, float("inf")).min(-1).values
    largest_dropped = logits.masked_fill(kept, float("-inf")).max(-1).values
    assert (smallest_kept > largest_dropped).all()
    assert top_k_filter(logits, 100).isfinite().all()  # k > V keeps everything


@pytest.mark.parametrize(
    ("p", "kept"),
    [(0.25, 1), (0.2500001, 2), (0.5, 2), (0.74, 3), (0.75, 3), (0.76, 4), (1.0, 4)],
)
def test_top_p_boundary_is_exact(p, kept):
    """Four tokens of probability exactly 1/4 (and the rest 0): p = 0.5 keeps exactly two, the
    smallest set whose probability reaches 0.5; a hair above keeps three."""
    logits = torch.tensor([[0.0, 0.0, float("-inf"), 0.0, 0.0, float("-inf")]])
    out = top_p_filter(logits, p)
    assert out.isfinite().sum().item() == kept
    assert out.isfinite()[0, [0, 1, 3, 4]].tolist() == [
        i < kept for i in range(4)
    ]  # lower id first


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_keeps_the_smallest_set_reaching_p(p):
    logits = random_logits(seed=1)
    probs = logits.softmax(-1)
    kept = top_p_filter(logits, p).isfinite()
    mass = (probs * kept).sum(-1)
    least_kept = probs.masked_fill(~kept, float("inf")).min(-1).values
    assert (mass >= p - 1e-6).all()  # it reaches p ...
    assert (mass - least_kept < p).all()  # ... and without its least likely token it would not
    assert (probs.masked_fill(kept, 0).max(-1).values <= least_kept).all()  # the most likely


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filters_equal_transformers_warpers(seed):
    logits = random_logits(seed=seed)
    for k in (1, 4, 16):
        expected = TopKLogitsWarper(top_k=k)(None, logits.clone())
        assert torch.equal(top_k_filter(logits, k).isfinite(), expected.isfinite())
    for p in (0.3, 0.8, 0.95):
        expected = TopPLogitsWarper(top_p=p)(None, logits.clone())
        # Away from the boundary (a cumulative sum within 1e-4 of p could round either way):
        cum = logits.softmax(-1).sort(-1, descending=True).values.cumsum(-1)
        clear = ((cum - p).abs() > 1e-4).all(-1)
        got = top_p_filter(logits, p)
        assert clear.sum() > 50
        assert torch.equal(got.isfinite()[clear], expected.isfinite()[clear])
    # The three together, in transformers' order: temperature, top-k, top-p.
    expected = TemperatureLogitsWarper(0.7)(None, logits)
    expected = TopPLogitsWarper(top_p=0.9)(None, TopKLogitsWarper(top_k=6)(None, expected))
    got = filter_logits(logits, temperature=0.7, top_k=6, top_p=0.9)
    cum = (logits / 0.7).topk(6, -1).values.softmax(-1).cumsum(-1)
    clear = ((cum - 0.9).abs() > 1e-4).all(-1)
    assert clear.sum() > 50
    torch.testing.assert_close(got[clear], expected[clear], atol=1e-6, rtol=1e-6)


def test_temperature_towards_zero_is_greedy_and_large_is_uniform():
    logits = random_logits()
    logits[torch.arange(len(logits)), logits.argmax(-1)] += 0.1  # no near-ties
    g = torch.Generator().manual_seed(0)
    sampled = next_token(logits, temperature=1e-3, generator=g)
    assert torch.equal(sampled, logits.argmax(-1))
    hot = apply_temperature(logits, 1e4).softmax(-1)
    torch.testing.assert_close(hot, torch.full_like(hot, 1 / V), atol=1e-3, rtol=0)


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.5}, {"top_k": 2}, {"top_p": 0.6}])
def test_samples_follow_the_filtered_distribution(settings):
    """Gumbel-max draws each token with its probability: 40,000 draws from one row land within
    0.01 of the filtered softmax (the standard error is at most 0.0025), and never on a
    filtered-out token."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    expected = filter_logits(logits, **settings).softmax(-1)[0]
    g = torch.Generator().manual_seed(0)
    draws = next_token(logits.expand(40_000, 4), generator=g, **settings)
    seen = torch.bincount(draws, minlength=4) / draws.numel()
    torch.testing.assert_close(seen, expected, atol=0.01, rtol=0)
    assert (seen[expected == 0] == 0).all()


def _gumbel_max(log_probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The draw as ``next_token`` and ``speculative._sample`` wrote it before ``sample`` was
    shared: ``argmax(log p + G)``, ``G = -log(-log U)``."""
    return (log_probs - torch.log(-torch.log(u.clamp_min(torch.finfo(u.dtype).tiny)))).argmax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sample_draws_the_tokens_the_gumbel_max_formula_draws(dtype):
    """``sample`` draws ``U`` in the log-probabilities' dtype (next_token's float32,
    speculative decoding's float64): the same seed gives the same tokens as the formula, and
    leaves the generator in the same state."""
    log_probs = torch.log_softmax(random_logits(rows=256).to(dtype), -1)
    log_probs[:, :4] = float("-inf")  # filtered out
    theirs, ours = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    want = _gumbel_max(log_probs, torch.rand(log_probs.shape, generator=theirs, dtype=dtype))
    got = sample(log_probs, ours)
    assert torch.equal(got, want) and (got >= 4).all()
    assert torch.equal(ours.get_state(), theirs.get_state())
    single = sample(log_probs[0], torch.Generator().manual_seed(5))  # one distribution (V,)
    assert single.shape == () and single == want[0]


@pytest.mark.parametrize("settings", [{}, {"top_k": 5, "temperature": 0.7}, {"top_p": 0.8}])
def test_next_token_samples_as_it_did_before_sample_was_shared(settings):
    logits = random_logits(rows=256, seed=2)
    log_probs = torch.log_softmax(filter_logits(logits, **settings).float(), -1)
    u = torch.rand(log_probs.shape, generator=torch.Generator().manual_seed(1))
    got = next_token(logits, generator=torch.Generator().manual_seed(1), **settings)
    assert torch.equal(got, _gumbel_max(log_probs, u))


def test_a_seeded_generator_reproduces_a_sample():
    lm, prompt = tiny_lm(), torch.tensor([[1], [2], [3]])

    def sample(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return generate(lm, prompt, 12, top_p=0.95, generator=g)

    assert torch.equal(sample(0), sample(0))
    assert not torch.equal(sample(0), sample(1))


@pytest.mark.parametrize("settings", [{"greedy": True}, {"top_k": 5, "temperature": 0.8}])
def test_cached_generation_equals_recomputing(settings):
    lm, prompt = tiny_lm(), torch.tensor([[1, 4, 2], [3, 3, 3]])
    outs = [
        generate(
            lm, prompt, 15, use_cache=use, generator=torch.Generator().manual_seed(0), **settings
        )
        for use in (True, False)
    ]
    assert outs[0].shape == (2, 18)
    assert torch.equal(outs[0], outs[1])


def test_generate_takes_a_ready_cache_of_any_kind():
    """``cache=``: the empty cache ``model.new_cache`` made, of any kind, changed in place:
    greedy's tokens from each."""
    torch.manual_seed(0)
    config = LMConfig(
        vocab_size=V, d_model=16, n_heads=2, n_kv_heads=1, n_layers=2, d_ff=32, max_len=24, **LLAMA
    )
    lm, prompt = LanguageModel(config).eval(), torch.tensor([[1, 4, 2], [3, 3, 3]])
    with torch.no_grad():  # peaked, varied distributions (as tiny_lm)
        lm.lm_head.weight.mul_(8.0)
    want = generate(lm, prompt, 15, greedy=True)
    assert len(set(want[:, 3:].flatten().tolist())) > 3
    prealloc = lm.new_cache(2, "preallocated")
    assert torch.equal(generate(lm, prompt, 15, greedy=True, cache=prealloc), want)
    assert prealloc.length == 17  # the prompt and every new token but the last
    paged = lm.new_cache(2, "paged", n_blocks=10, block_size=4)
    assert torch.equal(generate(lm, prompt, 15, greedy=True, cache=paged), want)
    sampled = [
        generate(lm, prompt, 15, top_k=5, generator=torch.Generator().manual_seed(0), **kind)
        for kind in ({}, {"cache": lm.new_cache(2, "preallocated")})
    ]
    assert torch.equal(sampled[0], sampled[1])


def _used_cache() -> object:
    cache = tiny_lm().new_cache(1)
    tiny_lm().step(torch.tensor([[1, 2]]), cache)
    return cache


CACHE_PROBES = {
    "cache and cache_kind": (
        lambda lm, cache: generate(lm, PROMPT, 3, cache=cache, cache_kind="preallocated"),
        ValueError,
        "pass cache or cache_kind, not both",
    ),
    "cache without use_cache": (
        lambda lm, cache: generate(lm, PROMPT, 3, cache=cache, use_cache=False),
        ValueError,
        "cache needs use_cache=True",
    ),
    "cache_kind without use_cache": (
        lambda lm, cache: generate(lm, PROMPT, 3, cache_kind="growing", use_cache=False),
        ValueError,
        "cache_kind needs use_cache=True",
    ),
    "cache a str": (
        lambda lm, cache: generate(lm, PROMPT, 3, cache="preallocated"),
        TypeError,
        "cache must be an empty LMCache (model.new_cache) or None, got str",
    ),
    "a used cache": (
        lambda lm, cache: generate(lm, PROMPT, 3, cache=_used_cache()),
        ValueError,
        "cache must be empty, got one holding 2 positions",
    ),
    "a paged cache_kind without its blocks": (
        lambda lm, cache: generate(lm, PROMPT, 3, cache_kind="paged"),
        ValueError,
        "cache_kind: the paged cache needs n_blocks and block_size",
    ),
    "an empty cache_kind": (
        lambda lm, cache: generate(lm, PROMPT, 3, cache_kind=""),
        ValueError,
        "cache_kind: kind must be one of ['growing', 'paged', 'preallocated'], got ''",
    ),
    "a prompt of no rows": (
        lambda lm, cache: generate(lm, torch.zeros(0, 2, dtype=torch.long), 3),
        ValueError,
        "prompt must be (B, T0) ids with B >= 1 and T0 >= 1, got (0, 2)",
    ),
}


@pytest.mark.parametrize(
    ("call", "error", "phrase"), CACHE_PROBES.values(), ids=CACHE_PROBES.keys()
)
def test_a_bad_cache_is_refused_and_left_as_it_was(call, error, phrase):
    lm = tiny_lm()
    cache = lm.new_cache(1, "preallocated")
    raises(lambda: call(lm, cache), error, phrase)
    assert cache.length == 0
    assert all(not b.any() for layer in cache.layers for b in layer.buffers)  # nothing written


def test_batched_greedy_equals_one_row_at_a_time():
    lm, prompt = tiny_lm(), torch.tensor([[1, 4], [3, 3], [7, 0]])
    batched = generate(lm, prompt, 10, greedy=True)
    for row in range(3):
        assert torch.equal(
            batched[row : row + 1], generate(lm, prompt[row : row + 1], 10, greedy=True)
        )


def test_eos_finishes_a_row_and_all_finished_stops():
    lm, prompt = tiny_lm(), torch.tensor([[1], [2], [3], [5]])
    free = generate(lm, prompt, 20, greedy=True)
    eos = free[0, 3].item()  # row 0 produces this token at step 3
    out = generate(lm, prompt, 20, greedy=True, eos_id=eos, pad_id=0)
    for row in range(4):
        new = free[row, 1:].tolist()
        if eos in new:
            end = new.index(eos) + 2  # through the first EOS, prompt included
            assert out[row, :end].tolist() == free[row, :end].tolist()
            assert out[row, end:].eq(0).all()
        else:
            assert out[row].tolist() == free[row, : out.size(1)].tolist()
    single = generate(lm, prompt[:1], 20, greedy=True, eos_id=eos)
    assert single.size(1) == 4 and single[0, -1] == eos  # stops as soon as its only row ends


@pytest.mark.parametrize(
    ("settings", "error", "phrase"),
    [
        ({"temperature": 0.0}, ValueError, "temperature must be greater than 0.0, got 0.0"),
        ({"temperature": -1.0}, ValueError, "temperature must be greater than 0.0"),
        ({"top_p": 0.0}, ValueError, "top_p must be in (0.0, 1.0], got 0.0"),
        ({"top_p": 1.5}, ValueError, "top_p must be in (0.0, 1.0], got 1.5"),
        ({"top_k": 0}, ValueError, "top_k must be at least 1, got 0"),
        ({"top_k": 2.5}, TypeError, "top_k must be an int"),
    ],
)
def test_bad_settings_are_refused(settings, error, phrase):
    logits = random_logits(rows=2)
    raises(lambda: filter_logits(logits, **settings), error, phrase)
    raises(lambda: next_token(logits, greedy=True, **settings), error, phrase)
    raises(lambda: generate(tiny_lm(), torch.tensor([[1]]), 3, **settings), error, phrase)


@pytest.mark.parametrize(
    ("call", "error", "phrase"),
    [
        (lambda lm: generate(lm, torch.tensor([[1] * 20]), 5), ValueError, "max_len=24"),
        (lambda lm: generate(lm, torch.tensor([1, 2]), 5), ValueError, "prompt must be (B, T0)"),
        (lambda lm: generate(lm, torch.tensor([[1]]), -1), ValueError, "max_new_tokens must be"),
        (lambda lm: next_token(torch.zeros(2, 3, V)), ValueError, "logits must be (B, V)"),
        (lambda lm: generate(lm, torch.tensor([[1]]), 3, eos_id=V), ValueError, "eos_id=17 is no"),
        (
            lambda lm: generate(lm, torch.tensor([[1]]), 3, cache_kind="pinned"),
            ValueError,
            "cache_kind: kind must be one of",
        ),
    ],
)
def test_bad_inputs_are_refused(call, error, phrase):
    raises(lambda: call(tiny_lm()), error, phrase)


@pytest.mark.parametrize("seed", [0, 1])
def test_top_p_equals_the_warper_at_a_real_vocabulary(seed):
    """At GPT-2's 50,257 tokens a float32 running sum from the top reaches 1 (or p) early and
    drops tokens: at p = 1 thousands, at p = 0.9 one a row. The filter keeps exactly the
    warper's tokens, and p = 1 is the identity."""
    logits = 3 * torch.randn(8, 50_257, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(top_p_filter(logits, 1.0), logits)
    for p in (0.5, 0.9, 0.99, 0.999):
        expected = TopPLogitsWarper(top_p=p)(None, logits.clone())
        assert torch.equal(top_p_filter(logits, p).isfinite(), expected.isfinite())


def test_top_p_at_a_real_vocabulary_with_ties():
    """Logits on a grid of 0.5 tie thousands of tokens. The warper breaks ties by its sort's
    order, ours by the lower id: both keep as many tokens, of the same probabilities; where the
    cut falls between two values they keep the same tokens."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(8, 50_257, generator=g) * 6).round() / 2
    for p in (0.3, 0.9, 0.99):
        expected = TopPLogitsWarper(top_p=p)(None, logits.clone()).isfinite()
        got = top_p_filter(logits, p).isfinite()
        assert torch.equal(got.sum(-1), expected.sum(-1))
        for row in range(len(logits)):
            ours, theirs = logits[row][got[row]], logits[row][expected[row]]
            assert torch.equal(ours.sort().values, theirs.sort().values)
            least = ours.min()
            if not (logits[row][~got[row]] == least).any():  # no tie group split by the cut
                assert torch.equal(got[row], expected[row])
        kept = got[0].nonzero().squeeze(-1)
        least_ids = kept[logits[0, kept] == logits[0, kept].min()]
        dropped_ties = ((logits[0] == logits[0, kept].min()) & ~got[0]).nonzero()
        if len(dropped_ties):  # the cut split a tie group: the lower ids were kept
            assert least_ids.max() < dropped_ties.min()


# --- API probes (issue 42): each bad call, and what its error must say ------------------------

LOGITS = torch.randn(3, V)
PROMPT = torch.tensor([[1, 2]])
SAMPLING_PROBES = {
    "integer logits": (
        lambda: top_k_filter(torch.tensor([[1, 2, 3]]), 2),
        TypeError,
        "logits must be a floating-point tensor, got torch.int64",
    ),
    "0-d logits": (
        lambda: top_p_filter(torch.tensor(1.0), 0.5),
        ValueError,
        "logits must be (..., V) with V >= 1 tokens, got ()",
    ),
    "logits a list": (
        lambda: next_token([[1.0, 2.0]]),
        TypeError,
        "logits must be a Tensor (B, V), got list",
    ),
    "no tokens": (lambda: next_token(torch.randn(2, 0)), ValueError, "V >= 1 tokens"),
    "generator an int": (
        lambda: next_token(LOGITS, generator=3),
        TypeError,
        "generator must be a torch.Generator or None, got int",
    ),
    "prompt a list": (
        lambda: generate(tiny_lm(), [[1, 2]], 3),
        TypeError,
        "prompt must be a Tensor, got list",
    ),
    "float prompt": (
        lambda: generate(tiny_lm(), PROMPT.float(), 3),
        TypeError,
        "prompt must be an integer tensor, got torch.float32",
    ),
    "model not a LanguageModel": (
        lambda: generate(torch.nn.Linear(2, 2), PROMPT, 3),
        TypeError,
        "model must be a LanguageModel, got Linear",
    ),
    "pad_id outside the vocabulary": (
        lambda: generate(tiny_lm(), PROMPT, 3, eos_id=1, pad_id=V),
        ValueError,
        f"pad_id={V} is no token of the model's vocabulary (0 to {V - 1})",
    ),
    "log_probs a list": (
        lambda: sample([0.0, -1.0], None),
        TypeError,
        "log_probs must be a Tensor (..., V), got list",
    ),
    "sample's generator an int": (
        lambda: sample(torch.zeros(3), 3),
        TypeError,
        "generator must be a torch.Generator or None, got int",
    ),
    "use_cache an int": (
        lambda: generate(tiny_lm(), PROMPT, 3, use_cache=1),
        TypeError,
        "use_cache must be True or False, got 1",
    ),
}


@pytest.mark.parametrize(
    ("call", "error", "phrase"), SAMPLING_PROBES.values(), ids=SAMPLING_PROBES.keys()
)
def test_bad_calls_name_the_argument_and_what_is_valid(call, error, phrase):
    raises(call, error, phrase)
