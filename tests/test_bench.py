"""bench/ (`make bench`, `python -m bench`): runs end to end on tiny sizes and writes its results,
the MFU column among them; bad arguments get one line and exit status 1; the CPU's peak memory is
seen in a fresh process. Benchmarks are measurements: nothing here asserts speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformer_tutorial.dropout import cheap_masks_pay
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.sampling import generate
from transformer_tutorial.lm.speculative import speculative_generate
from transformer_tutorial.records import load_reference_bench

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    """The ``bench`` package (a folder of the repository, run as ``python -m bench``)."""
    monkeypatch.syspath_prepend(str(ROOT))
    import bench
    import bench.__main__
    import bench.mfu
    import bench.roofline

    return bench


@pytest.fixture
def keep_threads():
    """The bench fixes the thread count: give the test process its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_bench_quick_runs_every_section_and_writes_results(
    bench, keep_threads, tmp_path, tiny_checkpoint, capsys
):
    args = ["--quick", "--threads=1", "--repeats=1", "--warmup=0"]
    code = bench.__main__.main([*args, f"--checkpoint={tiny_checkpoint}", f"--out={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0
    assert "1 threads (fixed)" in out
    [json_path] = tmp_path.glob("cpu-*-quick.json")
    assert json_path.with_suffix(".png").stat().st_size > 0
    results = json.loads(json_path.read_text())
    assert results["meta"]["threads"] == 1
    assert results["meta"]["command"].startswith("python -m bench --quick")
    for kind in ("train_step", "forward"):
        assert [(r["config"], r["length"]) for r in results[kind]] == [("tiny", 8), ("tiny", 16)]
        assert all(r["ratio"] > 0 and r["ours_ms"] > 0 for r in results[kind])
    assert results["compiled"] == [] and results["compile_skipped"]
    assert [r["tokens"] for r in results["decode"]] == [4, 8]
    assert results["beam"]["sentences"] == 4
    assert results["beam"]["beam5_sentences_per_s"] > 0
    assert [r["L"] for r in results["attention"]] == [64, 128]
    if sys.platform == "linux":  # tiny sizes: measured, but too small to compare
        assert all(r["written_peak_mib"] is not None for r in results["attention"])
    _check_mfu(results, out)
    _check_llama(results, out)
    _check_moe(results, out)
    _check_mla(results, out)
    _check_speculative(results, out)
    _check_paged(results, out)
    _check_tiled(results, out)
    _check_roofline(results, out, bench)


def _check_mfu(results: dict, out: str) -> None:
    """The training rows carry the counted FLOPs and MFU; the table prints them."""
    peaks = results["peaks"]
    assert peaks["matmul"]["dtype"] == "float32" and peaks["matmul"]["flop_per_s"] > 0
    assert peaks["datasheet_flop_per_s"] is None  # a CPU has no data-sheet entry
    assert "optimizer step is timed but not counted" in peaks["counted"]
    for r in results["train_step"]:
        # The same matrix products, less ours' output layer at padding (it skips those logits).
        assert 0 < r["ours_gflop"] < r["torch_gflop"]
        for side in ("ours", "torch"):
            achieved = 1e9 * r[f"{side}_gflop"] / (r[f"{side}_ms"] / 1e3)
            assert r[f"{side}_mfu"] == pytest.approx(achieved / peaks["matmul"]["flop_per_s"])
    assert all("ours_mfu" not in r for r in results["forward"])
    # Ours trains as the trainer does on this CPU, and the table's title says with which masks.
    assert results["ours_cheap_dropout"] == cheap_masks_pay(torch.device("cpu"))
    ours = "ours (cheap dropout masks)" if results["ours_cheap_dropout"] else "ours"
    table = out[out.index(f"throughput ratio {ours} ÷ nn.Transformer") :].splitlines()
    assert table[1].startswith("dropout: ")
    assert table[2].startswith("MFU ours/nn.Transformer: counted FLOP/s ÷ the float32")
    columns = ["config", "L", "ours", "ms", "torch", "ms", "ratio", "MFU", "spread"]
    assert table[3].split() == columns
    first = results["train_step"][0]
    # ours/nn.Transformer, in percent
    assert table[4].split()[6] == f"{first['ours_mfu']:.1%}/{first['torch_mfu']:.1%}"


def _check_llama(results: dict, out: str) -> None:
    """Section 6: both sides computed the same (logits, greedy tokens), each row has a ratio, the
    table prints one line a row."""
    llama = results["llama"]
    assert llama["config"] == "tiny" and llama["weights"] > 0
    assert [(r["batch"], r["length"]) for r in llama["train_step"]] == [(2, 16)]
    assert [r["new_tokens"] for r in llama["generate"]] == [8]
    for r in llama["train_step"]:
        assert r["same_logits"] and r["fp32_logits_diff"] <= 1e-4
    assert all(r["same_tokens"] for r in llama["generate"])
    for r in llama["train_step"] + llama["generate"]:
        assert r["ratio"] == pytest.approx(r["theirs_ms"] / r["ours_ms"]) and r["ratio"] > 0
    table = out[out.index("throughput ratio ours ÷ transformers' LlamaForCausalLM") :]
    lines = table.splitlines()[2:4]
    assert [line.split()[0] for line in lines] == ["train", "generate"]
    assert all(line.endswith("same") for line in lines)


def _check_moe(results: dict, out: str) -> None:
    """Section 7: both sides gave the same outputs, forward and train rows each have a ratio."""
    rows = results["moe"]["rows"]
    assert [(r["mode"], r["n_experts"], r["top_k"]) for r in rows] == [
        ("forward", 4, 2),
        ("train", 4, 2),
    ]
    for r in rows:
        assert r["same_output"] and r["fp32_output_diff"] <= 1e-4
        assert r["ratio"] == pytest.approx(r["theirs_ms"] / r["ours_ms"]) and r["ratio"] > 0
    table = out[out.index("throughput ratio ours ÷ transformers' Qwen3MoeSparseMoeBlock") :]
    lines = table.splitlines()[2:4]
    assert [line.split()[0] for line in lines] == ["forward", "train"]
    assert all(line.endswith("same") for line in lines)


def _check_mla(results: dict, out: str) -> None:
    """Section 8: the absorbed and unabsorbed decoding steps gave the same output; one ratio."""
    row = results["mla"]
    assert (row["batch"], row["cached"], row["heads"]) == (2, 16, 4)
    assert row["same_output"] and row["fp32_output_diff"] <= 1e-4
    assert row["ratio"] == pytest.approx(row["unabsorbed_ms"] / row["absorbed_ms"])
    assert row["cache_mib"] == 2 * 16 * (16 + 6) * 4 / 2**20  # the latents and rotary keys
    assert "ratio unabsorbed ÷ absorbed" in out
    assert "latent attention, one decoding step (B=2 after S=16, H=4)" in out  # the table
    steps = row["model_steps"]  # through the model: generate()'s step against unabsorbed
    assert [r["cached"] for r in steps] == [16, 32]
    for r in steps:
        assert r["default_form"] == "absorbed" and r["same_output"]
        assert r["ratio"] == pytest.approx(r["unabsorbed_ms"] / r["absorbed_ms"])
        over = r["absorbed_ms"] - r["fixed_ms"], r["unabsorbed_ms"] - r["fixed_ms"]
        if over[0] > 0:  # the attention over the cache, each form's step less the fixed part
            assert r["attention_ratio"] == pytest.approx(over[1] / over[0])
    assert "the fixed part (the step after 1 position)" in out
    assert "through the model, one layer: model.step as generate() takes it" in out


def _check_speculative(results: dict, out: str) -> None:
    """Section 9: both drafts and prompt lookup gave the target's greedy tokens; each row says
    what its draft is and how often it was accepted; the table prints a line a draft."""
    spec = results["speculative"]
    assert (spec["config"], spec["batch"], spec["new_tokens"]) == ("tiny", 1, 8)
    assert 0 <= spec["target_repeat_rate"] <= 1
    assert [r["draft"] for r in spec["rows"]] == ["copy", "first_layers", "prompt_lookup"]
    assert [r["k"] for r in spec["rows"]] == [2, 2, 8]
    assert spec["rows"][2]["draft_weights"] == 0
    for r in spec["rows"]:
        assert r["same_tokens"] and 0 <= r["acceptance_rate"] <= 1
        assert 1 <= r["target_calls"] <= 8 and r["draft_is"]
        assert r["speedup"] == pytest.approx(r["plain_ms"] / r["speculative_ms"])
    assert "shares nothing with the target" in spec["rows"][0]["draft_is"]
    table = out[out.index("speculative decoding, speed-up over plain greedy") :].splitlines()
    assert [line.split()[0] for line in table[2:5]] == ["copy", "first_layers", "prompt_lookup"]
    c = spec["copy_task"]
    assert c["same_tokens"] and c["rows"] == 16 and c["new_tokens"] == 16 * 16
    assert 16 <= c["target_calls"] <= 256 and 0 <= c["rows_copied"] <= 16
    assert c["speedup"] == pytest.approx(c["plain_ms"] / c["lookup_ms"])
    assert any(line.startswith("prompt lookup on a model trained to copy") for line in table)
    assert all(line.endswith("same") for line in table[2:5])


def _check_paged(results: dict, out: str) -> None:
    """Section 10: the paged and preallocated caches gave the same tokens at each batch."""
    rows = results["paged"]["rows"]
    assert [(r["batch"], r["new_tokens"], r["block_size"]) for r in rows] == [(1, 8, 4), (2, 8, 4)]
    assert [r["n_blocks"] for r in rows] == [3, 6]  # 12 positions a row, in blocks of 4
    for r in rows:
        assert r["same_tokens"]
        assert r["ratio"] == pytest.approx(r["paged_ms"] / r["preallocated_ms"])
    table = out[out.index("paged cache's overhead") :].splitlines()
    assert all(line.endswith("same") for line in table[2:4])
    b = results["paged"]["batching"]
    assert b["requests"] == 16 and b["same_tokens"]
    assert len(b["prompt_lengths"]) == len(b["budgets"]) == 16
    assert b["new_tokens"] == sum(b["budgets"])
    assert b["speedup"] == pytest.approx(b["one_by_one_s"] / b["batched_s"])
    assert table[4].startswith("continuous batching, 16 requests") and table[4].endswith("same")


def _check_roofline(results: dict, out: str, bench) -> None:
    """Section 12: six variants a batch and the compiled one at batch 1, each with its roofline
    share computed from its own bytes and time; float32 tokens equal to LlamaForCausalLM's; the
    trained model's losses."""
    roof = results["roofline"]
    assert roof["bandwidth_gb_per_s"] > 0
    variants = [r["variant"] for r in roof["rows"]]
    later = [v for v in bench.roofline.VARIANTS if v not in bench.roofline.BATCH_1_ONLY]
    assert variants == [*bench.roofline.VARIANTS, *later]  # the second batch: no compiled rows
    for r in roof["rows"]:
        per_s = r["step_bytes"] / (r["step_ms"] / 1e3)
        assert r["roofline"] == pytest.approx(per_s / (roof["bandwidth_gb_per_s"] * 1e9))
        assert 0 <= r["agrees_with_fp32"] <= 1
    fp32 = [r for r in roof["rows"] if r["variant"] in ("ours fp32", "theirs fp32")]
    assert all(r["agrees_with_fp32"] == 1 for r in fp32)
    int8 = next(r for r in roof["rows"] if r["variant"].startswith("ours int8"))
    assert int8["step_bytes"] < fp32[0]["step_bytes"] / 3  # a byte a weight, not four
    assert set(roof["loss"]["losses"]) == {"fp32", "bf16", "int8", "int4"}
    assert "greedy decoding against the roofline" in out
    _check_ceiling(roof, out, bench)


def _check_ceiling(roof: dict, out: str, bench) -> None:
    """Section 12's kernel ceiling: every linear layer of the model once a pass (the tiny
    model's 2 layers of 7 and its output layer), a pass's bytes its row's but the norms',
    each row's time outside its linear layers its step less its pass, and the verdict."""
    ceiling = roof["ceiling"]
    assert list(ceiling["kernels"]) == list(bench.roofline.KERNELS)
    step = {r["variant"]: r for r in roof["rows"] if r["batch"] == 1}
    for name, c in ceiling["kernels"].items():
        assert sum(s["layers"] for s in c["shapes"]) == 2 * 7 + 1
        row_bytes = step[bench.roofline.KERNELS[name]]["step_bytes"]  # the norms' too
        assert 0.95 * row_bytes < c["step_bytes"] < row_bytes
        assert c["roofline"] == pytest.approx(
            c["step_bytes"] / (c["step_ms"] / 1e3) / (roof["bandwidth_gb_per_s"] * 1e9)
        )
    for row, o in ceiling["outside_linears"].items():
        assert o["outside_ms"] == pytest.approx(step[row]["step_ms"] - o["kernels_ms"])
    theirs = step["theirs fp32"]["step_ms"]
    for key, kernel in (
        ("", "int8 kernel (bf16 act.)"),
        ("compiled_", "int8 one-row product, compiled"),
    ):
        int8 = ceiling["kernels"][kernel]["step_ms"]
        assert ceiling[f"{key}best_vs_theirs_fp32"] == pytest.approx(theirs / int8)
    compiled = theirs / step["ours int8 compiled"]["step_ms"]
    assert ceiling["compiled_reached_vs_theirs_fp32"] == pytest.approx(compiled)
    assert ceiling["verdict"] in out and ceiling["roofline_verdict"] in out
    assert roof["omp_wait_policy"]


def _check_tiled(results: dict, out: str) -> None:
    """Section 11: the tiled attention's outputs and gradients equal F.sdpa's, at a length that
    is a multiple of the tile and one that is not."""
    rows = results["tiled"]["rows"]
    assert [(r["mode"], r["L"]) for r in rows] == [
        ("forward", 64),
        ("train", 64),
        ("forward", 100),
        ("train", 100),
    ]
    for r in rows:
        assert r["same_output"] and r["fp32_output_diff"] <= 1e-4 and r["fp32_grad_diff"] <= 1e-4
        assert r["ratio"] == pytest.approx(r["tiled_ms"] / r["sdpa_ms"])
    table = out[out.index("tiled attention (chapter 22") :].splitlines()
    assert len(table) >= 6 and all(line.endswith("same") for line in table[2:6])


@pytest.mark.parametrize("cheap", [True, False])
def test_the_table_and_plot_say_when_ours_trains_with_the_cheap_dropout_masks(
    bench, capsys, cheap
):
    """The committed results (ours with dropout.with_cheap_dropout's masks, on an AMD CPU) and
    the same results as if ours had used nn.Dropout: the labels name the masks ours used."""
    from matplotlib.figure import Figure

    results = {**load_reference_bench(), "ours_cheap_dropout": cheap}
    bench.report.print_table(results)
    table = capsys.readouterr().out.splitlines()
    ours = "ours (cheap dropout masks)" if cheap else "ours"
    assert table[1].startswith(f"throughput ratio {ours} ÷ nn.Transformer")
    assert ("dropout.with_cheap_dropout" in table[2]) == cheap
    ax = Figure().subplots()
    bench.report._plot_ratios(ax, results)
    assert ("ours with the trainer's cheap dropout masks" in ax.get_title()) == cheap
    assert load_reference_bench()["ours_cheap_dropout"]  # the committed run's, labelled


def test_llama_pair_computes_the_same_and_its_checks_see_a_difference(bench):
    """The pair the section times has the same weights (the same logits, the same tokens), and
    the check it runs sees a wrong weight."""
    import bench.llama as llama

    cpu = torch.device("cpu")
    ours, theirs = llama.build_pair("tiny", cpu)
    assert theirs.config._attn_implementation == "sdpa"
    assert ours.num_parameters() == theirs.num_parameters()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    logits, tokens = {}, {}
    for side, model in (("ours", ours), ("theirs", theirs)):
        with torch.no_grad():
            logits[side] = llama.LMTrainStep(side, model, ids, "fp32").forward()
        tokens[side] = llama.greedy_fn(side, model, ids[:, :4], 8, "fp32")()
    assert llama.logits_difference(logits["ours"], logits["theirs"]) <= llama.LOGITS_RTOL
    assert torch.equal(tokens["ours"], tokens["theirs"]) and tokens["ours"].shape == (2, 12)
    with torch.no_grad():
        theirs.model.layers[1].mlp.up_proj.weight.copy_(ours.layers[0].ff.up_proj.weight)
        wrong = llama.LMTrainStep("theirs", theirs, ids, "fp32").forward()
    assert llama.logits_difference(logits["ours"], wrong) > 100 * llama.LOGITS_RTOL


def test_add_mfu_divides_counted_flop_per_second_by_each_peak(bench):
    row = {"ours_ms": 100.0, "torch_ms": 200.0}
    peaks = {"matmul": {"flop_per_s": 20e9}, "datasheet_flop_per_s": None}
    bench.mfu.add_mfu(row, {"ours": 1e9, "torch": 1e9}, peaks)
    assert row["ours_mfu"] == pytest.approx(0.5) and row["torch_mfu"] == pytest.approx(0.25)
    assert row["ours_tflop_per_s"] == pytest.approx(0.01) and "ours_mfu_datasheet" not in row
    bench.mfu.add_mfu(row, {"ours": 1e9, "torch": 1e9}, {**peaks, "datasheet_flop_per_s": 1e11})
    assert row["ours_mfu_datasheet"] == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("name", "precision", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989),
        ("NVIDIA H100 PCIe", "bf16", 756),
        ("NVIDIA H100 NVL", "fp32", 60),
        ("NVIDIA H200", "fp32", 67),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312),
        ("NVIDIA A100-PCIE-40GB", "fp32", 19.5),
        ("Tesla T4", "bf16", None),
    ],
)
def test_datasheet_peak_takes_the_variant_before_the_family(bench, name, precision, tflops):
    peak = bench.mfu.datasheet_peak(name, precision)
    assert peak == (None if tflops is None else pytest.approx(tflops * 1e12))


def test_matmul_peak_times_a_square_product(bench):
    peak = bench.mfu.matmul_peak(64, torch.float32, 2, torch.device("cpu"))
    assert peak["size"] == 64 and peak["dtype"] == "float32"
    assert peak["flop_per_s"] == pytest.approx(2 * 64**3 / peak["best_s"])


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("--threads=0", "error: argument --threads: must be at least 1, got 0"),
        ("--warmup=-1", "error: argument --warmup: must be at least 0, got -1"),
        ("--peak-tflops=0", "error: argument --peak-tflops: must be greater than 0.0, got 0.0"),
        ("--device=tpu0", "error: argument --device: device 'tpu0' is not a device name"),
        ("--checkpoint=nowhere.pt", "error: argument --checkpoint: no such file: nowhere.pt"),
    ],
)
def test_bench_bad_arguments_exit_2_with_one_line(bench, capsys, arg, message):
    with pytest.raises(SystemExit) as stop:
        bench.__main__.main([arg])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert err.startswith(message) and err.count("\n") == 1, err


PEAK_SCRIPT = """
import torch
from bench.memory import map_large_allocations, peak_memory
cpu = torch.device("cpu")
for mib in (20, 16):  # as the model benchmarks do: glibc raises its threshold, keeps freed memory
    scratch = torch.ones(mib * 2**18); del scratch
assert map_large_allocations()
for _ in range(2):  # twice: the second call reuses nothing the first one freed
    big = peak_memory(lambda: torch.ones(16 * 2**18).sum(), cpu) / 2**20  # 16 MiB
    small = peak_memory(lambda: torch.ones(1024).sum(), cpu) / 2**20
    print(f"{big:.1f} {small:.1f}")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the resident set is read from /proc")
def test_peak_memory_sees_a_temporary_tensor_after_the_process_freed_larger_ones():
    """Without map_large_allocations the 16 MiB tensor reuses memory glibc kept: peak 0."""
    done = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    for line in done.stdout.splitlines():
        big, small = map(float, line.split())
        # 16 MiB seen; the first call may add a few MiB allocated once (5 measured on a Xeon)
        assert 15 <= big <= 24 and small < 2, done.stdout


def test_moe_pair_computes_the_same_and_its_check_sees_a_difference(bench):
    """The pair section 7 times has the same weights (the same outputs); a changed expert
    weight on one side shows."""
    import bench.moe as moe

    ours, theirs = moe.build_pair(16, 8, 4, 2, torch.device("cpu"))
    x = torch.randn(1, 12, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=1e-5)
        theirs.experts.down_proj[1] += 0.1
        changed = theirs(x)
        assert (ours(x) - changed).abs().max() / changed.abs().max() > 100 * moe.OUTPUT_RTOL


def test_speculative_drafts_are_what_section_9_says(bench):
    """The copy draft proposes the token it read; the early exit holds the target's own first
    layers; with either, speculative decoding gives the target's greedy tokens."""
    import bench.speculative as speculative

    torch.manual_seed(0)
    target = LanguageModel(speculative.MODELS["tiny"]).eval()
    copy = speculative.copy_draft(target, 32)
    assert speculative.copies_its_input(copy, torch.device("cpu"))
    early = speculative.first_layers_draft(target, 1)
    assert len(early.layers) == 1 and len(target.layers) == 2
    ours = target.state_dict()
    assert all(torch.equal(w, ours[name]) for name, w in early.state_dict().items())
    prompt = torch.tensor([[5, 7, 9]])
    plain = generate(target, prompt, 10, greedy=True)
    for draft in (copy, early):
        out = speculative_generate(target, draft, prompt, 10, k=3, greedy=True)
        assert torch.equal(out.ids, plain)
