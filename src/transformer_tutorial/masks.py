"""Chapter 6: masks — what attention may look at.

Polarity follows PyTorch's modules: True = blocked. ``padding_mask`` is True at padding,
``causal_mask`` is True above the diagonal (the future), ``sliding_window_causal_mask``
(chapter 16) also below the window (the distant past). ``merge_masks`` is the one function that
combines them into the ``(B, 1, L, S)`` form attention consumes. Remember that
``torch.nn.functional.scaled_dot_product_attention`` reads a bool mask the other way round
(True = attend): pass it ``~blocked``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from transformer_tutorial.checks import check_int


def padding_mask(ids: Tensor, pad_id: int) -> Tensor:
    """``(B, L)`` token ids → ``(B, L)`` bool, True where the token is padding."""
    return ids == pad_id


def causal_mask(
    q_len: int, k_len: int | None = None, *, device: torch.device | str | None = None
) -> Tensor:
    """``(q_len, k_len)`` bool, True where query ``i`` must not see key ``j`` (the future).

    With ``k_len > q_len`` the queries are the last ``q_len`` positions of ``k_len`` (decoding with
    a cache of ``k_len - q_len`` earlier positions): query ``i`` sits at position
    ``k_len - q_len + i``.
    """
    k_len = q_len if k_len is None else k_len
    if k_len < q_len:
        raise ValueError(f"k_len={k_len} must be at least q_len={q_len}")
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).triu(k_len - q_len + 1)


def sliding_window_causal_mask(
    q_len: int,
    k_len: int | None = None,
    *,
    window: int,
    device: torch.device | str | None = None,
) -> Tensor:
    """``(q_len, k_len)`` bool, True where query ``i`` must not see key ``j``: the future, and
    every key ``window`` or more positions back (chapter 16).

    Each query sees at most ``window`` keys, itself included: the query at position ``p`` sees
    keys ``p - window < j <= p`` (the convention of ``transformers``' ``sliding_window``).
    Aligned bottom-right like :func:`causal_mask`: with ``k_len > q_len`` the queries are the
    last ``q_len`` positions of ``k_len``.
    """
    check_int("window", window, at_least=1)
    k_len = q_len if k_len is None else k_len
    future = causal_mask(q_len, k_len, device=device)  # checks k_len >= q_len
    too_old = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    return future | too_old.tril(k_len - q_len - window)  # j <= p - window, p = k_len - q_len + i


def _check_bool(name: str, mask: Tensor) -> None:
    if mask.dtype != torch.bool:
        raise TypeError(
            f"{name} must be a bool tensor with True = blocked, got {mask.dtype}. "
            f"From a float mask of 0/-inf use `{name} == float('-inf')`; "
            f"from a 0/1 mask use `{name} == 0` or `.bool()` as its meaning requires."
        )


def merge_masks(
    attn_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    *,
    batch_size: int,
    q_len: int,
    k_len: int,
    n_heads: int | None = None,
) -> Tensor | None:
    """Combine an attention mask and a key padding mask into one bool mask, True = blocked.

    Args:
        attn_mask: ``(L, S)`` shared by the batch, or ``(B, L, S)``, or ``(B, H, L, S)``
            (H = ``n_heads`` when given).
        key_padding_mask: ``(B, S)``, True at padded keys.

    Returns:
        A bool tensor broadcastable to ``(B, H, L, S)`` — ``(B or 1, H or 1, L or 1, S)`` —
        or None when neither mask is given.
    """
    merged = None
    if attn_mask is not None:
        _check_bool("attn_mask", attn_mask)
        if attn_mask.dim() == 2:
            expected = (q_len, k_len)
            merged = attn_mask[None, None]  # (1, 1, L, S)
        elif attn_mask.dim() == 3:
            expected = (batch_size, q_len, k_len)
            merged = attn_mask[:, None]  # (B, 1, L, S)
        elif attn_mask.dim() == 4:
            expected = (batch_size, n_heads or attn_mask.size(1), q_len, k_len)
            merged = attn_mask
        else:
            expected = (q_len, k_len)
        if tuple(attn_mask.shape) != expected:
            raise ValueError(
                f"attn_mask has shape {tuple(attn_mask.shape)}; "
                f"expected (L, S) = {(q_len, k_len)}, "
                f"(B, L, S) = {(batch_size, q_len, k_len)} or "
                f"(B, H, L, S) = {(batch_size, n_heads or 'H', q_len, k_len)}"
            )
    if key_padding_mask is not None:
        _check_bool("key_padding_mask", key_padding_mask)
        if tuple(key_padding_mask.shape) != (batch_size, k_len):
            raise ValueError(
                f"key_padding_mask has shape {tuple(key_padding_mask.shape)}; expected (B, S) = "
                f"{(batch_size, k_len)}, True at padding"
            )
        padded = key_padding_mask[:, None, None, :]  # (B, 1, 1, S)
        merged = padded if merged is None else merged | padded
    return merged
