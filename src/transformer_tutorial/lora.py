"""Chapter 24: LoRA, a trainable low-rank update beside a frozen linear layer.

``y = W x + b + s · B (A · dropout(x))`` with ``A`` ``(r, in)``, ``B`` ``(out, r)`` and the scaling
``s = alpha / r`` (Hu et al. 2021), or ``alpha / √r`` with ``use_rslora`` (Kalajdzievski 2023).
As ``peft``'s ``LoraLayer``: ``A`` starts Kaiming-uniform (``a = √5``, nn.Linear's own), ``B``
zeros, so the model starts unchanged; only ``A`` and ``B`` train. Merging adds ``s · B A`` to
``W`` and gives the same outputs with no extra work per token.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


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
        if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
            raise ValueError(f"rank must be a positive int, got {rank!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.base = base.requires_grad_(False)
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        w = base.weight
        self.lora_A = nn.Parameter(
            torch.empty(rank, base.in_features, device=w.device, dtype=w.dtype)
        )
        self.lora_B = nn.Parameter(
            torch.zeros(base.out_features, rank, device=w.device, dtype=w.dtype)
        )
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout)
        self.merged = False

    def delta_weight(self) -> Tensor:
        """The update ``scaling · B A`` ``(out, in)``."""
        return self.scaling * (self.lora_B @ self.lora_A)

    def forward(self, x: Tensor) -> Tensor:
        """``(..., in)`` → ``(..., out)``."""
        y = self.base(x)
        if self.merged:
            return y
        return y + self.scaling * (self.dropout(x) @ self.lora_A.T @ self.lora_B.T)

    @torch.no_grad()
    def merge(self) -> None:
        """Add the update into the frozen weight; outputs are unchanged (without dropout)."""
        if not self.merged:
            self.base.weight += self.delta_weight()
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Take the update back out of the weight (undoes :meth:`merge`)."""
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
    ``model``. An error if no layer matches."""
    model.requires_grad_(False)
    found = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rpartition(".")[2] in targets
    ]
    if not found:
        raise ValueError(f"targets={targets!r} name no nn.Linear of the model")
    for name in found:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        lora = LoRALinear(
            getattr(owner, child), rank=rank, alpha=alpha, dropout=dropout, use_rslora=use_rslora
        )
        setattr(owner, child, lora)
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace each :class:`LoRALinear` of ``model`` by its base layer with the update merged
    in, in place; returns ``model``."""
    for name, m in list(model.named_modules()):
        if isinstance(m, LoRALinear):
            m.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, m.base)
    return model


def trainable_parameters(model: nn.Module) -> int:
    """Weights that train (``requires_grad``)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors an optimizer holds (Adam: two moments per trainable weight, and a
    step count), measured as storage; zero before its first step."""
    tensors = [t for state in optimizer.state.values() for t in state.values()]
    return sum(t.untyped_storage().nbytes() for t in tensors if isinstance(t, Tensor))
