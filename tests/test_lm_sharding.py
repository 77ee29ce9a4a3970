"""Chapter 25's sharding: FSDP2 on two gloo ranks takes the steps of one process on the same
global batches, each rank holds about half the training state, and a sharded checkpoint written
before a rank dies resumes to the uninterrupted run's weights."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import raises
from transformer_tutorial import distributed
from transformer_tutorial.checkpoint import CheckpointError
from transformer_tutorial.lm import sharding
from transformer_tutorial.lm.config import LLAMA, LMConfig
from transformer_tutorial.lm.model import LanguageModel, next_token_loss
from transformer_tutorial.lm.sampling import generate

WORLD, STEPS, SAVE_AT = 2, 4, 2
CONFIG = LMConfig(
    vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=64, max_len=16,
    dropout=0.0, **LLAMA,
)  # fmt: skip


def _batches() -> torch.Tensor:
    return torch.randint(0, 64, (STEPS, 4, 16), generator=torch.Generator().manual_seed(1))


def _model_and_optimizer(shard: bool):
    torch.manual_seed(0)  # every rank starts from one process's weights
    model = LanguageModel(CONFIG).to(torch.float64)  # float64: rounding cannot blur the check
    if shard:
        sharding.shard_model(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_rank_rows_deals_equal_rows_in_order():
    batch = torch.arange(12).view(6, 2)
    rows = [sharding.rank_rows(batch, rank=r, world_size=3) for r in range(3)]
    assert torch.equal(torch.cat(rows), batch)
    assert {tuple(r.shape) for r in rows} == {(2, 2)}


@pytest.mark.parametrize(
    "rank, world_size, error, match",
    [
        (0, 4, ValueError, "world_size=4 must divide the global batch's 6 rows"),
        (0, 0, ValueError, "world_size must be at least 1, got 0"),
        (-1, 2, ValueError, "rank must be at least 0, got -1"),
        (2, 2, ValueError, "rank must be below world_size=2, got 2"),
        (0, 2.0, TypeError, "world_size must be an int"),
    ],
)
def test_rank_rows_names_the_bad_argument(rank, world_size, error, match):
    with pytest.raises(error, match=match):
        sharding.rank_rows(torch.zeros(6, 3, dtype=torch.long), rank=rank, world_size=world_size)


def test_held_bytes_counts_storage_once_and_whole():
    """A view counts the storage behind it, and tensors sharing a storage count it once (a
    tied matrix, DDP's gradients as views of its buckets)."""
    model = torch.nn.Linear(4, 3, bias=False)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    held = sharding.held_bytes(model, optimizer)
    assert held == sharding.HeldBytes(parameters=48, gradients=48, optimizer=2 * 48 + 4)
    bucket = torch.zeros(100)
    model.weight.grad = bucket[:12].view(3, 4)  # a view of a larger storage
    assert sharding.held_bytes(model, optimizer).gradients == 400


def test_load_checkpoint_names_a_missing_folder(tmp_path):
    model, optimizer = _model_and_optimizer(shard=False)
    with pytest.raises(FileNotFoundError, match="path must be a checkpoint folder"):
        sharding.load_checkpoint(tmp_path / "absent", model, optimizer)


def _rank(rank: int, store: str, out: str, mode: str) -> None:
    """One gloo rank: ``killed`` trains to SAVE_AT, saves, and rank 1 dies; ``resumed``
    continues from that checkpoint to STEPS."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    finished = False
    try:
        model, optimizer = _model_and_optimizer(shard=True)
        checkpoint, start, stop = os.path.join(out, "checkpoint"), 0, STEPS
        if mode == "resumed":
            start = sharding.load_checkpoint(checkpoint, model, optimizer)
        losses, held = [], None
        for step in range(start, SAVE_AT if mode == "killed" else stop):
            ids = sharding.rank_rows(_batches()[step], rank=rank, world_size=WORLD)
            if step == stop - 1:  # what the rank holds at the peak: gradients and state
                loss = next_token_loss(model(ids), ids)
                loss.backward()
                held = sharding.held_bytes(model, optimizer)
                optimizer.step()
                optimizer.zero_grad()
                loss = loss.detach()
            else:
                loss = sharding.train_step(model, optimizer, ids)
            losses.append(distributed.all_reduce_sum(loss).item() / WORLD)
        if mode == "killed":
            sharding.save_checkpoint(checkpoint, model, optimizer, step=SAVE_AT)
            if rank == 1:
                os._exit(1)  # dies without leaving the group
            dist.barrier()  # rank 0 waits for a rank that never comes
        weights = {name: t.full_tensor() for name, t in model.state_dict().items()}
        if rank == 0:
            torch.save({"losses": losses, "weights": weights, "held": held}, f"{out}/{mode}.pt")
        finished = True
    finally:
        distributed.teardown(finished=finished)


def _spawn(tmp_path, mode: str) -> dict:
    mp.spawn(_rank, args=(str(tmp_path / f"store-{mode}"), str(tmp_path), mode), nprocs=WORLD)
    return torch.load(tmp_path / f"{mode}.pt", weights_only=False)


@pytest.mark.slow
def test_fsdp2_on_two_gloo_ranks_resumes_after_a_rank_dies_to_one_process_weights(tmp_path):
    """The ranks save a sharded checkpoint, rank 1 dies, two new ranks resume: their losses
    and weights are one uninterrupted process's on the same global batches, and each rank
    holds half the training state."""
    model, optimizer = _model_and_optimizer(shard=False)
    losses = []
    for step, ids in enumerate(_batches()):
        if step == STEPS - 1:  # gradients present, as the ranks measure them
            model(ids).sum().backward()
            one_held = sharding.held_bytes(model, optimizer)
            optimizer.zero_grad()
        losses.append(sharding.train_step(model, optimizer, ids).item())

    with pytest.raises(mp.ProcessExitedException):
        _spawn(tmp_path, "killed")
    assert not (tmp_path / "killed.pt").exists()
    resumed = _spawn(tmp_path, "resumed")
    # The loss is computed in float32 (next_token_loss casts the logits); the weights, in
    # float64, differ only by the order of the reduce-scatter's sums (7e-14 seen).
    assert resumed["losses"] == pytest.approx(losses[SAVE_AT:], rel=1e-6)
    for name, weight in model.state_dict().items():
        torch.testing.assert_close(resumed["weights"][name], weight, rtol=0, atol=1e-10)
    # Each rank holds half of every tensor (first dimensions padded to an even length).
    for kind in ("parameters", "gradients", "optimizer"):
        ratio = getattr(resumed["held"], kind) / getattr(one_held, kind)
        assert 0.45 < ratio < 0.55, (kind, ratio)


def test_sharded_model_on_one_rank_gathers_in_every_layer(tmp_path):
    """FSDP gathers a layer's weights in hooks around its ``__call__`` (the model calls each
    layer) and the root's around ``forward``, ``step`` and ``forward_with_router_logits``: a
    sharded model (here on a world of one) takes one process's steps and decodes alike."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        sharded, sharded_optimizer = _model_and_optimizer(shard=True)
        model, optimizer = _model_and_optimizer(shard=False)
        for ids in _batches()[:2]:
            expected = sharding.train_step(model, optimizer, ids)
            assert sharding.train_step(sharded, sharded_optimizer, ids) == pytest.approx(expected)
        for name, weight in model.state_dict().items():
            local = sharded.state_dict()[name].to_local()
            torch.testing.assert_close(local, weight, rtol=0, atol=1e-12)
        # the root's other ways in gather too: decoding, and the MoE router logits
        prompt = _batches()[0][:1, :4]
        with torch.no_grad():
            assert torch.equal(
                generate(sharded, prompt, 3, greedy=True), generate(model, prompt, 3, greedy=True)
            )
            logits, routers = sharded.forward_with_router_logits(prompt)
        torch.testing.assert_close(logits, model(prompt), rtol=0, atol=1e-12)
        assert routers == ()  # a dense model
    finally:
        dist.destroy_process_group()


# --- API probes (issue 42): each bad call, and what its error must say ------------------------

SHARDING_PROBES = {
    "batch a list": (
        lambda _: sharding.rank_rows([[1, 2]], rank=0, world_size=1),
        TypeError,
        "batch must be a Tensor, got list",
    ),
    "an empty folder": (
        lambda folder: sharding.load_checkpoint(folder, *_model_and_optimizer(shard=False)),
        CheckpointError,
        "cannot read the checkpoint folder '{folder}': rank 0: ",
    ),
    "optimizer None": (
        lambda folder: sharding.load_checkpoint(folder, _model_and_optimizer(False)[0], None),
        TypeError,
        "optimizer must be a torch.optim.Optimizer, got NoneType",
    ),
    "model an int": (
        lambda folder: sharding.save_checkpoint(folder, 3, None, step=0),
        TypeError,
        "model must be an nn.Module, got int",
    ),
    "a file for a folder": (
        lambda folder: sharding.save_checkpoint(
            _file(folder), *_model_and_optimizer(shard=False), step=0
        ),
        CheckpointError,
        "cannot write the checkpoint folder '{folder}/file': rank 0: FileExistsError",
    ),
}


def _file(folder):
    (folder / "file").write_text("not a folder")
    return folder / "file"


@pytest.mark.parametrize(
    ("call", "error", "phrase"), SHARDING_PROBES.values(), ids=SHARDING_PROBES.keys()
)
def test_bad_calls_name_the_argument_and_what_is_valid(call, error, phrase, tmp_path):
    raises(lambda: call(tmp_path), error, phrase.format(folder=tmp_path))


def test_loading_another_models_checkpoint_is_an_exception_and_changes_nothing(tmp_path):
    """torch's CheckpointException is a BaseException: `except Exception` would not catch it."""
    model, optimizer = _model_and_optimizer(shard=False)
    sharding.save_checkpoint(tmp_path, model, optimizer, step=3)
    torch.manual_seed(1)
    wider = LanguageModel(dataclasses.replace(CONFIG, d_model=2 * CONFIG.d_model))
    other_optimizer = torch.optim.AdamW(wider.parameters())
    before = copy.deepcopy(wider.state_dict())
    with pytest.raises(Exception, match="Size mismatch") as info:
        sharding.load_checkpoint(tmp_path, wider, other_optimizer)
    assert isinstance(info.value, CheckpointError) and str(tmp_path) in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in wider.state_dict().items())
