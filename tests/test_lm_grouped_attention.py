"""Chapter 16: grouped-query attention equals attention written out and the paper's multi-head
attention on repeated key/value heads; with QK-norm, rotary positions and a sliding window it
equals ``transformers``' ``Qwen3Attention`` under the masks ``transformers`` builds from the
config (also with wide heads and left padding); cached decoding, one token at a time and past
the window, equals recomputing the whole sequence; the cache's storage is the formula's bytes.

Every comparison runs in float32 (atol 1e-5, rtol 1e-5) on random weights; nothing downloaded.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, masking_utils
from transformers.models.qwen3 import modeling_qwen3

from helpers import raises
from transformer_tutorial.attention import MultiHeadAttention
from transformer_tutorial.lm import grouped_attention
from transformer_tutorial.lm.cache import CacheLayout, SequenceBuffers
from transformer_tutorial.lm.grouped_attention import (
    GroupedQueryAttention,
    kv_cache_bytes,
    repeat_kv,
)
from transformer_tutorial.lm.rotary import RotaryEmbedding, RotaryPositions, apply_rotary
from transformer_tutorial.masks import causal_mask, merge_masks, sliding_window_causal_mask

D, H, DH = 32, 4, 8


def kv_cache(
    n_kv_heads: int = 2, d_head: int = DH, *, preallocate: tuple = (), dtype=None
) -> SequenceBuffers:
    """An empty cache of chapter 16's keys and values: growing, or ``preallocate=(B, S)``."""
    layout = CacheLayout(("k", "v"), ((n_kv_heads, d_head),) * 2, seq_dim=2)
    if not preallocate:
        return SequenceBuffers(layout)
    return SequenceBuffers.preallocate(layout, *preallocate, dtype=dtype)


TOL = dict(atol=1e-5, rtol=1e-5)
LAYOUTS = [4, 2, 1]  # n_kv_heads: multi-head, grouped, multi-query


def _qwen3_config(n_kv_heads: int, window: int | None, head_dim: int = DH) -> Qwen3Config:
    config = Qwen3Config(
        hidden_size=D,
        num_attention_heads=H,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
        num_hidden_layers=1,
        rms_norm_eps=1e-6,
        attention_bias=False,
        use_sliding_window=window is not None,
        sliding_window=window,
        max_window_layers=0,
    )
    config._attn_implementation = "eager"  # attention written out, the mask passed in
    return config


def _rotary_hook(config: Qwen3Config):
    """transformers' own rotary embedding as a position hook: (q, k, position ids) → (q, k)."""
    rotary = modeling_qwen3.Qwen3RotaryEmbedding(config)

    def hook(q, k, position_ids):
        cos, sin = rotary(q, position_ids)
        return modeling_qwen3.apply_rotary_pos_emb(q, k, cos, sin)

    return hook


def _book_rotary_hook(head_dim: int = DH):
    """Chapter 15's rotary embedding (the package's ``lm.rotary``) as a position hook."""
    rotary = RotaryEmbedding(head_dim, max_len=64)

    def hook(q, k, position_ids):
        cos, sin = rotary(q, position_ids)
        return apply_rotary(q, k, cos, sin)

    return hook


def _ours(
    n_kv_heads: int,
    window: int | None = None,
    *,
    book_rotary: bool = False,
    d_head: int = DH,
    **kwargs,
) -> GroupedQueryAttention:
    torch.manual_seed(0)
    config = _qwen3_config(n_kv_heads, window, d_head)
    positions = _book_rotary_hook(d_head) if book_rotary else _rotary_hook(config)
    return GroupedQueryAttention(
        D, H, n_kv_heads, d_head=d_head, window=window, rotary=positions, **kwargs
    ).eval()


def _qwen3_pair(n_kv_heads: int, window: int | None, d_head: int = DH, *, book_rotary=False):
    """Qwen3Attention (QK-norm weights drawn away from 1: the norms' order then matters) and
    our module with its weights."""
    config = _qwen3_config(n_kv_heads, window, d_head)
    theirs = modeling_qwen3.Qwen3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        theirs.q_norm.weight.uniform_(0.5, 1.5)
        theirs.k_norm.weight.uniform_(0.5, 1.5)
    ours = _ours(
        n_kv_heads,
        window,
        book_rotary=book_rotary,
        d_head=d_head,
        qk_norm=True,
        norm_eps=config.rms_norm_eps,
    )
    ours.load_state_dict(
        {n.replace("o_proj", "out_proj"): w for n, w in theirs.state_dict().items()}
    )
    return config, theirs, ours


def _qwen3_output(config, theirs, x, position_ids, pad=None):
    """Qwen3Attention under the mask Qwen3Model gives its layers: built by transformers from
    the config (``sliding_window`` read there, not in the attention) and the padding."""
    create = (
        masking_utils.create_causal_mask
        if config.sliding_window is None
        else masking_utils.create_sliding_window_causal_mask
    )
    mask = create(
        config=config,
        inputs_embeds=x,
        attention_mask=None if pad is None else (~pad).long(),
        cache=None,
        position_ids=position_ids,
    )
    rotary = modeling_qwen3.Qwen3RotaryEmbedding(config)
    return theirs(x, rotary(x, position_ids), mask)[0]


@pytest.mark.parametrize("n_rep", [1, 2, 4])
def test_repeat_kv_equals_transformers_and_repeat_interleave(n_rep):
    x = torch.randn(2, 3, 5, DH)
    out = repeat_kv(x, n_rep)
    assert out.shape == (2, 3 * n_rep, 5, DH)
    assert torch.equal(out, modeling_qwen3.repeat_kv(x, n_rep))
    assert torch.equal(out, torch.repeat_interleave(x, n_rep, dim=1))


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("n_kv_heads", LAYOUTS)
def test_grouped_attention_equals_attention_written_out_on_repeated_heads(n_kv_heads, window):
    """Independent of F.scaled_dot_product_attention: each key/value head repeated for its
    group (repeat_interleave), scores masked by index arithmetic, an explicit softmax."""
    ours = GroupedQueryAttention(D, H, n_kv_heads, window=window).eval()
    B, L = 2, 7
    x = torch.randn(B, L, D)
    n_rep = H // n_kv_heads
    with torch.no_grad():
        q = ours.q_proj(x).view(B, L, H, DH).transpose(1, 2)  # (B, H, L, Dh)
        k, v = (
            proj(x).view(B, L, n_kv_heads, DH).transpose(1, 2).repeat_interleave(n_rep, dim=1)
            for proj in (ours.k_proj, ours.v_proj)
        )  # (B, H, L, Dh) each
        scores = q @ k.transpose(-2, -1) / DH**0.5
        i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
        blocked = (j > i) | (j <= i - (window or L + 1))
        weights = torch.softmax(scores.masked_fill(blocked, float("-inf")), dim=-1)
        expected = ours.out_proj((weights @ v).transpose(1, 2).reshape(B, L, D))
        torch.testing.assert_close(ours(x), expected, **TOL)


@pytest.mark.parametrize("n_kv_heads", LAYOUTS)
def test_grouped_attention_equals_multi_head_attention_on_repeated_kv_weights(n_kv_heads):
    """Chapter 4's MultiHeadAttention whose key/value projections repeat each group's rows is
    the same function: GQA is MHA with heads tied in groups."""
    ours = GroupedQueryAttention(D, H, n_kv_heads).eval()
    mha = MultiHeadAttention(D, H, bias=False).eval()
    n_rep = H // n_kv_heads
    with torch.no_grad():
        mha.q_proj.weight.copy_(ours.q_proj.weight)
        mha.out_proj.weight.copy_(ours.out_proj.weight)
        for theirs, mine in ((mha.k_proj, ours.k_proj), (mha.v_proj, ours.v_proj)):
            rows = mine.weight.view(n_kv_heads, DH, D).repeat_interleave(n_rep, dim=0)
            theirs.weight.copy_(rows.reshape(D, D))
    x = torch.randn(3, 9, D)
    expected, _ = mha(x, x, x, attn_mask=causal_mask(9))
    torch.testing.assert_close(ours(x), expected, **TOL)
    n_projected = sum(p.numel() for p in ours.k_proj.parameters())
    assert n_projected == D * D // n_rep  # 1/n_rep of MHA's key weights


@pytest.mark.parametrize("book_rotary", [False, True], ids=["hf-rotary", "book-rotary"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("n_kv_heads", LAYOUTS)
def test_qk_norm_attention_equals_qwen3_attention(n_kv_heads, window, book_rotary):
    """Qwen3Attention (RMS QK-norm with learned weights before rotary, grouped heads, eager
    attention under the mask transformers builds from the config) with our weights copied in;
    our position hook is transformers' rotary embedding or the package's (chapter 15)."""
    config, theirs, ours = _qwen3_pair(n_kv_heads, window, book_rotary=book_rotary)
    B, L = 2, 10
    x = torch.randn(B, L, D)
    position_ids = torch.arange(L).expand(B, L)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), _qwen3_output(config, theirs, x, position_ids), **TOL)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("n_kv_heads", LAYOUTS)
def test_wide_heads_and_left_padding_equal_qwen3_attention(n_kv_heads, window):
    """Heads of width 16, H · Dh = 64 ≠ D = 32 (Qwen3 0.6B, 4B and 32B choose head_dim apart
    from D), and a row left-padded by 3 under a window of 3: its positions skip the padding,
    transformers builds the mask from its attention mask, and the real positions agree."""
    config, theirs, ours = _qwen3_pair(n_kv_heads, window, d_head=16)
    assert ours.q_proj.weight.shape == (H * 16, D) and H * 16 != D
    B, L = 2, 10
    x = torch.randn(B, L, D)
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[0, :3] = True
    position_ids = (torch.cumsum(~pad, dim=1) - 1).clamp(min=0)
    with torch.no_grad():
        out = ours(x, position_ids=position_ids, key_padding_mask=pad)
        expected = _qwen3_output(config, theirs, x, position_ids, pad)
    torch.testing.assert_close(out[~pad], expected[~pad], **TOL)
    assert torch.isfinite(out).all()


def test_qk_norm_before_the_positions_is_not_after_unless_the_weight_is_constant():
    """nanochat normalises after rotary without a weight, Qwen3 before with one: the same
    function only while the weight is constant (a rotation keeps the RMS)."""
    config = _qwen3_config(2, None)
    rotary = _rotary_hook(config)
    before = _ours(2, qk_norm=True)
    after = _ours(2)  # same projections (same seed), the norms applied inside the hook

    def rotate_then_norm(q, k, position_ids):
        q, k = rotary(q, k, position_ids)
        return before.q_norm(q), before.k_norm(k)

    after.rotary = rotate_then_norm
    x = torch.randn(2, 8, D)
    with torch.no_grad():
        torch.testing.assert_close(before(x), after(x), **TOL)  # weights all 1
        before.q_norm.weight.uniform_(0.5, 1.5)
        before.k_norm.weight.uniform_(0.5, 1.5)
        assert (before(x) - after(x)).abs().max() > 1e-3


def _decode(ours: GroupedQueryAttention, x: torch.Tensor, cache: SequenceBuffers, chunks):
    out, start = [], 0
    for n in chunks:
        out.append(ours(x[:, start : start + n], cache=cache))
        start += n
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("d_head", [DH, 16])
@pytest.mark.parametrize("preallocate", [False, True])
@pytest.mark.parametrize("window", [None, 1, 3])
@pytest.mark.parametrize("n_kv_heads", LAYOUTS)
def test_cached_decoding_past_the_window_equals_recomputing(
    n_kv_heads, window, preallocate, d_head
):
    """A prompt of 4 (longer than a window of 3 or 1), then one token at a time and a chunk of
    3 — 14 positions, past the window — with rotary positions and QK-norm, equals one call on
    the whole sequence; also with heads of 16, H · Dh ≠ D."""
    ours = _ours(n_kv_heads, window, d_head=d_head, qk_norm=True)
    B, L = 2, 14
    x = torch.randn(B, L, D)
    chunks = [4, 1, 1, 3, 1, 1, 1, 1, 1]
    capacity = L if window is None else window - 1 + max(chunks)
    cache = kv_cache(n_kv_heads, d_head, preallocate=(B, capacity) if preallocate else ())
    with torch.no_grad():
        torch.testing.assert_close(_decode(ours, x, cache, chunks), ours(x), **TOL)
    assert cache.seen == L
    if window is not None and not preallocate:
        assert cache.held == window - 1  # only what a later query can still see


@pytest.mark.parametrize("preallocate", [False, True])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("n_kv_heads", LAYOUTS)
def test_the_calls_without_a_mask_tensor_equal_the_masked_attention(
    n_kv_heads, window, preallocate, monkeypatch
):
    """Without padding, a whole sequence runs with ``is_causal=True`` and a one-token step after
    the cache with no mask at all (F.sdpa's fastest kernels); each equals the explicit mask."""
    ours = _ours(n_kv_heads, window, qk_norm=True)
    B, L = 2, 9
    x = torch.randn(B, L, D, generator=torch.Generator().manual_seed(n_kv_heads))
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, attn_mask=None, is_causal=False, **kwargs):
        calls.append((attn_mask is None, is_causal))
        return sdpa(*args, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    def run() -> torch.Tensor:
        cache = kv_cache(n_kv_heads, preallocate=(B, L) if preallocate else ())
        with torch.no_grad():
            return torch.cat([ours(x), _decode(ours, x, cache, [4, 1, 1, 3])], dim=1)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    fast = run()
    # The whole sequence, then the prompt of 4 and the chunk of 3: a mask tensor (but a whole
    # sequence without a window: is_causal); the two one-token steps: no mask at all, unless
    # the cache holds keys out of the window (a preallocated one keeps them until it is full).
    whole = (True, True) if window is None else (False, False)
    step = (True, False) if window is None or not preallocate else (False, False)
    assert calls == [whole, whole, step, step, (False, False)]

    def explicit(B, L, S, pad, *, window, device):  # the mask tensor, always
        if window is None:
            blocked = causal_mask(L, S, device=device)
        else:
            blocked = sliding_window_causal_mask(L, S, window=window, device=device)
        pad = None if pad is None else pad[:, -S:]
        return ~merge_masks(blocked, pad, batch_size=B, q_len=L, k_len=S), False

    monkeypatch.setattr(grouped_attention, "sdpa_mask", explicit)
    torch.testing.assert_close(fast, run(), **TOL)


@pytest.mark.parametrize("window", [None, 3])
def test_a_left_padded_row_with_a_cache_decodes_like_the_row_alone(window):
    """A row left-padded by 2, its padding masked and its position ids counting real tokens
    only, decodes like the same row alone. (Rotary scores depend on distances only, so here
    the default ids, shifted by the padding, agree as well; absolute positions would not.)"""
    ours = _ours(2, window, qk_norm=True)
    x = torch.randn(1, 9, D)
    padded = torch.cat([torch.zeros(1, 2, D), x], dim=1)  # (1, 11, D)
    pad = torch.tensor([[True, True] + [False] * 9])
    positions = (torch.cumsum(~pad, dim=1) - 1).clamp(min=0)  # 0, 0, 0, 1, ..., 8
    with torch.no_grad():
        alone = _decode(ours, x, kv_cache(), [4] + [1] * 5)
        cache, out = kv_cache(), []
        for start, n in ((0, 6), *((t, 1) for t in range(6, 11))):
            out.append(
                ours(
                    padded[:, start : start + n],
                    position_ids=positions[:, start : start + n],
                    key_padding_mask=pad[:, : start + n],
                    cache=cache,
                )
            )
        padded_out = torch.cat(out, dim=1)
        naive = ours(padded, key_padding_mask=pad)
    torch.testing.assert_close(padded_out[:, 2:], alone, **TOL)
    assert torch.isfinite(padded_out).all()  # padding queries that see no key give no NaN
    torch.testing.assert_close(naive[:, 2:], alone, **TOL)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_kv_heads", LAYOUTS)
def test_kv_cache_bytes_is_the_storage_the_caches_keep(n_kv_heads, dtype, window):
    """Measured as storage, not as the views' sizes, after a prompt longer than the window (a
    slice of the prompt's keys would keep all of them allocated) and after each later step."""
    n_layers, B, L, prompt = 3, 2, 11, 7
    layers = [
        GroupedQueryAttention(D, H, n_kv_heads, window=window).to(dtype).eval()
        for _ in range(n_layers)
    ]
    caches = [kv_cache(n_kv_heads) for _ in layers]
    x = torch.randn(B, L, D, dtype=dtype)
    shape = dict(n_layers=n_layers, batch_size=B, n_kv_heads=n_kv_heads, d_head=DH, dtype=dtype)
    with torch.no_grad():
        for start, n in ((0, prompt), *((t, 1) for t in range(prompt, L))):
            h = x[:, start : start + n]
            for layer, cache in zip(layers, caches, strict=True):
                h = layer(h, cache=cache)
            seen = start + n
            held = seen if window is None else min(seen, window - 1)
            expected = kv_cache_bytes(length=held, **shape)
            storage = sum(t.untyped_storage().nbytes() for c in caches for t in c.buffers)
            assert storage == expected
            assert sum(c.nbytes for c in caches) == expected
    preallocated = SequenceBuffers.preallocate(layers[0].cache_layout, B, 64, dtype=dtype)
    assert preallocated.nbytes * n_layers == kv_cache_bytes(length=64, **shape)


def test_the_cache_keeps_no_larger_tensor_alive_for_a_view_it_is_given():
    """Keys handed in as a slice of a larger tensor (a fused QKV projection, say) are copied."""
    fused = torch.randn(1, 2, 5, 3 * DH)
    cache = kv_cache()
    cache.update(fused[..., DH : 2 * DH], fused[..., 2 * DH :])
    storage = sum(b.untyped_storage().nbytes() for b in cache.buffers)
    assert storage == cache.nbytes == 2 * fused[..., :DH].numel() * fused.element_size()
    torch.testing.assert_close(cache.buffers[0], fused[..., DH : 2 * DH], rtol=0, atol=0)


def test_kv_cache_bytes_of_llama_3_8b():
    """32 layers, 8 key/value heads of 128, bfloat16: 128 KiB a token (32 heads: 512 KiB)."""
    llama = dict(n_layers=32, batch_size=1, length=1, d_head=128, dtype=torch.bfloat16)
    assert kv_cache_bytes(n_kv_heads=8, **llama) == 128 * 1024
    assert kv_cache_bytes(n_kv_heads=32, **llama) == 512 * 1024


def test_a_full_preallocated_cache_says_so():
    ours = GroupedQueryAttention(D, H, 2).eval()
    cache = kv_cache(preallocate=(1, 4))
    with torch.no_grad():
        ours(torch.randn(1, 3, D), cache=cache)
        raises(lambda: ours(torch.randn(1, 2, D), cache=cache), ValueError, "holds 4 positions")


@pytest.mark.parametrize(
    "make, error, phrase",
    [
        (lambda: GroupedQueryAttention(30, 4), ValueError, "d_model=30 must be divisible"),
        (lambda: GroupedQueryAttention(32, 4, 3), ValueError, "n_kv_heads=3 must divide n_heads"),
        (lambda: GroupedQueryAttention(32, 4, 3), ValueError, "[1, 2, 4]"),
        (lambda: GroupedQueryAttention(32, 4, 0), ValueError, "n_kv_heads must be at least 1"),
        (lambda: GroupedQueryAttention(32, 4, window=0), ValueError, "window must be at least 1"),
        (lambda: GroupedQueryAttention(32, 4, norm_eps=0.0), ValueError, "norm_eps must be"),
        (lambda: GroupedQueryAttention(32, 4, rotary=3), TypeError, "rotary must be"),
        (lambda: GroupedQueryAttention(32, 4, backend="flash"), ValueError, "attention_backend"),
        (
            lambda: GroupedQueryAttention(32, 4, window=2, backend="tiled"),
            ValueError,
            "'tiled' (chapter 22) has no sliding window",
        ),
        (lambda: repeat_kv(torch.zeros(1, 2, 3, 4), 0), ValueError, "n_rep must be at least 1"),
        (
            lambda: kv_cache_bytes(
                n_layers=1, batch_size=1, length=1, n_kv_heads=1, d_head=1, dtype=2
            ),
            TypeError,
            "dtype must be a torch.dtype",
        ),
        (
            lambda: GroupedQueryAttention(32, 4)(torch.zeros(2, 5, 16)),
            ValueError,
            "x must be (B, L, D=32)",
        ),
        (
            lambda: GroupedQueryAttention(32, 4)(
                torch.zeros(2, 5, 32), key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)
            ),
            ValueError,
            "expected (B, seen + L) = (2, 5)",
        ),
        (
            lambda: GroupedQueryAttention(32, 4)(
                torch.zeros(2, 5, 32), key_padding_mask=torch.zeros(2, 5)
            ),
            TypeError,
            "key_padding_mask must be a bool tensor",
        ),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(make, error, phrase):
    raises(make, error, phrase)


def test_a_head_width_of_its_own_needs_no_divisible_d_model():
    ours = GroupedQueryAttention(30, 4, 2, d_head=16)
    assert ours.q_proj.weight.shape == (64, 30) and ours.k_proj.weight.shape == (32, 30)
    assert ours(torch.randn(1, 3, 30)).shape == (1, 3, 30)


@pytest.mark.parametrize("preallocate", [False, True])
def test_rewind_forgets_the_last_positions(preallocate):
    """Decoding 6 positions, rewinding 3 and decoding 3 others equals decoding the 3 kept and
    the 3 others from scratch (speculative decoding's rejected tokens, chapter 23).

    Not bitwise: the rewound cache attends over other matrix shapes than the fresh one (a
    preallocated buffer, a longer history written before), and BLAS kernels block those
    differently (measured: 6e-8 apart in float32 on an AMD EPYC). In float64 what is left of the
    rounding is 1e-16 relative: 1e-12 would still catch a single position not forgotten."""
    torch.manual_seed(0)
    ours = GroupedQueryAttention(D, H, 2, rotary=_book_rotary_hook()).double().eval()
    x, other = torch.randn(1, 6, D, dtype=torch.float64), torch.randn(1, 3, D, dtype=torch.float64)
    cache = kv_cache(preallocate=(1, 16) if preallocate else (), dtype=torch.float64)
    fresh = kv_cache()
    with torch.no_grad():
        ours(x, cache=cache)
        cache.rewind(3)
        assert (cache.seen, cache.held) == (3, 3)
        got = ours(other, cache=cache)
        ours(x[:, :3], cache=fresh)
        torch.testing.assert_close(got, ours(other, cache=fresh), atol=1e-12, rtol=0)
    raises(lambda: cache.rewind(7), ValueError, "n=7 exceeds the 6 positions")
    raises(lambda: cache.rewind(-1), ValueError, "n must be at least 0")


def test_rewind_refuses_a_cache_that_dropped_positions():
    ours = GroupedQueryAttention(D, H, 2, window=2).eval()
    cache = SequenceBuffers(ours.cache_layout)
    with torch.no_grad():
        ours(torch.randn(1, 4, D), cache=cache)
    raises(lambda: cache.rewind(1), ValueError, "dropped 3 older positions")


# --- API probes (issue 42): each bad call, and what its error must say ------------------------

X3 = torch.randn(1, 3, 16)
GROUPED_PROBES = {
    "3-D keys": (
        lambda: repeat_kv(torch.randn(2, 3, 4), 2),
        ValueError,
        "x must be (B, Hkv, S, Dh), got shape (2, 3, 4)",
    ),
    "x a list": (
        lambda: GroupedQueryAttention(16, 2)([1.0]),
        TypeError,
        "x must be a Tensor (B, L, D=16), got list",
    ),
    "integer x": (
        lambda: GroupedQueryAttention(16, 2)(X3.long()),
        TypeError,
        "x must be a floating-point tensor, got torch.int64",
    ),
    "a cache of latents": (
        lambda: GroupedQueryAttention(16, 2)(X3, SequenceBuffers(CacheLayout(("c",), ((4,),), 1))),
        TypeError,
        "cache must keep k (B, 2, S, 8), v (B, 2, S, 8) (the attention's cache_layout), got "
        "SequenceBuffers keeping c (B, S, 4)",
    ),
    "position ids for 4 positions": (
        lambda: GroupedQueryAttention(16, 2, rotary=RotaryPositions(8))(
            X3, position_ids=torch.arange(4)[None]
        ),
        ValueError,
        "position_ids must be (B, L=3), got (1, 4)",
    ),
    "float position ids": (
        lambda: GroupedQueryAttention(16, 2)(X3, position_ids=torch.zeros(1, 3)),
        TypeError,
        "position_ids must be an integer tensor, got torch.float32",
    ),
    "a cache of other heads": (
        lambda: GroupedQueryAttention(16, 2)(X3, kv_cache(1, 8)),
        TypeError,
        "cache must keep k (B, 2, S, 8), v (B, 2, S, 8)",
    ),
    "dropout 1": (
        lambda: GroupedQueryAttention(16, 2, dropout=1.0),
        ValueError,
        "dropout must be in [0.0, 1.0), got 1.0",
    ),
}


@pytest.mark.parametrize(
    ("call", "error", "phrase"), GROUPED_PROBES.values(), ids=GROUPED_PROBES.keys()
)
def test_bad_calls_name_the_argument_and_what_is_valid(call, error, phrase):
    raises(call, error, phrase)


def test_a_refused_call_leaves_the_cache_as_it_was():
    attention = GroupedQueryAttention(16, 2)
    cache = SequenceBuffers(attention.cache_layout)
    attention(X3, cache)
    raises(
        lambda: attention(X3, cache, key_padding_mask=torch.zeros(1, 3).bool()), ValueError, "6"
    )
    raises(lambda: attention(X3.long(), cache), TypeError, "x must be a floating-point")
    raises(lambda: attention(X3[..., :8], cache), ValueError, "x must be (B, L, D=16)")
    assert (cache.seen, cache.held) == (3, 3)
