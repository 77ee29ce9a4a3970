"""Chapter 6: masks mean True = blocked and merge into one broadcastable bool tensor; every entry
point refuses a float mask.

What masks do inside the model is tested where it happens: attention with masks equals
``nn.MultiheadAttention`` and never gives NaN (test_attention.py), the decoder layer is causal and
the layers ignore padding (test_layers.py), the model derives its masks from ``pad_id``
(test_model.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from transformer_tutorial.attention import MultiHeadAttention, scaled_dot_product_attention
from transformer_tutorial.masks import (
    causal_mask,
    merge_masks,
    padding_mask,
    sliding_window_causal_mask,
)

PAD = 0


def _ids() -> torch.Tensor:
    """``(3, 6)`` right-padded token ids: lengths 6, 3 and 4."""
    return torch.tensor([[5, 3, 8, 5, 2, 9], [4, 7, 6, PAD, PAD, PAD], [1, 2, 3, 4, PAD, PAD]])


def test_padding_mask_is_true_at_padding():
    expected = torch.tensor([[False] * 6, [False] * 3 + [True] * 3, [False] * 4 + [True] * 2])
    mask = padding_mask(_ids(), PAD)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)


def test_causal_mask_is_true_above_the_diagonal_as_pytorchs():
    mask = causal_mask(4)
    assert mask.dtype == torch.bool
    upper = [[0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]]
    assert torch.equal(mask, torch.tensor(upper, dtype=torch.bool))
    assert torch.equal(causal_mask(7), nn.Transformer.generate_square_subsequent_mask(7).isinf())


@pytest.mark.parametrize("q_len, k_len", [(1, 5), (2, 5), (5, 5), (3, 8)])
def test_causal_mask_with_a_cache_is_the_bottom_rows(q_len, k_len):
    assert torch.equal(causal_mask(q_len, k_len), causal_mask(k_len)[-q_len:])
    assert not causal_mask(q_len, k_len)[-1].any()  # the newest query sees every key


def test_causal_mask_refuses_fewer_keys_than_queries():
    with pytest.raises(ValueError, match="k_len=2 must be at least q_len=3"):
        causal_mask(3, 2)


def _sliding_by_index(q_len: int, k_len: int, window: int) -> torch.Tensor:
    """The sliding-window mask from index arithmetic: query i sits at p = k_len - q_len + i
    and is blocked from key j unless p - window < j <= p."""
    p = torch.arange(k_len - q_len, k_len)[:, None]
    j = torch.arange(k_len)[None, :]
    return (j > p) | (j <= p - window)


SLIDING_CASES = [(9, 9, 3), (12, 12, 1), (1, 10, 4), (3, 11, 4), (6, 6, 6), (5, 8, 20)]


@pytest.mark.parametrize("q_len, k_len, window", SLIDING_CASES)
def test_sliding_window_causal_mask_equals_index_arithmetic(q_len, k_len, window):
    mask = sliding_window_causal_mask(q_len, k_len, window=window)
    assert mask.dtype == torch.bool and mask.shape == (q_len, k_len)
    assert torch.equal(mask, _sliding_by_index(q_len, k_len, window))
    # every query sees min(window, its position + 1) keys, the newest one itself
    seen = (~mask).sum(-1)
    positions = torch.arange(k_len - q_len, k_len)
    assert torch.equal(seen, torch.clamp(positions + 1, max=window))
    assert not mask[:, -q_len:].diagonal().any()


@pytest.mark.parametrize("q_len, k_len, window", SLIDING_CASES)
def test_sliding_window_causal_mask_equals_transformers(q_len, k_len, window):
    """transformers' own mask, ``sdpa_mask`` with ``sliding_window_causal_mask_function``, reads
    True = attend: ours is its negation, with a cache (``q_offset``) too."""
    from transformers import masking_utils as masking

    allowed = masking.sdpa_mask(
        batch_size=1,
        q_length=q_len,
        kv_length=k_len,
        q_offset=k_len - q_len,
        mask_function=masking.sliding_window_causal_mask_function(window),
        allow_is_causal_skip=False,
    )
    assert torch.equal(sliding_window_causal_mask(q_len, k_len, window=window), ~allowed[0, 0])


def test_sliding_window_causal_mask_is_causal_when_the_window_is_long_enough():
    assert torch.equal(sliding_window_causal_mask(7, window=7), causal_mask(7))
    assert torch.equal(sliding_window_causal_mask(3, 7, window=100), causal_mask(3, 7))
    assert torch.equal(sliding_window_causal_mask(5, window=1), ~torch.eye(5, dtype=torch.bool))


def test_sliding_window_causal_mask_with_a_cache_is_the_bottom_rows():
    full = sliding_window_causal_mask(10, window=3)
    for q_len in (1, 4, 10):
        assert torch.equal(sliding_window_causal_mask(q_len, 10, window=3), full[-q_len:])


def test_sliding_window_causal_mask_refuses_bad_windows():
    with pytest.raises(ValueError, match="window must be at least 1, got 0"):
        sliding_window_causal_mask(4, window=0)
    with pytest.raises(TypeError, match="window must be an int"):
        sliding_window_causal_mask(4, window=2.0)
    with pytest.raises(ValueError, match="k_len=2 must be at least q_len=3"):
        sliding_window_causal_mask(3, 2, window=2)


def test_merge_masks_shapes_broadcast_to_b_h_l_s():
    B, L, S = 3, 4, 6
    kpm = torch.zeros(B, S, dtype=torch.bool)
    cases = [
        (None, None, None),
        (causal_mask(L, S), None, (1, 1, L, S)),
        (None, kpm, (B, 1, 1, S)),
        (causal_mask(L, S), kpm, (B, 1, L, S)),
        (torch.zeros(B, L, S, dtype=torch.bool), kpm, (B, 1, L, S)),
        (torch.zeros(B, 2, L, S, dtype=torch.bool), kpm, (B, 2, L, S)),
    ]
    for attn_mask, key_padding_mask, shape in cases:
        merged = merge_masks(attn_mask, key_padding_mask, batch_size=B, q_len=L, k_len=S)
        assert (merged if merged is None else merged.shape) == shape


def test_merge_masks_is_the_union_true_blocked():
    ids = _ids()
    B, T = ids.shape
    merged = merge_masks(causal_mask(T), padding_mask(ids, PAD), batch_size=B, q_len=T, k_len=T)
    assert merged.dtype == torch.bool
    for b in range(B):
        length = int((ids[b] != PAD).sum())
        for i in range(T):
            for j in range(T):
                assert merged[b, 0, i, j].item() == (j > i or j >= length), (b, i, j)


def _through(entry: str, **masks) -> None:
    """Hand ``masks`` to one of the four places a mask enters attention."""
    B, L, D = 2, 5, 8
    x = torch.randn(B, L, D)
    if entry == "merge_masks":
        merge_masks(**masks, batch_size=B, q_len=L, k_len=L)
    elif entry == "function":
        scaled_dot_product_attention(x, x, x, **masks)
    else:
        MultiHeadAttention(D, 2)(x, x, x, need_weights=entry == "written-out", **masks)


@pytest.mark.parametrize("entry", ["merge_masks", "function", "fused", "written-out"])
@pytest.mark.parametrize("name", ["attn_mask", "key_padding_mask"])
def test_float_masks_are_refused_everywhere(name, entry):
    """A 0/-inf float mask (PyTorch's additive form) would otherwise be read with some polarity."""
    mask = torch.zeros(2, 5) if name == "key_padding_mask" else torch.zeros(5, 5)
    message = f"{name} must be a bool tensor with True = blocked, got torch.float32"
    with pytest.raises(TypeError, match=message):
        _through(entry, **{name: mask})


def test_merge_masks_refuses_wrong_shapes():
    kpm_error = r"key_padding_mask has shape \(5, 2\); expected \(B, S\) = \(2, 5\)"
    with pytest.raises(ValueError, match=kpm_error):
        merge_masks(None, torch.zeros(5, 2, dtype=torch.bool), batch_size=2, q_len=5, k_len=5)
    with pytest.raises(ValueError, match=r"attn_mask has shape \(4, 5\); expected \(L, S\)"):
        merge_masks(torch.zeros(4, 5, dtype=torch.bool), None, batch_size=2, q_len=5, k_len=5)
    with pytest.raises(ValueError, match=r"attn_mask has shape \(5,\)"):
        merge_masks(torch.zeros(5, dtype=torch.bool), None, batch_size=2, q_len=5, k_len=5)
