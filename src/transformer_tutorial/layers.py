"""Chapters 5, 7 and 8: Add & Norm, the feed-forward block, and the encoder and decoder layers.

Shapes: ``x`` ``(B, L, D)`` throughout; ``memory`` (the encoder's output) ``(B, S, D)``.
Layer bodies follow ``torch.nn.TransformerEncoderLayer``: named sub-blocks ``_sa_block``,
``_ca_block`` (PyTorch's ``_mha_block``), ``_ff_block`` under one ``if self.norm_first:``.
``norm_first=False`` is the paper's post-norm, ``x = norm(x + sublayer(x))``;
``norm_first=True`` is pre-norm, ``x = x + sublayer(norm(x))``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_tutorial.attention import KVCache, MultiHeadAttention
from transformer_tutorial.masks import causal_mask, check_padding_mask

# The feed-forward's activations by name: the paper's ReLU, GELU, and GELU's tanh approximation,
# GPT-2's (chapter 13; "gelu_new" in transformers).
ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
}


class LayerNorm(nn.Module):
    """Normalise each position's D features to mean 0 and variance 1, then scale and shift.

    ``y = (x - mean) / sqrt(var + eps) * weight + bias`` with the *biased* variance (divide by D)
    inside the square root, as ``torch.nn.LayerNorm``. :meth:`written_out` is that formula line
    by line; ``forward`` hands the same formula to PyTorch's fused kernel, which reads ``x`` once
    instead of five times (the two are tested equal).

    Shapes:
        ``(..., D)`` → ``(..., D)``.
    """

    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model))

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def written_out(self, x: Tensor) -> Tensor:
        """The formula step by step: equal to :meth:`forward`, slower."""
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


class FeedForward(nn.Module):
    """Position-wise feed-forward network: ``linear2(dropout(activation(linear1(x))))``.

    Args:
        d_model: D, input and output width.
        d_ff: inner width (2048 in the paper's base model).
        dropout: dropout after the activation.
        activation: ``"relu"`` (the paper), ``"gelu"``, ``"gelu_tanh"`` (GPT-2's), or a
            function of one tensor (as ``nn.TransformerEncoderLayer`` takes).
        bias: whether the two linear layers have biases.

    Shapes:
        ``(B, L, D)`` → ``(B, L, D)``, each position independently.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        dropout: float = 0.0,
        activation: str | Callable[[Tensor], Tensor] = "relu",
        *,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if not callable(activation) and activation not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}"
            )
        self.linear1 = nn.Linear(d_model, d_ff, bias=bias)
        self.activation = activation if callable(activation) else ACTIVATIONS[activation]
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(self.dropout(self.activation(self.linear1(x))))


class EncoderLayer(nn.Module):
    """Self-attention, then feed-forward, each wrapped in a residual connection and a LayerNorm.

    Args:
        d_model, n_heads, d_ff, dropout, activation, layer_norm_eps: as
            ``nn.TransformerEncoderLayer``.
        norm_first: False = post-norm (the paper), True = pre-norm.

    Shapes:
        x ``(B, S, D)``, src_key_padding_mask ``(B, S)`` bool True = padding → ``(B, S, D)``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        *,
        norm_first: bool = False,
        activation: str = "relu",
        layer_norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.ff = FeedForward(d_model, d_ff, dropout, activation)
        self.norm1 = LayerNorm(d_model, layer_norm_eps)
        self.norm2 = LayerNorm(d_model, layer_norm_eps)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, x: Tensor, *, src_key_padding_mask: Tensor | None = None) -> Tensor:
        return self._layer(x, src_key_padding_mask, need_weights=False)[0]

    def forward_with_weights(
        self, x: Tensor, *, src_key_padding_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """As :meth:`forward`, through the written-out attention, with its weights
        ``(B, H, S, S)``."""
        return self._layer(x, src_key_padding_mask, need_weights=True)

    def _layer(
        self, x: Tensor, key_padding_mask: Tensor | None, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        check_padding_mask("src_key_padding_mask", key_padding_mask, "(B, S)", x.shape[:2])
        if self.norm_first:
            sa, weights = self._sa_block(self.norm1(x), key_padding_mask, need_weights)
            x = x + sa
            x = x + self._ff_block(self.norm2(x))
        else:
            sa, weights = self._sa_block(x, key_padding_mask, need_weights)
            x = self.norm1(x + sa)
            x = self.norm2(x + self._ff_block(x))
        return x, weights

    def _sa_block(
        self, x: Tensor, key_padding_mask: Tensor | None, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        out, weights = self.self_attn(
            x, x, x, key_padding_mask=key_padding_mask, need_weights=need_weights
        )
        return self.dropout1(out), weights

    def _ff_block(self, x: Tensor) -> Tensor:
        return self.dropout2(self.ff(x))


@dataclass(frozen=True)
class LayerCache:
    """What one decoder layer keeps between decoding steps, each ``(B, H, *, Dh)``.

    ``self_kv``: keys/values of the target positions generated so far (grows by one a step);
    ``memory_kv``: keys/values of the encoder memory (computed once).
    """

    self_kv: KVCache | None
    memory_kv: KVCache

    def reorder(self, index: Tensor) -> LayerCache:
        self_kv = None if self.self_kv is None else self.self_kv.reorder(index)
        return LayerCache(self_kv, self.memory_kv.reorder(index))


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention over the encoder memory, then feed-forward.

    PyTorch calls the cross-attention ``multihead_attn`` and its block ``_mha_block``; here they
    are ``cross_attn`` and ``_ca_block``.

    Self-attention here is always causal: position t sees targets 0..t only. The mask is built
    in this layer, so no caller can forget it, and it does not depend on ``self.training``.

    Args:
        as :class:`EncoderLayer`.

    Shapes:
        x ``(B, T, D)``, memory ``(B, S, D)``, tgt_key_padding_mask ``(B, T)``,
        memory_key_padding_mask ``(B, S)`` (bool, True = padding) → ``(B, T, D)``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        *,
        norm_first: bool = False,
        activation: str = "relu",
        layer_norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.ff = FeedForward(d_model, d_ff, dropout, activation)
        self.norm1 = LayerNorm(d_model, layer_norm_eps)
        self.norm2 = LayerNorm(d_model, layer_norm_eps)
        self.norm3 = LayerNorm(d_model, layer_norm_eps)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """Teacher forcing: all T positions at once, the causal mask standing in for time."""
        return self._layer(
            x, self.init_cache(memory), tgt_key_padding_mask, memory_key_padding_mask, False
        )[0]

    def forward_with_weights(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """As :meth:`forward`, through the written-out attention, with the weights
        ``(self-attention (B, H, T, T), cross-attention (B, H, T, S))``."""
        x, _, weights = self._layer(
            x, self.init_cache(memory), tgt_key_padding_mask, memory_key_padding_mask, True
        )
        return x, weights

    def step(
        self, x: Tensor, cache: LayerCache, *, memory_key_padding_mask: Tensor | None = None
    ) -> tuple[Tensor, LayerCache]:
        """Decode new positions ``x`` ``(B, T_new, D)`` after those held in ``cache``.

        Returns the new positions' outputs and a new cache that also holds them.
        """
        x, self_kv, _ = self._layer(x, cache, None, memory_key_padding_mask, False)
        return x, LayerCache(self_kv, cache.memory_kv)

    def init_cache(self, memory: Tensor) -> LayerCache:
        """A cache with the memory's keys/values projected once and no target positions yet."""
        return LayerCache(None, self.cross_attn.project_kv(memory, memory))

    def _layer(
        self,
        x: Tensor,
        cache: LayerCache,
        tgt_key_padding_mask: Tensor | None,
        memory_key_padding_mask: Tensor | None,
        need_weights: bool,
    ) -> tuple[Tensor, KVCache, tuple[Tensor | None, Tensor | None]]:
        B, S = x.size(0), cache.memory_kv.k.size(2)
        check_padding_mask("tgt_key_padding_mask", tgt_key_padding_mask, "(B, T)", x.shape[:2])
        check_padding_mask("memory_key_padding_mask", memory_key_padding_mask, "(B, S)", (B, S))
        if self.norm_first:
            sa, self_kv, w_self = self._sa_block(
                self.norm1(x), cache.self_kv, tgt_key_padding_mask, need_weights
            )
            x = x + sa
            ca, w_cross = self._ca_block(
                self.norm2(x), cache.memory_kv, memory_key_padding_mask, need_weights
            )
            x = x + ca
            x = x + self._ff_block(self.norm3(x))
        else:
            sa, self_kv, w_self = self._sa_block(
                x, cache.self_kv, tgt_key_padding_mask, need_weights
            )
            x = self.norm1(x + sa)
            ca, w_cross = self._ca_block(x, cache.memory_kv, memory_key_padding_mask, need_weights)
            x = self.norm2(x + ca)
            x = self.norm3(x + self._ff_block(x))
        return x, self_kv, (w_self, w_cross)

    def _sa_block(
        self, x: Tensor, past: KVCache | None, key_padding_mask: Tensor | None, need_weights: bool
    ) -> tuple[Tensor, KVCache, Tensor | None]:
        q, kv = self.self_attn.project_qkv(x)  # (B, H, T_new, Dh) each
        if past is not None:
            kv = past.append(kv)
        t_new, t_all = x.size(1), kv.k.size(2)
        # One new position may see every key so far: no mask needed.
        future = None if t_new == 1 else causal_mask(t_new, t_all, device=x.device)
        out, weights = self.self_attn.attend_heads(
            q, kv, attn_mask=future, key_padding_mask=key_padding_mask, need_weights=need_weights
        )
        return self.dropout1(out), kv, weights

    def _ca_block(
        self, x: Tensor, memory_kv: KVCache, key_padding_mask: Tensor | None, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        out, weights = self.cross_attn.attend(
            x, memory_kv, key_padding_mask=key_padding_mask, need_weights=need_weights
        )
        return self.dropout2(out), weights

    def _ff_block(self, x: Tensor) -> Tensor:
        return self.dropout3(self.ff(x))
