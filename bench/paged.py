"""Section 10: the paged cache's overhead, greedy decoding with
:func:`~transformer_tutorial.lm.paged_cache.paged_cache` ÷ the same with
:func:`~transformer_tutorial.lm.paged_cache.preallocated_cache`, section 6's model (random
weights, seed 0), one prompt length and batch 1 and 8.

Both run :func:`~transformer_tutorial.lm.paged_cache.greedy_with_cache`, the only difference
the cache: the preallocated one holds exactly the run's positions; the paged one has blocks of
:data:`BLOCK_SIZE` positions, just enough of them for every row, and gathers each row's blocks
at every step. The tokens are asserted equal before any timing (that run is the first untimed
one).
"""

from __future__ import annotations

import torch

from bench.cli import Settings
from bench.llama import MODELS
from bench.timing import interleaved
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.paged_cache import greedy_with_cache, paged_cache, preallocated_cache

SIDES = ("preallocated", "paged")
BLOCK_SIZE = {"quick": 4, "full": 16}  # positions a block: each divides its model's max_len
# (batches, prompt length, new tokens): --quick, full (64 tokens: at 128, 2.5 minutes on 2 CPU
# cores, and the same ratio).
SHAPES = {"quick": ((1, 2), 4, 8), "full": ((1, 8), 8, 64)}


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
            "preallocated": lambda b=batch: preallocated_cache(model, b, max_len=total),
            "paged": lambda b=batch, nb=n_blocks: paged_cache(
                model, b, n_blocks=nb, block_size=block_size
            ),
        }
        fns = {
            side: lambda c=caches[side], p=prompt: greedy_with_cache(model, p, n, c())
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
    return {"config": s.llama_config, "weights": model.num_parameters(), "rows": rows}
