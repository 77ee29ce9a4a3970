"""Chapter 21: multi-head latent attention (MLA, DeepSeek-V2 and V3) and its cache of latents.

Each position's keys and values are read, through an up-projection, from one compressed latent
of ``Dc`` (``kv_lora_rank``) numbers, RMS-normalised with an epsilon of its own. Each head's
query and key split into a part without positions (``Dn``, ``qk_nope_head_dim``) and a rotary
part (``Dr``, ``qk_rope_head_dim``), whose key is one vector shared by every head ("decoupled
RoPE"). A cache then holds ``Dc + Dr`` numbers per position and layer, whatever ``H``.

Decoding can skip the up-projection of the cached latents: the key's is folded into the query,
the value's applied after attention (:meth:`MultiHeadLatentAttention.forward` with
``absorbed=True``): attention becomes multi-query attention over the latents. Unless told, each
call takes the cheaper form (:meth:`MultiHeadLatentAttention.absorbs`): a decoding step after a
cache the absorbed one, the prompt and training the unabsorbed one.

Shapes: input ``(B, L, D)``; queries ``(B, H, L, Dn + Dr)``; latents ``(B, S, Dc)``; the
shared rotary key ``(B, 1, S, Dr)``; values ``(B, H, S, Dv)``. Masks are bool, True = blocked.
"""

from __future__ import annotations

import math
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
)
from transformer_tutorial.lm.cache import CacheLayout, LayerCache
from transformer_tutorial.lm.grouped_attention import PositionHook, check_attention_input
from transformer_tutorial.lm.registry import ATTENTIONS, POSITIONS, AttentionPiece
from transformer_tutorial.lm.rope_scaling import RopeScaling, check_scaling
from transformer_tutorial.lm.rotary import RotaryLayout
from transformer_tutorial.masks import causal_mask, check_padding_mask, sdpa_mask
from transformer_tutorial.norms import RMSNorm


def check_latent_dims(
    *,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    q_lora_rank: int | None = None,
) -> None:
    """Refuse ranks and head widths MLA cannot use, naming the argument."""
    for name, value in (
        ("kv_lora_rank", kv_lora_rank),
        ("qk_nope_head_dim", qk_nope_head_dim),
        ("qk_rope_head_dim", qk_rope_head_dim),
        ("v_head_dim", v_head_dim),
    ):
        check_int(name, value, at_least=1)
    check_optional_int("q_lora_rank", q_lora_rank, at_least=1)
    if qk_rope_head_dim % 2:
        raise ValueError(
            f"qk_rope_head_dim={qk_rope_head_dim} must be even: RoPE rotates pairs of coordinates"
        )


def mla_softmax_scale(qk_head_dim: int, scaling: RopeScaling | None = None) -> float:
    """The factor of the scores: ``1/√(Dn + Dr)``, times ``mscale²`` under YaRN with
    ``mscale_all_dim`` (DeepSeek's ``0.1 · mscale_all_dim · ln(factor) + 1``, squared), as
    ``transformers``' ``yarn_apply_mscale``."""
    check_int("qk_head_dim", qk_head_dim, at_least=1)
    check_scaling(scaling)
    scale = qk_head_dim**-0.5
    if scaling is not None and scaling.mscale_all_dim and scaling.factor > 1:
        mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
        scale *= mscale * mscale
    return scale


class MultiHeadLatentAttention(nn.Module):
    """Causal self-attention whose keys and values come from a compressed latent (DeepSeek-V2,
    2024), called as chapter 16's :class:`~transformer_tutorial.lm.grouped_attention.
    GroupedQueryAttention`.

    Args:
        d_model: D.
        n_heads: H.
        kv_lora_rank: Dc, the width of each position's latent.
        qk_nope_head_dim: Dn, each head's query/key part without positions.
        qk_rope_head_dim: Dr, each head's rotary part (even); its key is shared by all heads.
        v_head_dim: Dv, each head's value width.
        q_lora_rank: queries through a latent of this width (with its RMSNorm); None: directly.
        latent_norm_eps: the epsilon of the latents' RMSNorms (DeepSeek's 1e-6, whatever the
            model's ``rms_norm_eps``).
        rotary: a :data:`~transformer_tutorial.lm.grouped_attention.PositionHook` for the
            rotary parts ``(B, H, L, Dr)`` and ``(B, 1, L, Dr)``; None: no positions.
        softmax_scale: the factor of the scores (default ``1/√(Dn + Dr)``; see
            :func:`mla_softmax_scale`).
        dropout: dropout on the attention weights while training.
        absorbed: the form of every call, absorbed (True) or unabsorbed (False), as for a
            measurement; None (the default): each call's cheaper form (:meth:`absorbs`).

    Which form runs. Both give the same output (chapter 21 proves it in float64) and read the
    same cache; they differ in cost. Per head, the unabsorbed form up-projects every held latent
    to a key and a value, ``S · Dc · (Dn + Dv)`` multiply-adds however few the queries, then
    scores and sums ``Dn + Dr + Dv`` numbers per query and key; the absorbed form up-projects
    only the ``L`` queries and outputs, ``L · Dc · (Dn + Dv)``, but scores and sums over the
    latents, ``2·Dc + Dr`` per query and key (1,088 against 320 at DeepSeek-V3's widths). So
    the absorbed form is cheaper when ``L`` is small beside ``S``: exactly when
    ``L · S · (2·Dc − Dn − Dv) < (S − L) · Dc · (Dn + Dv)``, at DeepSeek-V3's widths any call of
    at most 170 new positions after a much longer cache. A call takes that form unless told
    (``absorbed=`` here or in :meth:`forward`), and only after cached positions:

    - a decoding step (``generate()``'s every token, speculative decoding's check of a draft)
      runs absorbed, and reads only the latents (``Dc + Dr`` numbers a position, not
      ``H · (Dn + Dv)`` up-projected ones);
    - the prompt's first call (``L = S``), a call without a cache (training, :meth:`forward` of
      a whole sequence) and a call of many new positions run unabsorbed: there the absorbed form
      would spend ≈3× the attention's multiply-adds (up to 3.4× at DeepSeek-V3's widths), and
      save little, up-projecting ``L`` queries and outputs instead of ``S ≈ L`` latents.

    vLLM's MLA backends split the work the same way (prefill "compute friendly", decode "data
    movement friendly"); DeepSeek-V3's own reference code takes one form for every call.

    Shapes:
        x ``(B, L, D)`` → ``(B, L, D)``; ``position_ids`` ``(B, L)`` (default: those after the
        cache's); ``key_padding_mask`` ``(B, seen + L)``, True at padding.
    """

    # What writes into the residual stream: a language model initialises it smaller.
    residual_projections = ("out_proj.weight",)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        latent_norm_eps: float = 1e-6,
        rotary: PositionHook | None = None,
        softmax_scale: float | None = None,
        dropout: float = 0.0,
        absorbed: bool | None = None,
    ) -> None:
        super().__init__()
        check_int("d_model", d_model, at_least=1)
        check_int("n_heads", n_heads, at_least=1)
        check_latent_dims(
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            q_lora_rank=q_lora_rank,
        )
        check_number("latent_norm_eps", latent_norm_eps, low=0.0, low_open=True)
        check_number("dropout", dropout, low=0.0, high=1.0, high_open=True)
        if absorbed is not None:
            check_bool("absorbed", absorbed)
        if softmax_scale is not None:
            check_number("softmax_scale", softmax_scale, low=0.0, low_open=True)
        if rotary is not None and not callable(rotary):
            raise TypeError(
                f"rotary must be callable (q, k, position_ids) or None, got {rotary!r}"
            )
        self.d_model, self.n_heads = d_model, n_heads
        self.kv_lora_rank, self.q_lora_rank = kv_lora_rank, q_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.v_head_dim = v_head_dim
        d_qk = qk_nope_head_dim + qk_rope_head_dim
        self.softmax_scale = d_qk**-0.5 if softmax_scale is None else softmax_scale
        self.rotary, self.dropout, self.absorbed = rotary, dropout, absorbed
        if q_lora_rank is None:
            self.q_proj = nn.Linear(d_model, n_heads * d_qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d_model, q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(q_lora_rank, latent_norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, n_heads * d_qk, bias=False)
        # the latent and the shared rotary key, from one projection
        self.kv_a_proj = nn.Linear(d_model, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(kv_lora_rank, latent_norm_eps)
        # the latent's up-projection: W_UK (Dn rows) then W_UV (Dv rows) of each head
        d_kv = qk_nope_head_dim + v_head_dim
        self.kv_b_proj = nn.Linear(kv_lora_rank, n_heads * d_kv, bias=False)
        self.out_proj = nn.Linear(n_heads * v_head_dim, d_model, bias=False)

    def forward(
        self,
        x: Tensor,
        cache: LayerCache | None = None,
        *,
        position_ids: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        absorbed: bool | None = None,
    ) -> Tensor:
        """``x`` ``(B, L, D)`` → ``(B, L, D)``; with ``cache``, after the positions it holds.
        ``absorbed``: True, the decoding form, attending over the latents themselves; False,
        every held latent up-projected; None (the default): :meth:`absorbs` chooses."""
        self._check_input(x, cache, position_ids, absorbed)
        B, L, _ = x.shape
        H, Dc = self.n_heads, self.kv_lora_rank
        Dn, Dr = self.qk_nope_head_dim, self.qk_rope_head_dim
        seen = 0 if cache is None else cache.seen
        check_padding_mask("key_padding_mask", key_padding_mask, "(B, seen + L)", (B, seen + L))
        # 1) queries, directly or through their own latent: (B, H, L, Dn + Dr)
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = q.view(B, L, H, Dn + Dr).transpose(1, 2)
        q_nope, q_rope = q.split([Dn, Dr], dim=-1)  # (B, H, L, Dn), (B, H, L, Dr)
        # 2) the latent, normalised, and the shared rotary key: (B, L, Dc), (B, 1, L, Dr)
        latent, k_rope = self.kv_a_proj(x).split([Dc, Dr], dim=-1)
        latent, k_rope = self.kv_a_norm(latent), k_rope[:, None]
        if self.rotary is not None:  # 3) rotate the rotary parts only
            if position_ids is None:
                position_ids = torch.arange(seen, seen + L, device=x.device).expand(B, L)
            q_rope, k_rope = self.rotary(q_rope, k_rope, position_ids)
        new = torch.cat([latent, k_rope[:, 0]], dim=-1)  # (B, L, Dc + Dr): what is cached
        held = new if cache is None else cache.update(new)[0]  # 4) (B, S, Dc + Dr)
        allowed, is_causal = sdpa_mask(B, L, held.size(1), key_padding_mask, device=x.device)
        if absorbed is None:
            absorbed = self.absorbs(L, seen)
        attend = self._attend_absorbed if absorbed else self._attend
        out = attend(q_nope, q_rope, held, allowed, is_causal)  # (B, H, L, Dv)
        out = out.transpose(1, 2).reshape(B, L, H * self.v_head_dim)  # 6) concat heads
        return self.out_proj(out)

    def _check_input(
        self, x: Tensor, cache: object, position_ids: Tensor | None, absorbed: object
    ) -> None:
        check_attention_input(self, x, cache, position_ids)
        if absorbed is not None:
            check_bool("absorbed", absorbed)

    def absorbs(self, new: int, seen: int) -> bool:
        """Whether a call of ``new`` positions after ``seen`` cached ones takes the absorbed
        form when its caller does not say: the module's ``absorbed`` if set, else True only
        after cached positions and when the absorbed form costs fewer multiply-adds (the
        class's "Which form runs", with ``L = new`` and ``S = seen + new``)."""
        check_int("new", new, at_least=1)
        check_int("seen", seen, at_least=0)
        if self.absorbed is not None:
            return self.absorbed
        Dc, d_kv = self.kv_lora_rank, self.qk_nope_head_dim + self.v_head_dim
        return seen > 0 and new * (seen + new) * (2 * Dc - d_kv) < seen * Dc * d_kv

    @cached_property  # built once: the model and the attention compare it at every step
    def cache_layout(self) -> CacheLayout:
        """What its cache keeps: per position the normalised latent then the rotated shared
        key, ``(B, S, Dc + Dr)`` in one tensor."""
        return CacheLayout(("latent",), ((self.kv_lora_rank + self.qk_rope_head_dim,),), 1)

    def _attend(
        self, q_nope: Tensor, q_rope: Tensor, held: Tensor, allowed: Tensor | None, causal: bool
    ) -> Tensor:
        """5) Up-project every held latent to H keys and values, then attend."""
        B, S, _ = held.shape
        H, Dn, Dr = self.n_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        latent, k_rope = held.split([self.kv_lora_rank, Dr], dim=-1)
        kv = self.kv_b_proj(latent).view(B, S, H, Dn + self.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([Dn, self.v_head_dim], dim=-1)  # (B, H, S, Dn), (B, H, S, Dv)
        k = torch.cat([k_nope, k_rope[:, None].expand(B, H, S, Dr)], dim=-1)  # (B, H, S, Dn+Dr)
        q = torch.cat([q_nope, q_rope], dim=-1)  # (B, H, L, Dn + Dr)
        return self._sdpa(q, k, v, allowed, causal)

    def _attend_absorbed(
        self, q_nope: Tensor, q_rope: Tensor, held: Tensor, allowed: Tensor | None, causal: bool
    ) -> Tensor:
        """5) W_UK folded into the query, W_UV applied after: one key/value head, the latent,
        which every head's queries read as one longer sequence of queries (``H · L`` rows)."""
        B, H, L, _ = q_nope.shape
        S, Dn, Dv = held.size(1), self.qk_nope_head_dim, self.v_head_dim
        w = self.kv_b_proj.weight.view(H, Dn + Dv, self.kv_lora_rank)
        w_uk, w_uv = w.split([Dn, Dv], dim=1)  # (H, Dn, Dc), (H, Dv, Dc)
        q_latent = torch.einsum("bhld,hdc->bhlc", q_nope, w_uk)  # (B, H, L, Dc)
        q = torch.cat([q_latent, q_rope], dim=-1).reshape(B, 1, H * L, -1)  # (B, 1, H·L, Dc+Dr)
        k = held[:, None]  # (B, 1, S, Dc + Dr): one key head, shared
        v = held[:, None, :, : self.kv_lora_rank]  # (B, 1, S, Dc)
        if causal:  # the rows are no longer one square block: the mask written out
            allowed = ~causal_mask(L, S, device=held.device)[None, None]  # (1, 1, L, S)
        if allowed is not None:  # (B or 1, 1, L, S) → (B or 1, 1, H·L, S), head-major rows
            allowed = allowed.expand(-1, H, L, S).reshape(allowed.size(0), 1, H * L, S)
        out_latent = self._sdpa(q, k, v, allowed, False).view(B, H, L, self.kv_lora_rank)
        return torch.einsum("bhlc,hvc->bhlv", out_latent, w_uv)  # (B, H, L, Dv)

    def _sdpa(
        self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, causal: bool
    ) -> Tensor:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=allowed,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal,
            scale=self.softmax_scale,
        )

    def extra_repr(self) -> str:
        return (
            f"n_heads={self.n_heads}, q_lora_rank={self.q_lora_rank}, kv_lora_rank="
            f"{self.kv_lora_rank}, qk_nope_head_dim={self.qk_nope_head_dim}, qk_rope_head_dim="
            f"{self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}"
        )


def latent_cache_bytes(
    *,
    n_layers: int,
    batch_size: int,
    length: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    dtype: torch.dtype,
) -> int:
    """Bytes of a full MLA cache: layers · batch · length · (Dc + Dr) · bytes per number (one
    latent and one rotary key per position, whatever the heads)."""
    for name, value in (("n_layers", n_layers), ("batch_size", batch_size), ("length", length)):
        check_int(name, value, at_least=0)
    check_int("kv_lora_rank", kv_lora_rank, at_least=1)
    check_int("qk_rope_head_dim", qk_rope_head_dim, at_least=1)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.bfloat16, got {dtype!r}")
    return n_layers * batch_size * length * (kv_lora_rank + qk_rope_head_dim) * dtype.itemsize


class LatentAttentionPiece(AttentionPiece):
    """``attention="mla"``: chapter 21's :class:`MultiHeadLatentAttention`, its scores scaled as
    DeepSeek's; rotary positions on its ``qk_rope_head_dim`` part only."""

    owns = MappingProxyType(
        {
            "q_lora_rank": None,
            "kv_lora_rank": None,
            "qk_nope_head_dim": None,
            "qk_rope_head_dim": None,
            "v_head_dim": None,
            "rope_interleave": False,
        }
    )
    needs = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")

    def check(self, config: Any) -> None:
        missing = [k for k in self.needs if getattr(config, k) is None]
        if missing:
            raise ValueError(f"attention='mla' needs {', '.join(missing)}")
        widths = {k: getattr(config, k) for k in self.needs}
        check_latent_dims(**widths, q_lora_rank=config.q_lora_rank)
        in_attention = POSITIONS[config.positions].in_attention
        if not in_attention or config.partial_rotary_factor != 1.0 or config.bias:
            raise ValueError(
                "attention='mla' rotates its own qk_rope_head_dim part of each head, without "
                "biases: set positions='rope', partial_rotary_factor=1.0 and bias=False (got "
                f"{config.positions!r}, {config.partial_rotary_factor}, {config.bias})"
            )

    def rotary_layout(self, config: Any) -> RotaryLayout:
        """The ``qk_rope_head_dim`` part of each head, its pairs interleaved with
        ``rope_interleave`` (DeepSeek's checkpoints)."""
        layout = "interleaved" if config.rope_interleave else "half_split"
        return RotaryLayout(config.qk_rope_head_dim, layout=layout)

    def saved_as(self, config: Any) -> str:
        return "deepseek_v3"

    def build(self, config: Any, rotary: PositionHook | None) -> MultiHeadLatentAttention:
        return MultiHeadLatentAttention(
            config.d_model,
            config.n_heads,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            q_lora_rank=config.q_lora_rank,
            rotary=rotary,
            softmax_scale=mla_softmax_scale(
                config.qk_nope_head_dim + config.qk_rope_head_dim, config.rope_scaling
            ),
            dropout=config.dropout,
        )


ATTENTIONS.register("mla", LatentAttentionPiece())
