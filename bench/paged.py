"""Section 10: the paged cache's overhead, greedy decoding with ``model.new_cache(B, "paged")``
÷ the same with ``model.new_cache(B, "preallocated")``, section 6's model (random weights, seed
0), one prompt length and batch 1 and 8.

Both run :func:`~transformer_tutorial.lm.sampling.generate` with the ready cache, the only
difference the cache: the preallocated one holds exactly the run's positions; the paged one has
blocks of :data:`BLOCK_SIZE` positions, just enough of them for every row, and gathers each
row's blocks at every step. The tokens are asserted equal before any timing (that run is the
first untimed one).

Then continuous batching's throughput: :data:`REQUESTS` requests of mixed prompt lengths and
budgets, decoded by :func:`~transformer_tutorial.lm.paged_cache.continuous_greedy` (all of them
may run at once, in a pool just large enough) ÷ the same requests decoded one after another by
:func:`~transformer_tutorial.lm.sampling.generate`; each request's tokens asserted equal first.
"""

from __future__ import annotations

import torch

from bench.cli import Settings
from bench.llama import MODELS
from bench.timing import interleaved
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.paged_cache import continuous_greedy
from transformer_tutorial.lm.sampling import generate

SIDES = ("preallocated", "paged")
BLOCK_SIZE = {"quick": 4, "full": 16}  # positions a block: each divides its model's max_len
# (batches, prompt length, new tokens): --quick, full (64 tokens: at 128, 2.5 minutes on 2 CPU
# cores, and the same ratio).
SHAPES = {"quick": ((1, 2), 4, 8), "full": ((1, 8), 8, 64)}
REQUESTS = 16  # continuous batching: requests of mixed lengths
# (prompt lengths, budgets) drawn uniformly from these ranges: --quick, full.
MIXED = {"quick": ((1, 8), (2, 10)), "full": ((4, 32), (8, 64))}


def bench_paged(s: Settings, device: torch.device) -> dict:
    """Section 10: for each batch, the two caches' tokens compared, then their decoding timed
    in turns; ratio = paged time ÷ preallocated time (> 1: the paged cache's overhead)."""
    kind = "quick" if s.quick else "full"
    batches, prompt_len, n = SHAPES[kind]
    block_size, total = BLOCK_SIZE[kind], prompt_len + n
    torch.manual_seed(0)
    model = LanguageModel(MODELS[s.llama_config]).to(device).eval()
    gen = torch.Generator().manual_seed(2)
    rows = []
    for batch in batches:
        prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=gen)
        prompt = prompt.to(device)
        n_blocks = batch * -(-total // block_size)  # every row's blocks, none to spare
        caches = {
            "preallocated": lambda b=batch: model.new_cache(b, "preallocated", max_len=total),
            "paged": lambda b=batch, nb=n_blocks: model.new_cache(
                b, "paged", n_blocks=nb, block_size=block_size
            ),
        }
        fns = {
            side: lambda c=caches[side], p=prompt: generate(model, p, n, greedy=True, cache=c())
            for side in SIDES
        }
        outs = {side: fn() for side, fn in fns.items()}
        same = torch.equal(outs["preallocated"], outs["paged"])
        assert same, f"the paged cache changed the greedy tokens at batch {batch}"
        timed = interleaved(fns, s.llama_repeats, s.warmup_after_check(), device)
        pre, paged = timed["preallocated"], timed["paged"]
        row = {
            "batch": batch,
            "prompt": prompt_len,
            "new_tokens": n,
            "block_size": block_size,
            "n_blocks": n_blocks,
            "preallocated_ms": 1e3 * pre["median_s"],
            "paged_ms": 1e3 * paged["median_s"],
            "preallocated_spread": pre["spread"],
            "paged_spread": paged["spread"],
            "ratio": paged["median_s"] / pre["median_s"],
            "same_tokens": same,
        }
        rows.append(row)
        print(
            f"  greedy {n} tokens ×{batch:<2} ({n_blocks} blocks of {block_size}): preallocated "
            f"{row['preallocated_ms']:8.1f} ms  paged {row['paged_ms']:8.1f} ms  ratio paged ÷ "
            f"preallocated {row['ratio']:.2f}  (tokens the same)",
            flush=True,
        )
    return {
        "config": s.llama_config,
        "weights": model.num_parameters(),
        "rows": rows,
        "batching": _batching(s, model, kind, device),
    }


def _batching(s: Settings, model: LanguageModel, kind: str, device: torch.device) -> dict:
    """Continuous batching's throughput ÷ one request after another's (see the module)."""
    (lo, hi), (b_lo, b_hi) = MIXED[kind]
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(lo, hi + 1, (REQUESTS,), generator=gen).tolist()
    budgets = torch.randint(b_lo, b_hi + 1, (REQUESTS,), generator=gen).tolist()
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in lengths]
    block_size = BLOCK_SIZE[kind]
    n_blocks = sum(-(-(n + b - 1) // block_size) for n, b in zip(lengths, budgets, strict=True))

    def one_by_one() -> list[list[int]]:
        return [
            generate(model, p[None].to(device), b, greedy=True)[0, len(p) :].tolist()
            for p, b in zip(prompts, budgets, strict=True)
        ]

    def batched() -> list[list[int]]:
        ids = [p.tolist() for p in prompts]
        return continuous_greedy(
            model, ids, budgets, max_batch=REQUESTS, n_blocks=n_blocks, block_size=block_size
        )

    same = one_by_one() == batched()
    assert same, "continuous batching changed a request's greedy tokens"
    timed = interleaved(
        {"one_by_one": one_by_one, "batched": batched}, s.llama_repeats, s.warmup, device
    )
    tokens = sum(budgets)
    row = {
        "requests": REQUESTS,
        "prompt_lengths": lengths,
        "budgets": budgets,
        "new_tokens": tokens,
        "block_size": block_size,
        "n_blocks": n_blocks,
        "one_by_one_s": timed["one_by_one"]["median_s"],
        "batched_s": timed["batched"]["median_s"],
        "one_by_one_tokens_per_s": tokens / timed["one_by_one"]["median_s"],
        "batched_tokens_per_s": tokens / timed["batched"]["median_s"],
        "speedup": timed["one_by_one"]["median_s"] / timed["batched"]["median_s"],
        "same_tokens": same,
    }
    print(
        f"  continuous batching, {REQUESTS} requests (prompts {lo}-{hi}, {b_lo}-{b_hi} new "
        f"tokens, {tokens} in all): one by one {row['one_by_one_tokens_per_s']:.1f} tokens/s, "
        f"batched {row['batched_tokens_per_s']:.1f} tokens/s, speed-up {row['speedup']:.2f} "
        f"(tokens the same)",
        flush=True,
    )
    return row
