"""Chapters 3 and 4: scaled dot-product attention and multi-head attention.

Shapes: queries ``(B, L, D)``, keys and values ``(B, S, D)``; inside, heads ``(B, H, L, Dh)``.
Masks are bool with True = blocked (see :mod:`transformer_tutorial.masks`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_tutorial.checks import check_int, check_number
from transformer_tutorial.masks import merge_masks


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    dropout: Callable[[Tensor, float], Tensor] = F.dropout,
) -> tuple[Tensor, Tensor | None]:
    """softmax(q kᵀ / √d_k) v, written out.

    Args:
        q: ``(B, H, L, Dk)`` or ``(B, L, Dk)``.
        k: ``(B, H, S, Dk)`` or ``(B, S, Dk)``.
        v: ``(B, H, S, Dv)`` or ``(B, S, Dv)``.
        attn_mask: bool, True = blocked: ``(L, S)``, ``(B, L, S)`` or, when ``q`` has heads,
            ``(B, H, L, S)`` or ``(B, 1, L, S)``; any other shape is refused.
        key_padding_mask: bool ``(B, S)``, True = padding.
        dropout_p: dropout on the attention weights (pass 0.0 when evaluating).
        need_weights: also return the weights ``(B, H, L, S)`` (or ``(B, L, S)``).
        dropout: what drops the weights, ``dropout(weights, dropout_p)``: ``F.dropout``, or
            chapter 12's :func:`~transformer_tutorial.dropout.cheap_dropout`.

    Returns:
        ``(output, weights or None)``; output ``(B, H, L, Dv)`` (or ``(B, L, Dv)``).

    A query whose every key is blocked gets all-zero weights and a zero output, never NaN.
    """
    if q.dim() not in (3, 4) or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(
            f"q, k, v must all be (B, L, Dk) or all (B, H, L, Dk); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[:-1] != v.shape[:-1] or q.shape[:-2] != k.shape[:-2] or q.size(-1) != k.size(-1):
        raise ValueError(
            "q, k, v must agree: k and v the same (B, [H,] S), q the same (B, [H]) and the "
            f"width Dk of k; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    check_number("dropout_p", dropout_p, low=0.0, high=1.0)
    heads = q.dim() == 4
    B, L, S = q.size(0), q.size(-2), k.size(-2)
    H = q.size(1) if heads else None
    blocked = merge_masks(attn_mask, key_padding_mask, batch_size=B, q_len=L, k_len=S, n_heads=H)
    if blocked is not None and not heads:
        blocked = blocked[:, 0]  # (B or 1, L or 1, S): no heads, so dimension 1 has size 1
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, L, S)
    if blocked is not None:
        # The most negative finite number, not -inf: a fully blocked row then softmaxes to a
        # uniform row instead of NaN, and is zeroed just below.
        scores = scores.masked_fill(blocked, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1)
    if blocked is not None:
        weights = weights.masked_fill(blocked, 0.0)
    if dropout_p > 0.0:
        weights = dropout(weights, dropout_p)
    return weights @ v, (weights if need_weights else None)


@dataclass(frozen=True)
class KVCache:
    """Keys and values already projected and split into heads, each ``(B, H, S, Dh)``."""

    k: Tensor
    v: Tensor

    def append(self, other: KVCache) -> KVCache:
        """A new cache with ``other``'s positions after this one's (along S)."""
        return KVCache(torch.cat([self.k, other.k], dim=2), torch.cat([self.v, other.v], dim=2))

    def reorder(self, index: Tensor) -> KVCache:
        """Select batch rows (beam search reorders hypotheses after every step)."""
        return KVCache(self.k.index_select(0, index), self.v.index_select(0, index))


class MultiHeadAttention(nn.Module):
    """H attention heads in parallel, each on its own Dh-wide projection (section 3.2.2).

    Args:
        d_model: D, split into ``n_heads`` heads of width ``D // n_heads``.
        n_heads: H.
        dropout: dropout on the attention weights while training.
        bias: whether the four projections have biases.

    Shapes:
        query ``(B, L, D)``, key and value ``(B, S, D)`` → output ``(B, L, D)`` and, with
        ``need_weights=True``, per-head weights ``(B, H, L, S)``.

    ``forward`` = project (``q_proj`` and :meth:`project_kv`) + :meth:`attend_heads`; decoding
    calls :meth:`project_kv` and :meth:`attend` separately so that keys and values computed once
    can be kept in a :class:`KVCache`. In self-attention (``query is key is value``, as
    ``nn.MultiheadAttention`` tests it) ``forward`` computes the three projections as one matrix
    product instead (:meth:`project_qkv`), and when ``key is value`` the two of keys and values:
    the same numbers, fewer and larger GEMMs.

    ``drop_weights`` (None) is what drops the attention weights while training on a CPU: None
    leaves it to PyTorch's fused kernel, which draws the same masks as ``nn.MultiheadAttention``;
    a function, as chapter 12's :func:`~transformer_tutorial.dropout.with_cheap_dropout` sets,
    runs the written-out attention there and drops the weights with it. On a GPU the fused
    kernel drops them either way.
    """

    def __init__(
        self, d_model: int, n_heads: int, dropout: float = 0.0, bias: bool = True
    ) -> None:
        super().__init__()
        check_int("d_model", d_model, at_least=1)
        check_int("n_heads", n_heads, at_least=1)
        check_number("dropout", dropout, low=0.0, high=1.0)
        if d_model % n_heads:
            raise ValueError(
                f"d_model={d_model} must be divisible by n_heads={n_heads}: each head gets "
                f"d_model // n_heads dimensions. Choose e.g. n_heads in "
                f"{[h for h in range(1, min(d_model, 16) + 1) if d_model % h == 0]}"
            )
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.dropout = dropout
        self.drop_weights: Callable[[Tensor, float], Tensor] | None = None
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def _split_heads(self, x: Tensor) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, L, Dh)

    def project_kv(self, key: Tensor, value: Tensor) -> KVCache:
        """Project keys and values and split them into heads:
        ``(B, S, D)`` → ``(B, H, S, Dh)``.

        When ``key is value`` (cross-attention reads the memory twice) both projections run as
        one matrix product, :meth:`_packed`, as in ``nn.MultiheadAttention``; the same numbers.
        """
        if key is value:
            return KVCache(*self._packed(key, (self.k_proj, self.v_proj)))
        return KVCache(self._split_heads(self.k_proj(key)), self._split_heads(self.v_proj(value)))

    def project_qkv(self, x: Tensor) -> tuple[Tensor, KVCache]:
        """Self-attention's three projections of ``x`` ``(B, L, D)`` as one matrix product.

        Equal to ``q_proj``, ``k_proj`` and ``v_proj`` applied one by one. Returns queries
        ``(B, H, L, Dh)`` and keys/values ``(B, H, L, Dh)``.
        """
        q, k, v = self._packed(x, (self.q_proj, self.k_proj, self.v_proj))
        return q, KVCache(k, v)

    def _packed(self, x: Tensor, projections: tuple[nn.Linear, ...]) -> tuple[Tensor, ...]:
        """``x`` ``(B, L, D)`` through several projections at once: their ``(D, D)`` weights
        stacked into one ``(nD, D)`` matrix, like PyTorch's packed ``in_proj_weight``, so one
        GEMM reads ``x`` once instead of n times. Returns each projection in heads
        ``(B, H, L, Dh)``."""
        B, L, _ = x.shape
        weight = torch.cat([p.weight for p in projections])  # (nD, D)
        bias = None if projections[0].bias is None else torch.cat([p.bias for p in projections])
        out = F.linear(x, weight, bias).view(B, L, len(projections), self.n_heads, self.d_head)
        return out.permute(2, 0, 3, 1, 4).unbind(0)  # n × (B, H, L, Dh)

    def attend(
        self,
        query: Tensor,
        kv: KVCache,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` ``(B, L, D)`` over projected keys/values ``(B, H, S, Dh)``."""
        q = self._split_heads(self.q_proj(query))  # 1) project: (B, H, L, Dh)
        return self.attend_heads(
            q,
            kv,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            need_weights=need_weights,
        )

    def attend_heads(
        self,
        q: Tensor,
        kv: KVCache,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """As :meth:`attend`, from queries already projected and split, ``(B, H, L, Dh)``."""
        B, _, L, _ = q.shape
        S = kv.k.size(2)
        dropout_p = self.dropout if self.training else 0.0
        blocked = merge_masks(  # True = blocked, (B or 1, H or 1, L or 1, S)
            attn_mask, key_padding_mask, batch_size=B, q_len=L, k_len=S, n_heads=self.n_heads
        )
        # Its own dropout on a CPU only: there PyTorch's kernel writes the weights out anyway.
        own_dropout = dropout_p > 0.0 and self.drop_weights is not None and q.device.type == "cpu"
        if need_weights or own_dropout:  # 2) attend, written out
            mask = None if blocked is None else blocked.expand(B, -1, L, S)
            out, weights = scaled_dot_product_attention(
                q,
                kv.k,
                kv.v,
                attn_mask=mask,
                dropout_p=dropout_p,
                need_weights=need_weights,
                dropout=self.drop_weights or F.dropout,
            )
        else:  # 2) attend with PyTorch's fused kernel: same function, less memory traffic
            allowed = None if blocked is None else ~blocked  # F.sdpa: True = attend
            # (torch >= 2.5 gives a query with no key left zeros, as the written-out path does)
            out = F.scaled_dot_product_attention(
                q, kv.k, kv.v, attn_mask=allowed, dropout_p=dropout_p
            )
            weights = None
        out = out.transpose(1, 2).reshape(B, L, self.d_model)  # 3) concat heads: (B, L, D)
        return self.out_proj(out), weights  # 4) mix heads

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Returns ``(output (B, L, D), per-head weights (B, H, L, S) or None)``."""
        self._check_inputs(query, key, value)
        if query is key and key is value:  # self-attention: the three projections as one
            q, kv = self.project_qkv(query)
        else:
            q, kv = self._split_heads(self.q_proj(query)), self.project_kv(key, value)
        return self.attend_heads(
            q,
            kv,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            need_weights=need_weights,
        )

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        D = self.d_model
        got = f"got query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        if any(x.dim() != 3 or x.size(-1) != D for x in (query, key, value)):
            raise ValueError(f"query, key and value must be batch-first (B, L, D={D}); {got}")
        if key.shape[:2] != value.shape[:2]:
            raise ValueError(f"key and value must have the same (B, S), a value per key; {got}")
        if query.size(0) != key.size(0):
            raise ValueError(f"query and key must have the same batch size B; {got}")
