"""Chapter 15: rotary position embeddings (RoPE, Su et al. 2021).

Instead of adding a position vector to the embeddings (chapter 2), RoPE rotates each query and
key, one 2-D rotation per pair of coordinates, by an angle proportional to the position: pair
``i`` at position ``m`` turns by ``m · θ_i`` with ``θ_i = base^(-2i/Dh)``, chapter 2's
frequencies. A query at ``m`` dotted with a key at ``n`` then depends on ``m − n`` only.

Which two coordinates form a pair is a convention, and three are in use (``LAYOUTS``):

- ``"half_split"``: coordinate ``i`` pairs with ``i + Dh/2``, turned by ``+θ``
  (``transformers``' Llama and Qwen, GPT-NeoX).
- ``"interleaved"``: coordinate ``2i`` pairs with ``2i + 1``, turned by ``+θ`` (the RoFormer
  paper, GPT-J, Meta's original Llama checkpoints).
- ``"half_split_negative"``: pairs as ``"half_split"``, turned by ``−θ`` (nanochat).

They are one function up to a signed permutation of each head's rows of the query and key
projections: :func:`convert_qk_weight` moves weights from one to another.

Shapes: queries and keys ``(B, H, L, Dh)``; position ids ``(B, L)`` (or ``(L,)``) integers;
cos and sin ``(B, L, Dh)`` (or ``(L, Dh)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from transformer_tutorial.checks import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_tensor,
)

LAYOUTS = ("half_split", "interleaved", "half_split_negative")


@dataclass(frozen=True)
class RotaryLayout:
    """What rotary positions turn in each head of an attention, as the attention declares it:
    the first ``int(dim · partial_rotary_factor)`` of ``dim`` coordinates, paired as ``layout``
    says (one of ``LAYOUTS``)."""

    dim: int
    partial_rotary_factor: float = 1.0
    layout: str = "half_split"


def _check_head_dim(head_dim: int) -> None:
    check_int("head_dim", head_dim, at_least=2)
    if head_dim % 2:
        raise ValueError(
            f"head_dim must be even (RoPE rotates pairs of coordinates), got {head_dim}"
        )


def rotary_frequencies(head_dim: int, base: float = 10000.0) -> Tensor:
    """``θ_i = base^(-2i/Dh)`` for the ``Dh/2`` pairs, in float64: chapter 2's ``ω_i`` with
    ``D`` replaced by the head width ``Dh``."""
    _check_head_dim(head_dim)
    check_number("base", base, low=1.0, low_open=True)
    two_i = torch.arange(0, head_dim, 2, dtype=torch.float64)  # (Dh/2,)
    return base ** (-two_i / head_dim)


def _check_frequencies(frequencies: Tensor, head_dim: int) -> None:
    """1 to ``Dh/2`` finite, positive float frequencies (read once, when the tables are
    built)."""
    check_int("head_dim", head_dim, at_least=2)
    check_tensor("frequencies", frequencies, kind="float")
    if frequencies.dim() != 1 or not 1 <= len(frequencies) <= head_dim // 2:
        raise ValueError(
            f"frequencies must be 1-D with 1 to head_dim/2 = {head_dim // 2} entries, "
            f"got shape {tuple(frequencies.shape)}"
        )
    if not bool((frequencies.isfinite() & (frequencies > 0)).all()):
        raise ValueError(f"frequencies must be finite and positive, got {frequencies.tolist()}")


class RotaryEmbedding(nn.Module):
    """The cos and sin of every angle ``m · θ_i``, looked up at the given positions.

    The tables are computed once in float64 and kept as float32 non-persistent buffers: they
    move with ``.to(device)``, are cast to the input's dtype, and stay out of checkpoints. Like
    any buffer they also follow ``.to(dtype)``, ``.half()`` or ``.bfloat16()`` of the module
    that holds them (rounding them, as in a model loaded in bfloat16): :meth:`reset_tables`
    computes them again.
    Each pair's angle appears twice, ``cat(angles, angles)``, as in ``transformers``'
    ``LlamaRotaryEmbedding``; :func:`apply_rotary` rearranges them for the other layouts.

    Args:
        head_dim: Dh, even: RoPE rotates the ``Dh/2`` pairs of each head.
        max_len: positions ``0 … max_len − 1`` are covered.
        base: the base of the angles θ_i = base^(−2i/Dh), ``rope_theta`` in ``transformers``
            (10000; Llama 3 uses 500000).
        frequencies: θ_i to use instead, ``(Dr/2,)`` (rope scaling, chapter 18); fewer than
            ``Dh/2`` rotate only the first ``Dr`` coordinates (partial rotary).
        attention_scaling: multiplies the cos and sin tables once (YaRN's attention factor).
        checked: refuse position ids outside ``[0, max_len)``, which reads their range back
            from the device (two reads a call). A language model's hook is built unchecked:
            :meth:`~transformer_tutorial.lm.model.LanguageModel.step` counts the positions on
            the host and refuses any past ``max_len``, so decoding reads nothing here.

    Shapes:
        ``forward(x, position_ids)``: ``position_ids`` integer ``(B, L)`` or ``(L,)`` →
        ``(cos, sin)``, each ``position_ids.shape + (Dr,)`` (``Dr = Dh`` unless
        ``frequencies`` are given), in ``x``'s dtype and device (``x`` is read only for those).
    """

    def __init__(
        self,
        head_dim: int,
        *,
        max_len: int = 4096,
        base: float = 10000.0,
        frequencies: Tensor | None = None,
        attention_scaling: float = 1.0,
        checked: bool = True,
    ) -> None:
        super().__init__()
        check_int("max_len", max_len, at_least=1)
        check_number("attention_scaling", attention_scaling, low=0.0, low_open=True)
        check_bool("checked", checked)
        if frequencies is None:
            with torch.device("cpu"):  # even under a meta device: the tables' recipe is values
                theta = rotary_frequencies(head_dim, base)  # (Dh/2,)
        else:
            _check_frequencies(frequencies, head_dim)
            theta = frequencies.double()  # (Dr/2,)
        self.head_dim, self.max_len, self.base = head_dim, max_len, base
        self.attention_scaling, self.checked = attention_scaling, checked
        self.theta = theta  # float64, kept off the module's buffers: the tables' recipe
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self) -> tuple[Tensor, Tensor]:
        position = torch.arange(self.max_len, dtype=torch.float64, device=self.theta.device)
        angles = torch.outer(position, self.theta)  # (max_len, Dr/2): m · θ_i
        angles = torch.cat([angles, angles], dim=-1)  # (max_len, Dr)
        scale = self.attention_scaling
        return (angles.cos() * scale).float(), (angles.sin() * scale).float()

    def reset_tables(self) -> None:
        """Compute the tables again into the buffers, in their dtype and device: after
        ``to_empty`` (a model built on the meta device), whose buffers hold garbage."""
        cos, sin = self._tables()
        with torch.no_grad():
            self.cos.copy_(cos)
            self.sin.copy_(sin)

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        check_tensor("x", x, kind="float")
        check_tensor("position_ids", position_ids)
        if position_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
        if self.checked and position_ids.numel():
            low, high = position_ids.min(), position_ids.max()
            if low < 0 or high >= self.max_len:
                raise ValueError(
                    f"position_ids must lie in [0, {self.max_len}), got values from "
                    f"{low.item()} to {high.item()}; build RotaryEmbedding with a larger max_len"
                )
        position_ids = position_ids.to(self.cos.device)
        cos, sin = self.cos[position_ids], self.sin[position_ids]  # (..., L, Dh)
        return cos.to(x.device, x.dtype), sin.to(x.device, x.dtype)

    def extra_repr(self) -> str:
        scaled = "" if self.attention_scaling == 1.0 else f", scaling={self.attention_scaling:.4g}"
        width = "" if self.cos.size(-1) == self.head_dim else f", rotated={self.cos.size(-1)}"
        return f"head_dim={self.head_dim}, max_len={self.max_len}, base={self.base}{width}{scaled}"


class RotaryPositions(nn.Module):
    """Rotary embeddings as the position hook of an attention layer (chapter 16's
    ``rotary=``): ``(q, k, position_ids)`` → ``(q, k)`` rotated by :func:`apply_rotary`.

    A module rather than a function, so that its tables are a submodule's buffers and move with
    the model's ``.to(device)``.

    Args:
        head_dim, max_len, base, frequencies, attention_scaling, checked: as
            :class:`RotaryEmbedding`.
        layout: which coordinates pair up, one of ``LAYOUTS``: within the first ``Dr``
            coordinates when only those rotate (partial rotary, GPT-NeoX); the rest pass.

    Shapes:
        q ``(B, H, L, Dh)``, k ``(B, Hkv, L, Dh)``, position_ids ``(B, L)`` → q, k as given.
    """

    def __init__(
        self,
        head_dim: int,
        *,
        max_len: int = 4096,
        base: float = 10000.0,
        layout: str = "half_split",
        frequencies: Tensor | None = None,
        attention_scaling: float = 1.0,
        checked: bool = True,
    ) -> None:
        super().__init__()
        check_choice("layout", layout, LAYOUTS)
        self.rotary = RotaryEmbedding(
            head_dim,
            max_len=max_len,
            base=base,
            frequencies=frequencies,
            attention_scaling=attention_scaling,
            checked=checked,
        )
        self.layout = layout

    def reset_buffers(self) -> None:
        """Compute the cos and sin tables again (:meth:`RotaryEmbedding.reset_tables`)."""
        self.rotary.reset_tables()

    def forward(self, q: Tensor, k: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        _check_queries_and_keys(q, k, position_ids)
        cos, sin = self.rotary(q, position_ids)  # (B, L, Dr) each
        width = cos.size(-1)
        if width == q.size(-1):
            return apply_rotary(q, k, cos, sin, layout=self.layout)
        q_turned, k_turned = apply_rotary(
            q[..., :width], k[..., :width], cos, sin, layout=self.layout
        )
        return (
            torch.cat([q_turned, q[..., width:]], dim=-1),  # (B, H, L, Dh)
            torch.cat([k_turned, k[..., width:]], dim=-1),  # (B, Hkv, L, Dh)
        )

    def extra_repr(self) -> str:
        return f"layout={self.layout!r}"


def _check_queries_and_keys(q: Tensor, k: Tensor, position_ids: Tensor) -> None:
    """q ``(B, H, L, Dh)`` and k ``(B, Hkv, L, Dh)`` of one width and length, and a position
    for each of their ``L`` positions."""
    check_tensor("q", q, kind="float", dims=4, shape="(B, H, L, Dh)")
    check_tensor("k", k, kind="float", dims=4, shape="(B, Hkv, L, Dh)")
    check_tensor("position_ids", position_ids)
    L = q.size(-2)
    if k.size(-2) != L or k.size(-1) != q.size(-1) or position_ids.size(-1) != L:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)} and position_ids "
            f"{tuple(position_ids.shape)} must agree: (B, H, L, Dh), (B, Hkv, L, Dh), (B, L)"
        )


def rotate_half(x: Tensor) -> Tensor:
    """``(x1, x2) → (−x2, x1)`` for the two halves of the last dimension: each half-split pair
    ``(a, b)`` turned by 90°."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x: Tensor) -> Tensor:
    """``(x0, x1, x2, x3, …) → (−x1, x0, −x3, x2, …)``: each interleaved pair turned by 90°."""
    x_even, x_odd = x[..., 0::2], x[..., 1::2]  # (..., Dh/2) each
    return torch.stack((-x_odd, x_even), dim=-1).flatten(-2)  # (..., Dh)


def rotate(x: Tensor, cos: Tensor, sin: Tensor, *, layout: str = "half_split") -> Tensor:
    """``x`` turned pair by pair: ``(a, b) → (a cos − b sin, a sin + b cos)``.

    Args:
        x: ``(B, H, L, Dh)`` queries or keys.
        cos, sin: from :class:`RotaryEmbedding`, ``(B, L, Dh)`` or ``(L, Dh)``; they broadcast
            over the heads.
        layout: which coordinates pair up, one of ``LAYOUTS``.
    """
    check_choice("layout", layout, LAYOUTS)
    if cos.shape != sin.shape or x.size(-1) != cos.size(-1):
        raise ValueError(
            f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have one shape whose last "
            f"size is the head width of x {tuple(x.shape)}"
        )
    if x.size(-1) % 2:
        raise ValueError(f"the head width must be even, got x of shape {tuple(x.shape)}")
    cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # (B, 1, L, Dh): the same for every head
    if layout == "interleaved":
        half = cos.size(-1) // 2  # the tables hold each angle twice: (a_0 … | a_0 …)
        cos = cos[..., :half].repeat_interleave(2, dim=-1)  # (a_0, a_0, a_1, a_1, …)
        sin = sin[..., :half].repeat_interleave(2, dim=-1)
        return x * cos + rotate_pairs(x) * sin
    if layout == "half_split_negative":
        return x * cos - rotate_half(x) * sin
    return x * cos + rotate_half(x) * sin


def apply_rotary(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, layout: str = "half_split"
) -> tuple[Tensor, Tensor]:
    """Queries and keys, each turned by :func:`rotate`; with the default ``layout`` this is
    ``transformers``' ``apply_rotary_pos_emb``. Values are never rotated."""
    return rotate(q, cos, sin, layout=layout), rotate(k, cos, sin, layout=layout)


def _pairing(layout: str, head_dim: int) -> tuple[Tensor, Tensor]:
    """``(index, sign)`` with ``sign * x[index]`` = the coordinates of ``x`` (one head, in
    ``layout``) rearranged as ``"half_split"``: first halves of the pairs, then second halves."""
    half = head_dim // 2
    sign = torch.ones(head_dim)
    if layout == "interleaved":
        index = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    else:
        index = torch.arange(head_dim)
    if layout == "half_split_negative":
        sign[half:] = -1.0  # (a, b) turned by −θ is (a, −b) turned by +θ, then b negated back
    return index, sign


def qk_row_permutation(head_dim: int, *, source: str, target: str) -> tuple[Tensor, Tensor]:
    """The signed permutation of one head's rows from layout ``source`` to ``target``:
    ``row_target[r] = sign[r] * row_source[index[r]]``. Returns ``(index, sign)``, each
    ``(Dh,)``."""
    _check_head_dim(head_dim)
    check_choice("source", source, LAYOUTS)
    check_choice("target", target, LAYOUTS)
    index_s, sign_s = _pairing(source, head_dim)
    index_t, sign_t = _pairing(target, head_dim)
    inverse_t = torch.argsort(index_t)  # where each target row sits in the half-split order
    return index_s[inverse_t], (sign_s * sign_t)[inverse_t]


def convert_qk_weight(weight: Tensor, n_heads: int, *, source: str, target: str) -> Tensor:
    """A query or key projection's weight (or bias) moved from one RoPE layout to another.

    The rows of each head are permuted (and, to or from ``"half_split_negative"``, half of them
    negated): the model computes the same attention scores. ``interleaved → half_split`` is the
    permutation ``transformers``' Llama conversion script applies to Meta's checkpoints. A
    QK-norm's gains (``q_norm.weight``, ``(Dh,)``) must move by the same permutation, without
    the sign: ``weight[index]`` with ``index`` from :func:`qk_row_permutation`.

    Args:
        weight: ``(n_heads · Dh, ...)``: ``q_proj.weight`` ``(H · Dh, D)``, a bias ``(H · Dh,)``.
        n_heads: the heads of this projection: ``num_key_value_heads`` for ``k_proj`` under
            grouped-query attention.
        source, target: layouts, each one of ``LAYOUTS``.
    """
    check_tensor("weight", weight)
    check_int("n_heads", n_heads, at_least=1)
    rows = weight.size(0) if weight.dim() else 0
    if rows == 0 or rows % n_heads:
        raise ValueError(
            f"weight's first dimension ({rows}) must be n_heads={n_heads} times the head width"
        )
    index, sign = qk_row_permutation(rows // n_heads, source=source, target=target)
    heads = weight.reshape(n_heads, rows // n_heads, *weight.shape[1:])  # (H, Dh, ...)
    sign = sign.to(weight.device, weight.dtype).reshape(-1, *[1] * (weight.dim() - 1))
    return (heads[:, index.to(weight.device)] * sign).reshape(weight.shape)
