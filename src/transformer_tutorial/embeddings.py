"""Chapters 1 and 2: token embeddings and sinusoidal positional encodings.

Shapes: token ids ``(B, L)`` → embeddings ``(B, L, D)``; the positional table is
``(max_len, D)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class TokenEmbedding(nn.Module):
    """A lookup table of ``vocab_size`` vectors of width ``d_model``, scaled by √d_model.

    The scale (section 3.4 of the paper) lifts embeddings initialised with standard deviation
    ``d_model ** -0.5`` to entries of size about 1, the scale of the positional encodings added
    to them (whose entries have RMS 1/√2: the token vector's norm is √2 times theirs; chapter 1
    measures both).

    Args:
        vocab_size: V, the number of token ids.
        d_model: D, the width of each vector.
        padding_idx: id whose vector stays zero and gets no gradient, or None.

    Shapes:
        ids ``(B, L)`` integer → ``(B, L, D)``.
    """

    def __init__(self, vocab_size: int, d_model: int, padding_idx: int | None = None) -> None:
        super().__init__()
        if vocab_size <= 0 or d_model <= 0:
            raise ValueError(
                f"vocab_size and d_model must be positive, got {vocab_size} and {d_model}"
            )
        if padding_idx is not None and not 0 <= padding_idx < vocab_size:
            raise ValueError(f"padding_idx={padding_idx} must be an id in [0, {vocab_size})")
        self.d_model = d_model
        self.embedding = nn.Embedding(vocab_size, d_model, padding_idx=padding_idx)

    @property
    def weight(self) -> Tensor:
        """The ``(V, D)`` table, shared with the output layer when embeddings are tied."""
        return self.embedding.weight

    def forward(self, ids: Tensor) -> Tensor:
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(
                f"token ids must be an integer tensor, got {ids.dtype}; call .long() on them"
            )
        return self.embedding(ids) * math.sqrt(self.d_model)


def sinusoidal_table(max_len: int, d_model: int) -> Tensor:
    """The paper's table: ``PE[pos, 2i] = sin(pos / 10000^(2i/D))``, ``PE[pos, 2i+1] = cos(...)``.

    Both columns of a sin/cos pair share one frequency; the exponent counts pairs, not columns.
    Computed in float64 and returned as float32, shape ``(max_len, D)``.
    """
    if d_model % 2:
        raise ValueError(f"d_model must be even (sin/cos pairs), got {d_model}")
    position = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)  # (max_len, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (D/2,) the 2i of each pair
    angle = position / 10000.0 ** (two_i / d_model)  # (max_len, D/2)
    table = torch.empty(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table.float()


class SinusoidalPositionalEncoding(nn.Module):
    """Adds the sinusoidal position table to embeddings, then applies dropout (section 3.5).

    The table is a non-persistent buffer: it moves with ``.to(device)``, is cast to the input's
    dtype, and is not written into checkpoints (it is a formula, not a weight).

    Args:
        d_model: D, even.
        max_len: the longest sequence the table covers.
        dropout: dropout probability applied to the sum.

    Shapes:
        x ``(B, L, D)`` → ``(B, L, D)``; ``start`` shifts the positions (used when decoding one
        token at a time).
    """

    def __init__(self, d_model: int, max_len: int = 5000, dropout: float = 0.0) -> None:
        super().__init__()
        self.max_len = max_len
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("pe", sinusoidal_table(max_len, d_model), persistent=False)

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        if not x.is_floating_point():
            raise TypeError(
                f"x must hold floating-point embeddings, got {x.dtype}; embed token ids first"
            )
        length = x.size(1)
        if start + length > self.max_len:
            raise ValueError(
                f"sequence reaches position {start + length}, beyond max_len={self.max_len}; "
                "build the encoding with a larger max_len or shorten the input"
            )
        return self.dropout(x + self.pe[start : start + length].to(x.dtype))
