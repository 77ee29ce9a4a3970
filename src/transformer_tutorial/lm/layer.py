"""Chapter 13: the decoder-only layer, GPT-2's "block"; chapters 16-21: the same layer with
other attentions and feed-forward layers.

Chapter 8's decoder layer without cross-attention, built from the pieces that
:mod:`~transformer_tutorial.lm.pieces` chooses from a
:class:`~transformer_tutorial.lm.config.LMConfig`. Its body follows
``torch.nn.TransformerEncoderLayer``: named sub-blocks ``_sa_block``, ``_ff_block`` under one
``if self.norm_first:``. The layer never asks which attention it holds: every attention answers
the same call and keeps its positions in the layer's cache (:mod:`~transformer_tutorial.lm.cache`).

Shapes: ``x`` ``(B, T_new, D)``; the layer's cache holds the ``S_past`` positions before it.
"""

from __future__ import annotations

from torch import Tensor, nn

from transformer_tutorial.checks import check_int, check_tensor, check_type
from transformer_tutorial.lm.cache import LayerCache
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.pieces import make_attention, make_feed_forward, make_norm
from transformer_tutorial.lm.rotary import RotaryPositions


class DecoderOnlyLayer(nn.Module):
    """Chapter 8's decoder layer without cross-attention: causal self-attention, then
    feed-forward, each in a residual connection with a norm (GPT-2's "block").

    ``norm_first=True`` (GPT-2) normalises each sub-layer's input, ``False`` (the paper) the
    sum. The attention builds the causal mask, so no caller can forget it. ``rotary``: the
    model's rotary position hook, shared by its layers (None: positions added to the
    embeddings).

    Shapes:
        x ``(B, T_new, D)`` after the ``S_past`` positions ``cache`` holds (None: no earlier
        positions, nothing kept) → ``(B, T_new, D)``; the cache then holds the new positions
        too. ``position_ids`` ``(B, T_new)`` (rotary positions; default: those after the
        cache's) and ``padding_mask`` ``(B, S_past + T_new)``, True at padding.
    """

    def __init__(
        self, config: LMConfig, layer: int = 0, rotary: RotaryPositions | None = None
    ) -> None:
        super().__init__()
        check_type("config", config, LMConfig, "an LMConfig")
        check_int("layer", layer, at_least=0)
        if layer >= config.n_layers:
            raise ValueError(f"layer must be 0 to {config.n_layers - 1} (n_layers), got {layer}")
        self.d_model = config.d_model
        self.norm_first = config.norm_first
        self.self_attn = make_attention(config, rotary)
        self.ff = make_feed_forward(config, layer)  # layer: which are sparse (chapter 20)
        # Chapter 20: whether ff is a mixture of experts, which also gives its router's logits.
        self.sparse = config.is_sparse(layer)
        self.norm1 = make_norm(config)
        self.norm2 = make_norm(config)
        self.dropout1 = nn.Dropout(config.dropout)
        self.dropout2 = nn.Dropout(config.dropout)

    def forward(
        self,
        x: Tensor,
        cache: LayerCache | None = None,
        *,
        position_ids: Tensor | None = None,
        padding_mask: Tensor | None = None,
        router_logits: list[Tensor] | None = None,
    ) -> Tensor:
        """``router_logits``: a list to which a mixture-of-experts layer (chapter 20) appends
        its router's logits ``(B · T_new, E)``; a dense layer adds nothing."""
        self._check(x, cache, padding_mask, router_logits)
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), cache, position_ids, padding_mask)
            x = x + self._ff_block(self.norm2(x), router_logits)
        else:
            x = self.norm1(x + self._sa_block(x, cache, position_ids, padding_mask))
            x = self.norm2(x + self._ff_block(x, router_logits))
        return x

    def _check(
        self,
        x: Tensor,
        cache: LayerCache | None,
        padding_mask: Tensor | None,
        router_logits: list[Tensor] | None,
    ) -> None:
        """Types and shapes only: nothing read back from the device."""
        check_tensor("x", x, kind="float", dims=3, shape="(B, T_new, D)")
        if x.size(-1) != self.d_model:
            raise ValueError(f"x must be (B, T_new, D={self.d_model}), got {tuple(x.shape)}")
        if padding_mask is not None:
            check_tensor("padding_mask", padding_mask, kind="bool", dims=2, shape="(B, S)")
            past = 0 if cache is None else cache.seen
            if padding_mask.shape != (x.size(0), past + x.size(1)):
                raise ValueError(
                    f"padding_mask must be (B, S_past + T_new) = ({x.size(0)}, {past} + "
                    f"{x.size(1)}), True at padding, got {tuple(padding_mask.shape)}"
                )
        if router_logits is not None and not isinstance(router_logits, list):
            raise TypeError(
                "router_logits must be a list (the layer appends to it) or None, got "
                f"{type(router_logits).__name__}"
            )

    def _sa_block(
        self,
        x: Tensor,
        cache: LayerCache | None,
        position_ids: Tensor | None,
        padding_mask: Tensor | None,
    ) -> Tensor:
        out = self.self_attn(x, cache, position_ids=position_ids, key_padding_mask=padding_mask)
        return self.dropout1(out)

    def _ff_block(self, x: Tensor, router_logits: list[Tensor] | None) -> Tensor:
        if self.sparse:  # chapter 20
            out, logits = self.ff.forward_with_router_logits(x)
            if router_logits is not None:
                router_logits.append(logits)
            return self.dropout2(out)
        return self.dropout2(self.ff(x))
