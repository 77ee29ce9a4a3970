"""Chapter 6: masks mean True = blocked and merge into one broadcastable bool tensor; every entry
point refuses a float mask, and a mask whose shape does not fit its scores, naming the argument.

What masks do inside the model is tested where it happens: attention with masks equals
``nn.MultiheadAttention`` and never gives NaN (test_attention.py), the decoder layer is causal and
the layers ignore padding (test_layers.py), the model derives its masks from ``pad_id``
(test_model.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import raises, tiny_config
from transformer_tutorial.attention import MultiHeadAttention, scaled_dot_product_attention
from transformer_tutorial.layers import DecoderLayer, EncoderLayer
from transformer_tutorial.lm.cache import SequenceBuffers
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.grouped_attention import GroupedQueryAttention
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.masks import (
    causal_mask,
    check_mask,
    merge_masks,
    padding_mask,
    sliding_window_causal_mask,
)
from transformer_tutorial.model import Transformer
from transformer_tutorial.stacks import Decoder, Encoder

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
        (torch.zeros(B, 1, L, S, dtype=torch.bool), None, (B, 1, L, S)),
    ]
    for attn_mask, key_padding_mask, shape in cases:
        merged = merge_masks(
            attn_mask, key_padding_mask, batch_size=B, q_len=L, k_len=S, n_heads=2
        )
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


def _bool(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.bool)


def _translation_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(tiny_config()).eval()


SRC = torch.tensor([[3, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])  # (B, S) = (2, 6), no padding
TGT = torch.tensor([[2, 5, 6, 7, 8], [2, 5, 6, 7, 8]])  # (B, T) = (2, 5)
Q3, Q4 = torch.randn(2, 5, 4), torch.randn(2, 2, 5, 4)  # (B, L, Dk), (B, H, L, Dk)
X, MEMORY = torch.randn(2, 5, 16), torch.randn(2, 6, 16)  # (B, T, D), (B, S, D)
LM = LMConfig(vocab_size=11, d_model=16, n_heads=4, n_layers=1, d_ff=32, max_len=12,
              dropout=0.0, positions="rope", attention="gqa")  # fmt: skip
ATTN_LS = "(L, S) = (5, 5) or (B, L, S) = (2, 5, 5), True = blocked"


def _lm_step_after(n_cached: int, padding: torch.Tensor) -> None:
    """Cache ``n_cached`` tokens, then one more with ``padding``."""
    lm = LanguageModel(LM).eval()
    ids = torch.ones(2, n_cached + 1, dtype=torch.long)
    _, cache = lm.step(ids[:, :n_cached])
    lm.step(ids[:, n_cached:], cache, padding_mask=padding)


# (entry point, the call with a mask that does not fit, the error, the phrase a user reads)
BAD_MASKS = [
    (
        "sdpa: 4-D mask, 3-D queries",
        lambda: scaled_dot_product_attention(Q3, Q3, Q3, attn_mask=_bool(2, 2, 5, 5)),
        ValueError,
        f"attn_mask has shape (2, 2, 5, 5); expected {ATTN_LS}",
    ),
    (
        "sdpa: 4-D mask, 3-D queries, weights",
        lambda: scaled_dot_product_attention(
            Q3, Q3, Q3, attn_mask=_bool(2, 3, 5, 5), need_weights=True
        ),
        ValueError,
        "attn_mask has shape (2, 3, 5, 5)",
    ),
    (
        "sdpa: 3 mask heads, 1 query head",
        lambda: scaled_dot_product_attention(
            Q4[:, :1], Q4[:, :1], Q4[:, :1], attn_mask=_bool(2, 3, 5, 5)
        ),
        ValueError,
        "attn_mask has shape (2, 3, 5, 5); expected (L, S) = (5, 5) or (B, L, S) = (2, 5, 5) or "
        "(B, H, L, S) = (2, 1, 5, 5)",
    ),
    (
        "sdpa: 3 mask heads, 2 query heads",
        lambda: scaled_dot_product_attention(Q4, Q4, Q4, attn_mask=_bool(2, 3, 5, 5)),
        ValueError,
        "(B, H, L, S) = (2, 2, 5, 5) or (B, 1, L, S) = (2, 1, 5, 5), True = blocked",
    ),
    (
        "sdpa: 5-D mask",
        lambda: scaled_dot_product_attention(Q4, Q4, Q4, attn_mask=_bool(1, 2, 2, 5, 5)),
        ValueError,
        "attn_mask has shape (1, 2, 2, 5, 5)",
    ),
    (
        "sdpa: key padding (B, L, S)",
        lambda: scaled_dot_product_attention(Q3, Q3, Q3, key_padding_mask=_bool(2, 5, 5)),
        ValueError,
        "key_padding_mask has shape (2, 5, 5); expected (B, S) = (2, 5), True at padding",
    ),
    (
        "MultiHeadAttention: 3 mask heads for 4",
        lambda: MultiHeadAttention(16, 4)(X, X, X, attn_mask=_bool(2, 3, 5, 5)),
        ValueError,
        "attn_mask has shape (2, 3, 5, 5)",
    ),
    (
        "MultiHeadAttention.attend: key padding of the queries' length",
        lambda: (
            lambda m: m.attend(X, m.project_kv(MEMORY, MEMORY), key_padding_mask=_bool(2, 5))
        )(MultiHeadAttention(16, 4)),
        ValueError,
        "key_padding_mask has shape (2, 5); expected (B, S) = (2, 6)",
    ),
    (
        "MultiHeadAttention.attend_heads: (B, L, S) of another batch",
        lambda: (lambda m: m.attend_heads(*m.project_qkv(X), attn_mask=_bool(3, 5, 5)))(
            MultiHeadAttention(16, 4)
        ),
        ValueError,
        "attn_mask has shape (3, 5, 5)",
    ),
    (
        "Encoder.forward_with_weights",
        lambda: Encoder([EncoderLayer(16, 4, 32, 0.0)]).forward_with_weights(
            MEMORY, src_key_padding_mask=_bool(2, 7)
        ),
        ValueError,
        "src_key_padding_mask has shape (2, 7); expected (B, S) = (2, 6)",
    ),
    (
        "Decoder.forward_with_weights",
        lambda: Decoder([DecoderLayer(16, 4, 32, 0.0)]).forward_with_weights(
            X, MEMORY, memory_key_padding_mask=_bool(2, 5)
        ),
        ValueError,
        "memory_key_padding_mask has shape (2, 5); expected (B, S) = (2, 6)",
    ),
    (
        "EncoderLayer",
        lambda: EncoderLayer(16, 4, 32, 0.0)(MEMORY, src_key_padding_mask=_bool(2, 5)),
        ValueError,
        "src_key_padding_mask has shape (2, 5); expected (B, S) = (2, 6), True at padding",
    ),
    (
        "EncoderLayer.forward_with_weights",
        lambda: EncoderLayer(16, 4, 32, 0.0).forward_with_weights(
            MEMORY, src_key_padding_mask=_bool(6, 2)
        ),
        ValueError,
        "src_key_padding_mask has shape (6, 2); expected (B, S) = (2, 6)",
    ),
    (
        "DecoderLayer: target padding",
        lambda: DecoderLayer(16, 4, 32, 0.0)(X, MEMORY, tgt_key_padding_mask=_bool(2, 6)),
        ValueError,
        "tgt_key_padding_mask has shape (2, 6); expected (B, T) = (2, 5), True at padding",
    ),
    (
        "DecoderLayer: memory padding",
        lambda: DecoderLayer(16, 4, 32, 0.0).forward_with_weights(
            X, MEMORY, memory_key_padding_mask=_bool(2, 5)
        ),
        ValueError,
        "memory_key_padding_mask has shape (2, 5); expected (B, S) = (2, 6)",
    ),
    (
        "DecoderLayer.step",
        lambda: (
            lambda d: d.step(X[:, :1], d.init_cache(MEMORY), memory_key_padding_mask=_bool(2, 1))
        )(DecoderLayer(16, 4, 32, 0.0)),
        ValueError,
        "memory_key_padding_mask has shape (2, 1); expected (B, S) = (2, 6)",
    ),
    (
        "Transformer.encode",
        lambda: _translation_model().encode(SRC, _bool(2, 5)),
        ValueError,
        "src_key_padding_mask has shape (2, 5); expected (B, S) = (2, 6)",
    ),
    (
        "Transformer.forward",
        lambda: _translation_model()(SRC, TGT, tgt_key_padding_mask=_bool(5, 2)),
        ValueError,
        "tgt_key_padding_mask has shape (5, 2); expected (B, T) = (2, 5)",
    ),
    (
        "Transformer.decode",
        lambda: _translation_model().decode(TGT, MEMORY, memory_key_padding_mask=_bool(2, 6, 1)),
        ValueError,
        "memory_key_padding_mask has shape (2, 6, 1); expected (B, S) = (2, 6)",
    ),
    (
        "Transformer.decode_step",
        lambda: (lambda m: m.decode_step(TGT[:, :1], m.init_cache(MEMORY, _bool(1, 6))))(
            _translation_model()
        ),
        ValueError,
        "memory_key_padding_mask has shape (1, 6); expected (B, S) = (2, 6)",
    ),
    (
        "GroupedQueryAttention",
        lambda: GroupedQueryAttention(16, 4, 2)(X, key_padding_mask=_bool(2, 4)),
        ValueError,
        "key_padding_mask has shape (2, 4); expected (B, seen + L) = (2, 5), True at padding",
    ),
    (
        "LanguageModel: float padding",
        lambda: LanguageModel(LM)(TGT, padding_mask=torch.zeros(2, 5)),
        TypeError,
        "padding_mask must be a bool tensor with True = blocked, got torch.float32",
    ),
    (
        "LanguageModel.step: the new positions only",
        lambda: _lm_step_after(4, _bool(2, 1)),
        ValueError,
        "padding_mask has shape (2, 1); expected (B, cached + new) = (2, 5), True at padding",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "phrase"), [r[1:] for r in BAD_MASKS], ids=[r[0] for r in BAD_MASKS]
)
def test_every_entry_point_refuses_a_mask_of_the_wrong_shape_naming_it(call, error, phrase):
    """A mask that does not fit the scores as the docstring says is refused by name, never
    broadcast into a wrong shape (a 4-D mask on 3-D queries gave 4-D outputs) nor left to a
    size error deep inside."""
    raises(call, error, phrase)


def test_check_mask_lets_none_and_every_listed_shape_through():
    shapes = {"(L, S)": (5, 6), "(B, L, S)": (2, 5, 6)}
    for mask in (None, _bool(5, 6), _bool(2, 5, 6)):
        check_mask("attn_mask", mask, shapes)
    raises(lambda: check_mask("m", _bool(6, 5), shapes), ValueError, "m has shape (6, 5)")


def test_a_refused_padding_mask_leaves_the_cache_as_it_was():
    """The mask is checked before the cache takes the new keys: after the error the cache still
    holds the prompt only, and decoding can go on."""
    torch.manual_seed(0)
    attention = GroupedQueryAttention(16, 4, 2).eval()
    cache = SequenceBuffers(attention.cache_layout)
    with torch.no_grad():
        attention(X, cache=cache)
        k, v = (b.clone() for b in cache.buffers)
        raises(lambda: attention(X[:, :1], cache=cache, key_padding_mask=_bool(2, 1)),
               ValueError, "expected (B, seen + L) = (2, 6)")  # fmt: skip
        assert (
            cache.seen == 5
            and torch.equal(cache.buffers[0], k)
            and torch.equal(cache.buffers[1], v)
        )
        out = attention(X[:, :1], cache=cache, key_padding_mask=_bool(2, 6))
    assert out.shape == (2, 1, 16) and cache.seen == 6
