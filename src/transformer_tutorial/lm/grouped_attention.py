"""Chapter 16: attention that scales — grouped-query attention, QK-norm, sliding windows and the
KV cache of a decoder-only model.

Shapes: input ``(B, L, D)``; queries ``(B, H, L, Dh)``; keys and values ``(B, Hkv, S, Dh)`` with
``Hkv`` (``n_kv_heads``) dividing ``H``: each key/value head serves ``H // Hkv`` query heads.
``Hkv = H`` is the paper's multi-head attention, ``Hkv = 1`` multi-query attention. Masks are bool
with True = blocked (see :mod:`transformer_tutorial.masks`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_tutorial.checks import (
    check_bool,
    check_int,
    check_number,
    check_optional_int,
    check_tensor,
)
from transformer_tutorial.lm.cache import CacheLayout, LayerCache
from transformer_tutorial.lm.registry import ATTENTION_KERNELS, ATTENTIONS, AttentionPiece, Piece
from transformer_tutorial.lm.rotary import RotaryLayout
from transformer_tutorial.masks import check_padding_mask, sdpa_mask
from transformer_tutorial.norms import RMSNorm

# A position scheme: (queries (B, H, L, Dh), keys (B, Hkv, L, Dh), position ids (B, L)) → the
# queries and keys it has encoded the positions into (rotary embeddings, chapter 15).
PositionHook = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """Repeat each key/value head ``n_rep`` times, next to each other: ``(B, Hkv, S, Dh)`` →
    ``(B, Hkv * n_rep, S, Dh)``, head ``h`` of the result being head ``h // n_rep`` of ``x``.

    Equal to ``torch.repeat_interleave(x, n_rep, dim=1)`` and to ``transformers``' ``repeat_kv``.
    """
    check_tensor("x", x, dims=4, shape="(B, Hkv, S, Dh)")
    check_int("n_rep", n_rep, at_least=1)
    B, Hkv, S, Dh = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(B, Hkv, n_rep, S, Dh).reshape(B, Hkv * n_rep, S, Dh)


def kv_cache_bytes(
    *,
    n_layers: int,
    batch_size: int,
    length: int,
    n_kv_heads: int,
    d_head: int,
    dtype: torch.dtype,
) -> int:
    """Bytes of a full KV cache: 2 (keys and values) · layers · batch · length · kv heads ·
    head width · bytes per number."""
    for name, value in (("n_layers", n_layers), ("batch_size", batch_size), ("length", length)):
        check_int(name, value, at_least=0)
    check_int("n_kv_heads", n_kv_heads, at_least=1)
    check_int("d_head", d_head, at_least=1)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.bfloat16, got {dtype!r}")
    return 2 * n_layers * batch_size * length * n_kv_heads * d_head * dtype.itemsize


def head_width(config: Any) -> int:
    """Dh, the head width of chapter 16's attention for an ``LMConfig``: its ``d_head``, or
    ``d_model // n_heads`` when None (``transformers``' ``head_dim``)."""
    return config.d_model // config.n_heads if config.d_head is None else config.d_head


def check_attention_input(
    attention: nn.Module, x: Tensor, cache: object, position_ids: Tensor | None
) -> None:
    """What a self-attention (chapter 16's, chapter 21's) is called with, before any cache
    changes: ``x`` float ``(B, L, D)``, a cache of the layout it declares (its
    ``cache_layout``), position ids ``(B, L)`` or ``(L,)``."""
    D = attention.d_model
    check_tensor("x", x, kind="float", dims=3, shape=f"(B, L, D={D})")
    if x.size(-1) != D:
        raise ValueError(f"x must be (B, L, D={D}), got {tuple(x.shape)}")
    if cache is not None and getattr(cache, "layout", None) != attention.cache_layout:
        raise TypeError(
            f"cache must keep {attention.cache_layout} (the attention's cache_layout), got "
            f"{type(cache).__name__} keeping {getattr(cache, 'layout', None)}"
        )
    if position_ids is not None:
        check_tensor("position_ids", position_ids, kind="int", dims=(1, 2), shape="(B, L)")
        if position_ids.size(-1) != x.size(1):
            raise ValueError(
                f"position_ids must be (B, L={x.size(1)}), got {tuple(position_ids.shape)}"
            )


class GroupedQueryAttention(nn.Module):
    """Causal self-attention of a decoder-only model with ``n_kv_heads`` key/value heads shared
    by groups of ``n_heads // n_kv_heads`` query heads (Ainslie et al., 2023).

    Args:
        d_model: D.
        n_heads: H, the query heads.
        n_kv_heads: Hkv, dividing H (default H: multi-head attention; 1: multi-query).
        d_head: Dh, the width of a head (default ``D // H``; Qwen3 chooses it apart from D).
        bias: whether the four projections have biases (Llama and Qwen3: no).
        qk_norm: RMS-normalise each query and key head with a learned weight, before the
            position scheme, as Qwen3 does; ``norm_eps`` is its epsilon.
        window: each query sees at most this many keys, itself included (a sliding window);
            None sees every earlier position.
        rotary: a :data:`PositionHook` applied to queries and keys with their position ids
            (rotary embeddings); None leaves them as they are.
        dropout: dropout on the attention weights while training.
        backend: the kernel that computes softmax(q kᵀ) v, a name of
            :data:`~transformer_tutorial.lm.registry.ATTENTION_KERNELS` chosen here once:
            ``"sdpa"`` (:func:`sdpa_attend`: ``F.scaled_dot_product_attention``), or chapter 22's
            ``"tiled"`` (without the score matrix; no window, no dropout).

    Shapes:
        x ``(B, L, D)`` → ``(B, L, D)``; ``position_ids`` ``(B, L)`` (default: the positions after
        those the cache has seen); ``key_padding_mask`` ``(B, seen + L)``, True at padding.

    With a cache (:attr:`cache_layout`: keys and values) the call decodes ``L`` new positions
    after those the cache holds, whose queries are the *last* ``L`` of the keys: the causal mask
    is aligned bottom-right (:func:`~transformer_tutorial.masks.causal_mask` with
    ``k_len > q_len``).
    """

    # What writes into the residual stream: a language model initialises it smaller.
    residual_projections = ("out_proj.weight",)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        d_head: int | None = None,
        bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        window: int | None = None,
        rotary: PositionHook | None = None,
        dropout: float = 0.0,
        backend: str = "sdpa",
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        check_int("d_model", d_model, at_least=1)
        check_int("n_heads", n_heads, at_least=1)
        check_int("n_kv_heads", n_kv_heads, at_least=1)
        check_optional_int("d_head", d_head, at_least=1)
        check_optional_int("window", window, at_least=1)
        check_bool("bias", bias)
        check_bool("qk_norm", qk_norm)
        check_number("norm_eps", norm_eps, low=0.0, low_open=True)
        check_number("dropout", dropout, low=0.0, high=1.0, high_open=True)
        if d_head is None and d_model % n_heads:
            raise ValueError(
                f"d_model={d_model} must be divisible by n_heads={n_heads} (or pass d_head): "
                f"each head gets d_model // n_heads dimensions"
            )
        if n_heads % n_kv_heads:
            raise ValueError(
                f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}: each key/value head "
                f"serves n_heads // n_kv_heads query heads. Choose one of "
                f"{[h for h in range(1, n_heads + 1) if n_heads % h == 0]}"
            )
        if rotary is not None and not callable(rotary):
            raise TypeError(
                f"rotary must be callable (q, k, position_ids) or None, got {rotary!r}"
            )
        kernel = ATTENTION_KERNELS[backend]
        kernel.check_attention(window=window, dropout=dropout)
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.d_head = d_model // n_heads if d_head is None else d_head
        self.window, self.rotary, self.dropout = window, rotary, dropout
        self.backend, self.kernel = backend, kernel.attend  # chosen once, here
        self.q_proj = nn.Linear(d_model, n_heads * self.d_head, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.d_head, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.d_head, bias=bias)
        self.out_proj = nn.Linear(n_heads * self.d_head, d_model, bias=bias)
        self.q_norm = RMSNorm(self.d_head, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.d_head, norm_eps) if qk_norm else None

    @cached_property  # built once: the model and the attention compare it at every step
    def cache_layout(self) -> CacheLayout:
        """What its cache keeps: keys and values ``(B, Hkv, S, Dh)``."""
        shape = (self.n_kv_heads, self.d_head)
        return CacheLayout(("k", "v"), (shape, shape), seq_dim=2)

    def forward(
        self,
        x: Tensor,
        cache: LayerCache | None = None,
        *,
        position_ids: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """``x`` ``(B, L, D)`` → ``(B, L, D)``; with ``cache``, after the positions it holds."""
        check_attention_input(self, x, cache, position_ids)
        B, L, _ = x.shape
        seen = 0 if cache is None else cache.seen
        # before the cache changes: a mask over every position so far
        check_padding_mask("key_padding_mask", key_padding_mask, "(B, seen + L)", (B, seen + L))
        # 1) project: H query heads, Hkv key/value heads, (B, L, heads, Dh)
        q = self.q_proj(x).view(B, L, self.n_heads, self.d_head)
        k = self.k_proj(x).view(B, L, self.n_kv_heads, self.d_head)
        v = self.v_proj(x).view(B, L, self.n_kv_heads, self.d_head).transpose(1, 2)
        if self.q_norm is not None:  # 2) QK-norm: each head's vector, before the positions
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, L, Dh), (B, Hkv, L, Dh)
        if self.rotary is not None:  # 3) positions, e.g. rotary
            if position_ids is None:
                position_ids = torch.arange(seen, seen + L, device=x.device).expand(B, L)
            q, k = self.rotary(q, k, position_ids)
        if cache is not None:  # 4) cache: every held position's keys, (B, Hkv, S, Dh)
            keep = None if self.window is None else self.window - 1
            k, v = cache.update(k, v, keep=keep)
        # 5) attend, each K/V head serving its group: (B, H, L, Dh), by the kernel chosen once
        out = self.kernel(self, q, k, v, key_padding_mask=key_padding_mask)
        out = out.transpose(1, 2).reshape(B, L, self.n_heads * self.d_head)  # 6) concat heads
        return self.out_proj(out)

    def extra_repr(self) -> str:
        return (
            f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, d_head={self.d_head}, "
            f"window={self.window}"
        )


def sdpa_attend(
    attention: GroupedQueryAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None,
) -> Tensor:
    """Chapter 16's kernel: PyTorch's fused ``F.scaled_dot_product_attention`` over the held
    keys, under the causal mask aligned bottom-right, the window and the padding
    (:func:`~transformer_tutorial.masks.sdpa_mask`: no mask tensor where none is needed).

    Shapes: q ``(B, H, L, Dh)``, k and v ``(B, Hkv, S, Dh)`` → ``(B, H, L, Dh)``."""
    B, _, L, _ = q.shape
    allowed, is_causal = sdpa_mask(
        B, L, k.size(2), key_padding_mask, window=attention.window, device=q.device
    )
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=allowed,
        dropout_p=attention.dropout if attention.training else 0.0,
        is_causal=is_causal,
        enable_gqa=attention.n_kv_heads != attention.n_heads,
    )


class KernelPiece(Piece):
    """An attention kernel for :class:`GroupedQueryAttention` (``LMConfig.attention_backend``):
    ``attend(attention, q, k, v, key_padding_mask=...)`` and the settings it cannot serve.
    ``every_attention``: the default, which the other attentions' own calls stand for (their
    ``attention_backend`` stays at it)."""

    def __init__(self, attend: Callable[..., Tensor], *, every_attention: bool = False) -> None:
        self.attend, self.every_attention = attend, every_attention

    def check_attention(self, *, window: int | None, dropout: float) -> None:
        """Raise if this kernel cannot serve an attention with ``window`` and ``dropout``."""

    def check(self, config: Any) -> None:
        if not self.every_attention and not ATTENTIONS[config.attention].takes_kernel:
            raise ValueError(
                f"attention_backend={config.attention_backend!r} chooses the kernel of chapter "
                f"16's attention; attention={config.attention!r} has its own: set "
                "attention='gqa'"
            )
        self.check_attention(window=config.window, dropout=config.dropout)


class GroupedAttentionPiece(AttentionPiece):
    """``attention="gqa"``: chapter 16's :class:`GroupedQueryAttention`."""

    owns = MappingProxyType({"n_kv_heads": None, "d_head": None, "qk_norm": False, "window": None})
    takes_kernel = True

    def check(self, config: Any) -> None:
        for name in ("n_kv_heads", "d_head", "window"):
            check_optional_int(name, getattr(config, name), at_least=1)
        if config.d_head is None and config.d_model % config.n_heads:
            raise ValueError(
                f"d_model={config.d_model} must be divisible by n_heads={config.n_heads}"
            )
        if config.n_kv_heads is not None and config.n_heads % config.n_kv_heads:
            raise ValueError(
                f"n_kv_heads={config.n_kv_heads} must divide n_heads={config.n_heads}: each "
                "key/value head serves n_heads // n_kv_heads query heads"
            )

    def rotary_layout(self, config: Any) -> RotaryLayout:
        """What rotary positions turn in each head: the first ``partial_rotary_factor`` of
        its ``head_dim`` coordinates, the halves paired."""
        return RotaryLayout(head_width(config), config.partial_rotary_factor)

    def saved_as(self, config: Any) -> str:
        """Qwen3 with QK-norm (Qwen3-MoE with experts too), Llama otherwise (chapter 19)."""
        if config.qk_norm:
            return "qwen3_moe" if config.n_experts else "qwen3"
        return "llama"

    def build(self, config: Any, rotary: PositionHook | None) -> GroupedQueryAttention:
        return GroupedQueryAttention(
            config.d_model,
            config.n_heads,
            config.n_kv_heads,
            d_head=config.d_head,
            bias=config.bias,
            qk_norm=config.qk_norm,
            norm_eps=config.layer_norm_eps,
            window=config.window,
            rotary=rotary,
            dropout=config.dropout,
            backend=config.attention_backend,
        )


ATTENTIONS.register("gqa", GroupedAttentionPiece())
ATTENTION_KERNELS.register("sdpa", KernelPiece(sdpa_attend, every_attention=True))
