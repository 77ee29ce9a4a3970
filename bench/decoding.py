"""Section 3: greedy decoding of exactly n tokens, with the KV cache and recomputing the prefix."""

from __future__ import annotations

import torch

from bench.cli import Settings
from bench.models import build_pair, make_batch
from bench.timing import interleaved
from transformer_tutorial.data import BOS_ID, EOS_ID, PAD_ID
from transformer_tutorial.decode import greedy_decode
from transformer_tutorial.precision import autocast


def bench_decoding(s: Settings, device: torch.device) -> list[dict]:
    """Section 3: the KV cache's speed-up over recomputing, for each of ``s.decode_tokens``."""
    model, _, vocab = build_pair(s.decode_config, device)
    model.eval()
    src = make_batch(vocab, 32, 24, device)[0]
    special = {"bos_id": BOS_ID, "eos_id": EOS_ID, "pad_id": PAD_ID}
    rows = []
    for n in s.decode_tokens:

        def decode(use_cache: bool, n: int = n) -> None:
            with autocast(s.precision, device):
                greedy_decode(model, src, max_len=n, min_len=n, use_cache=use_cache, **special)

        fns = {"cache": lambda: decode(True), "recompute": lambda: decode(False)}
        timed = interleaved(fns, max(s.repeats - 2, 1), 1, device)
        cache, recompute = timed["cache"]["median_s"], timed["recompute"]["median_s"]
        rows.append(
            {
                "config": s.decode_config,
                "tokens": n,
                "sentences": src.size(0),
                "cache_ms": 1e3 * cache,
                "recompute_ms": 1e3 * recompute,
                "speedup": recompute / cache,
            }
        )
        print(
            f"  greedy {n:>4} tokens ×{src.size(0)}: KV cache {1e3 * cache:8.1f} ms  recompute "
            f"{1e3 * recompute:8.1f} ms  speed-up {recompute / cache:.2f}×",
            flush=True,
        )
    return rows
