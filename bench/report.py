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
    for key, table in EXTRA_TABLES:
        if key in results:  # records made before the section was added lack it
            table(results[key])


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


def _same(flag: bool) -> str:
    return "same" if flag else "DIFFERENT"


def print_moe_table(moe: dict) -> None:
    """Section 7: each row's medians and throughput ratio ours ÷ Qwen3MoeSparseMoeBlock."""
    print(
        "\nthroughput ratio ours ÷ transformers' Qwen3MoeSparseMoeBlock (> 1: ours faster), "
        "same weights, median wall clock"
    )
    print(f"{'':10}{'shape':<24}{'ours ms':>10}{'theirs ms':>11}{'ratio':>7}{'spread':>12}  check")
    for r in moe["rows"]:
        shape = f"E={r['n_experts']} k={r['top_k']} N={r['tokens']}"
        spread = f"{r['ours_spread']:.0%}/{r['theirs_spread']:.0%}"
        print(
            f"{r['mode']:<10}{shape:<24}{r['ours_ms']:>10.2f}{r['theirs_ms']:>11.2f}"
            f"{r['ratio']:>7.2f}{spread:>12}  {_same(r['same_output'])}"
        )


def print_mla_table(r: dict) -> None:
    """Section 8: one decoding step, absorbed and unabsorbed."""
    print(
        f"\nlatent attention, one decoding step (B={r['batch']} after S={r['cached']}, "
        f"H={r['heads']}): ratio unabsorbed ÷ absorbed (> 1: absorbed faster)"
    )
    print(f"{'absorbed ms':>12}{'unabsorbed ms':>15}{'ratio':>7}{'spread':>12}  check")
    spread = f"{r['absorbed_spread']:.0%}/{r['unabsorbed_spread']:.0%}"
    print(
        f"{r['absorbed_ms']:>12.2f}{r['unabsorbed_ms']:>15.2f}{r['ratio']:>7.2f}{spread:>12}  "
        f"{_same(r['same_output'])}"
    )
    if "model_steps" not in r:  # records made before it was added lack it
        return
    print(
        "through the model, one layer: model.step as generate() takes it ÷ every layer unabsorbed"
    )
    print(
        f"{'S':>6}{'generate ms':>12}{'unabsorbed ms':>15}{'ratio':>7}{'spread':>12}"
        f"{'fixed ms':>10}  check"
    )
    for step in r["model_steps"]:
        spread = f"{step['absorbed_spread']:.0%}/{step['unabsorbed_spread']:.0%}"
        fixed = f"{step['fixed_ms']:>10.2f}" if "fixed_ms" in step else f"{'':>10}"
        print(
            f"{step['cached']:>6}{step['absorbed_ms']:>12.2f}{step['unabsorbed_ms']:>15.2f}"
            f"{step['ratio']:>7.2f}{spread:>12}{fixed}  {_same(step['same_output'])}"
        )


def print_speculative_table(spec: dict) -> None:
    """Section 9: each draft's acceptance, target calls and speed-up over plain greedy."""
    print(
        f"\nspeculative decoding, speed-up over plain greedy (> 1: faster), {spec['config']} "
        f"target ({spec['target_weights']:,} weights), batch 1, {spec['new_tokens']} tokens; "
        f"the target repeats its previous token in {spec['target_repeat_rate']:.0%} of steps"
    )
    print(
        f"{'draft':<14}{'k':>3}{'accepted':>10}{'calls':>7}{'spec ms':>10}{'plain ms':>10}"
        f"{'speed-up':>10}{'spread':>12}  check"
    )
    for r in spec["rows"]:
        spread = f"{r['speculative_spread']:.0%}/{r['plain_spread']:.0%}"
        print(
            f"{r['draft']:<14}{r['k']:>3}{r['acceptance_rate']:>10.0%}{r['target_calls']:>7}"
            f"{r['speculative_ms']:>10.1f}{r['plain_ms']:>10.1f}{r['speedup']:>10.2f}"
            f"{spread:>12}  {_same(r['same_tokens'])}"
        )
    for r in spec["rows"]:
        print(f"  {r['draft']}: {r['draft_is']}")
    c = spec.get("copy_task")
    if c:
        print(
            f"prompt lookup on a model trained to copy ({c['rows_copied']}/{c['rows']} rows "
            f"copied): {c['target_calls']} target calls for {c['new_tokens']} tokens, speed-up "
            f"{c['speedup']:.2f} (goal >= 1.5)  {_same(c['same_tokens'])}"
        )


def print_paged_table(paged: dict) -> None:
    """Section 10: greedy decoding with each cache, ratio paged ÷ preallocated."""
    print(
        f"\npaged cache's overhead, ratio paged ÷ preallocated time (> 1: paged slower), "
        f"greedy decoding, {paged['config']} ({paged['weights']:,} weights)"
    )
    print(f"{'shape':<18}{'blocks':>10}{'prealloc ms':>13}{'paged ms':>10}{'ratio':>7}  check")
    for r in paged["rows"]:
        shape = f"B={r['batch']} n={r['new_tokens']}"
        blocks = f"{r['n_blocks']}×{r['block_size']}"
        print(
            f"{shape:<18}{blocks:>10}{r['preallocated_ms']:>13.1f}{r['paged_ms']:>10.1f}"
            f"{r['ratio']:>7.2f}  {_same(r['same_tokens'])}"
        )
    b = paged.get("batching")
    if b:
        print(
            f"continuous batching, {b['requests']} requests ({b['new_tokens']} new tokens): "
            f"{b['batched_tokens_per_s']:.1f} tokens/s batched vs "
            f"{b['one_by_one_tokens_per_s']:.1f} one by one, speed-up {b['speedup']:.2f} "
            f"(goal >= 2)  {_same(b['same_tokens'])}"
        )


def print_tiled_table(tiled: dict) -> None:
    """Section 11: the tiled attention's time ÷ F.sdpa's (a report, no goal)."""
    print(
        f"\ntiled attention (chapter 22, a teaching implementation) ÷ F.sdpa time, causal, "
        f"B={tiled['batch']} H={tiled['heads']} Dh={tiled['d_head']}, float32"
    )
    print(f"{'':10}{'L':>6}{'tiled ms':>10}{'sdpa ms':>10}{'ratio':>8}  check")
    for r in tiled["rows"]:
        print(
            f"{r['mode']:<10}{r['L']:>6}{r['tiled_ms']:>10.2f}{r['sdpa_ms']:>10.2f}"
            f"{r['ratio']:>8.1f}  {_same(r['same_output'])}"
        )


def print_roofline_table(roof: dict) -> None:
    """Section 12: each variant's step time, its share of the bandwidth roofline, its speed
    against LlamaForCausalLM, and its agreement with float32."""
    print(
        f"\ngreedy decoding against the roofline ({roof['config']}): read bandwidth "
        f"{roof['bandwidth_gb_per_s']:.1f} GB/s; roofline = weight bytes a step reads ÷ step "
        f"time ÷ bandwidth"
    )
    print(
        f"{'B':>2} {'variant':<29}{'ms/step':>9}{'tok/s':>8}{'GB/s':>7}{'roofline':>9}"
        f"{'×HF fp32':>9}{'×HF bf16':>9}{'as fp32':>8}"
    )
    for r in roof["rows"]:
        print(
            f"{r['batch']:>2} {r['variant']:<29}{r['step_ms']:>9.1f}{r['tokens_per_s']:>8.1f}"
            f"{r['read_gb_per_s']:>7.1f}{r['roofline']:>9.0%}{r['vs_theirs_fp32']:>9.2f}"
            f"{r['vs_theirs_bf16']:>9.2f}{r['agrees_with_fp32']:>8.0%}"
        )
    if "ceiling" in roof:  # CPU runs
        print(
            f"kernel ceiling (each linear layer once, batch 1, OMP_WAIT_POLICY="
            f"{roof['omp_wait_policy']}):"
        )
        for k, c in roof["ceiling"]["kernels"].items():
            print(
                f"   {k:<31}{c['step_ms']:>9.1f}{'':>8}{c['read_gb_per_s']:>7.1f}"
                f"{c['roofline']:>9.0%}"
            )
        print(f"{roof['ceiling']['verdict']}; {roof['ceiling']['roofline_verdict']}")
    loss = roof["loss"]
    print(
        f"held-out loss gap to float32, chapter 17's model trained {loss['train_seconds']:.0f} s: "
        + ", ".join(f"{k} {v:+.4f}" for k, v in loss["gaps"].items() if k != "fp32")
        + " (goal: int8 within 0.02)"
    )


# The later sections' tables: (key in the results, the table).
EXTRA_TABLES = (
    ("moe", print_moe_table),
    ("mla", print_mla_table),
    ("speculative", print_speculative_table),
    ("paged", print_paged_table),
    ("tiled", print_tiled_table),
    ("roofline", print_roofline_table),
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
        labels = [f"B={r['batch']}\n{r['new_tokens']} tokens" for r in rows]
        title = f"greedy generation, prompts of {rows[0]['prompt']}"
    ax.bar(range(len(rows)), [r["ratio"] for r in rows], 0.5)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("throughput, ours ÷ LlamaForCausalLM")
    ax.set_title(f"Llama-style ({llama['config']}): {title}")


def _plot_speculative(ax, spec: dict) -> None:
    """Section 9: each draft's speed-up, its acceptance rate under the bar."""
    rows = spec["rows"]
    ax.bar(range(len(rows)), [r["speedup"] for r in rows], 0.5)
    ax.axhline(1.0, color="k", lw=0.8)
    labels = [f"{r['draft']}\naccepted {r['acceptance_rate']:.0%}" for r in rows]
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("speed-up over plain greedy")
    ax.set_title(f"speculative decoding, batch 1, k={rows[0]['k']} ({spec['config']})")


def _plot_side_ratios(ax, rows: list[dict], labels: list[str], ylabel: str, title: str) -> None:
    ax.bar(range(len(rows)), [r["ratio"] for r in rows], 0.5)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), labels)
    ax.set(ylabel=ylabel, title=title)


def _plot_tiled(ax, tiled: dict) -> None:
    """Section 11: time against L, both modes, both sides."""
    for mode, marker in (("forward", "o"), ("train", "s")):
        rows = [r for r in tiled["rows"] if r["mode"] == mode]
        ls = [r["L"] for r in rows]
        ax.plot(ls, [r["tiled_ms"] for r in rows], f"C0{marker}-", label=f"tiled, {mode}")
        ax.plot(ls, [r["sdpa_ms"] for r in rows], f"C1{marker}--", label=f"F.sdpa, {mode}")
    ax.set(xscale="log", yscale="log", xlabel="L", ylabel="ms")
    ax.set_title("tiled attention vs F.sdpa (causal, float32)")
    ax.legend()


def _plot_later_sections(axes, results: dict) -> None:
    """The third row: sections 9, 10 and 11, where the results have them."""
    if "speculative" in results:
        _plot_speculative(axes[0], results["speculative"])
    if "paged" in results:
        rows = results["paged"]["rows"]
        _plot_side_ratios(
            axes[1],
            rows,
            [f"B={r['batch']}\n{r['new_tokens']} tokens" for r in rows],
            "time, paged ÷ preallocated",
            f"paged cache's overhead ({results['paged']['config']})",
        )
    if "tiled" in results:
        _plot_tiled(axes[2], results["tiled"])


def plot(results: dict, path: Path) -> None:
    """Nine panels: the ratios, decoding, attention's time and its peak memory, section 6's
    ratios against LlamaForCausalLM (training, generation), and sections 9-11 (speculative
    decoding, the paged cache, the tiled attention)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 3, figsize=(16, 12))
    _plot_ratios(axes[0, 0], results)
    _plot_decoding(axes[0, 1], results["decode"])
    _plot_attention(axes[1, 0], axes[1, 1], results["attention"])
    _plot_llama(axes[0, 2], results["llama"], "train_step")
    _plot_llama(axes[1, 2], results["llama"], "generate")
    _plot_later_sections(axes[2], results)
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
