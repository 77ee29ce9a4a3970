"""Chapter 13: the decoder-only layer, GPT-2's "block"; chapters 16-17: the same layer with
grouped-query attention and rotary positions.

Chapter 8's decoder layer without cross-attention, built from the pieces that
:mod:`~transformer_tutorial.lm.pieces` chooses from a
:class:`~transformer_tutorial.lm.config.LMConfig`. Its body follows
``torch.nn.TransformerEncoderLayer``: named sub-blocks ``_sa_block``, ``_ff_block`` under one
``if self.norm_first:``.

Shapes: ``x`` ``(B, T_new, D)``; one layer's cached keys and values ``(B, Hkv, S_past, Dh)``.
"""

from __future__ import annotations

import copy

from torch import Tensor, nn

from transformer_tutorial.attention import KVCache
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.grouped_attention import GroupedKVCache, GroupedQueryAttention
from transformer_tutorial.lm.latent_attention import LatentKVCache, MultiHeadLatentAttention
from transformer_tutorial.lm.moe import MixtureOfExperts
from transformer_tutorial.lm.pieces import make_attention, make_feed_forward, make_norm
from transformer_tutorial.masks import causal_mask

# One layer's keys and values so far: chapter 11's for "mha", chapter 16's for "gqa",
# chapter 21's latents for "mla".
Cache = KVCache | GroupedKVCache | LatentKVCache


class DecoderOnlyLayer(nn.Module):
    """Chapter 8's decoder layer without cross-attention: causal self-attention, then
    feed-forward, each in a residual connection with a norm (GPT-2's "block").

    ``norm_first=True`` (GPT-2) normalises each sub-layer's input, ``False`` (the paper) the
    sum. The causal mask is built here, so no caller can forget it.

    Shapes:
        x ``(B, T_new, D)`` after the ``S_past`` positions of ``past`` (each ``(B, H, S_past,
        Dh)``) → ``(B, T_new, D)`` and the keys/values of all ``S_past + T_new`` positions.
        :meth:`forward_with_router_logits` also returns the router's logits ``(B · T_new, E)``
        of a mixture-of-experts layer (chapter 20), None in a dense layer.
        With ``attention="gqa"`` or ``"mla"`` only: ``position_ids`` ``(B, T_new)`` for rotary
        positions and ``padding_mask`` ``(B, S_past + T_new)``, True at padding.
    """

    def __init__(self, config: LMConfig, layer: int = 0) -> None:
        super().__init__()
        self.norm_first = config.norm_first
        self.self_attn = make_attention(config)
        self.ff = make_feed_forward(config, layer)  # layer: which are sparse (chapter 20)
        self.norm1 = make_norm(config)
        self.norm2 = make_norm(config)
        self.dropout1 = nn.Dropout(config.dropout)
        self.dropout2 = nn.Dropout(config.dropout)

    def forward(
        self,
        x: Tensor,
        past: Cache | None = None,
        *,
        position_ids: Tensor | None = None,
        padding_mask: Tensor | None = None,
    ) -> tuple[Tensor, Cache]:
        x, kv, _ = self.forward_with_router_logits(
            x, past, position_ids=position_ids, padding_mask=padding_mask
        )
        return x, kv

    def forward_with_router_logits(
        self,
        x: Tensor,
        past: Cache | None = None,
        *,
        position_ids: Tensor | None = None,
        padding_mask: Tensor | None = None,
    ) -> tuple[Tensor, Cache, Tensor | None]:
        """:meth:`forward`, and the router's logits ``(B · T_new, E)`` (None: a dense layer)."""
        pads = dict(position_ids=position_ids, padding_mask=padding_mask)  # "gqa" only
        if self.norm_first:
            sa, kv = self._sa_block(self.norm1(x), past, **pads)
            x = x + sa
            ff, router_logits = self._ff_block(self.norm2(x))
            x = x + ff
        else:
            sa, kv = self._sa_block(x, past, **pads)
            x = self.norm1(x + sa)
            ff, router_logits = self._ff_block(x)
            x = self.norm2(x + ff)
        return x, kv, router_logits

    def _sa_block(
        self, x: Tensor, past: Cache | None, **pads: Tensor | None
    ) -> tuple[Tensor, Cache]:
        if isinstance(self.self_attn, GroupedQueryAttention | MultiHeadLatentAttention):
            return self._grouped_sa_block(x, past, **pads)
        q, kv = self.self_attn.project_qkv(x)  # (B, H, T_new, Dh) each
        if past is not None:
            kv = past.append(kv)  # (B, H, S_past + T_new, Dh)
        t_new, t_all = x.size(1), kv.k.size(2)
        # Chapter 6's mask, aligned bottom-right: new position i sits at t_all - t_new + i.
        future = None if t_new == 1 else causal_mask(t_new, t_all, device=x.device)
        out, _ = self.self_attn.attend_heads(q, kv, attn_mask=future)
        return self.dropout1(out), kv

    def _grouped_sa_block(
        self,
        x: Tensor,
        past: GroupedKVCache | LatentKVCache | None,
        *,
        position_ids: Tensor | None = None,
        padding_mask: Tensor | None = None,
    ) -> tuple[Tensor, GroupedKVCache | LatentKVCache]:
        """Chapter 16's attention builds its own mask (causal or sliding-window, bottom-right),
        turns queries and keys by their positions (``position_ids``: default, those after the
        cache's) and adds the new keys and values to a copy of ``past``, which stays as it was (a
        growing cache, the kind ``LanguageModel`` makes: a preallocated one shares its buffers).
        Chapter 21's latent attention is called alike, with a cache of its latents."""
        if past is None:
            latent = isinstance(self.self_attn, MultiHeadLatentAttention)
            past = LatentKVCache() if latent else GroupedKVCache()
        cache = copy.copy(past)
        out = self.self_attn(
            x, position_ids=position_ids, key_padding_mask=padding_mask, cache=cache
        )
        return self.dropout1(out), cache

    def _ff_block(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        if isinstance(self.ff, MixtureOfExperts):
            out, router_logits = self.ff.forward_with_router_logits(x)
            return self.dropout2(out), router_logits
        return self.dropout2(self.ff(x)), None
