"""Chapter 6: masks — what attention may look at.

Polarity follows PyTorch's modules: True = blocked. ``padding_mask`` is True at padding,
``causal_mask`` is True above the diagonal (the future), ``sliding_window_causal_mask``
(chapter 16) also below the window (the distant past). ``merge_masks`` is the one function that
combines them into the ``(B, 1, L, S)`` form attention consumes; ``check_mask`` the one that
refuses a mask of another dtype or shape, naming the argument and the shapes it may have.
Remember that ``torch.nn.functional.scaled_dot_product_attention`` reads a bool mask the other
way round (True = attend): pass it ``~blocked``.
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


def check_mask(
    name: str,
    mask: Tensor | None,
    shapes: dict[str, tuple[int, ...]],
    *,
    meaning: str = "True = blocked",
) -> None:
    """Refuse ``mask`` unless it is None or bool (True = blocked) with one of ``shapes``.

    ``shapes`` maps each shape's name to its size, e.g. ``{"(B, S)": (2, 7)}``; the error names
    the argument, the shape it has, every shape it may have and ``meaning``. Every public
    function that takes a mask checks it here, before it changes anything (a cache).
    """
    if mask is None:
        return
    if mask.dtype != torch.bool:
        raise TypeError(
            f"{name} must be a bool tensor with True = blocked, got {mask.dtype}. "
            f"From a float mask of 0/-inf use `{name} == float('-inf')`; "
            f"from a 0/1 mask use `{name} == 0` or `.bool()` as its meaning requires."
        )
    if tuple(mask.shape) not in shapes.values():
        allowed = " or ".join(f"{label} = {shape}" for label, shape in shapes.items())
        raise ValueError(f"{name} has shape {tuple(mask.shape)}; expected {allowed}, {meaning}")


def check_padding_mask(name: str, mask: Tensor | None, label: str, shape: tuple[int, ...]) -> None:
    """:func:`check_mask` for a key padding mask: the one shape ``label`` = ``shape``, True at
    padding."""
    check_mask(name, mask, {label: tuple(shape)}, meaning="True at padding")


def attn_mask_shapes(
    batch_size: int, q_len: int, k_len: int, n_heads: int | None = None
) -> dict[str, tuple[int, ...]]:
    """The shapes an ``attn_mask`` may have: ``(L, S)``, ``(B, L, S)`` and, when the scores
    have ``n_heads`` heads, ``(B, H, L, S)`` or ``(B, 1, L, S)`` (one mask for every head)."""
    shapes = {"(L, S)": (q_len, k_len), "(B, L, S)": (batch_size, q_len, k_len)}
    if n_heads is not None:
        shapes["(B, H, L, S)"] = (batch_size, n_heads, q_len, k_len)
        shapes["(B, 1, L, S)"] = (batch_size, 1, q_len, k_len)
    return shapes


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
        attn_mask: ``(L, S)`` shared by the batch, or ``(B, L, S)``, or, when the scores have
            ``n_heads`` = H heads, ``(B, H, L, S)`` or ``(B, 1, L, S)``; ``n_heads=None`` (scores
            ``(B, L, S)``) refuses a 4-D mask.
        key_padding_mask: ``(B, S)``, True at padded keys.

    Returns:
        A bool tensor broadcastable to ``(B, H, L, S)`` — ``(B or 1, H or 1, L or 1, S)`` —
        or None when neither mask is given.
    """
    merged = None
    if attn_mask is not None:
        check_mask("attn_mask", attn_mask, attn_mask_shapes(batch_size, q_len, k_len, n_heads))
        if attn_mask.dim() == 2:
            merged = attn_mask[None, None]  # (1, 1, L, S)
        elif attn_mask.dim() == 3:
            merged = attn_mask[:, None]  # (B, 1, L, S)
        else:
            merged = attn_mask  # (B, H, L, S)
    if key_padding_mask is not None:
        check_padding_mask("key_padding_mask", key_padding_mask, "(B, S)", (batch_size, k_len))
        padded = key_padding_mask[:, None, None, :]  # (B, 1, 1, S)
        merged = padded if merged is None else merged | padded
    return merged


def sdpa_mask(
    batch_size: int,
    q_len: int,
    k_len: int,
    key_padding_mask: Tensor | None = None,
    *,
    window: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor | None, bool]:
    """``F.scaled_dot_product_attention``'s ``attn_mask`` (True = attend) and ``is_causal`` for
    the last ``q_len`` of ``k_len`` positions under a causal mask aligned bottom-right (a sliding
    ``window`` too, if given) and ``key_padding_mask`` ``(B, ≥ k_len)`` (its last ``k_len``
    columns are the keys', True at padding).

    Without padding, two common cases need no mask tensor, which leaves F.sdpa every kernel (on
    CUDA, FlashAttention takes no mask tensor, and a grouped call no fused kernel takes runs the
    math path, which copies the keys and values): a whole sequence, ``q_len == k_len``, is plain
    causal attention (``is_causal=True``); one new token after a cache sees every key the cache
    holds (it keeps at most ``window`` of them)."""
    if key_padding_mask is None and (window is None or window >= k_len):
        if q_len == k_len and window is None:
            return None, True
        if q_len == 1:
            return None, False
    if window is None:
        blocked = causal_mask(q_len, k_len, device=device)
    else:
        blocked = sliding_window_causal_mask(q_len, k_len, window=window, device=device)
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask[:, -k_len:]  # the positions held
    blocked = merge_masks(
        blocked, key_padding_mask, batch_size=batch_size, q_len=q_len, k_len=k_len
    )
    return ~blocked, False
