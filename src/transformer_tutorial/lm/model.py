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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_tutorial.checks import (
    check_bool,
    check_int,
    check_optional_int,
    check_tensor,
    check_type,
)
from transformer_tutorial.lm.cache import LMCache
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.layer import DecoderOnlyLayer
from transformer_tutorial.lm.pieces import make_norm, make_positions, make_rotary
from transformer_tutorial.lm.registry import CACHE_KINDS
from transformer_tutorial.masks import check_padding_mask


class LanguageModel(nn.Module):
    """A decoder-only Transformer: token embeddings + positions → layers → norm → logits.

    ``model(ids)`` gives the logits of every position at once (teacher forcing, nothing kept);
    ``model.step(ids, cache)`` continues from an :class:`LMCache`, changes it in place, and
    equals it. The caller picks the cache's kind when decoding starts (:meth:`new_cache`).

    Shapes:
        ids ``(B, T)`` integer → logits ``(B, T, V)``; logit ``[b, t]`` scores token ``t + 1``.
        With rotary positions, ``padding_mask`` ``(B, cached + T)`` (True at padding) lets rows
        be padded on the left: positions are counted from each row's first real token.
    """

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        check_type("config", config, LMConfig, "an LMConfig")
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.embed_scale = math.sqrt(c.d_model) if c.scale_embeddings else 1.0
        self.positions = make_positions(c)
        # One rotary hook for the whole model (its cos/sin tables built once), handed to every
        # layer's attention; None when the positions are added to the embeddings.
        self.rotary = make_rotary(c, checked=False)  # positions counted on the host (_run)
        self.layers = nn.ModuleList(DecoderOnlyLayer(c, i, self.rotary) for i in range(c.n_layers))
        # In pre-norm the residual stream is never normalised inside the stack: one norm at the
        # end (GPT-2's ln_f). Post-norm layers already end with one.
        self.norm = make_norm(c) if c.norm_first else None
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self._init_weights()  # the weights only: the rotary tables were just built
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def reset_parameters(self) -> None:
        """GPT-2's initialisation: every matrix N(0, 0.02²), biases 0, norms' gains 1, and the
        projections that write into the residual stream N(0, (0.02 / √(2 · layers))²), so that
        the variance all the residual branches add together does not grow with depth (the
        stream still grows through the stack, as chapter 14 measures). Each piece names its own
        (``residual_projections``: attention's ``out_proj``, the feed-forward's ``linear2`` or
        ``down_proj``, the experts' stacked ``down_proj``), so a new piece declares its own.
        With ``scale_embeddings`` the table is N(0, 1/D), as in chapter 9. The buffers, which are
        not weights, are computed again too (after ``to_empty`` they hold garbage): each module
        that keeps some resets its own (``reset_buffers``: the rotary and sinusoidal tables,
        DeepSeek's correction bias)."""
        self._init_weights()
        for module in self.modules():
            reset_buffers = getattr(module, "reset_buffers", None)
            if reset_buffers is not None:
                reset_buffers()

    def _init_weights(self) -> None:
        residual = {
            id(module.get_parameter(name))
            for module in self.modules()
            for name in getattr(module, "residual_projections", ())
        }
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if id(p) in residual:
                nn.init.normal_(p, std=residual_std)
            elif p.dim() > 1:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:  # a norm's gain (every other 1-D weight is one)
                nn.init.ones_(p)
        if self.config.scale_embeddings:
            nn.init.normal_(self.embed.weight, std=self.config.d_model**-0.5)

    def new_cache(
        self,
        batch_size: int,
        kind: str = "growing",
        *,
        max_len: int | None = None,
        **options: int,
    ) -> LMCache:
        """An empty cache for ``batch_size`` rows, one per layer over the layout its attention
        declares (``cache_layout``), of the caller's ``kind``
        (:data:`~transformer_tutorial.lm.registry.CACHE_KINDS`): ``"growing"`` (concatenates a
        step's keys; nothing allocated ahead), ``"preallocated"`` (each layer's buffers for
        ``max_len`` positions, default the model's, allocated now in the model's dtype and
        device) or chapter 23's ``"paged"`` (``n_blocks`` and ``block_size`` in ``options``)."""
        piece = CACHE_KINDS[kind]
        check_int("batch_size", batch_size, at_least=1)
        check_optional_int("max_len", max_len, at_least=1)
        if max_len is not None and max_len > self.config.max_len:
            raise ValueError(
                f"max_len={max_len} exceeds the model's max_len={self.config.max_len}: no step "
                f"can reach those positions"
            )
        weight = self.embed.weight  # the activations' dtype, even where linears are quantized
        return piece.new(
            [layer.self_attn.cache_layout for layer in self.layers],
            batch_size,
            max_len=self.config.max_len if max_len is None else max_len,
            dtype=weight.dtype,
            device=weight.device,
            **options,
        )

    def forward(self, ids: Tensor, *, padding_mask: Tensor | None = None) -> Tensor:
        """Token ids ``(B, T)`` → logits ``(B, T, V)``; no cache is kept."""
        return self._run(ids, None, padding_mask, check_ids=True)[0]

    def step(
        self,
        ids: Tensor,
        cache: LMCache | None = None,
        *,
        padding_mask: Tensor | None = None,
        check_ids: bool = True,
    ) -> tuple[Tensor, LMCache]:
        """New ids ``(B, T_new)`` after the ``cache.length`` positions in ``cache`` (a new
        growing cache when None) → their logits ``(B, T_new, V)`` and the cache, which now also
        holds them (changed in place). Equal to :meth:`forward` on the whole sequence.
        ``padding_mask``: see the class. ``check_ids=False`` skips the ids' range check, one
        read back from the device: for ids the model itself chose (:func:`generate` does)."""
        if cache is None:
            check_tensor("ids", ids, kind="int", dims=2, shape="(B, T)")
            cache = self.new_cache(ids.size(0))
        return self._run(ids, cache, padding_mask, check_ids=check_ids)[0], cache

    def forward_with_router_logits(
        self, ids: Tensor, *, padding_mask: Tensor | None = None
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """:meth:`forward`, and the router's logits ``(B · T, E)`` of each mixture-of-experts
        layer in order (chapter 20), which
        :func:`~transformer_tutorial.lm.moe.load_balancing_loss` reads. Dense layers give
        none."""
        logits, arguments = self._run(ids, None, padding_mask, check_ids=True)
        return logits, tuple(arguments["router_logits"])

    def _run(
        self,
        ids: Tensor,
        cache: LMCache | None,
        padding_mask: Tensor | None,
        *,
        check_ids: bool,
    ) -> tuple[Tensor, dict]:
        """The one path: logits ``(B, T_new, V)``, and what every layer was told besides its
        input and cache (:meth:`_layer_arguments`), which the layers may have filled in."""
        self._check_ids(ids, cache, read_range=check_ids)
        start = 0 if cache is None else cache.length
        caches = (None,) * len(self.layers) if cache is None else cache.layers
        x = self.positions(self.embed(ids) * self.embed_scale, start)  # (B, T_new, D)
        arguments = self._layer_arguments(padding_mask, ids, start)
        for layer, layer_cache in zip(self.layers, caches, strict=True):
            x = layer(x, layer_cache, **arguments)
        if self.norm is not None:
            x = self.norm(x)
        return self.lm_head(x), arguments

    def _layer_arguments(self, padding_mask: Tensor | None, ids: Tensor, start: int) -> dict:
        """What each layer is told besides its input and cache: the padding mask and the position
        ids that skip it (chapter 17's left padding), and the list to which the mixture-of-experts
        layers append their router's logits, in order (chapter 20)."""
        position_ids = self._left_padding(padding_mask, ids, start)
        return dict(position_ids=position_ids, padding_mask=padding_mask, router_logits=[])

    def _left_padding(self, padding_mask: Tensor | None, ids: Tensor, start: int) -> Tensor | None:
        """The position ids that skip the padding, ``(B, T_new)``: a row's first real token is
        position 0, as in ``transformers``' ``generate`` (None without a padding mask)."""
        if padding_mask is None:
            return None
        if self.rotary is None:
            raise ValueError(
                "padding_mask needs positions='rope': a position table added to the embeddings "
                "cannot skip the padding; pad on the right instead"
            )
        B, T_new = ids.shape
        check_padding_mask("padding_mask", padding_mask, "(B, cached + new)", (B, start + T_new))
        return ((~padding_mask).cumsum(-1) - 1).clamp(min=0)[:, start:]  # (B, T_new)

    def _check_cache(self, cache: LMCache, batch_size: int) -> None:
        """Before any layer writes: one cache a layer, holding this batch's rows."""
        if not isinstance(cache, LMCache) or len(cache.layers) != len(self.layers):
            raise ValueError(
                f"cache must be an LMCache with one cache for each of the model's "
                f"{len(self.layers)} layers (model.new_cache), got {cache!r}"
            )
        for i, (layer, held) in enumerate(zip(self.layers, cache.layers, strict=True)):
            wanted, holds = layer.self_attn.cache_layout, getattr(held, "layout", None)
            if holds != wanted:
                raise ValueError(
                    f"layer {i}'s attention keeps {wanted}; its cache ({type(held).__name__}) "
                    f"keeps {holds}: make the cache with this model's new_cache"
                )
        rows = {layer.batch_size for layer in cache.layers} - {None}
        if rows and rows != {batch_size}:
            raise ValueError(
                f"the cache holds {sorted(rows)} rows and ids has {batch_size}: a cache serves "
                f"the batch it started with"
            )

    def _check_ids(self, ids: Tensor, cache: LMCache | None, *, read_range: bool) -> None:
        """Before anything changes: the ids, the cache (if any) and the positions they reach."""
        check_tensor("ids", ids)
        if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(
                f"ids must be integer token ids of shape (B, T), got {ids.dtype} "
                f"{tuple(ids.shape)}"
            )
        check_bool("check_ids", read_range)
        if cache is not None:
            self._check_cache(cache, ids.size(0))
        start = 0 if cache is None else cache.length
        # Positions: counted on the host, so the rotary tables need no check of their own.
        if start + ids.size(1) > self.config.max_len:
            raise ValueError(
                f"{start} cached + {ids.size(1)} new positions exceed max_len="
                f"{self.config.max_len}"
            )
        if not read_range or torch.compiler.is_compiling() or not ids.numel():
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


def _check_loss_inputs(logits: Tensor, ids: Tensor, ignore_index: int | None) -> None:
    check_tensor("logits", logits, kind="float")
    check_tensor("ids", ids, kind="int")
    if logits.dim() != 3 or logits.shape[:2] != ids.shape:
        raise ValueError(
            f"logits must be (B, T, V) for ids (B, T) = {tuple(ids.shape)}, "
            f"got {tuple(logits.shape)}"
        )
    if ids.size(1) < 2:
        raise ValueError(
            f"ids need at least 2 positions to predict a next token, got {ids.size(1)}"
        )
    if ignore_index is not None:
        check_int("ignore_index", ignore_index)


def next_token_loss(logits: Tensor, ids: Tensor, *, ignore_index: int | None = None) -> Tensor:
    """Mean cross-entropy of predicting ``ids[:, t + 1]`` from ``logits[:, t]``.

    Args:
        logits: ``(B, T, V)``, the model's output for ``ids``.
        ids: ``(B, T)``, the tokens the model read.
        ignore_index: a target id not scored (padding), or None.

    The last position has no next token and the first token is never a target: ``B · (T - 1)``
    predictions, fewer those whose target is ``ignore_index``.
    """
    _check_loss_inputs(logits, ids, ignore_index)
    predictions = logits[:, :-1].flatten(0, 1)  # (B·(T-1), V)
    targets = ids[:, 1:].flatten()  # (B·(T-1),)
    return F.cross_entropy(
        predictions.float(), targets, ignore_index=-100 if ignore_index is None else ignore_index
    )
