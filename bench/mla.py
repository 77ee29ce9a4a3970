"""Section 8: chapter 21's latent attention, one decoding step in its absorbed form ÷ the same
step unabsorbed, after a cache of ``S`` positions.

Both forms read the same :class:`~transformer_tutorial.lm.cache.LatentKVCache` (the
latents and the rotary key) and give the same output, compared before any timing. The
unabsorbed step up-projects every cached latent to ``H`` keys and values; the absorbed one
folds the key's up-projection into the query and attends over the latents themselves. One
token per row, in float32, as decoding runs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from bench.cli import Settings
from bench.timing import interleaved
from transformer_tutorial.lm.cache import LatentKVCache
from transformer_tutorial.lm.latent_attention import MultiHeadLatentAttention
from transformer_tutorial.lm.rotary import RotaryPositions

SIDES = {"absorbed": "absorbed", "unabsorbed": "unabsorbed"}
# (D, H, q_lora_rank, Dc, Dn, Dr, Dv, batch, cached positions): --quick; the CPU (DeepSeek-V3's
# head widths and latent with 16 heads); CUDA (DeepSeek-V3's attention layer, 128 heads).
SHAPES = {
    "quick": (32, 4, 12, 16, 8, 6, 10, 2, 16),
    "cpu": (1024, 16, 384, 512, 128, 64, 128, 1, 2048),
    "cuda": (7168, 128, 1536, 512, 128, 64, 128, 4, 4096),
}
OUTPUT_RTOL = 1e-4  # float32, the products in other orders; a wrong fold: ~1
CHUNK = 256  # prompt positions written to the cache at a time


def build(shape: tuple[int, ...], device: torch.device) -> MultiHeadLatentAttention:
    """One layer of latent attention, random weights (seed 0), in eval mode."""
    d_model, heads, q_rank, kv_rank, nope, rope, v, _, cached = shape
    torch.manual_seed(0)
    mla = MultiHeadLatentAttention(
        d_model,
        heads,
        q_lora_rank=q_rank,
        kv_lora_rank=kv_rank,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        positions=RotaryPositions(rope, max_len=cached + 1, layout="interleaved"),
    )
    return mla.to(device).eval()


def _step(
    mla: MultiHeadLatentAttention, x: torch.Tensor, cache: LatentKVCache, absorbed: bool
) -> Callable[[], torch.Tensor]:
    """The timed call: one new token per row after the cache (a copy, so it stays as it was)."""

    def run() -> torch.Tensor:
        with torch.no_grad():
            return mla(x, cache=copy.copy(cache), absorbed=absorbed)

    return run


def bench_mla(s: Settings, device: torch.device) -> dict:
    """Section 8: the two forms' outputs compared, then their decoding steps timed in turns."""
    shape = SHAPES["quick" if s.quick else device.type]
    d_model, heads, _, kv_rank, _, rope, _, batch, cached = shape
    mla = build(shape, device)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randn(batch, cached, d_model, generator=g).to(device)  # (B, S, D)
    x = torch.randn(batch, 1, d_model, generator=g).to(device)  # (B, 1, D)
    cache = LatentKVCache()
    with torch.no_grad():  # the prompt in chunks: its scores stay (B, 1, H · CHUNK, S) at most
        for start in range(0, cached, CHUNK):
            mla(prompt[:, start : start + CHUNK], cache=cache, absorbed=True)
    fns = {SIDES[side]: _step(mla, x, cache, side == "absorbed") for side in SIDES}
    outs = {name: fn() for name, fn in fns.items()}
    diff = (outs["absorbed"] - outs["unabsorbed"]).abs().max() / outs["unabsorbed"].abs().max()
    timed = interleaved(fns, s.repeats, s.warmup, device)
    absorbed, unabsorbed = (timed[name] for name in SIDES.values())
    row = {
        "d_model": d_model,
        "heads": heads,
        "kv_lora_rank": kv_rank,
        "qk_rope_head_dim": rope,
        "batch": batch,
        "cached": cached,
        "cache_mib": cache.nbytes / 2**20,
        "absorbed_ms": 1e3 * absorbed["median_s"],
        "unabsorbed_ms": 1e3 * unabsorbed["median_s"],
        "absorbed_spread": absorbed["spread"],
        "unabsorbed_spread": unabsorbed["spread"],
        "ratio": unabsorbed["median_s"] / absorbed["median_s"],
        "fp32_output_diff": diff.item(),
        "same_output": diff.item() <= OUTPUT_RTOL,
    }
    print(
        f"  decode step, B={batch} after S={cached} (cache {row['cache_mib']:.1f} MiB), D="
        f"{d_model} H={heads} Dc={kv_rank}: absorbed {row['absorbed_ms']:8.2f} ms  unabsorbed "
        f"{row['unabsorbed_ms']:8.2f} ms  ratio unabsorbed ÷ absorbed {row['ratio']:.2f}  (fp32 "
        f"outputs differ by {diff.item():.0e} of the largest)",
        flush=True,
    )
    return row
