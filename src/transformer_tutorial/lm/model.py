"""Chapter 13: the decoder alone, a language model (GPT); chapter 17: the same code path with
today's pieces (Llama, Qwen3).

Chapter 8's decoder without cross-attention reads tokens ``0..t`` and predicts token ``t + 1``:
that is GPT. The model stacks :class:`~transformer_tutorial.lm.layer.DecoderOnlyLayer` and is
one code path whose pieces are chosen by small factories from the config
(:mod:`~transformer_tutorial.lm.pieces`) — the norm (:func:`make_norm`), the
feed-forward layer (:func:`make_feed_forward`), the position scheme (:func:`make_positions`)
and the attention head layout (:func:`make_attention`) — so that a later choice (RMSNorm,
SwiGLU, rotary positions, grouped heads) is a new branch in one factory, not a new model. The
defaults are GPT-2 small's; ``lm.config.LLAMA`` and ``lm.config.QWEN3`` hold today's choices.

Shapes: token ids ``(B, T)`` → logits ``(B, T, V)``. Padding goes at the end of a row: under the
causal mask no real position sees it, and :func:`next_token_loss` ignores it. With rotary
positions a row may also be padded on the left, given a ``padding_mask``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.layer import Cache, DecoderOnlyLayer
from transformer_tutorial.lm.pieces import make_norm, make_positions
from transformer_tutorial.masks import check_padding_mask

# The projections that write into the residual stream, initialised smaller.
RESIDUAL_PROJECTIONS = (
    "self_attn.out_proj.weight",
    "ff.linear2.weight",
    "ff.down_proj.weight",
    "ff.experts.down_proj",  # chapter 20's experts, stacked
)


@dataclass(frozen=True)
class LMCache:
    """What decoding carries from one step to the next: each layer's keys and values
    ``(B, Hkv, S, Dh)`` (chapter 21's latent attention: its latents ``(B, S, Dc + Dr)``) and how
    many positions have been decoded (with a sliding window a layer holds only the last
    ``window - 1``)."""

    layers: tuple[Cache, ...]
    length: int


class LanguageModel(nn.Module):
    """A decoder-only Transformer: token embeddings + positions → layers → norm → logits.

    ``model(ids)`` gives the logits of every position at once (teacher forcing);
    ``model.step(ids, cache)`` continues from a :class:`LMCache` and equals it.

    Shapes:
        ids ``(B, T)`` integer → logits ``(B, T, V)``; logit ``[b, t]`` scores token ``t + 1``.
        With rotary positions, ``padding_mask`` ``(B, cached + T)`` (True at padding) lets rows
        be padded on the left: positions are counted from each row's first real token.
    """

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.embed_scale = math.sqrt(c.d_model) if c.scale_embeddings else 1.0
        self.positions = make_positions(c)
        self.layers = nn.ModuleList(DecoderOnlyLayer(c, i) for i in range(c.n_layers))
        # In pre-norm the residual stream is never normalised inside the stack: one norm at the
        # end (GPT-2's ln_f). Post-norm layers already end with one.
        self.norm = make_norm(c) if c.norm_first else None
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.reset_parameters()
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def reset_parameters(self) -> None:
        """GPT-2's initialisation: every matrix N(0, 0.02²), biases 0, norms' gains 1, and the
        two projections that write into the residual stream (attention's ``out_proj``, the
        feed-forward's ``linear2`` or ``down_proj``) N(0, (0.02 / √(2 · layers))²), so that
        the variance all the residual branches add together does not grow with depth (the
        stream still grows through the stack, as chapter 14 measures). With
        ``scale_embeddings`` the table is N(0, 1/D), as in chapter 9."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith(RESIDUAL_PROJECTIONS):
                nn.init.normal_(p, std=residual_std)
            elif p.dim() > 1:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        if self.config.scale_embeddings:
            nn.init.normal_(self.embed.weight, std=self.config.d_model**-0.5)

    def forward(self, ids: Tensor, *, padding_mask: Tensor | None = None) -> Tensor:
        """Token ids ``(B, T)`` → logits ``(B, T, V)``."""
        return self.step(ids, padding_mask=padding_mask)[0]

    def step(
        self, ids: Tensor, cache: LMCache | None = None, *, padding_mask: Tensor | None = None
    ) -> tuple[Tensor, LMCache]:
        """New ids ``(B, T_new)`` after the ``cache.length`` positions in ``cache`` (none when
        None) → their logits ``(B, T_new, V)`` and a cache that also holds them. Equal to
        :meth:`forward` on the whole sequence. ``padding_mask``: see the class."""
        start = 0 if cache is None else cache.length
        self._check_ids(ids, start)
        pads = self._left_padding(padding_mask, ids, start)
        past = (None,) * len(self.layers) if cache is None else cache.layers
        x = self.positions(self.embed(ids) * self.embed_scale, start)  # (B, T_new, D)
        kvs = []
        for layer, layer_past in zip(self.layers, past, strict=True):
            x, kv = layer(x, layer_past, **pads)
            kvs.append(kv)
        if self.norm is not None:
            x = self.norm(x)
        return self.lm_head(x), LMCache(tuple(kvs), start + ids.size(1))

    def step_with_router_logits(
        self, ids: Tensor, cache: LMCache | None = None, *, padding_mask: Tensor | None = None
    ) -> tuple[Tensor, LMCache, tuple[Tensor, ...]]:
        """:meth:`step`, and the router's logits ``(B · T_new, E)`` of each mixture-of-experts
        layer in order (chapter 20), which
        :func:`~transformer_tutorial.lm.moe.load_balancing_loss` reads. Dense layers give none."""
        start = 0 if cache is None else cache.length
        self._check_ids(ids, start)
        pads = self._left_padding(padding_mask, ids, start)
        past = (None,) * len(self.layers) if cache is None else cache.layers
        x = self.positions(self.embed(ids) * self.embed_scale, start)  # (B, T_new, D)
        kvs, routers = [], []
        for layer, layer_past in zip(self.layers, past, strict=True):
            x, kv, router_logits = layer.forward_with_router_logits(x, layer_past, **pads)
            kvs.append(kv)
            if router_logits is not None:
                routers.append(router_logits)
        if self.norm is not None:
            x = self.norm(x)
        return self.lm_head(x), LMCache(tuple(kvs), start + ids.size(1)), tuple(routers)

    def _left_padding(self, padding_mask: Tensor | None, ids: Tensor, start: int) -> dict:
        """The padding mask and the position ids that skip the padding, ``(B, T_new)``: a row's
        first real token is position 0, as in ``transformers``' ``generate``."""
        if padding_mask is None:
            return {}
        if self.config.positions != "rope":
            raise ValueError(
                "padding_mask needs positions='rope': a position table added to the embeddings "
                "cannot skip the padding; pad on the right instead"
            )
        B, T_new = ids.shape
        check_padding_mask("padding_mask", padding_mask, "(B, cached + new)", (B, start + T_new))
        position_ids = ((~padding_mask).cumsum(-1) - 1).clamp(min=0)[:, start:]  # (B, T_new)
        return dict(position_ids=position_ids, padding_mask=padding_mask)

    def _check_ids(self, ids: Tensor, start: int) -> None:
        if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(
                f"ids must be integer token ids of shape (B, T), got {ids.dtype} "
                f"{tuple(ids.shape)}"
            )
        if start + ids.size(1) > self.config.max_len:
            raise ValueError(
                f"{start} cached + {ids.size(1)} new positions exceed max_len="
                f"{self.config.max_len}"
            )
        if torch.compiler.is_compiling() or not ids.numel():
            return
        low, high = torch.stack(torch.aminmax(ids)).tolist()  # one read back from the device
        if not 0 <= low <= high < self.config.vocab_size:
            raise ValueError(
                f"ids hold token ids from {low} to {high}; valid ids are 0 to "
                f"{self.config.vocab_size - 1}"
            )

    def num_parameters(self) -> int:
        """Distinct weights (a tied matrix counted once)."""
        return sum(p.numel() for p in self.parameters())


def next_token_loss(logits: Tensor, ids: Tensor, *, ignore_index: int | None = None) -> Tensor:
    """Mean cross-entropy of predicting ``ids[:, t + 1]`` from ``logits[:, t]``.

    Args:
        logits: ``(B, T, V)``, the model's output for ``ids``.
        ids: ``(B, T)``, the tokens the model read.
        ignore_index: a target id not scored (padding), or None.

    The last position has no next token and the first token is never a target: ``B · (T - 1)``
    predictions, fewer those whose target is ``ignore_index``.
    """
    if logits.dim() != 3 or logits.shape[:2] != ids.shape:
        raise ValueError(
            f"logits must be (B, T, V) for ids (B, T) = {tuple(ids.shape)}, "
            f"got {tuple(logits.shape)}"
        )
    if ids.size(1) < 2:
        raise ValueError(
            f"ids need at least 2 positions to predict a next token, got {ids.size(1)}"
        )
    predictions = logits[:, :-1].flatten(0, 1)  # (B·(T-1), V)
    targets = ids[:, 1:].flatten()  # (B·(T-1),)
    return F.cross_entropy(
        predictions.float(), targets, ignore_index=-100 if ignore_index is None else ignore_index
    )
