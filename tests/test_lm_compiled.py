"""lm.compiled: a model's one-token steps through torch.compile give the eager tokens, for every
cache kind and attention, and compile no new graph for a new length; the view shares the
model's weights; bad input is refused by name."""

from __future__ import annotations

import pytest
import torch

from helpers import needs_compiler, raises
from transformer_tutorial.lm.compiled import CompiledSteps
from transformer_tutorial.lm.config import LLAMA, LMConfig
from transformer_tutorial.lm.deepseek_weights import DEEPSEEK
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.sampling import generate
from transformer_tutorial.quantization import quantize_linears

V = 17
BASE = dict(vocab_size=V, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_len=32, dropout=0.0)
CONFIGS = {
    "gpt": {},
    "llama gqa": dict(LLAMA, n_kv_heads=2),
    "window": dict(LLAMA, window=4),
    "mla": dict(
        DEEPSEEK,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
    ),
}


def peaked_lm(seed: int = 0, **changes) -> LanguageModel:
    """A random model with large weights: peaked distributions, no near-tie for a float order
    to flip."""
    torch.manual_seed(seed)
    lm = LanguageModel(LMConfig(**(BASE | changes))).eval()
    with torch.no_grad():
        for p in lm.parameters():
            p.mul_(8.0)
    return lm


@pytest.fixture
def fresh_dynamo():
    """No compiled graph from an earlier test, and its counters from zero (reset keeps them)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters["stats"]
    torch._dynamo.reset()


@needs_compiler
@pytest.mark.slow
def test_compiled_steps_give_the_eager_tokens_and_compile_no_new_length(fresh_dynamo):
    """Two rows and one, a stop id, the preallocated cache: the eager tokens. Once the lengths
    are symbols, a call for another number of new tokens (a cache of another size) compiles
    nothing (an error on recompiling), and the view's weights are the model's own."""
    lm = peaked_lm(seed=3)
    fast = CompiledSteps(lm)
    assert (
        fast.lm_head.weight is lm.lm_head.weight
        and fast.state_dict().keys() == lm.state_dict().keys()
    )

    def both(prompt: torch.Tensor, n: int) -> None:
        settings = dict(greedy=True, eos_id=2, cache_kind="preallocated")
        assert torch.equal(
            generate(fast, prompt, n, **settings), generate(lm, prompt, n, **settings)
        )

    for prompt in (torch.tensor([[1, 4, 2], [3, 3, 3]]), torch.tensor([[5]])):
        for n in (6, 12):
            both(prompt, n)
    # per batch size: a first graph, then the lengths as symbols (at most three: the cache's
    # count, then its capacity)
    assert 1 <= fresh_dynamo["unique_graphs"] <= 6, dict(fresh_dynamo)
    with torch._dynamo.config.patch(error_on_recompile=True):
        both(torch.tensor([[4]]), 9)


@needs_compiler
@pytest.mark.slow
@pytest.mark.parametrize(
    ("config", "kind"),
    [(c, k) for c in CONFIGS for k in ("preallocated", "growing")] + [("llama gqa", "paged")],
)
def test_every_attention_and_cache_kind_decodes_as_eager(config, kind, fresh_dynamo):
    """Each attention (multi-head, grouped, a sliding window, latent) with the preallocated and
    the growing cache, and the paged cache: the compiled steps give the eager greedy tokens."""
    lm = peaked_lm(**CONFIGS[config])
    prompt = torch.tensor([[1, 4, 2], [3, 3, 3]])

    def cache():
        options = dict(n_blocks=16, block_size=4) if kind == "paged" else {}
        return lm.new_cache(
            2, kind, max_len=BASE["max_len"] if kind != "growing" else None, **options
        )

    eager = generate(lm, prompt, 6, greedy=True, cache=cache())
    assert torch.equal(generate(CompiledSteps(lm), prompt, 6, greedy=True, cache=cache()), eager)


@needs_compiler
@pytest.mark.slow
def test_an_int8_model_at_batch_1_decodes_as_its_float32_products(fresh_dynamo):
    """An int8 model in float32 (the compiled one-row product and the eager int8 kernel differ
    only in float order there): the same greedy tokens, with a sampled row reproduced by a seed."""
    lm = quantize_linears(peaked_lm(**CONFIGS["llama gqa"]), bits=8, keep=())
    prompt = torch.tensor([[1, 4, 2]])
    for settings in ({"greedy": True}, {"top_k": 4}):
        outs = [
            generate(m, prompt, 8, generator=torch.Generator().manual_seed(0), **settings)
            for m in (lm, CompiledSteps(lm))
        ]
        assert torch.equal(*outs), settings


def test_other_calls_run_the_model_itself():
    """The prompt's step, a forward pass and a step without a cache never reach the compiler
    (no compiler needed): the model's own outputs."""
    lm = peaked_lm()
    fast = CompiledSteps(lm)
    fast._compiled_step = None  # a call to it would fail
    ids = torch.tensor([[1, 4, 2]])
    torch.testing.assert_close(fast(ids), lm(ids), rtol=0, atol=0)
    cache = fast.new_cache(1, "preallocated", max_len=8)
    logits, _ = fast.step(ids, cache)
    torch.testing.assert_close(logits, lm(ids), rtol=0, atol=0)
    assert cache.length == 3


@pytest.mark.parametrize(
    ("call", "error", "phrase"),
    [
        (lambda lm: CompiledSteps("model"), TypeError, "model must be a LanguageModel"),
        (lambda lm: CompiledSteps(CompiledSteps(lm)), TypeError, "compiled already"),
        (
            lambda lm: CompiledSteps(lm).step(torch.tensor([[V]]), lm.new_cache(1)),
            ValueError,
            "valid ids are 0 to 16",
        ),
    ],
)
def test_bad_input_is_refused_by_name(call, error, phrase):
    raises(lambda: call(peaked_lm()), error, phrase)
