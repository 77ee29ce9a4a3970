"""Section 7: chapter 20's mixture-of-experts layer, ours ÷ ``transformers``'
``Qwen3MoeSparseMoeBlock`` built from the same sizes with the same weights: a forward pass
(eval, no gradients) and a training pass (forward and backward), at a few expert counts.

Both sides run in one process, in float32, on the same tokens. Theirs is the block as
``Qwen3MoeForCausalLM`` builds it (its experts' ``"eager"`` loop over the experts hit);
ours groups the tokens by expert with one sort. The weights are copied with the package's
tested mapping (:func:`~transformer_tutorial.lm.moe_weights.copy_block_to_qwen3_moe`) and the
outputs compared before any timing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from bench.cli import Settings
from bench.timing import interleaved
from transformer_tutorial.lm.moe import MixtureOfExperts
from transformer_tutorial.lm.moe_weights import copy_block_to_qwen3_moe

SIDES = {"ours": "ours", "theirs": "Qwen3MoeSparseMoeBlock"}
# (D, F, tokens, [(E, k), ...]): --quick; the CPU (Qwen3-30B-A3B's 128 experts and 8 per token
# at a width the CPU can run); CUDA (Qwen3-30B-A3B's layer: D 2048, F 768).
SHAPES = {
    "quick": (32, 16, 16, [(4, 2)]),
    "cpu": (256, 128, 512, [(8, 2), (128, 8)]),
    "cuda": (2048, 768, 4096, [(8, 2), (128, 8)]),
}
OUTPUT_RTOL = 1e-4  # float32, the products in other orders; a wrong weight: ~1


def build_pair(
    d_model: int, d_ff: int, n_experts: int, top_k: int, device: torch.device
) -> tuple[MixtureOfExperts, Qwen3MoeSparseMoeBlock]:
    """Ours (renormalised top-k, as Qwen3-30B-A3B) and theirs, our weights copied into it."""
    config = Qwen3MoeConfig(
        hidden_size=d_model,
        moe_intermediate_size=d_ff,
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
    )
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    ours = MixtureOfExperts(d_model, d_ff, n_experts, top_k, norm_topk_prob=True)
    theirs = Qwen3MoeSparseMoeBlock(config)
    copy_block_to_qwen3_moe(ours, theirs)
    return ours.to(device), theirs.to(device)


def _row(timed: dict, **fields: object) -> dict:
    ours, theirs = (timed[name] for name in SIDES.values())
    return {
        **fields,
        "ours_ms": 1e3 * ours["median_s"],
        "theirs_ms": 1e3 * theirs["median_s"],
        "ours_spread": ours["spread"],
        "theirs_spread": theirs["spread"],
        "ratio": theirs["median_s"] / ours["median_s"],
    }


def _pass(block: torch.nn.Module, x: torch.Tensor, mode: str) -> Callable[[], None]:
    """The timed call: ``"forward"`` without gradients, or ``"train"``, forward and backward."""

    def run() -> None:
        if mode == "forward":
            with torch.no_grad():
                block(x)
        else:
            block(x).square().mean().backward()

    return run


def bench_moe(s: Settings, device: torch.device) -> dict:
    """Section 7: for each (E, k), the outputs compared, then the forward pass and the training
    pass timed in turns."""
    kind = "quick" if s.quick else device.type
    d_model, d_ff, n_tokens, experts = SHAPES[kind]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, n_tokens, d_model, generator=g).to(device)  # (B, T, D)
    rows = []
    for n_experts, top_k in experts:
        pair = dict(zip(SIDES, build_pair(d_model, d_ff, n_experts, top_k, device), strict=True))
        with torch.no_grad():
            ours, theirs = (block(x) for block in pair.values())
            diff = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        for mode in ("forward", "train"):
            fns = {SIDES[side]: _pass(block, x, mode) for side, block in pair.items()}
            row = _row(
                interleaved(fns, s.repeats, s.warmup, device),
                mode=mode,
                n_experts=n_experts,
                top_k=top_k,
                tokens=n_tokens,
                d_model=d_model,
                d_ff=d_ff,
                fp32_output_diff=diff,
                same_output=diff <= OUTPUT_RTOL,
            )
            rows.append(row)
            print(
                f"  {mode:<7} E={n_experts:<3} k={top_k} N={n_tokens} D={d_model} F={d_ff}: "
                f"ours {row['ours_ms']:8.2f} ms  Qwen3MoeSparseMoeBlock {row['theirs_ms']:8.2f} ms"
                f"  throughput ratio {row['ratio']:.2f}  (fp32 outputs differ by {diff:.0e} of "
                "the largest)",
                flush=True,
            )
    return {"rows": rows}
