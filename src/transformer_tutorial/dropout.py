"""Chapter 12: dropout with a cheaper mask on a CPU — the same operation, drawn a quarter as often.

``nn.Dropout`` draws one random number per element (``bernoulli_``). On Intel CPUs PyTorch draws
them with MKL's vectorised, multi-threaded generator; elsewhere (AMD, ARM) one at a time, and
there drawing is slow: in the ``small`` recipe's training step on a 2-core AMD EPYC it was 14%
of the time, more than anything but the matrix products. One 64-bit random integer holds four
independent 15-bit ones; comparing each with ``round(p · 2¹⁵)`` keeps an element with
probability ``1 − p`` (to within 2⁻¹⁶), so a mask costs a quarter of the draws.
:class:`CheapDropout` is ``nn.Dropout`` with that mask on a CPU and PyTorch's own everywhere
else; :func:`with_cheap_dropout` swaps it in for every ``nn.Dropout`` of a model, as
``nn.SyncBatchNorm.convert_sync_batchnorm`` swaps norms. The trainer does so in the model it is
handed where :func:`cheap_masks_pay` (a CPU whose ``bernoulli_`` draws one at a time); the
modules the chapters build use ``nn.Dropout`` until then.

Shapes: any ``x``; the mask has ``x``'s shape.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from transformer_tutorial.attention import MultiHeadAttention
from transformer_tutorial.provenance import cpu_name

BITS = 15  # per random number: four to one 64-bit draw (its top bit is always 0)


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, device: torch.device) -> Tensor:
    """A bool mask of ``shape``, each element True (kept) with probability ``1 − p``, from the
    default generator (``torch.manual_seed`` makes it repeatable)."""
    threshold = round(p * 2**BITS)
    if threshold >= 2**BITS:  # p within 2⁻¹⁶ of 1: nothing is kept (and 2¹⁵ fits no int16)
        return torch.zeros(shape, dtype=torch.bool, device=device)
    n = math.prod(shape)
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_()
    draws = words.view(torch.int16)[:n].view(shape) & (2**BITS - 1)  # uniform on 0 .. 2¹⁵ − 1
    return draws >= threshold


def cheap_dropout(x: Tensor, p: float) -> Tensor:
    """``x`` with each element zeroed with probability ``p`` and the rest scaled by
    ``1 / (1 − p)``, as ``F.dropout(x, p, training=True)``; its gradient is the same mask and
    scale."""
    if p >= 1.0:
        return x * 0.0  # nothing kept, as F.dropout(x, 1.0)
    scale = keep_mask(x.shape, p, x.device).to(x.dtype) * (1.0 / (1.0 - p))
    return x * scale


class CheapDropout(nn.Dropout):
    """``nn.Dropout`` whose mask, on a CPU, costs a quarter of the random draws
    (:func:`cheap_dropout`); elsewhere, in place, or when evaluating, exactly ``nn.Dropout``."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0 or self.inplace or x.device.type != "cpu":
            return super().forward(x)
        return cheap_dropout(x, self.p)


def cheap_masks_pay(device: torch.device) -> bool:
    """Whether :class:`CheapDropout` saves time on ``device``: a CPU on which PyTorch draws
    dropout's masks one number at a time — any but an Intel CPU with MKL. (On a GPU
    :class:`CheapDropout` is ``nn.Dropout`` anyway.)"""
    if device.type != "cpu":
        return False
    return not (torch.backends.mkl.is_available() and "intel" in cpu_name().lower())


def with_cheap_dropout(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Dropout`` in ``model`` (not its subclasses) by a
    :class:`CheapDropout` of the same ``p``, and have every
    :class:`~transformer_tutorial.attention.MultiHeadAttention` drop its weights with
    :func:`cheap_dropout` (``drop_weights``), in place; returns ``model``.

    The attention weights then go the written-out way instead of through PyTorch's fused
    kernel, which on a CPU computes them the same way when it drops them (its flash kernel
    cannot), but draws its mask with ``bernoulli_``."""
    for module in list(model.modules()):
        if isinstance(module, MultiHeadAttention):
            module.drop_weights = cheap_dropout
        for name, child in module.named_children():
            if type(child) is nn.Dropout:
                setattr(module, name, CheapDropout(child.p, child.inplace))
    return model
