"""The results: the table printed at the end, the plot, and the JSON file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

TABLE_KINDS = (("train_step", "train"), ("forward", "forward"), ("compiled", "compiled"))


def ours_name(results: dict) -> str:
    """Our side's name in the table and the plot: with its dropout masks where they are the
    cheap ones (``transformer_tutorial.dropout.with_cheap_dropout``), as the trainer's."""
    return "ours (cheap dropout masks)" if results["ours_cheap_dropout"] else "ours"


def _dropout_legend(results: dict) -> str:
    if not results["ours_cheap_dropout"]:
        return "dropout: nn.Dropout on both sides"
    return (
        "dropout: ours eager draws its masks as the trainer does on this CPU, from a quarter of "
        "the random draws, the attention weights' included (dropout.with_cheap_dropout); "
        "compiled rows and nn.Transformer use nn.Dropout"
    )


def _mfu(row: dict, suffix: str = "") -> str:
    if f"ours_mfu{suffix}" not in row:
        return "-"
    return f"{row[f'ours_mfu{suffix}']:.1%}/{row[f'torch_mfu{suffix}']:.1%}"


def _mfu_legend(peaks: dict) -> str:
    matmul, sheet = peaks["matmul"], peaks["datasheet_flop_per_s"]
    legend = (
        f"MFU ours/nn.Transformer: counted FLOP/s ÷ the {matmul['dtype']} matrix-multiply peak "
        f"{matmul['flop_per_s'] / 1e9:,.1f} GFLOP/s (measured)"
    )
    return legend + ("" if sheet is None else f"; MFU sheet: ÷ {sheet / 1e12:,.1f} TFLOP/s")


def print_table(results: dict) -> None:
    """Each row's medians, throughput ratio, MFU (ours/nn.Transformer) and spread."""
    sheet = results["peaks"]["datasheet_flop_per_s"] is not None
    print(
        f"\nthroughput ratio {ours_name(results)} ÷ nn.Transformer (> 1: ours faster), "
        "median wall clock"
    )
    print(_dropout_legend(results))
    print(_mfu_legend(results["peaks"]))
    header = f"{'':8}{'config':<7}{'L':>4}{'ours ms':>10}{'torch ms':>10}{'ratio':>7}{'MFU':>14}"
    print(header + (f"{'MFU sheet':>14}" if sheet else "") + f"{'spread':>14}")
    for kind, label in TABLE_KINDS:
        for r in results[kind]:
            spread = f"{r['ours_spread']:.0%}/{r['torch_spread']:.0%}"
            print(
                f"{label:<8}{r['config']:<7}{r['length']:>4}{r['ours_ms']:>10.1f}"
                f"{r['torch_ms']:>10.1f}{r['ratio']:>7.2f}{_mfu(r):>14}"
                + (f"{_mfu(r, '_datasheet'):>14}" if sheet else "")
                + f"{spread:>14}"
            )
    print_llama_table(results["llama"])


def print_llama_table(llama: dict) -> None:
    """Section 6: each row's medians and throughput ratio ours ÷ LlamaForCausalLM."""
    print(
        f"\nthroughput ratio ours ÷ transformers' LlamaForCausalLM (> 1: ours faster), "
        f"{llama['config']} ({llama['weights']:,} weights), same weights, median wall clock"
    )
    print(f"{'':10}{'shape':<14}{'ours ms':>10}{'theirs ms':>11}{'ratio':>7}{'spread':>12}  check")
    rows = [
        ("train", f"B={r['batch']} T={r['length']}", r, r["same_logits"])
        for r in llama["train_step"]
    ]
    rows += [
        ("generate", f"B={r['batch']} n={r['new_tokens']}", r, r["same_tokens"])
        for r in llama["generate"]
    ]
    for label, shape, r, same in rows:
        spread = f"{r['ours_spread']:.0%}/{r['theirs_spread']:.0%}"
        print(
            f"{label:<10}{shape:<14}{r['ours_ms']:>10.1f}{r['theirs_ms']:>11.1f}{r['ratio']:>7.2f}"
            f"{spread:>12}  {'same' if same else 'DIFFERENT'}"
        )


def _plot_ratios(ax, results: dict) -> None:
    rows = results["train_step"]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["ratio"] for r in rows], 0.4, label="train step")
    ax.bar([i + 0.2 for i in x], [r["ratio"] for r in results["forward"]], 0.4, label="forward")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(x), [f"{r['config']}\nL={r['length']}" for r in rows])
    ax.set_ylabel("throughput, ours ÷ nn.Transformer")
    masks = (
        "\nours with the trainer's cheap dropout masks" if results["ours_cheap_dropout"] else ""
    )
    ax.set_title(f"eager, median of interleaved runs{masks}")
    ax.legend()


def _plot_decoding(ax, dec: list[dict]) -> None:
    ax.plot([r["tokens"] for r in dec], [r["cache_ms"] for r in dec], "o-", label="KV cache")
    ax.plot([r["tokens"] for r in dec], [r["recompute_ms"] for r in dec], "s-", label="recompute")
    ax.set(xscale="log", yscale="log", xlabel="tokens generated", ylabel="ms")
    ax.set_title(f"greedy decoding, {dec[0]['sentences']} sentences ({dec[0]['config']})")
    ax.legend()


def _plot_attention(time_ax, memory_ax, att: list[dict]) -> None:
    ls = [r["L"] for r in att]
    time_ax.plot(ls, [r["written_ms"] for r in att], "o-", label="written out")
    time_ax.plot(ls, [r["fused_ms"] for r in att], "s-", label="fused F.sdpa")
    time_ax.set(xscale="log", yscale="log", xlabel="L", ylabel="ms")
    time_ax.set_title("attention alone: time (B=1, H=8, Dh=64)")
    time_ax.legend()
    if att[0]["written_peak_mib"] is not None:
        memory_ax.plot(ls, [r["written_peak_mib"] for r in att], "o-", label="written out, peak")
        memory_ax.plot(ls, [r["fused_peak_mib"] for r in att], "s-", label="fused, peak")
    memory_ax.plot(
        ls, [r["score_tensor_mib"] for r in att], "k--", label="one (B, H, L, L) tensor"
    )
    memory_ax.set(xscale="log", yscale="log", xlabel="L", ylabel="MiB")
    memory_ax.set_title("attention alone: peak memory")
    memory_ax.legend()


def _plot_llama(ax, llama: dict, kind: str) -> None:
    """Section 6's ratios of one kind: ``"train_step"`` (per batch) or ``"generate"`` (per
    number of new tokens)."""
    rows = llama[kind]
    if kind == "train_step":
        labels, title = [f"B={r['batch']}\nT={r['length']}" for r in rows], "training step"
    else:
        labels = [f"{r['new_tokens']} tokens" for r in rows]
        title = f"greedy generation, {rows[0]['batch']} prompts of {rows[0]['prompt']}"
    ax.bar(range(len(rows)), [r["ratio"] for r in rows], 0.5)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("throughput, ours ÷ LlamaForCausalLM")
    ax.set_title(f"Llama-style ({llama['config']}): {title}")


def plot(results: dict, path: Path) -> None:
    """Six panels: the ratios, decoding, attention's time and its peak memory, and section 6's
    ratios against LlamaForCausalLM (training, generation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    _plot_ratios(axes[0, 0], results)
    _plot_decoding(axes[0, 1], results["decode"])
    _plot_attention(axes[1, 0], axes[1, 1], results["attention"])
    _plot_llama(axes[0, 2], results["llama"], "train_step")
    _plot_llama(axes[1, 2], results["llama"], "generate")
    meta = results["meta"]
    fig.suptitle(f"{meta['device_name']}, torch {meta['torch']}, {meta['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _finite(value: object) -> object:
    """``value`` with every non-finite float (a ratio --quick cannot resolve) as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def write_results(results: dict, out: Path, quick: bool) -> tuple[Path, Path]:
    """``out/<device>-<torch version>[-quick].json`` and the plot beside it."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{results['meta']['device']}-{torch.__version__}" + ("-quick" if quick else "")
    json_path, png_path = out / f"{stem}.json", out / f"{stem}.png"
    text = json.dumps(_finite(results), indent=1, default=str, allow_nan=False)
    json_path.write_text(text + "\n")
    plot(results, png_path)
    return json_path, png_path
