"""Chapter 13: the decoder alone, a language model (GPT); chapter 17: the same code path with
today's pieces (Llama, Qwen3).

Chapter 8's decoder without cross-attention reads tokens ``0..t`` and predicts token ``t + 1``:
that is GPT. The model stacks :class:`~transformer_tutorial.lm_layer.DecoderOnlyLayer` and is
one code path whose pieces are chosen by small factories from the config
(:mod:`~transformer_tutorial.lm_pieces`) — the norm (:func:`make_norm`), the
feed-forward layer (:func:`make_feed_forward`), the position scheme (:func:`make_positions`)
and the attention head layout (:func:`make_attention`) — so that a later choice (RMSNorm,
SwiGLU, rotary positions, grouped heads) is a new branch in one factory, not a new model. The
defaults are GPT-2 small's; ``lm_pieces.LLAMA`` and ``lm_pieces.QWEN3`` hold today's choices.

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

from transformer_tutorial.checks import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_optional_int,
)
from transformer_tutorial.feed_forward import FEED_FORWARDS
from transformer_tutorial.lm_layer import Cache, DecoderOnlyLayer
from transformer_tutorial.lm_pieces import ATTENTIONS, POSITIONS, make_norm, make_positions
from transformer_tutorial.norms import NORMS

# The fields only chapter 16's attention has.
GQA_FIELDS = {"n_kv_heads": None, "d_head": None, "qk_norm": False, "window": None}


@dataclass(frozen=True)
class LMConfig:
    """Every hyperparameter of the language model. Defaults are GPT-2 small (124 M weights).

    ``norm``, ``activation`` (``"swiglu"``: the gated layer), ``positions`` and ``attention``
    name the pieces the factories build. ``bias`` gives the attention and feed-forward
    projections biases (the norms keep theirs). ``tie_embeddings`` makes the output layer reuse
    the token embedding matrix; ``scale_embeddings`` multiplies embeddings by √D as the 2017
    paper does (GPT-2 does not). ``layer_norm_eps`` is every norm's epsilon (LayerNorm's or
    RMSNorm's). ``rope_base`` is the base of rotary positions' angles (``rope_theta`` in
    ``transformers``).

    With ``attention="gqa"`` only: ``n_kv_heads`` key/value heads (None: ``n_heads``), a head
    width ``d_head`` of its own (None: ``d_model // n_heads``), ``qk_norm`` (Qwen3) and a
    sliding ``window`` (None: every earlier position). ``positions="rope"`` needs it too.
    """

    vocab_size: int
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12
    d_ff: int = 3072
    max_len: int = 1024
    dropout: float = 0.1
    norm_first: bool = True
    norm: str = "layer"
    layer_norm_eps: float = 1e-5
    activation: str = "gelu_tanh"
    positions: str = "learned"
    attention: str = "mha"
    bias: bool = True
    tie_embeddings: bool = True
    scale_embeddings: bool = False
    rope_base: float = 10000.0
    n_kv_heads: int | None = None
    d_head: int | None = None
    qk_norm: bool = False
    window: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_len"):
            check_int(name, getattr(self, name), at_least=1)
        for name in ("n_kv_heads", "d_head", "window"):
            check_optional_int(name, getattr(self, name), at_least=1)
        check_number("dropout", self.dropout, low=0.0, high=1.0, high_open=True)
        check_number("layer_norm_eps", self.layer_norm_eps, low=0.0, low_open=True)
        check_number("rope_base", self.rope_base, low=1.0, low_open=True)
        check_choice("norm", self.norm, NORMS)
        check_choice("activation", self.activation, FEED_FORWARDS)
        check_choice("positions", self.positions, POSITIONS)
        check_choice("attention", self.attention, ATTENTIONS)
        for name in ("norm_first", "bias", "tie_embeddings", "scale_embeddings", "qk_norm"):
            check_bool(name, getattr(self, name))
        self._check_heads()

    def _check_heads(self) -> None:
        if self.attention == "mha":
            chosen = [
                f"{k}={getattr(self, k)!r}" for k, v in GQA_FIELDS.items() if getattr(self, k) != v
            ]
            if self.positions == "rope":
                chosen.append("positions='rope'")
            if chosen:
                raise ValueError(
                    f"{', '.join(chosen)}: chapter 16's attention only; set attention='gqa'"
                )
        if self.d_head is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}: each "
                "key/value head serves n_heads // n_kv_heads query heads"
            )
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"d_model={self.d_model} must be even for sinusoidal positions")
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"the head width {self.head_dim} must be even for rotary positions")

    @property
    def head_dim(self) -> int:
        """Dh: ``d_head``, or ``d_model // n_heads``."""
        return self.d_model // self.n_heads if self.d_head is None else self.d_head


# The projections that write into the residual stream, initialised smaller.
RESIDUAL_PROJECTIONS = ("self_attn.out_proj.weight", "ff.linear2.weight", "ff.down_proj.weight")


@dataclass(frozen=True)
class LMCache:
    """What decoding carries from one step to the next: each layer's keys and values
    ``(B, Hkv, S, Dh)`` and how many positions have been decoded (with a sliding window a layer
    holds only the last ``window - 1``)."""

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
        self.layers = nn.ModuleList(DecoderOnlyLayer(c) for _ in range(c.n_layers))
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
        if padding_mask.dtype != torch.bool or padding_mask.shape != (B, start + T_new):
            raise ValueError(
                f"padding_mask must be bool (B, cached + new) = {(B, start + T_new)}, True at "
                f"padding; got {padding_mask.dtype} {tuple(padding_mask.shape)}"
            )
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
