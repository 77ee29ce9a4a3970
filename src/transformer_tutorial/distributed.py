"""Chapter 12: data parallelism — one process per GPU, each training on its share of the batches.

``torchrun --nproc_per_node N -m transformer_tutorial.train ...`` starts N copies of the training
command and tells each, through environment variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), who it is. :func:`setup` joins them into one process group
(NCCL between GPUs, gloo between CPU processes); PyTorch's ``DistributedDataParallel`` then
averages the gradients of all ranks during ``backward``, so every rank takes the same step.

What the trainer adds on top:

- every rank builds the same shuffled batches from the seed, and :func:`shard_batches` deals them
  out, so each pair is seen exactly once per epoch across ranks; the global batch of a step is
  the union of the ranks' batches (N × ``max_tokens`` padded tokens);
- the loss is normalised by the target tokens of the *global* batch (:func:`all_reduce_sum`), so
  N ranks with batches of B pairs take the same step as one process with all N·B pairs;
- the ranks agree on when to stop (:func:`agree_on_stop`), and only rank 0 logs, validates and
  writes checkpoints (:func:`is_main`).

Without torchrun nothing here does anything: rank 0 of a world of one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from transformer_tutorial.checks import check_int

# Every reason the trainer stops for, least pressing first (agree_on_stop takes the maximum).
STOP_REASONS = ("", "steps", "max_steps", "max_minutes", "interrupted")


def is_distributed() -> bool:
    """Whether this process is one of several in a process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's number, 0 to ``world_size() - 1`` (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """How many processes train together (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    """Whether this is rank 0, the process that logs, validates and writes files."""
    return rank() == 0


def setup(device: torch.device) -> torch.device:
    """Join the process group torchrun describes in the environment and return the device this
    process trains on: ``cuda:LOCAL_RANK`` on GPUs (backend NCCL), ``device`` otherwise (gloo).
    Without torchrun (no ``WORLD_SIZE`` above 1) it returns ``device`` and does nothing."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or dist.is_initialized():
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return device


def teardown(*, finished: bool = True) -> None:
    """Leave the process group, if this process joined one.

    ``finished`` says this rank ended without an error. Then, under gloo, it first waits for
    every rank (:func:`barrier`): gloo's worker threads release the tensors of the last
    collective just after it returns, and if this process is already shutting Python down by
    then, the thread cannot take the interpreter's lock and the process aborts ("terminate
    called without an active exception", about 1 exit in 30 on a 2-core CPU). Waiting gives the
    threads that moment. Under NCCL it leaves at once: the race was seen with gloo's threads, and
    NCCL's watchdog would end a rank kept waiting longer than its timeout while rank 0 scores
    the test set. After an error it leaves at once too: the other ranks may never arrive, and
    torchrun stops them when this one exits.
    """
    if dist.is_available() and dist.is_initialized():
        if finished and dist.get_backend() == "gloo":
            dist.barrier()
        dist.destroy_process_group()


def shard_batches(
    batches: Sequence[Sequence[int]], *, rank: int, world_size: int
) -> list[list[int]]:
    """Rank ``rank``'s batches: every ``world_size``-th one, starting at ``rank``, so that step
    ``k`` of all ranks together trains on ``batches[k·N : (k+1)·N]`` of the list after any split.

    Every rank must take the same number of steps, so while the count does not divide by
    ``world_size`` the batch with the most pairs is split into two halves, which go last: every
    index still appears exactly once across the ranks. Called with the same ``batches`` on every
    rank (the same seed), it gives each rank its own, disjoint share.
    """
    check_int("world_size", world_size, at_least=1)
    check_int("rank", rank, at_least=0)
    if rank >= world_size:
        raise ValueError(f"rank must be below world_size={world_size}, got {rank}")
    batches = [list(b) for b in batches]
    while len(batches) % world_size:
        largest = max(range(len(batches)), key=lambda i: len(batches[i]))
        if len(batches[largest]) < 2:
            raise ValueError(
                f"cannot deal {len(batches)} single-pair batches to {world_size} ranks evenly; "
                "give each rank more data or a larger max_tokens"
            )
        batch = batches.pop(largest)
        half = len(batch) // 2
        batches += [batch[:half], batch[half:]]
    return batches[rank::world_size]


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks, in place; returns it (unchanged in a world of one)."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def agree_on_stop(reason: str, device: torch.device) -> str:
    """The stop reason all ranks agree on: the most pressing of theirs, so that when one rank's
    clock runs out or it is interrupted, every rank stops after the same step."""
    if not is_distributed():
        return reason
    code = torch.tensor([STOP_REASONS.index(reason)], device=device)
    dist.all_reduce(code, op=dist.ReduceOp.MAX)
    return STOP_REASONS[int(code)]


def all_gather_object(obj: object) -> list:
    """``obj`` from every rank, in rank order (``[obj]`` in a world of one)."""
    if not is_distributed():
        return [obj]
    gathered: list = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def barrier() -> None:
    """Wait until every rank gets here (nothing to wait for in a world of one)."""
    if is_distributed():
        dist.barrier()
