"""Chapter 24: LoRA, a trainable low-rank update beside a frozen linear layer.

``y = W x + b + s · B (A · dropout(x))`` with ``A`` ``(r, in)``, ``B`` ``(out, r)`` and the scaling
``s = alpha / r`` (Hu et al. 2021), or ``alpha / √r`` with ``use_rslora`` (Kalajdzievski 2023).
As ``peft``'s ``LoraLayer``: ``A`` starts Kaiming-uniform (``a = √5``, nn.Linear's own), ``B``
zeros, so the model starts unchanged; only ``A`` and ``B`` train. Merging adds ``s · B A`` to
``W`` and gives the same outputs with no extra work per token.

On a bf16 or fp16 base, ``A`` and ``B`` are float32, as ``peft`` makes them
(``autocast_adapter_dtype=True``): an optimizer step of 1e-4 on a weight of 0.05 is below half
of bf16's step there, and a bf16 adapter would keep its old value. The update is computed in
float32 and added to the base's output before one rounding to its dtype, as ``peft`` does.
Merging adds the float32 update into the low-precision weight (one rounding per weight);
unmerging subtracts it again, which is not an exact inverse in low precision (nor in ``peft``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from transformer_tutorial.checks import check_bool, check_int, check_number, check_type

# Base dtypes whose adapters are kept in float32 (peft's cast_adapter_dtype).
LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_lora(rank: int, alpha: float, dropout: float, use_rslora: bool) -> None:
    check_int("rank", rank, at_least=1)
    check_number("alpha", alpha, low=-math.inf)
    check_number("dropout", dropout, low=0.0, high=1.0, high_open=True)
    check_bool("use_rslora", use_rslora)


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` (``base``) plus the low-rank update ``scaling · B A``.

    Args:
        base: the layer to adapt; its weight and bias are frozen (``requires_grad=False``).
        rank: ``r`` > 0, the rank of the update.
        alpha: the update's scale numerator (``lora_alpha`` in ``peft``).
        dropout: applied to the update's input only, in training.
        use_rslora: scale by ``alpha / √r`` instead of ``alpha / r``.
    """

    def __init__(
        self,
        base: nn.Linear,
        *,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
    ) -> None:
        super().__init__()
        check_type("base", base, nn.Linear, "an nn.Linear")
        _check_lora(rank, alpha, dropout, use_rslora)
        self.base = base.requires_grad_(False)
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        w = base.weight
        dtype = torch.float32 if w.dtype in LOW_PRECISION else w.dtype  # the adapters'
        self.lora_A = nn.Parameter(
            torch.empty(rank, base.in_features, device=w.device, dtype=dtype)
        )
        self.lora_B = nn.Parameter(
            torch.zeros(base.out_features, rank, device=w.device, dtype=dtype)
        )
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout)
        self.merged = False

    def delta_weight(self) -> Tensor:
        """The update ``scaling · B A`` ``(out, in)``, in the adapters' dtype."""
        return self.scaling * (self.lora_B @ self.lora_A)

    def forward(self, x: Tensor) -> Tensor:
        """``(..., in)`` → ``(..., out)``."""
        y = self.base(x)
        if self.merged:
            return y
        update = self.dropout(x.to(self.lora_A.dtype)) @ self.lora_A.T @ self.lora_B.T
        return (y + self.scaling * update).to(y.dtype)  # summed in float32 on a bf16 base

    @torch.no_grad()
    def merge(self) -> None:
        """Add the update into the frozen weight; outputs are unchanged (without dropout, and
        up to one rounding of each weight in low precision)."""
        if not self.merged:
            self.base.weight += self.delta_weight()
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Take the update back out of the weight (undoes :meth:`merge`, up to one more
        rounding of each weight in low precision)."""
        if self.merged:
            self.base.weight -= self.delta_weight()
            self.merged = False

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, scaling={self.scaling:g}"


def add_lora(
    model: nn.Module,
    *,
    targets: tuple[str, ...],
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    use_rslora: bool = False,
) -> nn.Module:
    """Freeze every weight of ``model`` and wrap each ``nn.Linear`` whose name ends with one of
    ``targets`` (e.g. ``("q_proj", "v_proj")``) in a :class:`LoRALinear`, in place; returns
    ``model``. An error if no layer matches; a refused call leaves the model as it was."""
    check_type("model", model, nn.Module, "an nn.Module")
    if not isinstance(targets, (tuple, list)) or not all(isinstance(t, str) for t in targets):
        raise TypeError(
            f"targets must be a tuple of layer names such as ('q_proj', 'v_proj'), got {targets!r}"
        )
    _check_lora(rank, alpha, dropout, use_rslora)
    found = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rpartition(".")[2] in targets
    ]
    if not found:
        raise ValueError(f"targets={targets!r} name no nn.Linear of the model")
    trainable = [p.requires_grad for p in model.parameters()]
    replaced = []  # (owner, child, base): to put back if a layer fails
    try:
        model.requires_grad_(False)
        for name in found:
            parent, _, child = name.rpartition(".")
            owner = model.get_submodule(parent)
            base = getattr(owner, child)
            lora = LoRALinear(base, rank=rank, alpha=alpha, dropout=dropout, use_rslora=use_rslora)
            setattr(owner, child, lora)
            replaced.append((owner, child, base))
    except BaseException:
        for owner, child, base in reversed(replaced):
            setattr(owner, child, base)
        for p, flag in zip(model.parameters(), trainable, strict=True):
            p.requires_grad_(flag)
        raise
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace each :class:`LoRALinear` of ``model`` by its base layer with the update merged
    in, in place; returns ``model``."""
    check_type("model", model, nn.Module, "an nn.Module")
    for name, m in list(model.named_modules()):
        if isinstance(m, LoRALinear):
            m.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, m.base)
    return model


def trainable_parameters(model: nn.Module) -> int:
    """Weights that train (``requires_grad``)."""
    check_type("model", model, nn.Module, "an nn.Module")
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors an optimizer holds (Adam: two moments per trainable weight, and a
    step count), measured as storage; zero before its first step."""
    check_type("optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer")
    tensors = [t for state in optimizer.state.values() for t in state.values()]
    return sum(t.untyped_storage().nbytes() for t in tensors if isinstance(t, Tensor))
