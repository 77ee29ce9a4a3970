"""Chapter 14: RMSNorm, and the switch between the paper's LayerNorm and today's RMSNorm.

Shapes: ``(..., D)`` → ``(..., D)``; both norms look at one position's D features at a time.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from transformer_tutorial.checks import check_choice, check_int, check_number
from transformer_tutorial.layers import LayerNorm


class RMSNorm(nn.Module):
    """Scale each position's D features to root-mean-square 1, then by a learned ``weight``.

    ``y = x / sqrt(mean(x**2) + eps) * weight``: LayerNorm without the centring (no mean is
    subtracted) and without the bias. As ``transformers``' ``LlamaRMSNorm``, the statistics are
    computed in float32 for 16-bit and float32 inputs, the normalised ``x`` is cast back to the
    input's dtype, and only then multiplied by ``weight`` (so a float32 ``weight`` on a bfloat16
    input gives a float32 output, as in Llama). A float64 input keeps float64 (Llama's drops to
    float32 there). ``torch.nn.RMSNorm`` (current releases) and Gemma multiply by the weight
    before they round: in 16-bit the two orders differ by one rounding step.

    Args:
        d_model: D, the number of features normalised together.
        eps: added to ``mean(x**2)`` inside the square root (Llama's default 1e-6; Llama 2
            and 3 checkpoints use 1e-5). ``torch.nn.RMSNorm``'s default differs: pass it.

    Shapes:
        ``(..., D)`` → ``(..., D)``.
    """

    def __init__(self, d_model: int, eps: float = 1e-6) -> None:
        super().__init__()
        check_int("d_model", d_model, at_least=1)
        check_number("eps", eps, low=0.0, low_open=True)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))  # float32 at least, float64 kept
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}"


NORMS = {"layer": LayerNorm, "rms": RMSNorm}


def build_norm(kind: str, d_model: int, eps: float) -> LayerNorm | RMSNorm:
    """The norm of a layer: ``"layer"`` (the paper's LayerNorm, :mod:`layers`) or ``"rms"``.

    ``eps`` has no default on purpose: LayerNorm's usual 1e-5, Llama's 1e-6 or 1e-5 and
    ``torch.nn.RMSNorm``'s machine epsilon all differ, and a port must copy the reference's.
    """
    check_choice("kind", kind, NORMS)
    check_int("d_model", d_model, at_least=1)
    check_number("eps", eps, low=0.0, low_open=True)
    return NORMS[kind](d_model, eps)
