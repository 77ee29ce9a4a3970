"""Chapter 13: the decoder alone, a language model (GPT).

Chapter 8's decoder without cross-attention reads tokens ``0..t`` and predicts token ``t + 1``:
that is GPT. The model is one code path whose pieces are chosen by small factories from the
config — the norm (:func:`make_norm`), the feed-forward layer (:func:`make_feed_forward`), the
position scheme (:func:`make_positions`) and the attention head layout
(:func:`make_attention`) — so that a later choice (RMSNorm, SwiGLU, rotary positions, grouped
heads) is a new branch in one factory, not a new model. The defaults are GPT-2 small's.

Shapes: token ids ``(B, T)`` → logits ``(B, T, V)``. Padding goes at the end of a row: under the
causal mask no real position sees it, and :func:`next_token_loss` ignores it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_tutorial.attention import KVCache, MultiHeadAttention
from transformer_tutorial.checks import check_bool, check_choice, check_int, check_number
from transformer_tutorial.embeddings import SinusoidalPositionalEncoding
from transformer_tutorial.layers import ACTIVATIONS, FeedForward, LayerNorm
from transformer_tutorial.masks import causal_mask

# The feed-forward's activations: the paper's two, and GELU's tanh approximation, GPT-2's
# ("gelu_new" in transformers).
LM_ACTIVATIONS = {**ACTIVATIONS, "gelu_tanh": partial(F.gelu, approximate="tanh")}
NORMS = ("layer",)
POSITIONS = ("learned", "sinusoidal")
ATTENTIONS = ("mha",)


@dataclass(frozen=True)
class LMConfig:
    """Every hyperparameter of the language model. Defaults are GPT-2 small (124 M weights).

    ``norm``, ``activation``, ``positions`` and ``attention`` name the pieces the factories
    build. ``bias`` gives the attention and feed-forward projections biases (the norms keep
    theirs). ``tie_embeddings`` makes the output layer reuse the token embedding matrix;
    ``scale_embeddings`` multiplies embeddings by √D as the 2017 paper does (GPT-2 does not).
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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_len"):
            check_int(name, getattr(self, name), at_least=1)
        check_number("dropout", self.dropout, low=0.0, high=1.0, high_open=True)
        check_number("layer_norm_eps", self.layer_norm_eps, low=0.0, low_open=True)
        check_choice("norm", self.norm, NORMS)
        check_choice("activation", self.activation, LM_ACTIVATIONS)
        check_choice("positions", self.positions, POSITIONS)
        check_choice("attention", self.attention, ATTENTIONS)
        for name in ("norm_first", "bias", "tie_embeddings", "scale_embeddings"):
            check_bool(name, getattr(self, name))
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"d_model={self.d_model} must be even for sinusoidal positions")


# --- The factories: one per switchable piece ------------------------------------------------


def make_norm(config: LMConfig) -> nn.Module:
    """The norm of each sub-layer (and the final one in pre-norm): ``"layer"``, LayerNorm."""
    return LayerNorm(config.d_model, config.layer_norm_eps)


def make_feed_forward(config: LMConfig) -> nn.Module:
    """The position-wise feed-forward layer of chapter 5 with ``config.activation``."""
    activation = LM_ACTIVATIONS[config.activation]
    return FeedForward(config.d_model, config.d_ff, config.dropout, activation, bias=config.bias)


def make_attention(config: LMConfig) -> MultiHeadAttention:
    """The self-attention's head layout: ``"mha"``, H query heads with H key/value heads.

    The block calls only ``project_qkv(x)`` → queries ``(B, H, T, Dh)`` and a
    :class:`KVCache`, and ``attend_heads(q, kv, attn_mask=...)``: another layout keeps those.
    """
    return MultiHeadAttention(config.d_model, config.n_heads, config.dropout, bias=config.bias)


def make_positions(config: LMConfig) -> nn.Module:
    """What adds positions to the token embeddings: ``"learned"`` (GPT-2, a trained table) or
    ``"sinusoidal"`` (the paper, chapter 2). Either takes ``(x, start)`` and adds dropout."""
    if config.positions == "sinusoidal":
        return SinusoidalPositionalEncoding(config.d_model, config.max_len, config.dropout)
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
        length = x.size(1)
        if start + length > self.max_len:
            raise ValueError(
                f"sequence reaches position {start + length}, beyond max_len={self.max_len}: "
                "the table has no vector for it; shorten the input or build a larger max_len"
            )
        return self.dropout(x + self.weight[start : start + length])


# --- The layer and the model ----------------------------------------------------------------


class DecoderOnlyLayer(nn.Module):
    """Chapter 8's decoder layer without cross-attention: causal self-attention, then
    feed-forward, each in a residual connection with a norm (GPT-2's "block").

    ``norm_first=True`` (GPT-2) normalises each sub-layer's input, ``False`` (the paper) the
    sum. The causal mask is built here, so no caller can forget it.

    Shapes:
        x ``(B, T_new, D)`` after the ``S_past`` positions of ``past`` (each ``(B, H, S_past,
        Dh)``) → ``(B, T_new, D)`` and the keys/values of all ``S_past + T_new`` positions.
    """

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.norm_first = config.norm_first
        self.self_attn = make_attention(config)
        self.ff = make_feed_forward(config)
        self.norm1 = make_norm(config)
        self.norm2 = make_norm(config)
        self.dropout1 = nn.Dropout(config.dropout)
        self.dropout2 = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, past: KVCache | None = None) -> tuple[Tensor, KVCache]:
        if self.norm_first:
            sa, kv = self._sa_block(self.norm1(x), past)
            x = x + sa
            x = x + self._ff_block(self.norm2(x))
        else:
            sa, kv = self._sa_block(x, past)
            x = self.norm1(x + sa)
            x = self.norm2(x + self._ff_block(x))
        return x, kv

    def _sa_block(self, x: Tensor, past: KVCache | None) -> tuple[Tensor, KVCache]:
        q, kv = self.self_attn.project_qkv(x)  # (B, H, T_new, Dh) each
        if past is not None:
            kv = past.append(kv)  # (B, H, S_past + T_new, Dh)
        t_new, t_all = x.size(1), kv.k.size(2)
        # Chapter 6's mask, aligned bottom-right: new position i sits at t_all - t_new + i.
        future = None if t_new == 1 else causal_mask(t_new, t_all, device=x.device)
        out, _ = self.self_attn.attend_heads(q, kv, attn_mask=future)
        return self.dropout1(out), kv

    def _ff_block(self, x: Tensor) -> Tensor:
        return self.dropout2(self.ff(x))


@dataclass(frozen=True)
class LMCache:
    """What decoding carries from one step to the next: each layer's keys and values
    ``(B, H, length, Dh)`` and how many positions they hold."""

    layers: tuple[KVCache, ...]
    length: int


class LanguageModel(nn.Module):
    """A decoder-only Transformer: token embeddings + positions → layers → norm → logits.

    ``model(ids)`` gives the logits of every position at once (teacher forcing);
    ``model.step(ids, cache)`` continues from a :class:`LMCache` and equals it.

    Shapes:
        ids ``(B, T)`` integer → logits ``(B, T, V)``; logit ``[b, t]`` scores token ``t + 1``.
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
        feed-forward's ``linear2``) N(0, (0.02 / √(2 · layers))²), so that the stream's variance
        does not grow with depth. With ``scale_embeddings`` the table is N(0, 1/D), as in
        chapter 9."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith(("self_attn.out_proj.weight", "ff.linear2.weight")):
                nn.init.normal_(p, std=residual_std)
            elif p.dim() > 1:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        if self.config.scale_embeddings:
            nn.init.normal_(self.embed.weight, std=self.config.d_model**-0.5)

    def forward(self, ids: Tensor) -> Tensor:
        """Token ids ``(B, T)`` → logits ``(B, T, V)``."""
        return self.step(ids)[0]

    def step(self, ids: Tensor, cache: LMCache | None = None) -> tuple[Tensor, LMCache]:
        """New ids ``(B, T_new)`` after the ``cache.length`` positions in ``cache`` (none when
        None) → their logits ``(B, T_new, V)`` and a cache that also holds them. Equal to
        :meth:`forward` on the whole sequence."""
        start = 0 if cache is None else cache.length
        self._check_ids(ids, start)
        past = (None,) * len(self.layers) if cache is None else cache.layers
        x = self.positions(self.embed(ids) * self.embed_scale, start)  # (B, T_new, D)
        kvs = []
        for layer, layer_past in zip(self.layers, past, strict=True):
            x, kv = layer(x, layer_past)
            kvs.append(kv)
        if self.norm is not None:
            x = self.norm(x)
        return self.lm_head(x), LMCache(tuple(kvs), start + ids.size(1))

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
