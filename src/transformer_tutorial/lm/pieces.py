"""Chapters 13-17: the pieces a language model is built from, each chosen by name.

One factory per switchable piece reads :class:`~transformer_tutorial.lm.config.LMConfig`
and builds it: the norm (:func:`make_norm`), the feed-forward layer (:func:`make_feed_forward`),
what adds positions to the embeddings (:func:`make_positions`) and the self-attention's head
layout (:func:`make_attention`). GPT-2's choices and the 2017 paper's are chapter 13's; RMSNorm
and SwiGLU chapter 14's, rotary positions chapter 15's, grouped-query attention with QK-norm
and a sliding window chapter 16's; chapter 17 assembles them into a Llama-style model.

Shapes: embeddings ``(B, T, D)``; queries ``(B, H, T, Dh)``, keys and values ``(B, Hkv, T, Dh)``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from transformer_tutorial.attention import KVCache, MultiHeadAttention
from transformer_tutorial.checks import check_bool, check_int, check_tensor, check_type
from transformer_tutorial.embeddings import SinusoidalPositionalEncoding
from transformer_tutorial.feed_forward import SwiGLU, build_feed_forward
from transformer_tutorial.layers import FeedForward
from transformer_tutorial.lm.cache import GroupedKVCache
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.grouped_attention import GroupedQueryAttention
from transformer_tutorial.lm.latent_attention import MultiHeadLatentAttention, mla_softmax_scale
from transformer_tutorial.lm.moe import DeepSeekMoE, MixtureOfExperts
from transformer_tutorial.lm.rope_scaling import scaled_rotary
from transformer_tutorial.lm.rotary import RotaryPositions
from transformer_tutorial.masks import causal_mask
from transformer_tutorial.norms import build_norm


def make_norm(config: LMConfig) -> nn.Module:
    """The norm of each sub-layer (and the final one in pre-norm): ``"layer"``, LayerNorm (the
    paper, GPT-2), or ``"rms"``, RMSNorm (Llama, chapter 14); ``layer_norm_eps`` either way."""
    check_type("config", config, LMConfig, "an LMConfig")
    return build_norm(config.norm, config.d_model, config.layer_norm_eps)


def make_feed_forward(config: LMConfig, layer: int = 0) -> FeedForward | SwiGLU | MixtureOfExperts:
    """The position-wise feed-forward layer of layer ``layer``, chapter 14's switch: chapter 5's
    layer with ``config.activation`` (``"gelu_tanh"``: GPT-2's), or with ``"swiglu"`` the gated
    layer (Llama's ``mlp``); ``d_ff`` is the hidden width, ``bias`` the config's. Chapter 20:
    where ``config.is_sparse(layer)``, a mixture of ``n_experts`` SwiGLU layers of ``moe_d_ff``
    (Qwen3-MoE's sparse block; with ``router="sigmoid"`` DeepSeek-V3's)."""
    check_type("config", config, LMConfig, "an LMConfig")
    check_int("layer", layer, at_least=0)
    if layer >= config.n_layers:
        raise ValueError(f"layer must be 0 to {config.n_layers - 1} (n_layers), got {layer}")
    if config.is_sparse(layer) and config.router == "sigmoid":
        return DeepSeekMoE(
            config.d_model,
            config.moe_d_ff or config.d_ff,
            config.n_experts,
            config.n_experts_per_token,
            n_shared_experts=config.n_shared_experts,
            n_group=config.n_group,
            topk_group=config.topk_group,
            norm_topk_prob=config.norm_topk_prob,
            routed_scaling_factor=config.routed_scaling_factor,
            dropout=config.dropout,
        )
    if config.is_sparse(layer):
        return MixtureOfExperts(
            config.d_model,
            config.moe_d_ff or config.d_ff,
            config.n_experts,
            config.n_experts_per_token,
            norm_topk_prob=config.norm_topk_prob,
            dropout=config.dropout,
        )
    ff = build_feed_forward(
        config.activation, config.d_model, config.d_ff, dropout=config.dropout, bias=config.bias
    )
    if isinstance(ff, FeedForward):  # chapter 5's layer, which knows nothing of residual streams
        ff.residual_projections = ("linear2.weight",)
    return ff


def make_rotary(config: LMConfig, *, checked: bool = True) -> RotaryPositions | None:
    """The model's one rotary position hook, handed to every layer's attention (chapter 15; its
    tables are built once, whatever the depth): with ``positions="rope"`` chapter 18's
    ``rope_scaling`` and ``partial_rotary_factor`` of the head width; with ``"mla"`` chapter
    21's ``qk_rope_head_dim`` part (interleaved pairs with ``rope_interleave``). None otherwise:
    the positions were added to the embeddings. ``checked=False`` (the model's): no read back
    from the device a layer, since the model counts positions on the host and refuses any past
    ``max_len`` (a layer called on its own keeps the check)."""
    check_type("config", config, LMConfig, "an LMConfig")
    check_bool("checked", checked)
    if config.attention == "mla":
        return scaled_rotary(
            config.qk_rope_head_dim,
            max_len=config.max_len,
            base=config.rope_base,
            scaling=config.rope_scaling,
            layout="interleaved" if config.rope_interleave else "half_split",
            checked=checked,
        )
    if config.positions != "rope":
        return None
    return scaled_rotary(
        config.head_dim,
        max_len=config.max_len,
        base=config.rope_base,
        scaling=config.rope_scaling,
        partial_rotary_factor=config.partial_rotary_factor,
        checked=checked,
    )


def make_attention(
    config: LMConfig, rotary: RotaryPositions | None = None
) -> CausalMultiHeadAttention | GroupedQueryAttention | MultiHeadLatentAttention:
    """The self-attention, one branch per kind; each answers the layer's one call,
    ``attention(x, cache, position_ids=..., key_padding_mask=...)`` → ``(B, T_new, D)``, and
    builds its own empty cache (``empty_cache``).

    ``"mha"``: chapter 4's multi-head attention under a causal mask
    (:class:`CausalMultiHeadAttention`). ``"gqa"``: chapter 16's
    :class:`GroupedQueryAttention` with ``n_kv_heads`` key/value heads, QK-norm and a sliding
    ``window``. ``"mla"``: chapter 21's :class:`MultiHeadLatentAttention`, its scores scaled as
    DeepSeek's. ``rotary``: the model's position hook (:func:`make_rotary`), shared by every
    layer; None builds one for this attention alone (checking the position ids it is given).
    """
    check_type("config", config, LMConfig, "an LMConfig")
    if rotary is not None:
        check_type("rotary", rotary, RotaryPositions, "a RotaryPositions (make_rotary) or None")
    rotary = make_rotary(config) if rotary is None else rotary
    if config.attention == "mha":
        return CausalMultiHeadAttention(
            config.d_model, config.n_heads, config.dropout, bias=config.bias
        )
    if config.attention == "mla":
        return MultiHeadLatentAttention(
            config.d_model,
            config.n_heads,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            q_lora_rank=config.q_lora_rank,
            positions=rotary,
            softmax_scale=mla_softmax_scale(
                config.qk_nope_head_dim + config.qk_rope_head_dim, config.rope_scaling
            ),
            dropout=config.dropout,
        )
    return GroupedQueryAttention(
        config.d_model,
        config.n_heads,
        config.n_kv_heads,
        d_head=config.d_head,
        bias=config.bias,
        qk_norm=config.qk_norm,
        norm_eps=config.layer_norm_eps,
        window=config.window,
        positions=rotary,
        dropout=config.dropout,
        backend=config.attention_backend,
    )


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
    cache_holds = "keys and values"  # the cache it reads and writes (lm.cache)

    def forward(  # type: ignore[override]  (the language model's call, not chapter 4's)
        self,
        x: Tensor,
        cache: GroupedKVCache | None = None,
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

    def empty_cache(
        self,
        batch_size: int,
        max_len: int | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> GroupedKVCache:
        """An empty cache, growing (``max_len`` None) or preallocated: H key/value heads."""
        if max_len is None:
            return GroupedKVCache()
        return GroupedKVCache.preallocate(
            batch_size, self.n_heads, max_len, self.d_head, dtype=dtype, device=device
        )


def make_positions(config: LMConfig) -> nn.Module:
    """What adds positions to the token embeddings: ``"learned"`` (GPT-2, a trained table),
    ``"sinusoidal"`` (the paper, chapter 2) or, with ``"rope"``, nothing: rotary positions turn
    queries and keys inside attention. Each takes ``(x, start)`` and adds dropout."""
    check_type("config", config, LMConfig, "an LMConfig")
    if config.positions == "sinusoidal":
        return SinusoidalPositionalEncoding(config.d_model, config.max_len, config.dropout)
    if config.positions == "rope":
        return PositionsInAttention(config.dropout)
    return LearnedPositionalEmbedding(config.max_len, config.d_model, config.dropout)


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
