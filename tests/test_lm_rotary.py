"""Chapter 15: rotary position embeddings equal ``transformers``' Llama RoPE, the paper's
interleaved pairs (Meta's complex-number form) and nanochat's −θ form; the three layouts are one
function up to a signed permutation of the q/k weight rows; scores depend only on m − n."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from helpers import raises, to_device
from transformer_tutorial.embeddings import sinusoidal_table
from transformer_tutorial.lm.rotary import (
    LAYOUTS,
    RotaryEmbedding,
    RotaryPositions,
    apply_rotary,
    convert_qk_weight,
    qk_row_permutation,
    rotary_frequencies,
    rotate,
    rotate_half,
)

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaAttention,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

B, H, H_KV, L, DH = 2, 4, 2, 9, 16


def _llama_config(base: float = 10000.0, max_len: int = 4096) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=H * DH,
        num_attention_heads=H,
        num_key_value_heads=H_KV,
        max_position_embeddings=max_len,
        rope_parameters={"rope_type": "default", "rope_theta": base},
        attn_implementation="eager",
    )


def _qk(seed: int = 0, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, DH, generator=gen, dtype=torch.float64)
    k = torch.randn(B, H_KV, L, DH, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype)


def _scores_at_all_positions(q: Tensor, k: Tensor, length: int, layout: str) -> Tensor:
    """``(length, length)``: the same query vector placed at m, the same key at n."""
    cos, sin = RotaryEmbedding(q.size(-1), max_len=length)(q, torch.arange(length))
    q_m = rotate(q.expand(1, 1, length, -1), cos, sin, layout=layout)[0, 0]  # (length, Dh)
    k_n = rotate(k.expand(1, 1, length, -1), cos, sin, layout=layout)[0, 0]
    return q_m @ k_n.T


def test_frequencies_and_tables_are_chapter_2s_sinusoids():
    table = sinusoidal_table(100, DH)  # (100, Dh): sin, cos, sin, cos, …
    rope = RotaryEmbedding(DH, max_len=100)
    torch.testing.assert_close(rope.cos[:, : DH // 2], table[:, 1::2], rtol=0, atol=1e-6)
    torch.testing.assert_close(rope.sin[:, : DH // 2], table[:, 0::2], rtol=0, atol=1e-6)
    assert torch.equal(rope.cos[:, : DH // 2], rope.cos[:, DH // 2 :])  # each angle twice
    expected = 10000.0 ** (-torch.arange(0, DH, 2, dtype=torch.float64) / DH)
    torch.testing.assert_close(rotary_frequencies(DH), expected, rtol=1e-15, atol=0)


@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_cos_sin_equal_llama_rotary_embedding(base: float, device):
    """Equal to ``LlamaRotaryEmbedding``'s up to its float32 angles: ``m · θ_i`` rounded in
    float32 is off by about m · 1.6e-8 (7e-5 at m ≈ 4000); ours come from float64 angles."""
    reference = LlamaRotaryEmbedding(_llama_config(base)).to(device)
    ours = RotaryEmbedding(DH, max_len=4096, base=base).to(device)
    x = torch.zeros(1, device=device)
    near = torch.arange(64, device=device).expand(B, -1)  # (B, 64)
    far = torch.randint(0, 4096, (B, 300), generator=torch.Generator().manual_seed(0))
    for positions, atol in ((near, 2e-6), (far.to(device), 2e-4)):
        for got, want in zip(ours(x, positions), reference(x, positions), strict=True):
            assert got.shape == want.shape == (B, positions.size(1), DH)
            torch.testing.assert_close(got, want, rtol=0, atol=atol)
    half = torch.zeros(1, device=device, dtype=torch.bfloat16)
    assert ours(half, near)[0].dtype == reference(half, near)[0].dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_apply_rotary_equals_apply_rotary_pos_emb(dtype: torch.dtype, device):
    """Given the same cos and sin, bit for bit in every dtype (k has fewer heads, as in GQA)."""
    q, k = to_device(_qk(dtype=dtype), device)
    positions = torch.randint(0, 4096, (B, L), generator=torch.Generator().manual_seed(1))
    cos, sin = LlamaRotaryEmbedding(_llama_config()).to(device)(q, positions.to(device))
    for got, want in zip(
        apply_rotary(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin), strict=True
    ):
        assert got.dtype == dtype
        assert torch.equal(got, want)
    ours = RotaryEmbedding(DH).to(device)(q, positions.to(device))
    if dtype == torch.float32:
        for got, want in zip(
            apply_rotary(q, k, *ours), apply_rotary_pos_emb(q, k, cos, sin), strict=True
        ):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-3)  # |q| < 5, cos off < 2e-4


def _meta_rotary(x: Tensor, positions: Tensor, base: float = 10000.0) -> Tensor:
    """Meta's Llama: pairs (x[2i], x[2i+1]) as complex numbers, times e^(i·m·θ_i)."""
    theta = base ** (-torch.arange(0, x.size(-1), 2, dtype=torch.float64) / x.size(-1))
    angles = torch.outer(positions.double(), theta)  # (L, Dh/2)
    turn = torch.polar(torch.ones_like(angles), angles)  # e^(i·m·θ_i)
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * turn).flatten(-2)


def _nanochat_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """nanochat: the half-split pairs turned by −θ (cos, sin: one angle per pair)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], dim=-1)


def test_interleaved_equals_metas_complex_rotation():
    q, _ = _qk(dtype=torch.float64)
    positions = torch.tensor([0, 1, 2, 5, 100, 1000, 2047, 3, 4])  # (L,)
    cos, sin = RotaryEmbedding(DH)(q, positions)
    got = rotate(q, cos.double(), sin.double(), layout="interleaved")
    torch.testing.assert_close(got, _meta_rotary(q, positions), rtol=0, atol=1e-6)


def test_half_split_negative_equals_nanochats_rotation():
    q, _ = _qk(dtype=torch.float64)
    positions = torch.arange(L) * 37
    cos, sin = RotaryEmbedding(DH)(q, positions)
    want = _nanochat_rotary(q, cos[:, : DH // 2].double(), sin[:, : DH // 2].double())
    got = rotate(q, cos.double(), sin.double(), layout="half_split_negative")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert not torch.allclose(got, rotate(q, cos.double(), sin.double()), atol=1e-3)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scores_depend_only_on_the_distance_and_norms_are_kept(layout: str):
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, DH, generator=gen, dtype=torch.float64)
    scores = _scores_at_all_positions(q, k, 64, layout)  # (64, 64)
    # Toeplitz: constant along every diagonal, so a function of m − n only
    torch.testing.assert_close(scores[1:, 1:], scores[:-1, :-1], rtol=0, atol=1e-6)
    assert scores.diagonal().sub(q @ k).abs().max() < 1e-6  # distance 0: no rotation at all
    assert (scores - scores[0, 0]).abs().max() > 1.0  # the distance does change the score
    positions = torch.arange(64)
    cos, sin = RotaryEmbedding(DH, max_len=64)(q, positions)
    turned = rotate(q.expand(1, 1, 64, -1), cos.double(), sin.double(), layout=layout)
    # cos² + sin² = 1 up to the tables' float32 rounding (measured: 2e-8 relative)
    torch.testing.assert_close(turned.norm(dim=-1), q.norm().expand(1, 1, 64), rtol=1e-6, atol=0)


def _hf_permute(w: Tensor, n_heads: int) -> Tensor:
    """``transformers``' convert_llama_weights_to_hf.py: Meta's (interleaved) q/k rows →
    half-split, per head."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def test_interleaved_to_half_split_is_the_llama_conversion_scripts_permutation():
    w = torch.randn(H * DH, 24)
    assert torch.equal(
        convert_qk_weight(w, H, source="interleaved", target="half_split"), _hf_permute(w, H)
    )
    index, sign = qk_row_permutation(8, source="interleaved", target="half_split")
    assert index.tolist() == [0, 2, 4, 6, 1, 3, 5, 7] and torch.equal(sign, torch.ones(8))
    wrong = _hf_permute(w, 1)  # the whole matrix treated as one head
    assert not torch.equal(wrong, _hf_permute(w, H))


@pytest.mark.parametrize(("source", "target"), list(itertools.permutations(LAYOUTS, 2)))
def test_converted_weights_give_the_same_scores(source: str, target: str):
    """For every pair of layouts: rotating converted q/k equals converting the rotated q/k
    (the same signed permutation), hence equal scores; a round trip is the identity."""
    gen = torch.Generator().manual_seed(3)
    w_q, w_k = torch.randn(2, H * DH, 24, generator=gen, dtype=torch.float64)
    x = torch.randn(B, L, 24, generator=gen, dtype=torch.float64)
    positions = torch.randint(0, 512, (B, L), generator=gen)
    cos, sin = (t.double() for t in RotaryEmbedding(DH, max_len=512)(x, positions))

    def scores(w_q, w_k, layout):
        q = (x @ w_q.T).view(B, L, H, DH).transpose(1, 2)  # (B, H, L, Dh)
        k = (x @ w_k.T).view(B, L, H, DH).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin, layout=layout)
        return q @ k.transpose(-2, -1), q  # (B, H, L, L), (B, H, L, Dh)

    before, q_before = scores(w_q, w_k, source)
    converted = [convert_qk_weight(w, H, source=source, target=target) for w in (w_q, w_k)]
    after, q_after = scores(*converted, target)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-10)
    rows = q_before.permute(1, 3, 0, 2).reshape(H * DH, B * L)  # one row per coordinate
    rows = convert_qk_weight(rows, H, source=source, target=target)
    torch.testing.assert_close(q_after, rows.view(H, DH, B, L).permute(2, 0, 3, 1))
    unconverted, _ = scores(w_q, w_k, target)  # a port that forgets the conversion
    assert (unconverted - before).abs().max() > 1.0
    back = convert_qk_weight(converted[0], H, source=target, target=source)
    assert torch.equal(back, w_q)
    bias = torch.randn(H * DH, generator=gen)
    assert torch.equal(
        convert_qk_weight(bias, H, source=source, target=target),
        convert_qk_weight(bias[:, None], H, source=source, target=target)[:, 0],
    )


@pytest.mark.parametrize(("source", "target"), list(itertools.permutations(LAYOUTS, 2)))
def test_qk_norm_gains_move_by_the_rows_permutation_without_its_sign(source: str, target: str):
    """Qwen3's QK-norm (one gain per head coordinate, before the rotation): converted q/k rows
    need the gains permuted by the same index and never negated (a sign passes through RMSNorm).
    Left in place, or negated with the rows, the scores change."""
    gen = torch.Generator().manual_seed(4)
    w_q, w_k = torch.randn(2, H * DH, 24, generator=gen, dtype=torch.float64)
    g_q, g_k = torch.rand(2, DH, generator=gen, dtype=torch.float64) + 0.5  # trained gains
    x = torch.randn(B, L, 24, generator=gen, dtype=torch.float64)
    positions = torch.randint(0, 512, (B, L), generator=gen)
    cos, sin = (t.double() for t in RotaryEmbedding(DH, max_len=512)(x, positions))

    def scores(w_q, w_k, g_q, g_k, layout):
        q = (x @ w_q.T).view(B, L, H, DH).transpose(1, 2)  # (B, H, L, Dh)
        k = (x @ w_k.T).view(B, L, H, DH).transpose(1, 2)
        q, k = F.rms_norm(q, (DH,), g_q, 1e-6), F.rms_norm(k, (DH,), g_k, 1e-6)
        q, k = apply_rotary(q, k, cos, sin, layout=layout)
        return q @ k.transpose(-2, -1)

    before = scores(w_q, w_k, g_q, g_k, source)
    rows = [convert_qk_weight(w, H, source=source, target=target) for w in (w_q, w_k)]
    index, sign = qk_row_permutation(DH, source=source, target=target)
    moved = scores(*rows, g_q[index], g_k[index], target)
    torch.testing.assert_close(moved, before, rtol=0, atol=1e-10)
    if not torch.equal(index, torch.arange(DH)):
        assert (scores(*rows, g_q, g_k, target) - before).abs().max() > 1.0
    if (sign < 0).any():
        signed = scores(*rows, g_q[index] * sign, g_k[index] * sign, target)
        assert (signed - before).abs().max() > 1.0


def _meta_style_attention(x: Tensor, w: dict[str, Tensor], cos: Tensor, sin: Tensor) -> Tensor:
    """Causal grouped-query attention in Meta's layout: interleaved RoPE, written out."""
    q = (x @ w["q"].T).view(B, L, H, DH).transpose(1, 2)  # (B, H, L, Dh)
    k = (x @ w["k"].T).view(B, L, H_KV, DH).transpose(1, 2)  # (B, H_KV, L, Dh)
    v = (x @ w["v"].T).view(B, L, H_KV, DH).transpose(1, 2)
    q, k = apply_rotary(q, k, cos, sin, layout="interleaved")
    k, v = (t.repeat_interleave(H // H_KV, dim=1) for t in (k, v))  # (B, H, L, Dh)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, L, Dh)
    return out.transpose(1, 2).reshape(B, L, H * DH) @ w["o"].T


def test_meta_layout_attention_equals_llama_attention_after_conversion(device):
    """A port of Meta's weights: q_proj and k_proj (with its own head count) converted, v and o
    copied as they are; float32, atol 1e-5."""
    torch.manual_seed(0)
    llama = LlamaAttention(_llama_config(), layer_idx=0).eval().to(device)
    x = torch.randn(B, L, H * DH, device=device)
    positions = torch.arange(L, device=device).expand(B, -1)
    cos, sin = RotaryEmbedding(DH).to(device)(x, positions)
    causal = torch.full((L, L), float("-inf"), device=device).triu(1).expand(B, 1, L, L)
    with torch.no_grad():
        want = llama(x, position_embeddings=(cos, sin), attention_mask=causal)[0]
        hf = {n: getattr(llama, f"{n}_proj").weight for n in "qkvo"}
        meta = dict(hf)
        meta["q"] = convert_qk_weight(hf["q"], H, source="half_split", target="interleaved")
        meta["k"] = convert_qk_weight(hf["k"], H_KV, source="half_split", target="interleaved")
        torch.testing.assert_close(
            _meta_style_attention(x, meta, cos, sin), want, rtol=0, atol=1e-5
        )
        assert (_meta_style_attention(x, hf, cos, sin) - want).abs().max() > 1e-2
        wrong_k = dict(
            meta, k=convert_qk_weight(hf["k"], H, source="half_split", target="interleaved")
        )
        assert (_meta_style_attention(x, wrong_k, cos, sin) - want).abs().max() > 1e-2


def test_left_padding_with_positions_that_skip_the_pads():
    """Position ids counted from the first real token: a left-padded row rotates its tokens
    exactly as the unpadded sequence does; plain 0 … L−1 positions do not (the scores between
    real tokens agree either way)."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, H, 5, DH, generator=gen)
    pads = 3
    padded = torch.cat([torch.zeros(1, H, pads, DH), q], dim=2)  # (1, H, 8, Dh)
    is_pad = torch.arange(5 + pads) < pads  # True = padding
    positions = ((~is_pad).cumsum(0) - 1).clamp(min=0)  # 0 0 0 0 1 2 3 4
    rope = RotaryEmbedding(DH, max_len=16)
    alone = rotate(q, *rope(q, torch.arange(5)))
    assert torch.equal(rotate(padded, *rope(q, positions))[:, :, pads:], alone)
    naive = rotate(padded, *rope(q, torch.arange(5 + pads)))[:, :, pads:]
    assert (naive - alone).abs().max() > 0.1
    # every real token moved by the same 3 positions: their scores only depend on m − n
    torch.testing.assert_close(naive @ naive.mT, alone @ alone.mT, rtol=0, atol=1e-4)


def test_tables_are_formulas_not_weights_and_follow_the_input():
    rope = RotaryEmbedding(DH, max_len=32)
    assert list(rope.state_dict()) == [] and list(rope.parameters()) == []
    assert rope.cos.dtype == torch.float32 and rope.cos.shape == (32, DH)
    for dtype in (torch.float64, torch.bfloat16):
        cos, sin = rope(torch.zeros(1, dtype=dtype), torch.arange(4))
        assert cos.dtype == sin.dtype == dtype and cos.shape == (4, DH)
    assert "base=500000.0" in repr(RotaryEmbedding(DH, base=500000.0))
    x = torch.randn(3, DH)
    assert torch.equal(rotate_half(rotate_half(x)), -x)  # two quarter turns: a half turn


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rotary_positions_hook_rotates_q_and_k_and_moves_with_its_module(layout: str):
    """The hook equals RotaryEmbedding + apply_rotary, and its tables are a submodule's buffers:
    a module holding it carries them through ``.to()`` (a plain function's would stay)."""
    q, k = _qk(2)
    positions = torch.arange(3, 3 + L).expand(B, L)  # (B, L): a cache of 3 positions before
    hook = RotaryPositions(DH, max_len=16, base=500.0, layout=layout)
    cos, sin = RotaryEmbedding(DH, max_len=16, base=500.0)(q, positions)
    got = hook(q, k, positions)
    want = apply_rotary(q, k, cos, sin, layout=layout)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    holder = torch.nn.Module()
    holder.positions = hook
    assert {"positions.rotary.cos", "positions.rotary.sin"} <= dict(holder.named_buffers()).keys()
    assert holder.to(torch.float64).positions.rotary.cos.dtype == torch.float64
    assert holder.state_dict() == {}  # formulas, not weights
    raises(lambda: RotaryPositions(DH, layout="gptj"), ValueError, "layout must be one of")


def test_bad_input_raises_clear_errors():
    rope = RotaryEmbedding(DH, max_len=10)
    q = torch.randn(1, 1, 3, DH)
    cos, sin = rope(q, torch.arange(3))
    raises(lambda: RotaryEmbedding(15), ValueError, "head_dim must be even")
    raises(lambda: RotaryEmbedding(0), ValueError, "head_dim must be at least 2")
    raises(lambda: RotaryEmbedding(DH, base=1.0), ValueError, "base must be greater than 1")
    raises(lambda: RotaryEmbedding(DH, max_len=0), ValueError, "max_len must be at least 1")
    raises(lambda: rope(q, torch.arange(11)), ValueError, "position_ids must lie in [0, 10)")
    raises(lambda: rope(q, torch.tensor([-1, 0])), ValueError, "from -1 to 0")
    unchecked = RotaryEmbedding(DH, max_len=10, checked=False)  # a model's: no read back
    assert torch.equal(unchecked(q, torch.arange(3))[0], cos)
    raises(lambda: unchecked(q, torch.arange(11)), IndexError, "out of bounds")
    raises(lambda: rope(q, torch.arange(3.0)), TypeError, "integer tensor")
    raises(lambda: rotate(q, cos, sin, layout="gptj"), ValueError, "layout must be one of")
    raises(lambda: rotate(q[..., :8], cos, sin), ValueError, "head width of x")
    raises(lambda: rotate(q, cos, sin[..., :8]), ValueError, "must have one shape")
    w = torch.randn(H * DH, 8)
    raises(
        lambda: convert_qk_weight(w, 3, source="interleaved", target="half_split"),
        ValueError,
        "must be n_heads=3 times",
    )
    raises(
        lambda: convert_qk_weight(w, H, source="neox", target="half_split"),
        ValueError,
        "source must be one of",
    )
    raises(
        lambda: convert_qk_weight(torch.randn(H * 3, 8), H, source="interleaved", target="x"),
        ValueError,
        "head_dim must be even",
    )


# --- API probes (issue 42): each bad call, and what its error must say ------------------------

Q4, K4 = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
ROTARY_PROBES = {
    "frequencies a list": (
        lambda: RotaryEmbedding(8, frequencies=[1.0, 0.5]),
        TypeError,
        "frequencies must be a Tensor, got list",
    ),
    "integer frequencies": (
        lambda: RotaryEmbedding(8, frequencies=torch.tensor([1, 2])),
        TypeError,
        "frequencies must be a floating-point tensor, got torch.int64",
    ),
    "NaN frequency": (
        lambda: RotaryEmbedding(8, frequencies=torch.tensor([float("nan"), 1.0])),
        ValueError,
        "frequencies must be finite and positive, got [nan, 1.0]",
    ),
    "checked an int": (
        lambda: RotaryEmbedding(8, checked=1),
        TypeError,
        "checked must be True or False, got 1",
    ),
    "infinite attention scaling": (
        lambda: RotaryEmbedding(8, attention_scaling=float("inf")),
        ValueError,
        "attention_scaling must be greater than 0.0, got inf",
    ),
    "position ids a list": (
        lambda: RotaryEmbedding(8)(Q4, [0, 1]),
        TypeError,
        "position_ids must be a Tensor, got list",
    ),
    "position ids for 4 of 5 positions": (
        lambda: RotaryPositions(8)(Q4, K4, torch.arange(4)),
        ValueError,
        "position_ids (4,) must agree: (B, H, L, Dh), (B, Hkv, L, Dh), (B, L)",
    ),
    "integer queries": (
        lambda: RotaryPositions(8)(Q4.long(), K4, torch.arange(5)),
        TypeError,
        "q must be a floating-point tensor, got torch.int64",
    ),
    "weight a list": (
        lambda: convert_qk_weight([1.0, 2.0], 1, source="half_split", target="interleaved"),
        TypeError,
        "weight must be a Tensor, got list",
    ),
}


@pytest.mark.parametrize(
    ("call", "error", "phrase"), ROTARY_PROBES.values(), ids=ROTARY_PROBES.keys()
)
def test_bad_calls_name_the_argument_and_what_is_valid(call, error, phrase):
    raises(call, error, phrase)
