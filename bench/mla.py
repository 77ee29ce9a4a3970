"""Section 8: chapter 21's latent attention, one decoding step in its absorbed form ÷ the same
step unabsorbed, after a cache of ``S`` positions: the layer alone, then through the model.

Both forms read the same :class:`~transformer_tutorial.lm.cache.SequenceBuffers` (the
latents and the rotary key) and give the same output, compared before any timing. The
unabsorbed step up-projects every cached latent to ``H`` keys and values; the absorbed one
folds the key's up-projection into the query and attends over the latents themselves. One
token per row, in float32, as decoding runs. Through the model (``LanguageModel.step``, as
``generate()`` decodes: its own choice, the absorbed form, against every layer told to stay
unabsorbed), one layer of the same widths after 1,024 and 4,096 cached positions; beside them,
in the same turns, the absorbed step after a single cached position: the step's *fixed part*
(embedding, projections, SwiGLU, norms, output layer — the same in both forms, whatever the
cache holds), so that each form's attention over the cache is its step less that part, and the
ratio a step can reach is bounded by how much of it the fixed part takes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from bench.cli import Settings
from bench.timing import interleaved
from transformer_tutorial.lm.cache import LMCache, SequenceBuffers
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.deepseek_weights import DEEPSEEK
from transformer_tutorial.lm.latent_attention import MultiHeadLatentAttention
from transformer_tutorial.lm.model import LanguageModel
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
# Through the model: the cached positions a decoding step follows (--quick: SHAPES' tiny
# widths), and the one layer's model around the attention: vocabulary, SwiGLU width ÷ D.
STEP_CACHED = {"quick": (16, 32), "full": (1024, 4096)}
STEP_VOCAB, STEP_FF = 1024, 3


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
        rotary=RotaryPositions(rope, max_len=cached + 1, layout="interleaved"),
    )
    return mla.to(device).eval()


def _step(
    mla: MultiHeadLatentAttention, x: torch.Tensor, cache: SequenceBuffers, absorbed: bool
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
    cache = SequenceBuffers(mla.cache_layout)
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
    row["model_steps"] = bench_mla_steps(s, device)
    return row


def build_model(shape: tuple[int, ...], max_len: int, device: torch.device) -> LanguageModel:
    """A one-layer DeepSeek-style model (chapter 21's ``LMConfig``) whose attention has
    ``shape``'s widths, random weights (seed 0), in eval mode."""
    d_model, heads, q_rank, kv_rank, nope, rope, v, _, _ = shape
    config = LMConfig(
        **DEEPSEEK,
        vocab_size=STEP_VOCAB,
        d_model=d_model,
        n_heads=heads,
        n_layers=1,
        d_ff=STEP_FF * d_model,
        max_len=max_len,
        dropout=0.0,
        q_lora_rank=q_rank,
        kv_lora_rank=kv_rank,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        rope_interleave=True,
    )
    torch.manual_seed(0)
    return LanguageModel(config).to(device).eval()


def _model_step(
    model: LanguageModel, token: torch.Tensor, cache: LMCache, absorbed: bool | None
) -> Callable[[], torch.Tensor]:
    """The timed call: ``model.step`` of one token per row, each layer's attention in the form
    ``absorbed`` says (None: its own choice, as ``generate()``), then the position rewound so
    that the cache stays as it was."""

    def run() -> torch.Tensor:
        for layer in model.layers:
            layer.self_attn.absorbed = absorbed
        with torch.no_grad():
            logits, _ = model.step(token, cache, check_ids=False)
        cache.rewind(1)
        return logits

    return run


def bench_mla_steps(s: Settings, device: torch.device) -> list[dict]:
    """Section 8 through the model: a prompt of the longest length read once (unabsorbed),
    then, rewinding to each length, one decoding step as ``generate()`` takes it (absorbed)
    and with every layer told to stay unabsorbed, logits compared, then timed in turns."""
    shape = SHAPES["quick" if s.quick else device.type]
    lengths = STEP_CACHED["quick" if s.quick else "full"]
    batch, longest = shape[7], max(lengths)
    model = build_model(shape, longest + 1, device)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, STEP_VOCAB, (batch, longest), generator=g).to(device)
    token = torch.randint(0, STEP_VOCAB, (batch, 1), generator=g).to(device)
    cache = model.new_cache(batch, "preallocated", max_len=longest + 1)
    one = model.new_cache(batch, "preallocated", max_len=2)  # the fixed part's: one position
    with torch.no_grad():
        model.step(prompt, cache)
        model.step(prompt[:, :1], one)
    attention = model.layers[0].self_attn
    rows = []
    for cached in sorted(lengths, reverse=True):
        cache.rewind(cache.length - cached)
        fns = {
            "absorbed": _model_step(model, token, cache, None),
            "unabsorbed": _model_step(model, token, cache, False),
            "fixed": _model_step(model, token, one, True),
        }
        outs = {name: fn() for name, fn in fns.items() if name != "fixed"}
        diff = (outs["absorbed"] - outs["unabsorbed"]).abs().max() / outs["unabsorbed"].abs().max()
        timed = interleaved(fns, s.repeats, s.warmup, device)
        absorbed, unabsorbed, fixed = timed["absorbed"], timed["unabsorbed"], timed["fixed"]
        attention.absorbed = None
        row = {
            "cached": cached,
            "default_form": "absorbed" if attention.absorbs(1, cached) else "unabsorbed",
            "absorbed_ms": 1e3 * absorbed["median_s"],
            "unabsorbed_ms": 1e3 * unabsorbed["median_s"],
            "absorbed_spread": absorbed["spread"],
            "unabsorbed_spread": unabsorbed["spread"],
            "ratio": unabsorbed["median_s"] / absorbed["median_s"],
            "fixed_ms": 1e3 * fixed["median_s"],
            "fp32_logits_diff": diff.item(),
            "same_output": diff.item() <= OUTPUT_RTOL,
        }
        fixed_share = row["fixed_ms"] / row["absorbed_ms"]
        over = (row["absorbed_ms"] - row["fixed_ms"], row["unabsorbed_ms"] - row["fixed_ms"])
        row["attention_ratio"] = over[1] / over[0] if over[0] > 0 else None
        rows.append(row)
        print(
            f"  model.step, B={batch} after S={cached}: generate()'s ({row['default_form']}) "
            f"{row['absorbed_ms']:8.2f} ms  unabsorbed {row['unabsorbed_ms']:8.2f} ms  ratio "
            f"{row['ratio']:.2f}  (fp32 logits differ by {diff.item():.0e} of the largest); the "
            f"fixed part (the step after 1 position) {row['fixed_ms']:.2f} ms, {fixed_share:.0%} "
            f"of the absorbed step; attention over the cache: absorbed {over[0]:.2f} ms, "
            f"unabsorbed {over[1]:.2f} ms",
            flush=True,
        )
    return rows[::-1]
