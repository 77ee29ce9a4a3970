"""Section 12: greedy decoding at the capstone's size against the machine's memory-bandwidth
roofline — ours in float32, bf16, int8 weight-only and int4 weight-only (both with bf16
activations), and at batch 1 ours in bf16 and int8 with the one-token step compiled
(:class:`~transformer_tutorial.lm.compiled.CompiledSteps`, left out with ``--no-compile`` or
where compiling fails), against ``transformers``' ``LlamaForCausalLM`` in float32 and bf16
(eager), in one run.

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

The **kernel ceiling** (:class:`KernelPasses`, CPU only) says what the kernels alone allow: the
model's linear layers, each called once in the model's order on one row (batch 1, each its own
weights, so a pass reads what a decoding step reads), with the kernel each variant runs —
``F.linear`` in float32 and bf16 as ``LlamaForCausalLM`` runs them, PyTorch's int8 and int4
weight-only kernels with bf16 activations as ``QuantizedLinear`` calls them, and
``QuantizedLinear`` itself (its own cost per call: the difference), and the one-row int8
products the compiled step fuses (one compiled call for the layers of each shape). A run of as
many passes as the decoding run has steps is timed in the same turns as batch 1's decoding runs,
so that a loaded machine weighs on both alike. A pass is the fastest a decoding step could be
with these kernels and nothing else; the section reports it as GB/s, as its share of the
roofline, as the best ratio to ``LlamaForCausalLM`` float32 a step of them could reach, and, by
subtraction, each decoding row's time outside its linear layers (attention, norms, rotary, the
cache, the Python loop). OpenMP's wait policy is recorded: with ``OMP_WAIT_POLICY=PASSIVE`` idle
threads sleep, and each of the kernels' parallel calls pays for waking them."""

from __future__ import annotations

import copy
import math
import os
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.cli import Settings
from bench.llama import MODELS, build_pair
from bench.timing import interleaved, sync
from transformer_tutorial.experiments.comparison import COMPARED, prepare_data
from transformer_tutorial.experiments.harness import train_for, validation_loss
from transformer_tutorial.lm.compiled import CompiledSteps
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.sampling import generate
from transformer_tutorial.quantization import QuantizedLinear, quantize_linears, weight_bytes

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
    "ours bf16 compiled",
    "ours int8 compiled",
)
# Batch 1 only, where a compiled step pays (lm.compiled): the int8 product it fuses is a
# one-row one (QuantizedLinear._one_row). Left out with --no-compile or where compiling fails.
BATCH_1_ONLY = ("ours bf16 compiled", "ours int8 compiled")
# The kernel ceiling's variants: (its name, the decoding row it bounds).
KERNELS = {
    "fp32 F.linear": "theirs fp32",
    "bf16 F.linear": "theirs bf16",
    "int8 kernel (bf16 act.)": "ours int8 (bf16 act.)",
    "int8 QuantizedLinear": "ours int8 (bf16 act.)",
    "int4 kernel (bf16 act.)": "ours int4 (bf16 act.)",
    "int8 one-row product, compiled": "ours int8 compiled",
}
GOAL_VS_FP32 = 3.0  # issue 45: int8 decoding ≥ 3× LlamaForCausalLM float32 at batch 1
GOAL_ROOFLINE = 0.5  # … at ≥ 50% of the measured bandwidth roofline


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
    models = {
        "ours fp32": ("ours", ours),
        "ours bf16": ("ours", bf16 := copy.deepcopy(ours).to(torch.bfloat16)),
        "ours int8 (bf16 act.)": ("ours", int8 := quantized(ours, 8)),
        "ours int4 (bf16 act.)": ("ours", quantized(ours, 4)),
        "theirs fp32": ("theirs", theirs),
        "theirs bf16": ("theirs", copy.deepcopy(theirs).to(torch.bfloat16)),
    }
    if s.compile_decoding:  # views of the same models, their one-token steps compiled
        models["ours bf16 compiled"] = ("ours", CompiledSteps(bf16))
        models["ours int8 compiled"] = ("ours", CompiledSteps(int8))
    return models


def _agreement(tokens: list, reference: list) -> float:
    pairs = [
        (a, b)
        for row, ref in zip(tokens, reference, strict=True)
        for a, b in zip(row, ref, strict=True)
    ]
    return sum(a == b for a, b in pairs) / len(pairs)


def decode_rows(
    models: dict[str, tuple[str, nn.Module]],
    s: Settings,
    device: torch.device,
    bandwidth: float,
    kind: str,
) -> tuple[list[dict], dict]:
    """Each batch: the variants' tokens checked, then their decoding timed in turns; at batch 1
    on the CPU, the kernel ceiling's passes in the same turns (:class:`KernelPasses`)."""
    batches, prompt_len, n, _, _ = SHAPES[kind]
    vocab = MODELS[s.llama_config].vocab_size
    rows, kernels = [], {}
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        prompt = torch.randint(0, vocab, (batch, prompt_len), generator=gen).to(device)
        batch_models = {k: v for k, v in models.items() if batch == 1 or k not in BATCH_1_ONLY}
        fns = {
            name: _decode(side, model, prompt, n) for name, (side, model) in batch_models.items()
        }
        tokens = {}
        for name, fn in list(fns.items()):
            try:
                tokens[name] = fn()  # a compiled row compiles here
            except Exception as err:  # a missing C++ compiler, an unsupported backend: say so
                if name not in BATCH_1_ONLY:
                    raise
                print(f"  {name}: left out, torch.compile failed here: {str(err).splitlines()[0]}")
                del fns[name], batch_models[name], models[name]
        same = tokens["ours fp32"] == tokens["theirs fp32"]
        assert same, f"ours and LlamaForCausalLM decode different float32 tokens at batch {batch}"
        passes = kernel_passes(models, n) if batch == 1 and device.type == "cpu" else {}
        fns |= {k: p.run for k, p in passes.items()}
        timed = interleaved(fns, s.llama_repeats, s.warmup_after_check(), device)
        kernels |= {k: p.summary(timed[k], n, bandwidth) for k, p in passes.items()}
        for name, (_, model) in batch_models.items():
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
        for r in rows[-len(batch_models) :]:
            print(
                f"  B={batch} {r['variant']:<22} {r['step_ms']:7.1f} ms a step "
                f"{r['tokens_per_s']:7.1f} tokens/s  {r['read_gb_per_s']:5.1f} GB/s = "
                f"{r['roofline']:.0%} of the roofline; × theirs fp32 {r['vs_theirs_fp32']:.2f}, "
                f"bf16 {r['vs_theirs_bf16']:.2f}; tokens as fp32 {r['agrees_with_fp32']:.0%}",
                flush=True,
            )
    return rows, kernels


# (weight shape, the call, bytes read, layers it covers: 1, or every layer of the shape)
Call = tuple[tuple[int, int], Callable[[], object], int, int]


def _linear_calls(name: str, model: nn.Module) -> list[Call]:
    """Each linear layer of ``model`` in its order, as kernel ``name`` calls it on one row (the
    compiled product: one compiled call a weight shape, over every layer of that shape)."""
    if name.endswith("compiled"):
        return _compiled_calls(model)
    calls = []
    for m in model.modules():
        if name.endswith("F.linear") and isinstance(m, nn.Linear):
            w = m.weight.detach()
            x = torch.randn(1, m.in_features, dtype=w.dtype, device=w.device)
            calls.append((tuple(w.shape), lambda x=x, w=w: F.linear(x, w), w.nbytes, 1))
        elif isinstance(m, QuantizedLinear):
            x = torch.randn(1, m.in_features, dtype=torch.bfloat16, device=m.qweight.device)
            nbytes = m.qweight.numel() * m.bits // 8 + m.scale.nbytes
            calls.append((tuple(m.qweight.shape), _quantized_call(name, m, x), nbytes, 1))
    return calls


def _compiled_calls(model: nn.Module) -> list[Call]:
    """The int8 layers' one-row products (:meth:`QuantizedLinear._one_row`) as the compiled
    decoding step runs them, grouped by weight shape: for each shape, one compiled call
    over all its layers (a call a layer would time the compiled call's own overhead, which
    the compiled step pays once). Compiled (and checked against the eager product) here."""
    by_shape: dict[tuple[int, int], list[QuantizedLinear]] = defaultdict(list)
    for m in model.modules():
        if isinstance(m, QuantizedLinear) and m.bits == 8:
            by_shape[tuple(m.qweight.shape)].append(m)
    calls = []
    for shape, layers in by_shape.items():
        x = torch.randn(1, shape[1], dtype=torch.bfloat16, device=layers[0].qweight.device)
        products = torch.compile(lambda x, layers=layers: [m._one_row(x) for m in layers])
        with torch.no_grad():
            got, want = products(x)[0], layers[0]._one_row(x)
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
        nbytes = sum(m.qweight.nbytes + m.scale.nbytes for m in layers)
        calls.append((shape, lambda x=x, f=products: f(x), nbytes, len(layers)))
    return calls


def _quantized_call(name: str, m: QuantizedLinear, x: Tensor) -> Callable[[], Tensor]:
    if name == "int8 QuantizedLinear":
        return lambda: m(x[None])  # (1, 1, in): a decoding step's shape
    if name.startswith("int8"):
        scale = m.scale[:, 0].to(x.dtype)  # (out,), converted once
        return lambda: torch.ops.aten._weight_int8pack_mm(x, m.qweight, scale)
    scales = m.int4_scales.to(x.dtype)
    return lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, m.int4_packed, m.group_size, scales
    )


class KernelPasses:
    """One kernel of :data:`KERNELS` on every linear layer of its model: a call of :meth:`run`
    is ``n`` passes (a decoding run's ``n`` steps), timed beside the decoding runs; each pass's
    time by weight shape is kept."""

    def __init__(self, calls: list[Call], n: int) -> None:
        self.calls, self.n = calls, n
        self.spent: list[dict[tuple[int, int], float]] = []  # a run's seconds by shape

    @torch.no_grad()
    def run(self) -> None:
        spent: dict[tuple[int, int], float] = defaultdict(float)
        for _ in range(self.n):
            for shape, call, _, _ in self.calls:
                start = time.perf_counter()
                call()
                spent[shape] += time.perf_counter() - start
        self.spent.append(spent)

    def summary(self, timed: dict, n: int, bandwidth: float) -> dict:
        """A pass's time (the timed runs' median ÷ ``n``), its bytes, GB/s and share of the
        roofline, and each shape's summed time a pass (median over the timed runs)."""
        step_s = timed["median_s"] / n
        nbytes = sum(b for _, _, b, _ in self.calls)
        timed_runs = self.spent[-len(timed["times_s"]) :]  # the warm-up runs dropped
        layers: Counter = Counter()
        for shape, _, _, count in self.calls:
            layers[shape] += count
        return {
            "step_ms": 1e3 * step_s,
            "spread": timed["spread"],
            "step_bytes": nbytes,
            "read_gb_per_s": nbytes / step_s / 1e9,
            "roofline": nbytes / step_s / bandwidth,
            "shapes": [
                {
                    "shape": list(shape),
                    "layers": count,
                    "ms": 1e3 * statistics.median(t[shape] for t in timed_runs) / n,
                }
                for shape, count in layers.items()
            ],
        }


def kernel_passes(models: dict[str, tuple[str, nn.Module]], n: int) -> dict[str, KernelPasses]:
    """The kernel ceiling's contenders (:data:`KERNELS`, int4 where its packed kernel runs)."""
    calls = {k: _linear_calls(k, models[row][1]) for k, row in KERNELS.items() if row in models}
    return {k: KernelPasses(c, n) for k, c in calls.items() if c}


def ceiling_summary(kernels: dict, rows: list[dict]) -> dict:
    """The batch-1 decoding rows against the kernel ceiling: the best ratio to
    ``LlamaForCausalLM`` float32 each int8 path allows (the eager kernel's; the compiled
    products', where compiled rows ran), each row's time outside its linear layers (the row's
    step − its kernels' pass), and the verdict on issue 45's goals."""
    step = {r["variant"]: r for r in rows if r["batch"] == 1}
    theirs = step["theirs fp32"]["step_ms"]
    int8 = kernels["int8 kernel (bf16 act.)"]
    outside = {
        row: {"step_ms": step[row]["step_ms"], "kernels_ms": kernels[k]["step_ms"]}
        for k, row in KERNELS.items()
        if k in kernels and k != "int8 QuantizedLinear"
    }
    for o in outside.values():
        o["outside_ms"] = o["step_ms"] - o["kernels_ms"]
        o["outside_share"] = o["outside_ms"] / o["step_ms"]
    eager = step["ours int8 (bf16 act.)"]
    summary = {
        "best_vs_theirs_fp32": theirs / int8["step_ms"],
        "reached_vs_theirs_fp32": theirs / eager["step_ms"],
        "kernels_fp32_over_int8": kernels["fp32 F.linear"]["step_ms"] / int8["step_ms"],
        "quantized_linear_own_ms": kernels["int8 QuantizedLinear"]["step_ms"] - int8["step_ms"],
        "outside_linears": outside,
    }
    eager_words = (
        f"eager int8 decoding is {summary['reached_vs_theirs_fp32']:.2f}× LlamaForCausalLM "
        f"float32 (eager), PyTorch's int8 kernel alone would allow "
        f"{summary['best_vs_theirs_fp32']:.2f}× ({outside[eager['variant']]['outside_ms']:.1f} "
        f"ms a step outside it)"
    )
    kernel_share = f"the int8 kernel alone {int8['roofline']:.0%}"
    fused = kernels.get("int8 one-row product, compiled")
    if fused is None or "ours int8 compiled" not in step:  # --no-compile, or compiling failed
        best = eager
        summary["verdict"] = f"{eager_words}; no compiled row"
    else:
        best = step["ours int8 compiled"]
        reached = theirs / best["step_ms"]
        summary["compiled_best_vs_theirs_fp32"] = theirs / fused["step_ms"]
        summary["compiled_reached_vs_theirs_fp32"] = reached
        bf16 = step.get("ours bf16 compiled")
        summary["verdict"] = (
            f"int8 decoding, compiled, is {reached:.2f}× LlamaForCausalLM float32 (eager) (goal "
            f"≥ {GOAL_VS_FP32:g}×: {'met' if reached >= GOAL_VS_FP32 else 'missed'}), "
            f"{best['vs_theirs_bf16']:.2f}× its bf16; its fused products alone would allow "
            f"{summary['compiled_best_vs_theirs_fp32']:.2f}×"
            + ("" if bf16 is None else f"; ours bf16 compiled {bf16['vs_theirs_fp32']:.2f}×")
            + f"; {eager_words}"
        )
        kernel_share = f"its fused products alone {fused['roofline']:.0%}, {kernel_share}"
    away = outside[best["variant"]]
    others = [f"{k} {c['roofline']:.0%}" for k, c in kernels.items() if "int8" not in k]
    summary["roofline_verdict"] = (
        f"{best['variant']} decoding reads {best['read_gb_per_s']:.1f} GB/s, "
        f"{best['roofline']:.0%} of the roofline (goal ≥ {GOAL_ROOFLINE:.0%}: "
        f"{'met' if best['roofline'] >= GOAL_ROOFLINE else 'missed'}); {kernel_share}, "
        + ", ".join(others)
        + f"; {away['outside_ms']:.1f} ms of its {away['step_ms']:.1f} ms step "
        f"({away['outside_share']:.0%}) go outside the linear layers"
    )
    return summary


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
    models = _models(s, device)
    rows, kernels = decode_rows(models, s, device, bandwidth, kind)
    out = {
        "config": s.llama_config,
        "bandwidth_gb_per_s": bandwidth / 1e9,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    if kernels:  # PyTorch's weight-only kernels: CPU ones
        out["ceiling"] = {"kernels": kernels, **ceiling_summary(kernels, rows)}
        _print_ceiling(out["ceiling"], out["omp_wait_policy"])
    out["loss"] = loss_rows(kind)
    return out


def _print_ceiling(ceiling: dict, policy: str) -> None:
    for k, c in ceiling["kernels"].items():
        shapes = ", ".join(
            f"{s['layers']}×{s['shape'][0]}×{s['shape'][1]} {s['ms']:.2f}" for s in c["shapes"]
        )
        print(
            f"  kernel ceiling {k:<30} {c['step_ms']:6.1f} ms a pass, {c['read_gb_per_s']:5.1f} "
            f"GB/s = {c['roofline']:.0%} of the roofline (ms by shape: {shapes})",
            flush=True,
        )
    for row, o in ceiling["outside_linears"].items():
        print(
            f"  B=1 {row:<22} {o['step_ms']:6.1f} ms a step − {o['kernels_ms']:.1f} ms of "
            f"linear layers = {o['outside_ms']:.1f} ms outside them ({o['outside_share']:.0%})"
        )
    print(f"  OMP_WAIT_POLICY={policy}: {ceiling['verdict']}; {ceiling['roofline_verdict']}")
