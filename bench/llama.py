"""Section 6: chapter 17's Llama-style model, ours ÷ ``transformers``' ``LlamaForCausalLM`` built
from the same config with the same weights: a training step, and greedy generation with a cache.

Both sides run in one process with the same dtype, the same mode (train or eval) and, on CUDA,
the same bf16 autocast; theirs uses its ``"sdpa"`` attention, as ours does. The weights are
copied with the package's tested mapping
(:func:`~transformer_tutorial.lm.hf_weights.copy_to_llama`) and, before any timing, checked in
float32: the same logits on a batch, the same greedy tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import product

import torch
from torch import Tensor, nn
from transformers import LlamaForCausalLM

from bench.cli import Settings
from bench.timing import interleaved
from transformer_tutorial.lm.config import LLAMA, LMConfig
from transformer_tutorial.lm.hf_weights import copy_to_llama, llama_config
from transformer_tutorial.lm.model import LanguageModel, next_token_loss
from transformer_tutorial.lm.sampling import generate
from transformer_tutorial.precision import autocast

# The sides: their names in the timings, and the prefix of their keys in a row.
SIDES = {"ours": "ours", "theirs": "LlamaForCausalLM"}
# The models, dropout off (so train mode computes the same on both sides): "capstone" is chapter
# 17's GPT-2-small-sized Llama (50,257 tokens, 12 layers of 768, 4 key/value heads, an output
# layer of its own: 153 M weights), "tiny" a smoke test's.
MODELS = {
    "tiny": LMConfig(
        vocab_size=100,
        d_model=32,
        n_heads=4,
        n_layers=2,
        d_ff=64,
        max_len=32,
        dropout=0.0,
        **(LLAMA | dict(n_kv_heads=2)),
    ),
    "capstone": LMConfig(
        vocab_size=50_257, dropout=0.0, **(LLAMA | dict(d_ff=2048, n_kv_heads=4))
    ),
}
# Float32 on both sides, F.sdpa in different kernels and orders: logits differ by ~1e-6 of their
# largest (H200, the capstone: 7e-6 in the loss). A weight copied to the wrong place: ~1.
LOGITS_RTOL = 1e-4


def build_pair(name: str, device: torch.device) -> tuple[LanguageModel, LlamaForCausalLM]:
    """Our model of ``MODELS[name]`` and theirs of the same config, our weights copied into it."""
    config = MODELS[name]
    torch.manual_seed(0)
    ours = LanguageModel(config).to(device)
    hf_config = llama_config(config)
    hf_config._attn_implementation = "sdpa"
    theirs = LlamaForCausalLM(hf_config).to(device)
    copy_to_llama(ours, theirs)
    return ours, theirs


def logits_fn(side: str, model: nn.Module) -> Callable[[Tensor], Tensor]:
    """Token ids ``(B, T)`` → logits ``(B, T, V)``: theirs without building a cache in training
    (what a training loop asks of it)."""
    if side == "ours":
        return model
    return lambda ids: model(input_ids=ids, use_cache=False).logits


class LMTrainStep:
    """One training step: forward, next-token loss, backward, AdamW; the same loss function and
    optimizer settings on both sides."""

    def __init__(self, side: str, model: nn.Module, ids: Tensor, precision: str) -> None:
        self.model, self.ids, self.precision = model, ids, precision
        self.logits = logits_fn(side, model)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def forward(self, precision: str | None = None) -> Tensor:
        """The logits of the batch, in training mode (``precision``: the step's by default)."""
        self.model.train()
        with autocast(precision or self.precision, self.ids.device):
            return self.logits(self.ids)

    def __call__(self) -> None:
        loss = next_token_loss(self.forward(), self.ids)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


def greedy_fn(
    side: str, model: nn.Module, prompt: Tensor, n: int, precision: str
) -> Callable[[], Tensor]:
    """Greedy decoding of exactly ``n`` new tokens after ``prompt`` ``(B, T0)``, eval mode:
    ours with its KV cache, theirs with ``generate`` (its cache, no end-of-sequence token)."""

    @torch.no_grad()
    def decode() -> Tensor:
        model.eval()
        with autocast(precision, prompt.device):
            if side == "ours":
                return generate(model, prompt, n, greedy=True)
            return model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                max_new_tokens=n,
                pad_token_id=0,
                eos_token_id=None,
            )

    return decode


def _row(timed: dict, **fields: object) -> dict:
    """Each side's median and spread, and the throughput ratio ours ÷ theirs (> 1: ours faster)."""
    ours, theirs = (timed[name] for name in SIDES.values())
    return {
        **fields,
        "ours_ms": 1e3 * ours["median_s"],
        "theirs_ms": 1e3 * theirs["median_s"],
        "ours_spread": ours["spread"],
        "theirs_spread": theirs["spread"],
        "ratio": theirs["median_s"] / ours["median_s"],
    }


def logits_difference(ours: Tensor, theirs: Tensor) -> float:
    """The largest difference of two sides' logits, as a share of the largest logit."""
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def _batch(vocab: int, batch: int, length: int, device: torch.device) -> Tensor:
    gen = torch.Generator().manual_seed(batch * 1000 + length)
    return torch.randint(0, vocab, (batch, length), generator=gen).to(device)


def train_rows(
    s: Settings, models: dict[str, nn.Module], vocab: int, device: torch.device
) -> list[dict]:
    """(a) The training step at each of ``s.llama_train_shapes``; the two sides' logits compared
    first."""
    rows = []
    for batch, length in s.llama_train_shapes:
        ids = _batch(vocab, batch, length, device)
        steps = {
            name: LMTrainStep(side, models[side], ids, s.precision) for side, name in SIDES.items()
        }
        with torch.no_grad():  # before any step: the same weights
            diff = logits_difference(*(step.forward("fp32") for step in steps.values()))
        row = _row(
            interleaved(steps, s.llama_repeats, s.warmup, device),
            batch=batch,
            length=length,
            fp32_logits_diff=diff,
            same_logits=diff <= LOGITS_RTOL,
        )
        rows.append(row)
        print(
            f"  train step   B={batch:<3} T={length:<4} ours {row['ours_ms']:8.1f} ms  "
            f"LlamaForCausalLM {row['theirs_ms']:8.1f} ms  throughput ratio {row['ratio']:.2f}  "
            f"(fp32 logits differ by {diff:.0e} of the largest)",
            flush=True,
        )
    return rows


def generate_rows(
    s: Settings, models: dict[str, nn.Module], vocab: int, device: torch.device
) -> list[dict]:
    """(b) Greedy generation of each of ``s.llama_new_tokens`` after each of
    ``s.llama_prompts`` (sentences, length); the two sides' tokens compared first, in float32
    (on a CPU that run is the first untimed one)."""
    rows = []
    for (batch, length), n in product(s.llama_prompts, s.llama_new_tokens):
        prompt = _batch(vocab, batch, length, device)
        fns = {
            name: greedy_fn(side, models[side], prompt, n, s.precision)
            for side, name in SIDES.items()
        }
        checks = [greedy_fn(side, models[side], prompt, n, "fp32")() for side in SIDES]
        same = checks[0].shape == checks[1].shape and torch.equal(checks[0], checks[1])
        row = _row(
            interleaved(fns, s.llama_repeats, s.warmup_after_check(), device),
            batch=batch,
            prompt=length,
            new_tokens=n,
            same_tokens=same,
        )
        rows.append(row)
        print(
            f"  generate {n:>4} tokens ×{batch:<2}: ours {row['ours_ms']:8.1f} ms  "
            f"LlamaForCausalLM.generate {row['theirs_ms']:8.1f} ms  throughput ratio "
            f"{row['ratio']:.2f}  (fp32 tokens {'the same' if same else 'DIFFER'})",
            flush=True,
        )
    return rows


def bench_llama(s: Settings, device: torch.device) -> dict:
    """Section 6: generation first (the weights as copied), then the training steps (each side
    trains its own copy, by the same updates)."""
    ours, theirs = build_pair(s.llama_config, device)
    models = {"ours": ours, "theirs": theirs}
    vocab = MODELS[s.llama_config].vocab_size
    print(
        f"  {s.llama_config}: {ours.num_parameters():,} weights a side, "
        f"their attention {theirs.config._attn_implementation!r}",
        flush=True,
    )
    return {
        "config": s.llama_config,
        "weights": ours.num_parameters(),
        "generate": generate_rows(s, models, vocab, device),
        "train_step": train_rows(s, models, vocab, device),
    }
