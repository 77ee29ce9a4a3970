"""Chapter 12's data parallelism: the batches dealt to the ranks cover every pair exactly once,
and two gloo processes training together take the same steps as one process on the same global
batches (the loss normalised over the global batch)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from transformer_tutorial import budget, distributed
from transformer_tutorial.configs import CONFIGS, RunOptions
from transformer_tutorial.data import pair_lengths, token_batches
from transformer_tutorial.model import Transformer
from transformer_tutorial.runtime import set_seed
from transformer_tutorial.trainer import Trainer, fit

VOCAB = 13  # the digit-reversal task's
SEED, STEPS, WORLD = 3, 4, 2
# No dropout: each rank draws its own masks, which one process cannot reproduce. The recipe's own
# length stops the ranks (its schedule decays to zero there): every rank must agree on "steps".
CONFIG = replace(
    CONFIGS["tiny"],
    model=replace(CONFIGS["tiny"].model, dropout=0.0),
    max_tokens=60,
    log_every=1,
    eval_every=0,
    checkpoint_every=0,
    warmup=2,
    steps=STEPS,
)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shards_cover_every_pair_once_and_give_each_rank_as_many_steps(world_size):
    lengths = [3 + i % 7 for i in range(101)]
    batches = token_batches(lengths, 40, generator=torch.Generator().manual_seed(0))
    shards = [
        distributed.shard_batches(batches, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    assert len({len(shard) for shard in shards}) == 1  # every rank takes the same steps
    seen = sorted(i for shard in shards for batch in shard for i in batch)
    assert seen == list(range(len(lengths)))
    assert all(batch for shard in shards for batch in shard)
    again = token_batches(lengths, 40, generator=torch.Generator().manual_seed(0))
    assert distributed.shard_batches(again, rank=0, world_size=world_size) == shards[0]
    if world_size == 1:
        assert shards[0] == batches  # a single process trains as it always did


def test_shard_batches_rejects_bad_ranks():
    with pytest.raises(ValueError, match="rank must be below world_size=2"):
        distributed.shard_batches([[0], [1]], rank=2, world_size=2)
    with pytest.raises(ValueError, match="cannot deal 3 single-pair batches"):
        distributed.shard_batches([[0], [1], [2]], rank=0, world_size=2)


@pytest.mark.parametrize("reason", distributed.STOP_REASONS)
def test_every_stop_reason_survives_the_ranks_agreement(monkeypatch, reason):
    """agree_on_stop sends each reason as its index in STOP_REASONS; one the trainer can give
    but the tuple lacks would fail only under torchrun."""
    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op: None)  # a world of one rank
    assert distributed.agree_on_stop(reason, torch.device("cpu")) == reason


def test_the_trainer_stops_only_for_reasons_the_ranks_can_agree_on():
    source = Path(budget.__file__).read_text(encoding="utf-8")  # where the trainer's stops are
    given = set(re.findall(r'reason = "([a-z_]+)"', source))
    assert given and given <= set(distributed.STOP_REASONS), given - set(distributed.STOP_REASONS)


@pytest.mark.parametrize(
    "backend, finished, calls",
    [
        ("gloo", True, ["barrier", "destroy"]),
        ("gloo", False, ["destroy"]),
        ("nccl", True, ["destroy"]),
    ],
)
def test_teardown_waits_for_every_gloo_rank_only_after_a_clean_run(
    monkeypatch, backend, finished, calls
):
    """A rank that exits right after its last collective can abort under gloo's worker threads
    (about 1 exit in 30 here), so a clean run waits for the others; after an error it must not,
    for the others may never come, nor under NCCL, whose watchdog ends a rank that waits long."""
    made = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda: backend)
    monkeypatch.setattr(dist, "barrier", lambda: made.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: made.append("destroy"))
    distributed.teardown(finished=finished)
    assert made == calls


def _train_rank(rank: int, store: str, pairs: tuple, out_dir: Path) -> None:
    """One of the ranks: join the gloo group, then train as ``fit`` does under torchrun."""
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    finished = False
    try:
        train_pairs, val_pairs = pairs
        fit(
            CONFIG,
            train_pairs,
            val_pairs,
            vocab_size=VOCAB,
            out_dir=out_dir,
            options=RunOptions(seed=SEED, progress=False),
        )
        finished = True
    finally:
        distributed.teardown(finished=finished)


@pytest.fixture
def float64():
    """Train in float64. Why: the gradient of a key projection's bias is zero in exact
    arithmetic (softmax ignores a shift shared by all keys), so in float32 it is rounding noise,
    which differs between one batch and two half batches; Adam divides it by its own size and
    turns it into steps of ±lr. In float32 these biases differ by ~3e-4 after 4 steps while every
    other weight agrees to 1e-6; in float64 the noise sinks below Adam's ε."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(default)


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process_on_the_same_global_batches(
    digit_reversal, tmp_path, float64
):
    pairs = digit_reversal.pairs(64, seed=1), digit_reversal.pairs(8, seed=2)
    mp.spawn(_train_rank, args=(str(tmp_path / "store"), pairs, tmp_path), nprocs=WORLD)
    ranks = torch.load(tmp_path / "last.pt", weights_only=True)

    set_seed(SEED)  # the initial weights fit() makes on every rank
    model = Transformer(CONFIG.model_config(VOCAB))
    one = Trainer(model, CONFIG, *pairs, folder=tmp_path / "one", options=RunOptions(seed=SEED))
    batches = token_batches(
        pair_lengths(pairs[0]), CONFIG.max_tokens, generator=torch.Generator().manual_seed(SEED)
    )
    shards = [distributed.shard_batches(batches, rank=r, world_size=WORLD) for r in range(WORLD)]
    losses = []
    for step in range(STEPS):
        global_batch = [i for shard in shards for i in shard[step]]
        loss_sum, tokens = one.train_step(global_batch)
        losses.append((loss_sum / tokens).item())  # tensors on the device: read when wanted

    assert ranks["state"]["step"] == STEPS  # stopped by the recipe's length, on both ranks
    logged = [e["train_loss"] for e in ranks["state"]["history"]["train"]]
    assert logged == pytest.approx(losses, rel=1e-5)
    worst = max(
        (a - ranks["model"][name]).abs().max().item() for name, a in one.model.state_dict().items()
    )
    assert ranks["model"]["decoder.norm.weight"].dtype == torch.float64
    assert worst <= 1e-5, worst


@pytest.mark.slow
@pytest.mark.corpus
def test_the_training_command_runs_and_resumes_under_torchrun(multi30k_dir, tmp_path):
    out = tmp_path / "tiny"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command = [
        *torchrun,
        "-m",
        "transformer_tutorial.train",
        *("--config", "tiny", "--out", str(out), "--eval-size", "3", "--no-progress"),
        *("--device", "cpu"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for extra in (["--max-steps", "2"], ["--max-steps", "4", "--resume"]):
        done = subprocess.run(
            [*command, *extra], capture_output=True, text=True, env=env, timeout=240
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.count("BLEU greedy") == 1  # rank 0 alone reports (describe_run)
    record = json.loads((out / "record.json").read_text())
    assert record["steps"] == 4 and record["hardware"]["processes"] == 2
    assert len(torch.load(out / "last.pt", weights_only=True)["rank_rng"]) == 2
