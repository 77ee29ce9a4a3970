"""Chapter 23: the preallocated and the paged cache give chapter 17's tokens (greedy, Llama- and
Qwen3-style, float64), for every attention (GPT-2's, chapter 16's, chapter 21's latents);
continuous batching gives each request the tokens it gets alone; bad block sizes and kinds are
refused by name."""

from __future__ import annotations

import pytest
import torch

from helpers import raises
from transformer_tutorial.lm.config import LLAMA, QWEN3, LMConfig
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.paged_cache import BlockAllocator, Scheduler, continuous_greedy
from transformer_tutorial.lm.sampling import generate

STYLES = {"llama": LLAMA, "qwen3": QWEN3}
MLA = dict(attention="mla", kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)


def paged_cache(model: LanguageModel, batch_size: int, **options) -> object:
    return model.new_cache(batch_size, "paged", **options)


def greedy_with_cache(model: LanguageModel, prompt: torch.Tensor, n: int, cache) -> torch.Tensor:
    return generate(model, prompt, n, greedy=True, cache=cache)


def _model(style: str, seed: int = 0, **overrides) -> LanguageModel:
    torch.manual_seed(seed)
    config = LMConfig(
        vocab_size=50,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        n_layers=2,
        d_ff=64,
        max_len=48,
        **(STYLES[style] | overrides),
    )
    return LanguageModel(config).double().eval()


@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("seed", [0, 1])
def test_preallocated_and_paged_give_the_growing_caches_tokens(style, seed):
    model = _model(style, seed)
    prompt = torch.randint(0, 50, (3, 5), generator=torch.Generator().manual_seed(seed))
    want = generate(model, prompt, 30, greedy=True)
    got = greedy_with_cache(model, prompt, 30, model.new_cache(3, "preallocated"))
    assert torch.equal(got, want)
    paged = paged_cache(model, 3, n_blocks=27, block_size=4)  # 35 positions: 9 blocks a row
    assert torch.equal(greedy_with_cache(model, prompt, 30, paged), want)


def test_a_preallocated_cache_runs_past_a_sliding_window():
    model = _model("qwen3", window=4)
    prompt = torch.randint(0, 50, (2, 3), generator=torch.Generator().manual_seed(2))
    want = generate(model, prompt, 20, greedy=True)
    assert torch.equal(
        greedy_with_cache(model, prompt, 20, model.new_cache(2, "preallocated")), want
    )
    small = model.new_cache(2, "preallocated", max_len=8)  # full: keeps the window's last 3
    assert torch.equal(greedy_with_cache(model, prompt, 20, small), want)


@pytest.mark.parametrize("style", sorted(STYLES))
def test_continuous_batching_gives_each_request_its_tokens_alone(style):
    """Seven requests of prompt lengths 1-9 and budgets 2-17, at most three at a time, in
    blocks of 4 positions from a pool too small to hold all seven at once: each gets exactly
    the tokens generate() gives it alone."""
    model = _model(style, 3)
    g = torch.Generator().manual_seed(4)
    lengths, budgets = [5, 1, 9, 3, 7, 2, 4], [17, 6, 2, 11, 9, 14, 5]
    prompts = [torch.randint(0, 50, (n,), generator=g).tolist() for n in lengths]
    got = continuous_greedy(model, prompts, budgets, max_batch=3, n_blocks=18, block_size=4)
    for prompt, n, tokens in zip(prompts, budgets, got, strict=True):
        alone = generate(model, torch.tensor([prompt]), n, greedy=True)[0, len(prompt) :]
        assert tokens == alone.tolist()


def test_continuous_batching_stops_a_request_at_eos():
    model = _model("llama", 5)
    prompts = [[1, 2, 3], [4, 5]]
    free = continuous_greedy(model, prompts, [12, 12], max_batch=2, n_blocks=8, block_size=4)
    eos = free[0][3]
    got = continuous_greedy(
        model, prompts, [12, 12], max_batch=2, n_blocks=8, block_size=4, eos_id=eos
    )
    assert got[0] == free[0][: free[0].index(eos) + 1]
    stop = free[1].index(eos) + 1 if eos in free[1] else 12
    assert got[1] == free[1][:stop]


@pytest.mark.parametrize("n_blocks", [6, 10])
def test_a_pool_too_small_for_all_finishes_them_all_by_preempting(n_blocks):
    """The seven requests above in 6 blocks (the largest request alone) or 10: the scheduler
    admits by free blocks and preempts (recomputing later) instead of failing; each request
    still gets its tokens alone."""
    model = _model("llama", 3)
    g = torch.Generator().manual_seed(4)
    lengths, budgets = [5, 1, 9, 3, 7, 2, 4], [17, 6, 2, 11, 9, 14, 5]
    prompts = [torch.randint(0, 50, (n,), generator=g).tolist() for n in lengths]
    scheduler = Scheduler(model, max_batch=7, n_blocks=n_blocks, block_size=4)
    got = scheduler.run(prompts, budgets)
    for prompt, n, tokens in zip(prompts, budgets, got, strict=True):
        alone = generate(model, torch.tensor([prompt]), n, greedy=True)[0, len(prompt) :]
        assert tokens == alone.tolist()
    assert scheduler.preemptions > 0
    assert len(scheduler.allocator.free) == n_blocks  # every block given back


def test_any_pool_that_fits_the_largest_request_loses_no_work():
    """Random requests (lengths, budgets, order), batch limits, block sizes and pools from the
    largest request alone upwards: every request gets the tokens generate() gives it alone."""
    model = _model("qwen3", 6)
    g = torch.Generator().manual_seed(7)
    preempted = 0
    for _ in range(12):
        n = int(torch.randint(1, 9, (1,), generator=g))
        lengths = torch.randint(1, 12, (n,), generator=g).tolist()
        budgets = torch.randint(0, 20, (n,), generator=g).tolist()
        prompts = [torch.randint(0, 50, (k,), generator=g).tolist() for k in lengths]
        block_size = int(torch.randint(1, 7, (1,), generator=g))
        held = [k + b - 1 for k, b in zip(lengths, budgets, strict=True)]
        largest = max(1, *(-(-h // block_size) for h in held))
        n_blocks = largest + int(torch.randint(0, 2 * largest, (1,), generator=g))
        max_batch = int(torch.randint(1, n + 1, (1,), generator=g))
        scheduler = Scheduler(model, max_batch=max_batch, n_blocks=n_blocks, block_size=block_size)
        got = scheduler.run(prompts, budgets)
        for prompt, b, tokens in zip(prompts, budgets, got, strict=True):
            alone = generate(model, torch.tensor([prompt]), b, greedy=True)[0, len(prompt) :]
            assert tokens == alone.tolist()
        assert len(scheduler.allocator.free) == n_blocks
        preempted += scheduler.preemptions
    assert preempted > 0  # the cases exercised preemption


def test_a_block_size_need_not_divide_max_len():
    model = _model("llama", 2)
    prompt = torch.randint(0, 50, (2, 4), generator=torch.Generator().manual_seed(2))
    want = generate(model, prompt, 44, greedy=True)  # 47 positions cached: max_len 48
    paged = paged_cache(model, 2, n_blocks=20, block_size=5)  # 10 blocks a row, the last part-full
    assert torch.equal(greedy_with_cache(model, prompt, 44, paged), want)


def test_blocks_are_given_back():
    allocator = BlockAllocator(4, 2)
    assert allocator.reserve(7, 3) == [0, 1]
    assert allocator.reserve(8, 4) == [2, 3]
    raises(lambda: allocator.reserve(7, 5), RuntimeError, "all 4 blocks of 2 positions")
    allocator.release(8)
    assert allocator.reserve(7, 5) == [0, 1, 2]


def _greedy(prompts, budgets, *, max_batch=2, n_blocks=4, block_size=4, eos_id=None):
    """A call of continuous_greedy on the model it is given, for the bad-input table."""
    return lambda m: continuous_greedy(
        m,
        prompts,
        budgets,
        max_batch=max_batch,
        n_blocks=n_blocks,
        block_size=block_size,
        eos_id=eos_id,
    )


@pytest.mark.parametrize(
    "call, error, phrase",
    [
        (lambda m: paged_cache(m, 1, n_blocks=4, block_size=0), ValueError, "block_size must be"),
        (lambda m: paged_cache(m, 1, n_blocks=0, block_size=4), ValueError, "n_blocks must be"),
        (
            lambda m: continuous_greedy(m, [[1]], [2, 3], max_batch=1, n_blocks=4, block_size=4),
            ValueError,
            "must pair up",
        ),
        (_greedy([[1, 2]], [-1]), ValueError, "max_new_tokens[0] must be at least 0"),
        (_greedy([[1], []], [2, 2]), ValueError, "prompts[1] is empty"),
        (_greedy([[1, 50]], [2]), ValueError, "prompts[0] holds a token outside 0 … 49"),
        (_greedy([[1]], [2], eos_id=50), ValueError, "eos_id=50 is outside the vocabulary"),
        (_greedy([[1]], [2], max_batch=0), ValueError, "max_batch must be at least 1"),
        (_greedy([[1], [2] * 40], [2, 10]), ValueError, "request 1 needs 49 positions"),
        (_greedy([[1] * 10], [8], n_blocks=4), ValueError, "more than the whole pool holds"),
    ],
)
def test_bad_input_is_refused_by_name(call, error, phrase):
    raises(lambda: call(_model("llama")), error, phrase)


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_every_attention_decodes_from_every_cache(attention):
    """The caches keep whatever layout an attention declares: GPT-2's keys and values and
    chapter 21's latents give the growing cache's tokens from a preallocated and a paged cache,
    and continuous batching serves latent attention too."""
    torch.manual_seed(3)
    changes = {} if attention == "mha" else dict(LLAMA, **MLA)
    config = LMConfig(vocab_size=20, d_model=16, n_heads=2, n_layers=2, max_len=24, **changes)
    model = LanguageModel(config).double().eval()
    prompt = torch.randint(0, 20, (2, 3), generator=torch.Generator().manual_seed(4))
    want = generate(model, prompt, 12, greedy=True)
    for cache in (
        model.new_cache(2, "preallocated"),
        paged_cache(model, 2, n_blocks=8, block_size=4),
    ):
        assert torch.equal(greedy_with_cache(model, prompt, 12, cache), want)
    if attention == "mla":
        prompts, budgets = [[1, 2, 3], [4, 5], [6, 7, 8, 9]], [6, 9, 4]
        got = continuous_greedy(model, prompts, budgets, max_batch=2, n_blocks=6, block_size=4)
        for p, b, tokens in zip(prompts, budgets, got, strict=True):
            assert (
                tokens == generate(model, torch.tensor([p]), b, greedy=True)[0, len(p) :].tolist()
            )


def test_the_paged_cache_refuses_a_sliding_window_by_name():
    model = _model("llama", window=4)
    cache = paged_cache(model, 1, n_blocks=2, block_size=4)
    raises(lambda: model.step(torch.tensor([[1, 2]]), cache), ValueError, "no sliding window")
    assert cache.length == 0


def test_caches_hold_the_activations_dtype_of_a_quantized_bf16_model():
    """Weight-only quantization keeps the activations in bf16 while a QuantizedLinear's weight
    reads back in float32: the preallocated and paged caches take the embedding's dtype."""
    from transformer_tutorial.quantization import quantize_linears

    model = quantize_linears(_model("llama").float().to(torch.bfloat16), bits=8, keep=())
    prompt = torch.randint(0, 50, (2, 4), generator=torch.Generator().manual_seed(5))
    want = greedy_with_cache(model, prompt, 8, model.new_cache(2))
    for cache in (
        model.new_cache(2, "preallocated"),
        paged_cache(model, 2, n_blocks=6, block_size=4),
    ):
        assert cache.layers[0].nbytes > 0
        assert torch.equal(greedy_with_cache(model, prompt, 8, cache), want)


# --- API probes (issue 42): each bad call, and what its error must say ------------------------

PAGED_PROBES = {
    "paged: no blocks given": (
        lambda m: m.new_cache(1, "paged"),
        ValueError,
        "the paged cache needs n_blocks and block_size",
    ),
    "paged_cache: allocator a str": (
        lambda m: paged_cache(m, 1, n_blocks=4, block_size=4, allocator="pool"),
        TypeError,
        "allocator must be a BlockAllocator or None, got str",
    ),
    "paged_cache: allocator of other blocks": (
        lambda m: paged_cache(m, 1, n_blocks=4, block_size=4, allocator=BlockAllocator(8, 2)),
        ValueError,
        "allocator cuts 8 blocks of 2 positions; the pools have n_blocks=4 of block_size=4",
    ),
    "Scheduler: a dict for the model": (
        lambda m: Scheduler({}, max_batch=1, n_blocks=4, block_size=4),
        TypeError,
        "model must be a LanguageModel, got dict",
    ),
    "reserve: length -1": (
        lambda m: BlockAllocator(4, 4).reserve(0, -1),
        ValueError,
        "length must be at least 0, got -1",
    ),
    "reserve: length a float": (
        lambda m: BlockAllocator(4, 4).reserve(0, 2.5),
        TypeError,
        "length must be an int, got 2.5",
    ),
}


@pytest.mark.parametrize(
    ("call", "error", "phrase"), PAGED_PROBES.values(), ids=PAGED_PROBES.keys()
)
def test_bad_calls_name_the_argument_and_what_is_valid(call, error, phrase):
    raises(lambda: call(_model("llama")), error, phrase)


def test_a_refused_reservation_takes_no_block():
    """A sequence that outgrew the pool kept the blocks it had taken before the pool ran out."""
    allocator = BlockAllocator(2, 2)
    allocator.reserve(0, 2)
    raises(lambda: allocator.reserve(1, 8), RuntimeError, "all 2 blocks of 2 positions")
    assert allocator.free == [1] and allocator.tables == {0: [0]}


def test_a_step_the_pool_cannot_hold_takes_no_block():
    """All rows' blocks are reserved at once or none: a refused step leaves the pool as it was,
    and a step that fits still runs."""
    model = _model("llama")
    cache = paged_cache(model, 2, n_blocks=3, block_size=2)
    raises(lambda: model.step(torch.ones(2, 5, dtype=torch.long), cache), RuntimeError, "in use")
    allocator = cache.layers[0].allocator
    assert allocator.tables == {} and len(allocator.free) == 3 and cache.length == 0
    model.step(torch.ones(2, 2, dtype=torch.long), cache)
    assert cache.length == 2 and len(allocator.free) == 1
