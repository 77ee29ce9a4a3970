"""Section 12: greedy decoding at the capstone's size against the machine's memory-bandwidth
roofline — ours in float32, bf16, int8 weight-only and int4 weight-only (both with bf16
activations), against ``transformers``' ``LlamaForCausalLM`` in float32 and bf16, in one run.

A decoding step reads every weight once (the embedding table excepted: a step reads one row of
it a sequence) and does about one multiply-add per weight and row, so at batch 1 its time is
bounded below by *bytes read ÷ memory bandwidth* (chapter 16's roofline). The section measures
the machine's read bandwidth itself (:func:`read_bandwidth`, a sum over a buffer far larger than
the caches), and reports each row's **fraction of the roofline**: weight bytes a step reads ÷
time a step takes ÷ bandwidth (1.0: every byte read at the machine's full speed). A step's time
is the run's time ÷ its new tokens, the prompt's prefill (8 positions) included.

Checks before any timing: ours and theirs give the same greedy tokens in float32 (asserted);
each lower precision's tokens are compared with ours in float32 (the share that agree), and its
loss on held-out text of a *trained* model (chapter 17's Llama-style model trained for
``TRAIN_SECONDS`` on Multi30k, chapter 13's data) is compared with float32's.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable

import torch
from torch import nn

from bench.cli import Settings
from bench.llama import MODELS, build_pair
from bench.timing import interleaved, sync
from transformer_tutorial.experiments.comparison import COMPARED, prepare_data
from transformer_tutorial.experiments.harness import train_for, validation_loss
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.sampling import generate
from transformer_tutorial.quantization import quantize_linears, weight_bytes

# (batches, prompt length, new tokens, bandwidth buffer MiB, training seconds): --quick, full.
SHAPES = {"quick": ((1, 2), 8, 4, 64, 3.0), "full": ((1, 8), 8, 64, 1024, 60.0)}
INT4_GROUP = 128  # int4's largest group size (divides the capstone's 768 and 2048 inputs)
VARIANTS = (
    "ours fp32",
    "ours bf16",
    "ours int8 (bf16 act.)",
    "ours int4 (bf16 act.)",
    "theirs fp32",
    "theirs bf16",
)


def read_bandwidth(mib: int, repeats: int, device: torch.device) -> float:
    """Bytes a second the machine reads: the best of ``repeats`` sums of a float32 buffer of
    ``mib`` MiB (far larger than the caches), each reading every byte once."""
    x = torch.ones(mib * 2**20 // 4, device=device)
    best = float("inf")
    for _ in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        x.sum()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def int4_group(model: nn.Module) -> int:
    """The largest power of two up to :data:`INT4_GROUP` dividing every linear layer's inputs."""
    inputs = math.gcd(*(m.in_features for m in model.modules() if isinstance(m, nn.Linear)))
    return math.gcd(inputs & -inputs, INT4_GROUP)


def quantized(model: nn.Module, bits: int) -> nn.Module:
    """Every linear layer of a bf16 copy of ``model`` weight-only quantized (output layer
    included): int8 one scale a row (PyTorch's int8 kernel), int4 in groups
    (:func:`int4_group`)."""
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    group = None if bits == 8 else int4_group(model)
    return quantize_linears(bf16, bits=bits, group_size=group, keep=())


def step_bytes(model: nn.Module) -> int:
    """Bytes of weights a decoding step reads: all of them but the input embedding table."""
    table = model.embed if isinstance(model, LanguageModel) else model.get_input_embeddings()
    return weight_bytes(model) - table.weight.numel() * table.weight.element_size()


def _decode(side: str, model: nn.Module, prompt: torch.Tensor, n: int) -> Callable[[], list]:
    @torch.no_grad()
    def run() -> list:
        if side == "ours":
            out = generate(model, prompt, n, greedy=True, cache_kind="preallocated")
        else:
            mask = torch.ones_like(prompt)
            out = model.generate(
                prompt, attention_mask=mask, do_sample=False, max_new_tokens=n,
                pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
        return out[:, prompt.size(1) :].tolist()

    return run


def _models(s: Settings, device: torch.device) -> dict[str, tuple[str, nn.Module]]:
    ours, theirs = build_pair(s.llama_config, device)
    ours, theirs = ours.eval(), theirs.eval()
    return {
        "ours fp32": ("ours", ours),
        "ours bf16": ("ours", copy.deepcopy(ours).to(torch.bfloat16)),
        "ours int8 (bf16 act.)": ("ours", quantized(ours, 8)),
        "ours int4 (bf16 act.)": ("ours", quantized(ours, 4)),
        "theirs fp32": ("theirs", theirs),
        "theirs bf16": ("theirs", copy.deepcopy(theirs).to(torch.bfloat16)),
    }


def _agreement(tokens: list, reference: list) -> float:
    pairs = [
        (a, b)
        for row, ref in zip(tokens, reference, strict=True)
        for a, b in zip(row, ref, strict=True)
    ]
    return sum(a == b for a, b in pairs) / len(pairs)


def decode_rows(s: Settings, device: torch.device, bandwidth: float, kind: str) -> list[dict]:
    """Each batch: the variants' tokens checked, then their decoding timed in turns."""
    batches, prompt_len, n, _, _ = SHAPES[kind]
    models = _models(s, device)
    vocab = MODELS[s.llama_config].vocab_size
    rows = []
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        prompt = torch.randint(0, vocab, (batch, prompt_len), generator=gen).to(device)
        fns = {name: _decode(side, model, prompt, n) for name, (side, model) in models.items()}
        tokens = {name: fn() for name, fn in fns.items()}
        same = tokens["ours fp32"] == tokens["theirs fp32"]
        assert same, f"ours and LlamaForCausalLM decode different float32 tokens at batch {batch}"
        timed = interleaved(fns, s.llama_repeats, s.warmup_after_check(), device)
        for name, (_, model) in models.items():
            step_s = timed[name]["median_s"] / n
            nbytes = step_bytes(model)
            rows.append(
                {
                    "batch": batch,
                    "variant": name,
                    "step_ms": 1e3 * step_s,
                    "tokens_per_s": batch / step_s,
                    "spread": timed[name]["spread"],
                    "step_bytes": nbytes,
                    "read_gb_per_s": nbytes / step_s / 1e9,
                    "roofline": nbytes / step_s / bandwidth,
                    "vs_theirs_fp32": timed["theirs fp32"]["median_s"] / timed[name]["median_s"],
                    "vs_theirs_bf16": timed["theirs bf16"]["median_s"] / timed[name]["median_s"],
                    "agrees_with_fp32": _agreement(tokens[name], tokens["ours fp32"]),
                }
            )
        for r in rows[-len(models) :]:
            print(
                f"  B={batch} {r['variant']:<22} {r['step_ms']:7.1f} ms a step "
                f"{r['tokens_per_s']:7.1f} tokens/s  {r['read_gb_per_s']:5.1f} GB/s = "
                f"{r['roofline']:.0%} of the roofline; × theirs fp32 {r['vs_theirs_fp32']:.2f}, "
                f"bf16 {r['vs_theirs_bf16']:.2f}; tokens as fp32 {r['agrees_with_fp32']:.0%}",
                flush=True,
            )
    return rows


def loss_rows(kind: str) -> dict:
    """Held-out loss of a trained small model in each precision, and its gap to float32."""
    seconds = SHAPES[kind][4]
    tokenizer, train_ids, val_batch = prepare_data()
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=tokenizer.get_vocab_size(), **COMPARED["llama"]))
    train_for(model, train_ids, val_batch, seconds=seconds, evaluations=1)
    model.eval()
    variants = {
        "fp32": model,
        "bf16": copy.deepcopy(model).to(torch.bfloat16),
        "int8": quantized(model, 8),
        "int4": quantized(model, 4),
    }
    losses = {name: validation_loss(m, val_batch) for name, m in variants.items()}
    gaps = {name: loss - losses["fp32"] for name, loss in losses.items()}
    print(
        f"  held-out loss of chapter 17's model trained {seconds:.0f} s: "
        + ", ".join(f"{k} {v:.4f}" for k, v in losses.items()),
        flush=True,
    )
    return {"train_seconds": seconds, "losses": losses, "gaps": gaps}


def bench_roofline(s: Settings, device: torch.device) -> dict:
    """Section 12: the bandwidth, the decoding rows, the trained model's losses."""
    kind = "quick" if s.quick else "full"
    mib = SHAPES[kind][3]
    bandwidth = read_bandwidth(mib, s.llama_repeats, device)
    print(f"  read bandwidth: {bandwidth / 1e9:.1f} GB/s (sum of {mib} MiB, best run)")
    return {
        "config": s.llama_config,
        "bandwidth_gb_per_s": bandwidth / 1e9,
        "rows": decode_rows(s, device, bandwidth, kind),
        "loss": loss_rows(kind),
    }
