"""Chapter 25: sharding across processes — the language model under FSDP2.

Chapter 12's DDP keeps a whole copy of the weights, their gradients and Adam's two moments on
every rank. FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps on each of N ranks only a
1/N slice of each: a parameter becomes a ``DTensor`` sharded along its first dimension. Before a
layer runs, its ranks all-gather the layer's full weights; after the backward pass they
reduce-scatter its gradients, so each rank receives the average gradient of its own slice and
Adam updates only that slice.

- :func:`rank_rows` gives a rank its rows of the global batch;
- :func:`shard_model` wraps each decoder layer, then the whole model, with ``fully_shard``;
- :func:`train_step` is one step, the same function for one process and for every rank;
- :func:`held_bytes` measures what a rank holds (parameters, gradients, optimizer state) from
  the storage of its local tensors;
- :func:`save_checkpoint` and :func:`load_checkpoint` write and read a sharded checkpoint with
  ``torch.distributed.checkpoint``: each rank writes its slices, and any world size reads them.

Shapes: token ids ``(B, T)``; a rank of ``N`` reads ``(B / N, T)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import (
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

from transformer_tutorial.checkpoint import CheckpointError
from transformer_tutorial.checks import check_int, check_tensor, check_type
from transformer_tutorial.lm.model import LanguageModel, next_token_loss


def rank_rows(batch: Tensor, *, rank: int, world_size: int) -> Tensor:
    """Rank ``rank``'s rows of a global batch ``(B, T)``: rows ``rank·B/N`` to
    ``(rank+1)·B/N``. ``B`` must divide by ``world_size``: each rank's loss is the mean over its
    rows, and the ranks' average equals the global mean only when every rank has as many rows
    (of the same length: no padding)."""
    check_tensor("batch", batch, kind="int")
    check_int("world_size", world_size, at_least=1)
    check_int("rank", rank, at_least=0)
    if rank >= world_size:
        raise ValueError(f"rank must be below world_size={world_size}, got {rank}")
    if batch.dim() != 2:
        raise ValueError(f"batch must be (B, T) token ids, got shape {tuple(batch.shape)}")
    rows = batch.size(0)
    if rows % world_size:
        raise ValueError(
            f"world_size={world_size} must divide the global batch's {rows} rows "
            "(each rank takes as many)"
        )
    per_rank = rows // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank]


def shard_model(
    model: LanguageModel,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> LanguageModel:
    """Shard ``model`` in place across the default process group and return it.

    Each decoder layer becomes one FSDP unit (its weights gathered together, just before it
    runs, and freed after it); the root unit holds the rest (embeddings, final norm, output
    layer). Tied embeddings are fine: both uses are in the root unit. ``mp_policy`` sets the
    dtypes of the gathered weights and of the gradient reduction (None: the weights' own);
    ``reshard_after_forward=False`` keeps each layer's full weights from the forward pass to
    the backward (more memory, one all-gather fewer per layer).
    """
    policy = MixedPrecisionPolicy() if mp_policy is None else mp_policy
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # FSDP gathers the root's weights around ``forward`` only: the other ways in run there too.
    for method in ("step", "forward_with_router_logits"):
        register_fsdp_forward_method(model, method)
    return model


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, ids: Tensor) -> Tensor:
    """One step on ``ids`` ``(B, T)``: the next-token loss (mean over the rows given), backward,
    optimizer step. Returns the loss, detached. Under FSDP2 the reduce-scatter averages the
    ranks' gradients, so N ranks of B/N rows take the step of one process on B rows: exactly
    when N is a power of two, otherwise up to the rounding of the float32 loss (1/(B/N) in
    float32, divided by N, is not 1/B in float32), which Adam's first steps can enlarge."""
    loss = next_token_loss(model(ids), ids)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


@dataclass(frozen=True)
class HeldBytes:
    """Bytes one rank holds, by kind, counted from the storage behind its local tensors."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts its whole storage, and a
    storage shared by several tensors counts once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> HeldBytes:
    """What this rank holds between steps: its parameters, their gradients (call it after
    ``backward``, before ``zero_grad``) and the optimizer's state tensors. Under FSDP2 these are
    the local shards (``DTensor.to_local()``); under DDP or in one process, whole tensors."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [
        value
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, Tensor)
    ]
    return HeldBytes(_storage_bytes(params), _storage_bytes(grads), _storage_bytes(state))


def _check_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    check_type("model", model, nn.Module, "an nn.Module")
    check_type("optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer")


def _failed(doing: str, path: str | Path, err: CheckpointException) -> CheckpointError:
    """torch's ``CheckpointException``, a ``BaseException`` that ``except Exception`` misses, as
    a :class:`CheckpointError` naming the folder and each rank's cause."""
    causes = "; ".join(
        f"rank {rank}: {failure[0] if isinstance(failure, tuple) else failure!r}"
        for rank, failure in sorted(err.failures.items())
    )
    return CheckpointError(f"cannot {doing} the checkpoint folder {str(path)!r}: {causes}")


def save_checkpoint(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, step: int
) -> None:
    """Write a sharded checkpoint to the folder ``path``: every rank writes its own slices of
    the model and the optimizer state (``torch.distributed.checkpoint``), and the step."""
    _check_state(model, optimizer)
    check_int("step", step, at_least=0)
    model_state, optim_state = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_state, "optim": optim_state, "step": step}, checkpoint_id=path)
    except CheckpointException as err:
        raise _failed("write", path, err) from err


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Read :func:`save_checkpoint`'s folder into ``model`` and ``optimizer`` (sharded as they
    are now, whatever the world size that wrote it) and return the step it was saved at. A
    folder that does not hold such a checkpoint (another model's, an empty one) raises
    :class:`~transformer_tutorial.checkpoint.CheckpointError`, the model unchanged."""
    _check_state(model, optimizer)
    if not Path(path).is_dir():
        raise FileNotFoundError(f"path must be a checkpoint folder, {str(path)!r} is not one")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": -1}
    try:
        dcp.load(state, checkpoint_id=path)
    except CheckpointException as err:  # a BaseException: `except Exception` would miss it
        raise _failed("read", path, err) from err
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return state["step"]
