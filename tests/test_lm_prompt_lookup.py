"""Chapter 23: prompt lookup proposes the tokens that followed the text's last n-gram before,
and decoding with it gives the target's greedy tokens, with fewer target calls on text that
repeats."""

from __future__ import annotations

import pytest
import torch

from helpers import raises
from transformer_tutorial.lm.config import LLAMA, QWEN3, LMConfig
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.prompt_lookup import lookup_proposals, prompt_lookup_generate
from transformer_tutorial.lm.sampling import generate


def _model(style, seed: int = 0, vocab_size: int = 50) -> LanguageModel:
    torch.manual_seed(seed)
    config = LMConfig(
        vocab_size=vocab_size,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        n_layers=2,
        d_ff=64,
        max_len=64,
        **style,
    )
    return LanguageModel(config).double().eval()


@pytest.mark.parametrize(
    "ids, k, max_ngram, want",
    [
        ([1, 2, 3, 9, 1, 2, 3], 2, 3, [9, 1]),  # the 3-gram 1 2 3 occurred: 9, 1 followed
        ([5, 2, 3, 7, 4, 2, 3, 8, 1, 2, 3], 3, 3, [8, 1, 2]),  # 2-gram 2 3: the latest wins
        ([4, 1, 2, 3, 6, 2, 3, 5, 1, 2, 3], 1, 3, [6]),  # the longest n-gram beats a later 2-gram
        ([4, 5, 6, 7], 3, 3, []),  # nothing repeats
        ([7, 7, 7], 4, 2, [7, 7, 7, 7]),  # a run: the copy runs into its own proposals
        ([1, 2, 1], 3, 3, [2, 1, 2]),  # the 1-gram 1 at 0: 2 1, then the copy goes on
        ([1, 2, 3, 1, 2, 3], 5, 2, [1, 2, 3, 1, 2]),  # a loop of period 3, k tokens ahead
        ([3], 2, 3, []),
        ([1, 2, 1, 2], 0, 3, []),
    ],
)
def test_lookup_copies_what_followed_the_latest_longest_match(ids, k, max_ngram, want):
    assert lookup_proposals(ids, k, max_ngram=max_ngram) == want


@pytest.mark.parametrize("style", [LLAMA, QWEN3], ids=["llama", "qwen3"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k, max_ngram", [(1, 1), (3, 2), (6, 3)])
def test_prompt_lookup_gives_the_greedy_tokens(style, seed, k, max_ngram):
    model = _model(style, seed)
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(0, 50, (6,), generator=g)
    prompt = torch.cat([phrase, torch.randint(0, 50, (3,), generator=g), phrase])[None]
    want = generate(model, prompt, 40, greedy=True)
    out = prompt_lookup_generate(model, prompt, 40, k=k, max_ngram=max_ngram)
    assert torch.equal(out.ids, want)
    assert out.target_calls + out.accepted == 40  # one token a call, plus each accepted one


def test_text_that_repeats_takes_fewer_target_calls():
    """A random model in float64 falls into a loop; every token of the loop is proposed and
    accepted, so 48 tokens take far fewer than 48 calls."""
    model = _model(LLAMA, 4, vocab_size=8)
    prompt = torch.tensor([[1, 2, 3, 4]])
    out = prompt_lookup_generate(model, prompt, 48, k=6)
    assert torch.equal(out.ids, generate(model, prompt, 48, greedy=True))
    assert out.target_calls <= 16 and out.acceptance_rate > 0.5  # 9 calls measured


def test_prompt_lookup_stops_at_eos():
    model = _model(LLAMA, 5)
    prompt = torch.tensor([[1, 2, 3, 1, 2]])
    free = generate(model, prompt, 30, greedy=True)[0, 5:].tolist()
    eos = free[4]
    got = prompt_lookup_generate(model, prompt, 30, k=4, eos_id=eos).ids[0, 5:].tolist()
    assert got == free[: free.index(eos) + 1]


@pytest.mark.parametrize(
    "call, phrase",
    [
        (lambda m: prompt_lookup_generate(m, torch.tensor([[1, 2]]), 4, k=0), "k must be"),
        (lambda m: prompt_lookup_generate(m, torch.tensor([[1], [2]]), 4, k=2), "one row"),
        (lambda m: prompt_lookup_generate(m, torch.tensor([[1]]), 70, k=2), "max_len=64"),
        (
            lambda m: prompt_lookup_generate(m, torch.tensor([[1]]), 4, k=2, max_ngram=0),
            "max_ngram",
        ),
        (
            lambda m: prompt_lookup_generate(m, torch.tensor([[1]]), 4, k=2, eos_id=50),
            "eos_id=50 is no token",
        ),
        (lambda m: lookup_proposals([1, 2], -1), "k must be at least 0"),
    ],
)
def test_bad_input_is_refused_by_name(call, phrase):
    raises(lambda: call(_model(LLAMA)), ValueError, phrase)


@pytest.mark.parametrize(
    "ids",
    [[1.5, 2.0, 1.5], "abcab", torch.tensor([[1, 2, 1]]), [True, False, True]],
    ids=["floats", "a str", "a 2-d tensor", "bools"],
)
def test_lookup_proposals_takes_a_list_of_token_ids_only(ids):
    """Floats and characters were copied as proposals; a 2-d tensor gave [] without a word."""
    raises(lambda: lookup_proposals(ids, 2), TypeError, "ids must be a list of int token ids")
