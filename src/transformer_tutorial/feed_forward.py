"""Chapter 14: the SwiGLU feed-forward layer, its hidden size, and the switch between it and the
paper's ReLU/GELU layer (:class:`transformer_tutorial.layers.FeedForward`): the one switch the
language model's factory (:func:`transformer_tutorial.lm.pieces.make_feed_forward`) calls.

Shapes: ``(B, L, D)`` → ``(B, L, D)``, each position independently; ``F`` is the hidden width
(``d_ff``).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from transformer_tutorial.checks import check_bool, check_choice, check_int, check_number
from transformer_tutorial.layers import ACTIVATIONS, FeedForward


class SwiGLU(nn.Module):
    """Gated feed-forward layer: ``down_proj(silu(gate_proj(x)) * up_proj(x))``.

    Two projections widen ``x`` to ``d_ff``: the gate goes through SiLU (Swish with β = 1) and
    multiplies the other, feature by feature; a third projection narrows back. The names and the
    default of no biases are Llama's (``LlamaMLP``), so its weights load as they are.

    Args:
        d_model: D, input and output width.
        d_ff: hidden width F: Llama 1/2 take about 8/3 · D (:func:`swiglu_hidden_size`), Llama 3
            8B and Mistral 7B 3.5 · D, Qwen3-8B 3.0 · D; a port passes its checkpoint's.
        dropout: dropout on the gated product, before ``down_proj`` (Llama has none).
        bias: give the three projections biases (Llama's ``mlp_bias``; False).

    Shapes:
        ``(B, L, D)`` → ``(B, L, D)``.
    """

    # What writes into the residual stream: a language model initialises it smaller.
    residual_projections = ("down_proj.weight",)

    def __init__(self, d_model: int, d_ff: int, *, dropout: float = 0.0, bias: bool = False):
        super().__init__()
        check_int("d_model", d_model, at_least=1)
        check_int("d_ff", d_ff, at_least=1)
        check_number("dropout", dropout, low=0.0, high=1.0, high_open=True)
        check_bool("bias", bias)
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        gated = F.silu(self.gate_proj(x)) * self.up_proj(x)  # (B, L, F)
        return self.down_proj(self.dropout(gated))


def swiglu_hidden_size(
    d_model: int, *, multiple_of: int = 256, ffn_dim_multiplier: float | None = None
) -> int:
    """Llama's hidden width: 2/3 of 4 · D (same weights as a 4 · D ReLU layer), times
    ``ffn_dim_multiplier`` if given, rounded **up** to a multiple of ``multiple_of``.

    Each step truncates to an int first, as Meta's reference code does: 4096 → 11008
    (Llama 2 7B); with 1.3 and 1024, 4096 → 14336 (Llama 3 8B).
    """
    check_int("d_model", d_model, at_least=1)
    check_int("multiple_of", multiple_of, at_least=1)
    if ffn_dim_multiplier is not None:
        check_number("ffn_dim_multiplier", ffn_dim_multiplier, low=0.0, low_open=True)
    hidden = int(2 * (4 * d_model) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * -(-hidden // multiple_of)  # ceil division


FEED_FORWARDS = (*ACTIVATIONS, "swiglu")


def build_feed_forward(
    kind: str, d_model: int, d_ff: int, *, dropout: float = 0.0, bias: bool | None = None
) -> FeedForward | SwiGLU:
    """The feed-forward layer: the paper's layer with an activation of ``layers.ACTIVATIONS``
    (``"relu"``, ``"gelu"``, GPT-2's ``"gelu_tanh"``) or ``"swiglu"``. ``d_ff`` is the hidden
    width either way: a SwiGLU layer of ``d_ff`` = 8/3 · D has the weights of a ReLU layer of
    4 · D. ``bias=None`` keeps each kind's own default: biases in the paper's layer, none in
    SwiGLU (Llama's)."""
    check_choice("kind", kind, FEED_FORWARDS)
    check_int("d_model", d_model, at_least=1)
    check_int("d_ff", d_ff, at_least=1)
    check_number("dropout", dropout, low=0.0, high=1.0, high_open=True)
    if bias is not None:
        check_bool("bias", bias)
    if kind == "swiglu":
        return SwiGLU(d_model, d_ff, dropout=dropout, bias=bool(bias))
    return FeedForward(d_model, d_ff, dropout, kind, bias=bias is not False)
