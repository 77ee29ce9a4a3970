"""Chapters 13-17: the pieces a language model is built from, each chosen by name.

One factory per switchable piece reads :class:`~transformer_tutorial.lm.config.LMConfig`
and builds it: the norm (:func:`make_norm`), the feed-forward layer (:func:`make_feed_forward`),
what adds positions to the embeddings (:func:`make_positions`), the rotary hook
(:func:`make_rotary`) and the self-attention (:func:`make_attention`). The last three look the
config's string up in a registry (:mod:`~transformer_tutorial.lm.registry`), where each chapter
registers its own pieces: here chapter 13's (``attention="mha"``, ``positions="learned"`` and
``"sinusoidal"``) and chapter 15's rotary positions (``"rope"``); chapter 16's grouped-query
attention registers itself in :mod:`~transformer_tutorial.lm.grouped_attention`, chapter 21's
latent attention in :mod:`~transformer_tutorial.lm.latent_attention`. Chapter 17 assembles them
into a Llama-style model.

Shapes: embeddings ``(B, T, D)``; queries ``(B, H, T, Dh)``, keys and values ``(B, Hkv, T, Dh)``.
"""

from __future__ import annotations

from functools import cached_property
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from transformer_tutorial.attention import KVCache, MultiHeadAttention
from transformer_tutorial.checks import check_bool, check_int, check_tensor, check_type
from transformer_tutorial.embeddings import SinusoidalPositionalEncoding, sinusoidal_table
from transformer_tutorial.feed_forward import build_feed_forward
from transformer_tutorial.lm.cache import CacheLayout, LayerCache
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.registry import (
    ATTENTIONS,
    POSITIONS,
    ROUTERS,
    AttentionPiece,
    PositionsPiece,
)
from transformer_tutorial.lm.rope_scaling import REFUSED, RopeScaling, rotary_width, scaled_rotary
from transformer_tutorial.lm.rotary import RotaryLayout, RotaryPositions
from transformer_tutorial.masks import causal_mask
from transformer_tutorial.norms import build_norm


def make_norm(config: LMConfig) -> nn.Module:
    """The norm of each sub-layer (and the final one in pre-norm): ``"layer"``, LayerNorm (the
    paper, GPT-2), or ``"rms"``, RMSNorm (Llama, chapter 14); ``layer_norm_eps`` either way."""
    check_type("config", config, LMConfig, "an LMConfig")
    return build_norm(config.norm, config.d_model, config.layer_norm_eps)


def make_feed_forward(config: LMConfig, layer: int = 0) -> nn.Module:
    """The position-wise feed-forward layer of layer ``layer``, chapter 14's switch: chapter 5's
    layer with ``config.activation`` (``"gelu_tanh"``: GPT-2's), or with ``"swiglu"`` the gated
    layer (Llama's ``mlp``); ``d_ff`` is the hidden width, ``bias`` the config's. Chapter 20:
    where ``config.is_sparse(layer)``, the mixture of experts its ``router`` registered
    (:data:`~transformer_tutorial.lm.registry.ROUTERS`: Qwen3-MoE's, DeepSeek-V3's)."""
    check_type("config", config, LMConfig, "an LMConfig")
    check_int("layer", layer, at_least=0)
    if layer >= config.n_layers:
        raise ValueError(f"layer must be 0 to {config.n_layers - 1} (n_layers), got {layer}")
    if config.is_sparse(layer):
        return ROUTERS[config.router].build(config)
    ff = build_feed_forward(
        config.activation, config.d_model, config.d_ff, dropout=config.dropout, bias=config.bias
    )
    if not hasattr(ff, "residual_projections"):  # chapter 5's layer knows no residual stream
        ff.residual_projections = ("linear2.weight",)
    return ff


def make_rotary(config: LMConfig, *, checked: bool = True) -> RotaryPositions | None:
    """The model's one rotary position hook, handed to every layer's attention (chapter 15; its
    tables are built once, whatever the depth), as the config's ``positions`` builds it: with
    ``"rope"``, over the part of each head the attention rotates. None otherwise: the positions
    were added to the embeddings. ``checked=False`` (the model's): no read back from the device
    a layer, since the model counts positions on the host and refuses any past ``max_len`` (a
    layer called on its own keeps the check)."""
    check_type("config", config, LMConfig, "an LMConfig")
    check_bool("checked", checked)
    return POSITIONS[config.positions].rotary(config, checked=checked)


def make_attention(config: LMConfig, rotary: RotaryPositions | None = None) -> nn.Module:
    """The self-attention the config's ``attention`` names, as its registered piece builds it.
    Each answers the layer's one call, ``attention(x, cache, position_ids=...,
    key_padding_mask=...)`` → ``(B, T_new, D)``, and declares what its cache keeps
    (``cache_layout``). ``rotary``: the model's position hook (:func:`make_rotary`), shared by
    every layer; None builds one for this attention alone (checking the position ids it is
    given)."""
    check_type("config", config, LMConfig, "an LMConfig")
    if rotary is not None:
        check_type("rotary", rotary, RotaryPositions, "a RotaryPositions (make_rotary) or None")
    rotary = make_rotary(config) if rotary is None else rotary
    return ATTENTIONS[config.attention].build(config, rotary)


class CausalMultiHeadAttention(MultiHeadAttention):
    """Chapter 4's multi-head attention as a language model's self-attention (GPT-2's ``attn``):
    the causal mask built here, aligned bottom-right after the cached positions, and the layer's
    attention call.

    Shapes:
        x ``(B, T_new, D)`` after the positions ``cache`` holds → ``(B, T_new, D)``;
        ``key_padding_mask`` ``(B, cached + T_new)``, True at padding.
    """

    # What writes into the residual stream: the language model initialises it smaller.
    residual_projections = ("out_proj.weight",)

    @cached_property  # built once: the model and the attention compare it at every step
    def cache_layout(self) -> CacheLayout:
        """What its cache keeps: keys and values ``(B, H, S, Dh)``."""
        shape = (self.n_heads, self.d_head)
        return CacheLayout(("k", "v"), (shape, shape), seq_dim=2)

    def forward(  # type: ignore[override]  (the language model's call, not chapter 4's)
        self,
        x: Tensor,
        cache: LayerCache | None = None,
        *,
        position_ids: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        if position_ids is not None:
            raise ValueError(
                "position_ids: chapter 4's attention has no position hook (the positions were "
                "added to the embeddings); rotary positions need attention='gqa'"
            )
        q, kv = self.project_qkv(x)  # (B, H, T_new, Dh) each
        if cache is not None:
            kv = KVCache(*cache.update(kv.k, kv.v))  # (B, H, S_past + T_new, Dh)
        t_new, t_all = x.size(1), kv.k.size(2)
        # Chapter 6's mask, aligned bottom-right: new position i sits at t_all - t_new + i.
        future = None if t_new == 1 else causal_mask(t_new, t_all, device=x.device)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask[:, -t_all:]  # the positions held
        out, _ = self.attend_heads(q, kv, key_padding_mask=key_padding_mask, attn_mask=future)
        return out


def make_positions(config: LMConfig) -> nn.Module:
    """What adds positions to the token embeddings: ``"learned"`` (GPT-2, a trained table),
    ``"sinusoidal"`` (the paper, chapter 2) or, with ``"rope"``, nothing: rotary positions turn
    queries and keys inside attention. Each takes ``(x, start)`` and adds dropout."""
    check_type("config", config, LMConfig, "an LMConfig")
    return POSITIONS[config.positions].build(config)


class LearnedPositionalEmbedding(nn.Module):
    """A trained ``(max_len, D)`` table, one vector per position, added to the embeddings, then
    dropout (GPT-2's ``wpe``).

    Shapes:
        x ``(B, T, D)`` → ``(B, T, D)``; ``start`` shifts the positions (decoding with a cache).
    """

    def __init__(self, max_len: int, d_model: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.max_len = max_len
        self.weight = nn.Parameter(torch.zeros(max_len, d_model))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        check_positions_input(x, start, self.weight.size(1))
        length = x.size(1)
        if start + length > self.max_len:
            raise ValueError(
                f"sequence reaches position {start + length}, beyond max_len={self.max_len}: "
                "the table has no vector for it; shorten the input or build a larger max_len"
            )
        return self.dropout(x + self.weight[start : start + length])


class SinusoidalPositions(SinusoidalPositionalEncoding):
    """Chapter 2's table as the language model's positions: the same module, which also computes
    its table again when the model resets its buffers (after ``to_empty``)."""

    def reset_buffers(self) -> None:
        with torch.no_grad():
            self.pe.copy_(sinusoidal_table(*self.pe.shape))


class PositionsInAttention(nn.Module):
    """The embedding side of rotary positions: nothing is added, only dropout. The positions
    enter each attention layer, where queries and keys are turned by them.

    Shapes:
        x ``(B, T, D)`` → ``(B, T, D)``; ``start`` is accepted and not needed.
    """

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        check_positions_input(x, start)
        return self.dropout(x)


def check_positions_input(x: object, start: object, d_model: int | None = None) -> None:
    """``x`` a float ``(B, T, D)`` (``D = d_model`` if given) and ``start`` an int ``>= 0``."""
    check_tensor("x", x, kind="float", dims=3, shape="(B, T, D)")
    if d_model is not None and x.size(-1) != d_model:
        raise ValueError(f"x must be (B, T, D={d_model}), got {tuple(x.shape)}")
    check_int("start", start, at_least=0)


class MultiHeadPiece(AttentionPiece):
    """``attention="mha"``: chapter 4's multi-head attention (:class:`CausalMultiHeadAttention`,
    GPT-2's), positions added to the embeddings: no rotary hook, no kernel to choose."""

    def check(self, config: Any) -> None:
        if config.d_model % config.n_heads:
            raise ValueError(
                f"d_model={config.d_model} must be divisible by n_heads={config.n_heads}"
            )

    def saved_as(self, config: Any) -> str:
        return "gpt2"  # its config function names any other field to change

    def build(self, config: Any, rotary: RotaryPositions | None) -> CausalMultiHeadAttention:
        return CausalMultiHeadAttention(
            config.d_model, config.n_heads, config.dropout, bias=config.bias
        )


class LearnedPiece(PositionsPiece):
    """``positions="learned"``: GPT-2's trained table."""

    def build(self, config: Any) -> nn.Module:
        return LearnedPositionalEmbedding(config.max_len, config.d_model, config.dropout)


class SinusoidalPiece(PositionsPiece):
    """``positions="sinusoidal"``: the paper's fixed table (chapter 2)."""

    def check(self, config: Any) -> None:
        if config.d_model % 2:
            raise ValueError(f"d_model={config.d_model} must be even for sinusoidal positions")

    def build(self, config: Any) -> nn.Module:
        return SinusoidalPositions(config.d_model, config.max_len, config.dropout)


class RotaryPiece(PositionsPiece):
    """``positions="rope"`` (chapter 15): nothing added to the embeddings; queries and keys
    turned in every attention, over the part of each head its attention names
    (``rotary_layout``), with chapter 18's ``rope_scaling`` and ``partial_rotary_factor``."""

    owns = MappingProxyType(
        {"rope_base": 10000.0, "rope_scaling": None, "partial_rotary_factor": 1.0}
    )
    in_attention = True

    def check(self, config: Any) -> None:
        scaling = config.rope_scaling
        if scaling is not None and not isinstance(scaling, RopeScaling):
            raise TypeError(
                f"rope_scaling must be a RopeScaling or None, got {scaling!r}; from "
                "transformers' rope_parameters: RopeScaling.from_parameters(...)"
            )
        if scaling is not None and scaling.rope_type in REFUSED:
            raise ValueError(REFUSED[scaling.rope_type])
        layout = ATTENTIONS[config.attention].rotary_layout(config)
        if layout is None:
            raise ValueError(
                f"positions='rope' turns queries and keys inside the attention; "
                f"attention={config.attention!r} has no hook for them: set attention='gqa'"
            )
        if layout.dim % 2:
            raise ValueError(f"the head width {layout.dim} must be even for rotary positions")
        rotary_width(layout.dim, layout.partial_rotary_factor)  # even, ≥ 2

    def build(self, config: Any) -> nn.Module:
        return PositionsInAttention(config.dropout)

    def rotary(self, config: Any, *, checked: bool) -> RotaryPositions:
        layout: RotaryLayout = ATTENTIONS[config.attention].rotary_layout(config)
        return scaled_rotary(
            layout.dim,
            max_len=config.max_len,
            base=config.rope_base,
            scaling=config.rope_scaling,
            partial_rotary_factor=layout.partial_rotary_factor,
            layout=layout.layout,
            checked=checked,
        )


ATTENTIONS.register("mha", MultiHeadPiece())
POSITIONS.register("learned", LearnedPiece())
POSITIONS.register("sinusoidal", SinusoidalPiece())
POSITIONS.register("rope", RotaryPiece())
