"""``python -m bench`` (``make bench``): the sections in turn, then the table, JSON and plot."""

from __future__ import annotations

import sys
import time

import torch

from bench.attention import bench_attention
from bench.beam import bench_beam
from bench.cli import Settings, parse_args, run_meta
from bench.decoding import bench_decoding
from bench.llama import bench_llama
from bench.mla import bench_mla
from bench.moe import bench_moe
from bench.paged import bench_paged
from bench.report import print_table, write_results
from bench.roofline import bench_roofline
from bench.speculative import bench_speculative
from bench.tiled import bench_tiled
from bench.train_forward import bench_models
from transformer_tutorial.allocator import keep_freed_memory

# (title, key in the results or None to merge the section's dict, the section)
SECTIONS = (
    (
        "1-2. train step (with MFU) and forward, ours (cheap dropout masks where they pay, as "
        "the trainer) vs nn.Transformer",
        None,
        bench_models,
    ),
    ("3. greedy decoding, KV cache vs recompute", "decode", bench_decoding),
    ("4. beam 5 vs greedy on test2016", "beam", bench_beam),
    ("5. attention alone, written out vs fused", "attention", bench_attention),
    (
        "6. chapter 17's Llama-style model (the capstone on a full run), ours vs transformers' "
        "LlamaForCausalLM",
        "llama",
        bench_llama,
    ),
    (
        "7. chapter 20's mixture-of-experts layer, ours vs transformers' Qwen3MoeSparseMoeBlock",
        "moe",
        bench_moe,
    ),
    (
        "8. chapter 21's latent attention, a decoding step absorbed vs unabsorbed",
        "mla",
        bench_mla,
    ),
    (
        "9. speculative decoding at batch 1 (chapter 23), section 6's model as the target, "
        "two drafts vs plain greedy",
        "speculative",
        bench_speculative,
    ),
    (
        "10. the paged cache (chapter 23) vs the preallocated one, greedy decoding",
        "paged",
        bench_paged,
    ),
    ("11. chapter 22's tiled attention vs F.sdpa (a report: no goal)", "tiled", bench_tiled),
    (
        "12. greedy decoding against the memory-bandwidth roofline: ours in float32, bf16, int8 "
        "and int4 (bf16 and int8 compiled) vs LlamaForCausalLM in float32 and bf16",
        "roofline",
        bench_roofline,
    ),
)


def run_sections(settings: Settings, device: torch.device, results: dict) -> None:
    for title, key, section in SECTIONS:
        start = time.perf_counter()
        print(f"\n{title}", flush=True)
        out = section(settings, device)
        if key is None:
            results.update(out)
        else:
            results[key] = out
        print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # a bad argument: one line, exit status 2
    device = args.device
    torch.set_num_threads(args.threads)
    if device.type == "cpu":  # as the trainer trains there; both sides gain
        keep_freed_memory()
    settings = Settings.from_args(args, device)
    meta = run_meta(settings, device, argv)
    print(
        f"bench: {device.type} ({meta['device_name']}), torch {torch.__version__}, "
        f"{meta['threads']} threads (fixed), {meta['precision']}, median of "
        f"{settings.repeats} interleaved runs"
        + (
            f" ({settings.llama_repeats} at {settings.llama_config}'s size)"
            if settings.llama_repeats != settings.repeats
            else ""
        ),
        flush=True,
    )
    start = time.perf_counter()
    results: dict = {"meta": meta}
    run_sections(settings, device, results)
    meta["total_s"] = round(time.perf_counter() - start, 1)
    print_table(results)
    json_path, png_path = write_results(results, args.out, settings.quick)
    print(f"\n{meta['total_s']:.0f} s in all; wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
