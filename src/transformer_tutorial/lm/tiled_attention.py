"""Chapter 22: attention without the score matrix — FlashAttention-2's tiles, in PyTorch.

The online softmax (:func:`online_softmax`), the tiled forward and backward passes of
FlashAttention-2 (Dao 2023, Algorithms 1 and 2) as a ``torch.autograd.Function``
(:func:`tiled_attention`), registered as chapter 16's attention kernel ``"tiled"``
(``LMConfig(attention_backend="tiled")``), and :class:`PeakStorage`, which measures the peak
bytes of the storages an operation allocates. A teaching implementation: exact, not fast. In
bf16 and fp16, as in FlashAttention, the scores, the running statistics and every sum (the
output's and the gradients') are float32; only what is returned is rounded to the inputs' dtype.

Shapes: queries ``(B, H, L, Dh)``, keys and values ``(B, H_kv, S, Dh)`` with ``H`` a multiple of
``H_kv`` (grouped heads); inside, queries ``(B, H_kv, G, L, Dh)`` with ``G = H // H_kv``, so
that one key head serves its group by broadcasting, never by a copy.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from transformer_tutorial.checks import check_bool, check_int, check_number, check_tensor
from transformer_tutorial.lm.grouped_attention import GroupedQueryAttention, KernelPiece
from transformer_tutorial.lm.registry import ATTENTION_KERNELS


def _check_scores(x: Tensor, block_size: int) -> None:
    check_tensor("x", x, kind="float")
    if x.dim() == 0:
        raise ValueError("x must have a last dimension to take the softmax over, got a 0-d tensor")
    check_int("block_size", block_size, at_least=1)


def online_softmax(x: Tensor, *, block_size: int) -> Tensor:
    """softmax over the last dimension, reading ``x`` one block of ``block_size`` columns at a
    time and keeping only a running maximum ``m`` and a running sum ``l`` of ``exp(x − m)``."""
    _check_scores(x, block_size)
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    l = torch.zeros_like(m)  # noqa: E741 (the paper's name)
    for start in range(0, x.size(-1), block_size):
        block = x[..., start : start + block_size]
        m_new = torch.maximum(m, block.amax(-1))
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new[..., None]).sum(-1)  # noqa: E741
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


def _blocked(
    rows: range, cols: range, *, offset: int, is_causal: bool, pad: Tensor | None, device
) -> Tensor | None:
    """Bool, True = blocked, for query rows ``rows`` and key columns ``cols``: broadcastable to
    ``(B, H_kv, G, rows, cols)``. Causal is aligned bottom-right: query ``i`` sits at position
    ``i + offset`` with ``offset = S − L``, as a step that follows a cache of ``S − L`` keys.
    None where nothing is blocked (a causal tile wholly on or below the diagonal)."""
    blocked = None
    if is_causal and cols.stop - 1 > rows.start + offset:
        i = torch.arange(rows.start, rows.stop, device=device)
        j = torch.arange(cols.start, cols.stop, device=device)
        blocked = j[None, :] > i[:, None] + offset  # (rows, cols)
    if pad is not None:
        pad_block = pad[:, None, None, None, cols.start : cols.stop]  # (B, 1, 1, 1, cols)
        blocked = pad_block if blocked is None else blocked | pad_block
    return blocked


def _tiles(n: int, size: int) -> list[range]:
    return [range(start, min(start + size, n)) for start in range(0, n, size)]


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the statistics and sums: float32 for bf16/fp16 inputs, as FlashAttention
    keeps them (an 8- or 11-bit running sum of thousands of terms loses its small ones, and an
    fp16 score ``q·k`` overflows at 65,504 before the scale); float32 and float64 as they are."""
    return torch.promote_types(dtype, torch.float32)


def _forward(q, k, v, pad, is_causal, scale, block_q, block_k):
    """Algorithm 1. ``q`` ``(B, H_kv, G, L, Dh)``, ``k``, ``v`` ``(B, H_kv, 1, S, Dh)``.
    Returns the output like ``q`` and the log-sum-exp ``(B, H_kv, G, L)`` in the accumulator's
    dtype (−inf on a row whose every key is blocked, whose output is zero). Each tile is read
    in that dtype, so scores, ``m``, ``l`` and the output's sum never round to the input's."""
    L, S = q.size(-2), k.size(-2)
    acc = _accumulator(q.dtype)
    out = torch.zeros_like(q)
    lse = torch.empty(q.shape[:-1], dtype=acc, device=q.device)
    for rows in _tiles(L, block_q):
        q_i = q[..., rows.start : rows.stop, :].to(acc)
        m = torch.full(q_i.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        l = torch.zeros_like(m)  # noqa: E741
        o = torch.zeros_like(q_i)
        for cols in _tiles(S, block_k):
            if is_causal and cols.start > rows.stop - 1 + (S - L):
                break  # this tile and the rest lie above the diagonal
            k_j = k[..., cols.start : cols.stop, :].to(acc)
            v_j = v[..., cols.start : cols.stop, :].to(acc)
            s = q_i @ k_j.transpose(-2, -1) * scale
            blocked = _blocked(
                rows, cols, offset=S - L, is_causal=is_causal, pad=pad, device=q.device
            )
            if blocked is not None:
                s = s.masked_fill(blocked, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows blocked so far
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m - m_safe)
            l = alpha * l + p.sum(-1)  # noqa: E741
            o = alpha[..., None] * o + p @ v_j
            m = m_new
        empty = l == 0
        out[..., rows.start : rows.stop, :] = o / l.masked_fill(empty, 1.0)[..., None]
        lse[..., rows.start : rows.stop] = m + torch.log(l)  # log 0 = −inf where empty
    return out, lse


def _backward(q, k, v, out, lse, d_out, pad, is_causal, scale, block_q, block_k):
    """Algorithm 2: each tile's probabilities recomputed from the saved log-sum-exp. The
    gradients are summed in the accumulator's dtype and returned in the inputs' dtypes."""
    L, S = q.size(-2), k.size(-2)
    acc = _accumulator(q.dtype)
    dq = torch.zeros_like(q, dtype=acc)
    dk, dv = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
    delta = (d_out.to(acc) * out.to(acc)).sum(-1)  # (B, H_kv, G, L): rowsum(dO ∘ O)
    lse_safe = lse.masked_fill(lse == float("-inf"), 0.0)
    for cols in _tiles(S, block_k):
        k_j = k[..., cols.start : cols.stop, :].to(acc)
        v_j = v[..., cols.start : cols.stop, :].to(acc)
        for rows in _tiles(L, block_q):
            if is_causal and cols.start > rows.stop - 1 + (S - L):
                continue
            q_i = q[..., rows.start : rows.stop, :].to(acc)
            do_i = d_out[..., rows.start : rows.stop, :].to(acc)
            s = q_i @ k_j.transpose(-2, -1) * scale
            blocked = _blocked(
                rows, cols, offset=S - L, is_causal=is_causal, pad=pad, device=q.device
            )
            if blocked is not None:
                s = s.masked_fill(blocked, float("-inf"))
            p = torch.exp(s - lse_safe[..., rows.start : rows.stop, None])
            dv[..., cols.start : cols.stop, :] += (p.transpose(-2, -1) @ do_i).sum(2, True)
            dp = do_i @ v_j.transpose(-2, -1)
            ds = p * (dp - delta[..., rows.start : rows.stop, None])
            dq[..., rows.start : rows.stop, :] += ds @ k_j * scale
            dk[..., cols.start : cols.stop, :] += (ds.transpose(-2, -1) @ q_i).sum(2, True) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pad, is_causal, scale, block_q, block_k):
        out, lse = _forward(q, k, v, pad, is_causal, scale, block_q, block_k)
        ctx.save_for_backward(q, k, v, out, lse)  # O(L) besides the inputs: no score matrix
        ctx.args = (pad, is_causal, scale, block_q, block_k)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse, d_out, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def _check_tiled(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float | None) -> None:
    """Float q, k and v of one dtype and device; ``is_causal`` a bool; ``scale`` None or > 0."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, kind="float")
    if not q.dtype == k.dtype == v.dtype or not q.device == k.device == v.device:
        raise TypeError(
            f"q, k and v must share one dtype and device, got {q.dtype} on {q.device}, "
            f"{k.dtype} on {k.device}, {v.dtype} on {v.device}"
        )
    check_bool("is_causal", is_causal)
    if scale is not None:
        check_number("scale", scale, low=0.0, low_open=True)


def tiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    block_q: int = 64,
    block_k: int = 64,
) -> Tensor:
    """softmax(q kᵀ · scale) v, one ``block_q × block_k`` tile of scores at a time.

    Args:
        q: ``(B, H, L, Dh)``.
        k, v: ``(B, H_kv, S, Dh)``, ``H`` a multiple of ``H_kv`` (grouped heads).
        key_padding_mask: bool ``(B, S)``, True = padding.
        is_causal: query ``i`` sees keys ``j ≤ i + S − L`` (bottom-right, as a cached step;
            ``F.scaled_dot_product_attention``'s ``is_causal`` is top-left).
        scale: defaults to ``1 / √Dh``.
        block_q, block_k: the tile's rows (queries) and columns (keys), at least 1.

    Returns:
        ``(B, H, L, Dh)`` in ``q``'s dtype (bf16 and fp16 are summed in float32). A query
        whose every key is blocked gets a zero output and zero gradients, as chapter 3's
        attention, never NaN.
    """
    _check_tiled(q, k, v, is_causal, scale)
    check_int("block_q", block_q, at_least=1)
    check_int("block_k", block_k, at_least=1)
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            "q must be (B, H, L, Dh), k and v the same (B, H_kv, S, Dh); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, H, L, Dh = q.shape
    H_kv, S = k.size(1), k.size(2)
    if k.size(0) != B or k.size(-1) != Dh or H % H_kv:
        raise ValueError(
            f"k and v must be (B={B}, H_kv, S, Dh={Dh}) with H={H} a multiple of H_kv; "
            f"got {tuple(k.shape)}"
        )
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool or key_padding_mask.shape != (B, S)
    ):
        raise ValueError(
            f"key_padding_mask must be bool (B, S) = ({B}, {S}), True = padding; got "
            f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
        )
    scale = 1.0 / math.sqrt(Dh) if scale is None else scale
    G = H // H_kv
    q5 = q.view(B, H_kv, G, L, Dh)  # (B, H_kv, G, L, Dh)
    k5, v5 = k[:, :, None], v[:, :, None]  # (B, H_kv, 1, S, Dh)
    out = _TiledAttention.apply(q5, k5, v5, key_padding_mask, is_causal, scale, block_q, block_k)
    return out.reshape(B, H, L, Dh)


def tiled_attend(
    attention: GroupedQueryAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None,
) -> Tensor:
    """Chapter 16's attention computed by :func:`tiled_attention`: the same numbers, one tile of
    scores at a time. q ``(B, H, L, Dh)``, k and v ``(B, Hkv, S, Dh)`` → ``(B, H, L, Dh)``."""
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask[:, -k.size(2) :]  # the positions held
    return tiled_attention(q.contiguous(), k, v, key_padding_mask=key_padding_mask, is_causal=True)


class TiledKernelPiece(KernelPiece):
    """``attention_backend="tiled"``: no sliding window, no dropout (a teaching version)."""

    def check_attention(self, *, window: int | None, dropout: float) -> None:
        if window is not None or dropout:
            raise ValueError(
                "attention_backend='tiled' (chapter 22) has no sliding window and no dropout: "
                f"set window=None and dropout=0 (got {window}, {dropout})"
            )


ATTENTION_KERNELS.register("tiled", TiledKernelPiece(tiled_attend))


class PeakStorage(TorchDispatchMode):
    """Within ``with PeakStorage() as p:``, ``p.peak`` is the most bytes held at once by the
    storages that operations allocated there (each storage counted once, whatever its views),
    forward and backward; ``p.live`` what is still held. Tensors made before, and views of
    them (a slice's storage is its whole base), are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._held: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._held.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, Tensor)
        }
        for t in tree_flatten(result)[0]:
            if isinstance(t, Tensor):
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and key not in self._held and key not in inputs:  # not a view
                    self._held.add(key)
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._release, key, nbytes)
        return result
