"""`make bench`: the book's Transformer against PyTorch's ``nn.Transformer``, side by side, in one
process.

    python bench/bench.py                    # CPU, 2 threads, under 10 minutes
    python bench/bench.py --device cuda      # a GPU: bf16 autocast, plus model FLOPs utilisation
    python bench/bench.py --quick            # tiny sizes, seconds: the smoke test

Sections:
  1. train step (forward, label-smoothed loss, backward, Adam): throughput ours ÷ nn.Transformer,
     eager, and compiled vs compiled (``torch.compile``, with its compile time), for the models
     of the ``small`` and ``base`` recipes at source/target lengths 16, 32 and 64;
  2. inference forward, the same ratio;
  3. greedy decoding of 16–128 tokens, KV cache ÷ recomputing the prefix every step;
  4. beam 5 vs greedy, sentences/s on test2016, with a trained checkpoint if one is cached;
  5. attention alone, written out (the chapter 3 function) vs fused
     (``F.scaled_dot_product_attention``): time and peak memory as L grows to 2,048.

The models are those of ``transformer_tutorial.configs.CONFIGS``. Both models share one wrapper
(embeddings, positional encoding, generator), one batch with padding and the same masks. Every
measurement interleaves the two (a busy machine slows both alike) and reports the median of
--repeats after --warmup, with the spread (max - min) / median. Writes
``bench/results/<device>-<torch version>.json`` and a PNG beside it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_tutorial.attention import scaled_dot_product_attention
from transformer_tutorial.configs import CONFIGS
from transformer_tutorial.data import BOS_ID, EOS_ID, PAD_ID
from transformer_tutorial.decode import greedy_decode
from transformer_tutorial.masks import causal_mask
from transformer_tutorial.model import Transformer
from transformer_tutorial.optim import make_optimizer, translation_loss
from transformer_tutorial.records import cpu_name, git_commit

# nn.Transformer's note that pre-norm layers cannot use its nested-tensor fast path.
warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
RESULTS = Path(__file__).resolve().parent / "results"
# Dense bf16 (fp16 where a GPU has no bf16) peak of known GPUs, FLOP/s, for model FLOPs
# utilisation. Names are matched as substrings of torch.cuda.get_device_name().
PEAK_FLOPS = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
    "RTX 4090": 165e12,
    "V100": 125e12,  # fp16 tensor cores, no bf16
    "T4": 65e12,  # fp16 tensor cores, no bf16
}


class Settings:
    """What one run measures: full (CPU or CUDA) or --quick."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.quick = args.quick
        self.configs = ("tiny",) if args.quick else ("small", "base")
        self.lengths = (8, 16) if args.quick else (16, 32, 64)
        # Tokens a batch (sentences = tokens // length): small enough for 10 minutes on 2 cores.
        self.tokens = {"tiny": 128, "small": 1024, "base": 512}
        if cuda:
            self.tokens = {name: 8192 for name in self.tokens}
        self.repeats, self.warmup = args.repeats, args.warmup
        # Compiling takes minutes on a CPU: there only `small` at one length.
        self.compile_cells = [] if args.no_compile or args.quick else [("small", 32)]
        if cuda and not args.no_compile:
            self.compile_cells = [(c, n) for c in self.configs for n in self.lengths]
        self.decode_config = "tiny" if args.quick else ("base" if cuda else "small")
        self.decode_tokens = (4, 8) if args.quick else (16, 32, 64, 128)
        self.attention_lengths = (64, 128) if args.quick else (128, 256, 512, 1024, 2048)
        self.beam_sentences = 4 if args.quick else args.sentences
        self.dtype = torch.bfloat16 if cuda and args.precision == "bf16" else None


class TorchTransformer(nn.Module):
    """``nn.Transformer`` inside our embeddings, positional encoding and generator."""

    def __init__(self, ours: Transformer) -> None:
        super().__init__()
        c = ours.config
        self.src_embed, self.tgt_embed = ours.src_embed, ours.tgt_embed
        self.positional = ours.positional
        self.pad_id = c.pad_id
        self.core = nn.Transformer(
            c.d_model,
            c.n_heads,
            c.n_encoder_layers,
            c.n_decoder_layers,
            c.d_ff,
            c.dropout,
            activation=c.activation,
            layer_norm_eps=c.layer_norm_eps,
            batch_first=True,
            norm_first=c.norm_first,
        )
        self.generator = nn.Linear(c.d_model, c.tgt_vocab_size)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        src_pad, tgt_pad = src == self.pad_id, tgt == self.pad_id
        out = self.core(
            self.positional(self.src_embed(src)),
            self.positional(self.tgt_embed(tgt)),
            tgt_mask=causal_mask(tgt.size(1), device=tgt.device),
            tgt_is_causal=True,
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
        )
        return self.generator(out)


def make_batch(vocab: int, sentences: int, length: int, device: torch.device) -> Tensor:
    """Token ids ``(2, B, length)``, source and target, lengths spread from 60% to 100%."""
    gen = torch.Generator().manual_seed(length)
    lengths = torch.linspace(0.6 * length, length, sentences).long()
    ids = torch.randint(4, vocab, (2, sentences, length), generator=gen)
    ids = ids.masked_fill(torch.arange(length)[None, :] >= lengths[:, None], PAD_ID)
    return ids.to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved(
    fns: dict[str, Callable[[], object]], repeats: int, warmup: int, device: torch.device
) -> dict[str, dict]:
    """Time each function ``repeats`` times, taking turns (the order flips every round).

    Returns per name: wall-clock median and spread, CPU-time median (this process's, all
    threads), and the first call's time (compile time shows there)."""
    names = list(fns)
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    first = {}
    for round_ in range(warmup + repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            sync(device)
            start, start_cpu = time.perf_counter(), time.process_time()
            fns[name]()
            sync(device)
            elapsed = time.perf_counter() - start
            first.setdefault(name, elapsed)
            if round_ >= warmup:
                wall[name].append(elapsed)
                cpu[name].append(time.process_time() - start_cpu)
    out = {}
    for n in names:
        median = statistics.median(wall[n])
        out[n] = {
            "median_s": median,
            "spread": (max(wall[n]) - min(wall[n])) / median,
            "cpu_median_s": statistics.median(cpu[n]),
            "first_s": first[n],
            "times_s": wall[n],
        }
    return out


def build_pair(name: str, device: torch.device) -> tuple[Transformer, TorchTransformer, int]:
    recipe = CONFIGS[name]
    torch.manual_seed(0)
    ours = Transformer(recipe.model_config(recipe.vocab_size)).to(device)
    theirs = TorchTransformer(ours).to(device)
    return ours, theirs, recipe.vocab_size


def autocast(device: torch.device, dtype: torch.dtype | None) -> torch.autocast:
    return torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def train_step_fn(model: nn.Module, ids: Tensor, device: torch.device, dtype) -> Callable:
    """One training step of the trainer's kind: forward, label-smoothed loss, backward, Adam."""
    optimizer, _ = make_optimizer(model, lr=1e-4, warmup=100)
    src, tgt = ids[0], ids[1]
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]

    def step() -> None:
        model.train()
        with autocast(device, dtype):
            logits = model(src, tgt_in)
        loss = translation_loss(logits, tgt_out, smoothing=0.1, ignore_index=PAD_ID)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def forward_fn(model: nn.Module, ids: Tensor, device: torch.device, dtype) -> Callable:
    @torch.no_grad()
    def forward() -> None:
        model.eval()
        with autocast(device, dtype):
            model(ids[0], ids[1])

    return forward


def ratio_row(config: str, length: int, sentences: int, timed: dict) -> dict:
    ours, theirs = timed["ours"], timed["nn.Transformer"]
    return {
        "config": config,
        "length": length,
        "sentences": sentences,
        "ours_ms": 1e3 * ours["median_s"],
        "torch_ms": 1e3 * theirs["median_s"],
        "ours_spread": ours["spread"],
        "torch_spread": theirs["spread"],
        "ratio": theirs["median_s"] / ours["median_s"],
        # A tiny --quick step can take less CPU time than the clock resolves: no ratio then.
        "cpu_ratio": (
            theirs["cpu_median_s"] / ours["cpu_median_s"]
            if ours["cpu_median_s"] > 0
            else float("nan")
        ),
    }


def bench_models(s: Settings, device: torch.device) -> dict:
    """Sections 1 and 2, and the compiled train step, one model pair per config."""
    out = {"train_step": [], "forward": [], "compiled": [], "compile_skipped": None}
    if not s.compile_cells:
        out["compile_skipped"] = "--quick or --no-compile"
    for config in s.configs:
        ours, theirs, vocab = build_pair(config, device)
        for length in s.lengths:
            sentences = max(s.tokens[config] // length, 1)
            ids = make_batch(vocab, sentences, length, device)
            for kind, make in (("train_step", train_step_fn), ("forward", forward_fn)):
                fns = {
                    "ours": make(ours, ids, device, s.dtype),
                    "nn.Transformer": make(theirs, ids, device, s.dtype),
                }
                timed = interleaved(fns, s.repeats, s.warmup, device)
                row = ratio_row(config, length, sentences, timed)
                out[kind].append(row)
                print(
                    f"  {kind:<10} {config:<5} L={length:<3} B={sentences:<4} ours "
                    f"{row['ours_ms']:8.1f} ms  nn.Transformer {row['torch_ms']:8.1f} ms  "
                    f"throughput ratio {row['ratio']:.2f}",
                    flush=True,
                )
            if (config, length) in s.compile_cells and out["compile_skipped"] is None:
                row = bench_compiled(s, config, length, sentences, ids, device)
                if isinstance(row, str):
                    out["compile_skipped"] = row
                else:
                    out["compiled"].append(row)
    return out


def bench_compiled(s: Settings, config, length, sentences, ids, device) -> dict | str:
    """Compiled ours vs compiled nn.Transformer, and ours compiled vs ours eager."""
    ours, theirs, _ = build_pair(config, device)
    fns = {
        "ours eager": train_step_fn(ours, ids, device, s.dtype),
        "ours": train_step_fn(torch.compile(ours), ids, device, s.dtype),
        "nn.Transformer": train_step_fn(torch.compile(theirs), ids, device, s.dtype),
    }
    try:
        timed = interleaved(fns, s.repeats, 2, device)
    except Exception as err:  # a missing compiler, an unsupported backend: say so, go on
        reason = f"torch.compile failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        print(f"  compiled: skipped, {reason}")
        return reason
    row = ratio_row(config, length, sentences, timed)
    row["ours_compile_s"] = timed["ours"]["first_s"] - timed["ours"]["median_s"]
    row["torch_compile_s"] = (
        timed["nn.Transformer"]["first_s"] - timed["nn.Transformer"]["median_s"]
    )
    row["ours_compiled_vs_eager"] = timed["ours eager"]["median_s"] / timed["ours"]["median_s"]
    print(
        f"  compiled   {config:<5} L={length:<3} B={sentences:<4} ours {row['ours_ms']:8.1f} ms  "
        f"nn.Transformer {row['torch_ms']:8.1f} ms  throughput ratio {row['ratio']:.2f}  "
        f"(ours compiled ÷ eager {row['ours_compiled_vs_eager']:.2f}; compile time ours "
        f"{row['ours_compile_s']:.0f} s, nn.Transformer {row['torch_compile_s']:.0f} s)",
        flush=True,
    )
    return row


def bench_decoding(s: Settings, device: torch.device) -> list[dict]:
    """Section 3: greedy decoding of exactly n tokens, with and without the KV cache."""
    model, _, vocab = build_pair(s.decode_config, device)
    model.eval()
    src = make_batch(vocab, 32, 24, device)[0]
    rows = []
    for n in s.decode_tokens:

        def decode(use_cache: bool, n: int = n) -> None:
            with autocast(device, s.dtype):
                greedy_decode(
                    model,
                    src,
                    max_len=n,
                    min_len=n,
                    bos_id=BOS_ID,
                    eos_id=EOS_ID,
                    pad_id=PAD_ID,
                    use_cache=use_cache,
                )

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


def bench_beam(s: Settings, device: torch.device, checkpoint: Path | None) -> dict:
    """Section 4: beam 5 against greedy, sentences/s on test2016 with a trained model."""
    from transformer_tutorial.checkpoint import load_model
    from transformer_tutorial.data import load_split
    from transformer_tutorial.decode import translate_sentences
    from transformer_tutorial.runs import find_checkpoint

    checkpoint = checkpoint or find_checkpoint()
    if checkpoint is None:
        reason = "no trained checkpoint cached (runs.find_checkpoint() found none)"
        print(f"  skipped: {reason}")
        return {"skipped": reason}
    model, tokenizer, _ = load_model(checkpoint, device)
    if tokenizer is None:
        return {"skipped": f"{checkpoint} has no tokenizer beside it"}
    try:
        test = load_split("test")[0]
    except Exception as err:  # no corpus here: skip rather than fail the whole benchmark
        reason = f"test2016 unavailable: {err}"
        print(f"  skipped: {reason}")
        return {"skipped": reason}
    # The first sentences that fit the model's positions (all of them for a trained recipe).
    fits = [len(e.ids) <= model.config.max_len for e in tokenizer.encode_batch(test)]
    sentences = [x for x, ok in zip(test, fits, strict=True) if ok][: s.beam_sentences]
    if not sentences:
        reason = f"no test2016 sentence fits the model's max_len={model.config.max_len}"
        print(f"  skipped: {reason}")
        return {"skipped": reason}
    row = {"checkpoint": str(checkpoint), "sentences": len(sentences)}
    for beam in (1, 5):
        sync(device)
        start = time.perf_counter()
        with autocast(device, s.dtype):
            translate_sentences(model, tokenizer, sentences, beam_size=beam)
        sync(device)
        row[f"beam{beam}_sentences_per_s"] = len(sentences) / (time.perf_counter() - start)
    row["beam5_over_greedy"] = row["beam5_sentences_per_s"] / row["beam1_sentences_per_s"]
    print(
        f"  {len(sentences)} sentences of test2016 ({checkpoint}): greedy "
        f"{row['beam1_sentences_per_s']:.1f}/s, beam 5 {row['beam5_sentences_per_s']:.1f}/s "
        f"(beam 5 ÷ greedy {row['beam5_over_greedy']:.2f})",
        flush=True,
    )
    return row


def _rss_bytes(field: str) -> int:
    match = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    return int(match.group(1)) * 1024


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def map_large_allocations(threshold: int = 64 * 1024) -> bool:
    """Make glibc give every allocation of ``threshold`` bytes or more its own mapping, returned
    to the system when it is freed, so that the resident set follows the live tensors.

    By default glibc raises that threshold as large blocks are freed (up to 32 MiB) and keeps
    freed memory for reuse: after the training benchmarks, a 128 MiB score tensor fits in memory
    the process already holds, and the resident set does not move (the peaks read 0). False
    where this is not glibc."""
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(M_MMAP_THRESHOLD, threshold) and libc.mallopt(
            M_TRIM_THRESHOLD, threshold
        )
        libc.malloc_trim(0)  # give back what is already free
    except (OSError, AttributeError):
        return False
    return bool(ok)


def peak_memory(fn: Callable[[], Tensor], device: torch.device) -> int | None:
    """Bytes the call needs at its peak above what was in use before it.

    CUDA: the caching allocator's peak. CPU (Linux, glibc): the peak resident set size, reset
    through ``/proc/self/clear_refs`` before the call; :func:`map_large_allocations` must have
    run, so that large tensors are mapped and unmapped one by one. None where neither works."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = _rss_bytes("VmRSS")
        fn()
        return _rss_bytes("VmHWM") - before
    except OSError:
        return None


@torch.no_grad()
def _written_out_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return scaled_dot_product_attention(q, k, v)[0]


@torch.no_grad()
def _fused_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v)


ATTENTION_SHAPE = {"batch": 1, "heads": 8, "d_head": 64}


def attention_peaks(lengths: list[int], device: torch.device, dtype: torch.dtype) -> dict:
    """``{L: (written-out peak, fused peak)}`` in MiB (None where not measurable)."""
    B, H, Dh = ATTENTION_SHAPE.values()
    peaks = {}
    for L in lengths:
        q, k, v = torch.randn(3, B, H, L, Dh, device=device, dtype=dtype).unbind(0)
        found = [
            peak_memory(partial(fn, q, k, v), device)
            for fn in (_written_out_attention, _fused_attention)
        ]
        peaks[L] = [None if peak is None else peak / 2**20 for peak in found]
    return peaks


def _cpu_attention_peaks(lengths: list[int], dtype: torch.dtype) -> dict:
    """:func:`attention_peaks` on the CPU, in a fresh Python process: there every large tensor
    is mapped and unmapped on its own from the start (:func:`map_large_allocations`), while this
    process's allocator holds memory the earlier sections freed and would reuse unseen."""
    code = (
        "import json, torch, bench\n"
        "ok = bench.map_large_allocations()\n"
        f"peaks = bench.attention_peaks({lengths}, torch.device('cpu'), {dtype}) if ok else None\n"
        "print(json.dumps(peaks))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parent,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())},
    )
    if done.returncode:
        return {}
    found = json.loads(done.stdout.splitlines()[-1]) or {}
    return {int(L): peaks for L, peaks in found.items()}


def bench_attention(s: Settings, device: torch.device) -> list[dict]:
    """Section 5: one self-attention call (B=1, H=8, Dh=64), forward, no grad: time, and peak
    memory (on the CPU measured in a fresh process, see :func:`_cpu_attention_peaks`)."""
    B, H, Dh = ATTENTION_SHAPE.values()
    dtype = s.dtype or torch.float32
    lengths = list(s.attention_lengths)
    if device.type == "cuda":
        peaks = attention_peaks(lengths, device, dtype)
    else:
        peaks = _cpu_attention_peaks(lengths, dtype)
    rows = []
    for L in lengths:
        q, k, v = torch.randn(3, B, H, L, Dh, device=device, dtype=dtype).unbind(0)
        written = partial(_written_out_attention, q, k, v)
        fused = partial(_fused_attention, q, k, v)
        torch.testing.assert_close(written(), fused(), atol=1e-2, rtol=1e-2)
        timed = interleaved({"written": written, "fused": fused}, s.repeats, 1, device)
        written_peak, fused_peak = peaks.get(L, (None, None))
        row = {
            "L": L,
            **ATTENTION_SHAPE,
            "score_tensor_mib": B * H * L * L * dtype.itemsize / 2**20,
            "written_ms": 1e3 * timed["written"]["median_s"],
            "fused_ms": 1e3 * timed["fused"]["median_s"],
            "written_peak_mib": written_peak,
            "fused_peak_mib": fused_peak,
        }
        rows.append(row)
        memory = (
            "memory not measured"
            if written_peak is None
            else f"peak {written_peak:7.1f} vs {fused_peak:6.1f} MiB"
        )
        print(
            f"  attention L={L:<5} written-out {row['written_ms']:8.2f} ms  fused "
            f"{row['fused_ms']:8.2f} ms  {memory} (scores {row['score_tensor_mib']:.1f} MiB)",
            flush=True,
        )
    return rows


def model_flops_utilisation(device: torch.device, settings: Settings, peak: float | None) -> dict:
    """Model FLOPs utilisation of the ``base`` train step in bf16 on a GPU: (6 · parameters ·
    tokens + attention FLOPs) / step time / the GPU's dense bf16 peak. Attention FLOPs: 12·D·L²
    a sentence for each self-attention over L positions (QKᵀ and AV, forward and backward), and
    12·D·T·S for each cross-attention."""
    name = torch.cuda.get_device_name(device)
    peak = peak or next((f for key, f in PEAK_FLOPS.items() if key in name), None)
    if peak is None:
        return {"skipped": f"peak FLOP/s of {name!r} unknown: pass --peak-tflops"}
    ours, _, vocab = build_pair("base", device)
    c = ours.config
    L = 32
    sentences = settings.tokens["base"] // L
    ids = make_batch(vocab, sentences, L, device)
    step = train_step_fn(ours, ids, device, torch.bfloat16)
    seconds = interleaved({"ours": step}, settings.repeats, 2, device)["ours"]["median_s"]
    params = sum(p.numel() for p in ours.parameters())
    tokens = sentences * (2 * L - 1)  # source and target positions, all computed on
    S, T = L, L - 1
    attention = (
        12
        * c.d_model
        * sentences
        * (c.n_encoder_layers * S * S + c.n_decoder_layers * (T * T + T * S))
    )
    flops = 6 * params * tokens + attention
    mfu = flops / seconds / peak
    print(
        f"  base, bf16, {sentences}×{L} tokens: {seconds * 1e3:.1f} ms a step, "
        f"{flops / seconds / 1e12:.1f} TFLOP/s of {peak / 1e12:.0f} peak: MFU {mfu:.1%}"
    )
    return {"gpu": name, "peak_flops": peak, "step_s": seconds, "flops": flops, "mfu": mfu}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax = axes[0, 0]
    rows = results["train_step"]
    labels = [f"{r['config']}\nL={r['length']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["ratio"] for r in rows], 0.4, label="train step")
    ax.bar([i + 0.2 for i in x], [r["ratio"] for r in results["forward"]], 0.4, label="forward")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("throughput, ours ÷ nn.Transformer")
    ax.set_title("eager, median of interleaved runs")
    ax.legend()
    ax = axes[0, 1]
    dec = results["decode"]
    ax.plot([r["tokens"] for r in dec], [r["cache_ms"] for r in dec], "o-", label="KV cache")
    ax.plot([r["tokens"] for r in dec], [r["recompute_ms"] for r in dec], "s-", label="recompute")
    ax.set(xscale="log", yscale="log", xlabel="tokens generated", ylabel="ms")
    ax.set_title(f"greedy decoding, {dec[0]['sentences']} sentences ({dec[0]['config']})")
    ax.legend()
    att = results["attention"]
    ls = [r["L"] for r in att]
    ax = axes[1, 0]
    ax.plot(ls, [r["written_ms"] for r in att], "o-", label="written out")
    ax.plot(ls, [r["fused_ms"] for r in att], "s-", label="fused F.sdpa")
    ax.set(xscale="log", yscale="log", xlabel="L", ylabel="ms")
    ax.set_title("attention alone: time (B=1, H=8, Dh=64)")
    ax.legend()
    ax = axes[1, 1]
    if att[0]["written_peak_mib"] is not None:
        ax.plot(ls, [r["written_peak_mib"] for r in att], "o-", label="written out, peak")
        ax.plot(ls, [r["fused_peak_mib"] for r in att], "s-", label="fused, peak")
    ax.plot(ls, [r["score_tensor_mib"] for r in att], "k--", label="one (B, H, L, L) tensor")
    ax.set(xscale="log", yscale="log", xlabel="L", ylabel="MiB")
    ax.set_title("attention alone: peak memory")
    ax.legend()
    meta = results["meta"]
    fig.suptitle(f"{meta['device_name']}, torch {meta['torch']}, {meta['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(results: dict) -> None:
    print("\nthroughput ratio ours ÷ nn.Transformer (> 1: ours faster), median wall clock")
    print(f"{'':8}{'config':<7}{'L':>4}{'ours ms':>10}{'torch ms':>10}{'ratio':>7}{'spread':>14}")
    for kind, label in (("train_step", "train"), ("forward", "forward"), ("compiled", "compiled")):
        for r in results[kind]:
            spread = f"{r['ours_spread']:.0%}/{r['torch_spread']:.0%}"
            print(
                f"{label:<8}{r['config']:<7}{r['length']:>4}{r['ours_ms']:>10.1f}"
                f"{r['torch_ms']:>10.1f}{r['ratio']:>7.2f}{spread:>14}"
            )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs a measurement")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument(
        "--precision", choices=["bf16", "fp32"], default="bf16", help="on CUDA (CPU: fp32)"
    )
    parser.add_argument("--sentences", type=int, default=200, help="test2016 sentences, beam")
    parser.add_argument("--checkpoint", type=Path, help="trained model (default: cached run)")
    parser.add_argument("--peak-tflops", type=float, help="GPU dense bf16 peak, for MFU")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> torch.device:
    for name in ("threads", "repeats", "sentences"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be at least 0, got {args.warmup}")
    if args.checkpoint is not None and not args.checkpoint.is_file():
        raise ValueError(f"--checkpoint {args.checkpoint}: no such file")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r} is not a device (cpu, cuda)") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is available here")
    return device


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        device = check_args(args)
    except ValueError as err:
        print(f"bench.py: {err}", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    settings = Settings(args, device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    meta = {
        "device": device.type,
        "device_name": device_name,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "precision": "bf16 autocast" if settings.dtype else "fp32",
        "repeats": settings.repeats,
        "quick": settings.quick,
        "commit": git_commit()["commit"],
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "bench/bench.py", *(argv or sys.argv[1:])]),
    }
    print(
        f"bench: {device.type} ({device_name}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads (fixed), {meta['precision']}, median of "
        f"{settings.repeats} interleaved runs",
        flush=True,
    )
    start = time.perf_counter()
    results: dict = {"meta": meta}
    sections = [
        ("1-2. train step and forward, ours vs nn.Transformer", None, bench_models, ()),
        ("3. greedy decoding, KV cache vs recompute", "decode", bench_decoding, ()),
        ("4. beam 5 vs greedy on test2016", "beam", bench_beam, (args.checkpoint,)),
        ("5. attention alone, written out vs fused", "attention", bench_attention, ()),
    ]
    for title, key, fn, extra in sections:
        section_start = time.perf_counter()
        print(f"\n{title}", flush=True)
        out = fn(settings, device, *extra)
        if key is None:
            results.update(out)
        else:
            results[key] = out
        print(f"  ({time.perf_counter() - section_start:.0f} s)", flush=True)
    if device.type == "cuda" and not settings.quick:
        print("\nmodel FLOPs utilisation", flush=True)
        peak = None if args.peak_tflops is None else 1e12 * args.peak_tflops
        results["mfu"] = model_flops_utilisation(device, settings, peak)
    meta["total_s"] = round(time.perf_counter() - start, 1)
    print_table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{device.type}-{torch.__version__}" + ("-quick" if settings.quick else "")
    json_path, png_path = args.out / f"{stem}.json", args.out / f"{stem}.png"
    json_path.write_text(json.dumps(results, indent=1, default=_json_default) + "\n")
    plot(results, png_path)
    print(f"\n{meta['total_s']:.0f} s in all; wrote {json_path} and {png_path}")
    return 0


def _json_default(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
