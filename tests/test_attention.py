"""Chapters 3 and 4: attention equals PyTorch's, masks mean True = blocked, no NaN anywhere.

Every numerical test compares against ``F.scaled_dot_product_attention`` or
``nn.MultiheadAttention`` with copied weights, so it fails if the 1/√d_k scale or the mask
polarity changes. Multi-head tests run both paths: ``need_weights=True`` (our written-out
function) and ``need_weights=False`` (PyTorch's fused kernel). Bad inputs (construction, shapes,
masks, ``dropout_p``) raise an error whose message says what is wrong, in both paths.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import raises, to_device
from transformer_tutorial import set_seed
from transformer_tutorial.attention import MultiHeadAttention, scaled_dot_product_attention
from transformer_tutorial.copy_weights import copy_mha
from transformer_tutorial.masks import causal_mask

ATOL = 1e-5
B, H, L, S, DK, D = 2, 3, 5, 7, 8, 12


def _qkv(heads: bool = True, seed: int = 0):
    set_seed(seed)
    lead = (B, H) if heads else (B,)
    return torch.randn(*lead, L, DK), torch.randn(*lead, S, DK), torch.randn(*lead, S, DK)


def _random_mask(seed: int = 1) -> torch.Tensor:
    """``(L, S)`` bool, True = blocked, about half blocked, every query keeps key 0."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(L, S, generator=gen) < 0.5
    mask[:, 0] = False
    return mask


def _key_padding() -> torch.Tensor:
    """``(B, S)`` bool, True = padding: the second sequence has three padded keys."""
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, -3:] = True
    return kpm


# --- scaled_dot_product_attention == F.scaled_dot_product_attention ---------------------------


@pytest.mark.parametrize("heads", [True, False], ids=["4d", "3d"])
def test_function_matches_torch_without_mask(heads, device):
    q, k, v = to_device(_qkv(heads), device)
    out, _ = scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=ATOL, rtol=0)


def test_function_matches_torch_with_bool_mask(device):
    q, k, v, mask = to_device((*_qkv(), _random_mask()), device)
    out, _ = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask)  # F.sdpa: True = attend
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_function_matches_torch_causal(device):
    set_seed(0)
    q, k, v = (torch.randn(B, H, L, DK).to(device) for _ in range(3))
    out, _ = scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(L, device=device))
    torch.testing.assert_close(
        out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=ATOL, rtol=0
    )


def test_function_matches_torch_with_key_padding_mask(device):
    q, k, v, kpm = to_device((*_qkv(), _key_padding()), device)
    out, _ = scaled_dot_product_attention(q, k, v, key_padding_mask=kpm)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=~kpm[:, None, None, :])
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("heads", [True, False], ids=["4d", "3d"])
def test_function_weights_shape_and_values(heads):
    q, k, v = _qkv(heads)
    mask = _random_mask()
    out, weights = scaled_dot_product_attention(q, k, v, attn_mask=mask, need_weights=True)
    lead = (B, H) if heads else (B,)
    assert weights.shape == (*lead, L, S) and out.shape == (*lead, L, DK)
    # Attending over the identity matrix as values returns the weights themselves.
    eye = torch.eye(S).expand(*lead, S, S)
    torch.testing.assert_close(
        weights, F.scaled_dot_product_attention(q, k, eye, attn_mask=~mask), atol=ATOL, rtol=0
    )
    assert scaled_dot_product_attention(q, k, v)[1] is None


def test_function_dropout_drops_weights_and_rescales():
    q, k, v = _qkv()
    clean = F.scaled_dot_product_attention(q, k, torch.eye(S).expand(B, H, S, S))  # the weights
    set_seed(3)
    _, dropped = scaled_dot_product_attention(q, k, v, dropout_p=0.5, need_weights=True)
    kept = dropped != 0
    assert 0.3 < kept.float().mean() < 0.7
    torch.testing.assert_close(dropped[kept], clean[kept] / 0.5, atol=ATOL, rtol=0)


# --- MultiHeadAttention == nn.MultiheadAttention(batch_first=True) ------------------------------


def _pair(dropout: float = 0.0, bias: bool = True, seed: int = 0):
    """Our module and PyTorch's with the same weights (random biases, so they are tested too)."""
    set_seed(seed)
    ref = nn.MultiheadAttention(D, H, dropout=dropout, bias=bias, batch_first=True)
    if bias:
        with torch.no_grad():
            nn.init.normal_(ref.in_proj_bias)  # PyTorch initialises both biases to zero
            nn.init.normal_(ref.out_proj.bias)
    ours = MultiHeadAttention(D, H, dropout=dropout, bias=bias)
    copy_mha(ours, ref)
    return ours.eval(), ref.eval()


def _inputs(case: str):
    set_seed(1)
    x = torch.randn(B, L, D)
    memory = torch.randn(B, S, D)
    if case == "self":
        return x, x, x, {}
    kwargs = {
        "cross": {},
        "key_padding_mask": {"key_padding_mask": _key_padding()},
        "attn_mask": {"attn_mask": _random_mask()},
        "both": {"key_padding_mask": _key_padding(), "attn_mask": _random_mask()},
    }[case]
    return x, memory, memory, kwargs


CASES = ["self", "cross", "key_padding_mask", "attn_mask", "both"]


@pytest.mark.parametrize("case", CASES)
def test_mha_matches_torch(case, device):
    ours, ref = to_device(_pair(), device)
    query, key, value, masks = to_device(_inputs(case), device)
    expected, per_head = ref(
        query, key, value, need_weights=True, average_attn_weights=False, **masks
    )
    _, averaged = ref(query, key, value, need_weights=True, average_attn_weights=True, **masks)
    out_fused, none = ours(query, key, value, need_weights=False, **masks)
    out_written, weights = ours(query, key, value, need_weights=True, **masks)
    assert none is None
    torch.testing.assert_close(out_fused, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(out_written, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(weights, per_head, atol=ATOL, rtol=0)
    torch.testing.assert_close(weights.mean(dim=1), averaged, atol=ATOL, rtol=0)


def test_mha_per_head_attn_mask_matches_torch(device):
    """Our ``(B, H, L, S)`` mask is PyTorch's ``(B·H, L, S)`` one, heads kept apart."""
    ours, ref = to_device(_pair(), device)
    query, key, value, _ = to_device(_inputs("cross"), device)
    gen = torch.Generator().manual_seed(2)
    mask = torch.rand(B, H, L, S, generator=gen) < 0.5
    mask[..., 0] = False
    mask = mask.to(device)
    expected, per_head = ref(
        query, key, value, attn_mask=mask.reshape(B * H, L, S), average_attn_weights=False
    )
    for need_weights in (False, True):
        out, weights = ours(query, key, value, attn_mask=mask, need_weights=need_weights)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(weights, per_head, atol=ATOL, rtol=0)


def test_mha_fully_blocked_query_gives_zeros_in_both_paths():
    ours, ref = _pair()
    query, key, value, _ = _inputs("cross")
    mask = _random_mask()
    mask[2] = True  # query 2 may see no key at all
    expected, _ = ref(query, key, value, attn_mask=mask, need_weights=False)
    for need_weights in (False, True):
        ours.zero_grad()
        query_ = query.clone().requires_grad_(True)
        out, weights = ours(query_, key, value, attn_mask=mask, need_weights=need_weights)
        # No key to read: the heads contribute zero and only the output bias is left.
        torch.testing.assert_close(out[:, 2], ours.out_proj.bias.expand(B, D), atol=ATOL, rtol=0)
        rest = [0, 1, 3, 4]
        torch.testing.assert_close(out[:, rest], expected[:, rest], atol=ATOL, rtol=0)
        if need_weights:
            assert torch.equal(weights[:, :, 2], torch.zeros(B, H, S))
        out.sum().backward()
        assert torch.isfinite(query_.grad).all()
        assert torch.equal(
            query_.grad[:, 2], torch.zeros(B, D)
        )  # the blocked query gets no gradient
        assert all(torch.isfinite(p.grad).all() for p in ours.parameters())


def test_mha_dropout_only_in_training():
    ours, ref = _pair(dropout=0.5)
    query, key, value, masks = _inputs("both")
    expected, _ = ref(query, key, value, **masks)
    for need_weights in (False, True):
        ours.eval()
        out_a, _ = ours(query, key, value, need_weights=need_weights, **masks)
        out_b, _ = ours(query, key, value, need_weights=need_weights, **masks)
        torch.testing.assert_close(out_a, expected, atol=ATOL, rtol=0)
        assert torch.equal(out_a, out_b)
        ours.train()
        out_c, _ = ours(query, key, value, need_weights=need_weights, **masks)
        out_d, _ = ours(query, key, value, need_weights=need_weights, **masks)
        assert not torch.allclose(out_c, out_a) and not torch.allclose(out_c, out_d)


def test_mha_dropout_matches_torch_in_training_with_same_seed():
    """Both draw one dropout mask over the (B, H, L, S) weights: the same seed drops the same."""
    ours, ref = _pair(dropout=0.5)
    ours.train()
    ref.train()
    query, key, value, masks = _inputs("both")
    for need_weights in (False, True):
        set_seed(7)
        expected, expected_weights = ref(
            query, key, value, need_weights=need_weights, average_attn_weights=False, **masks
        )
        set_seed(7)
        out, weights = ours(query, key, value, need_weights=need_weights, **masks)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(weights, expected_weights, atol=ATOL, rtol=0)


@pytest.mark.parametrize("bias", [True, False])
def test_mha_parameter_count(bias):
    ours, ref = _pair(bias=bias)
    count = sum(p.numel() for p in ours.parameters())
    assert count == 4 * D * D + (4 * D if bias else 0)
    assert count == sum(p.numel() for p in ref.parameters())


# --- bad inputs say what is wrong ---------------------------------------------------------------


MHA_CONSTRUCTION_ROWS = [
    ((8, 0), ValueError, "n_heads must be at least 1, got 0"),
    ((8, 3), ValueError, "d_model=8 must be divisible by n_heads=3"),
    (
        (10, 4),
        ValueError,
        "n_heads=4: each head gets d_model // n_heads dimensions. Choose e.g. "
        "n_heads in [1, 2, 5, 10]",
    ),
    ((0, 1), ValueError, "d_model must be at least 1"),
    ((8, 2, 1.5), ValueError, "dropout must be in [0.0, 1.0], got 1.5"),
    ((8, 2, -0.1), ValueError, "dropout must be in [0.0, 1.0]"),
]


@pytest.mark.parametrize(("args", "error", "phrase"), MHA_CONSTRUCTION_ROWS, ids=str)
def test_multi_head_attention_refuses_bad_construction(args, error, phrase):
    raises(lambda: MultiHeadAttention(*args), error, phrase)


MHA_X = torch.randn(2, 5, 8)
MHA_INPUT_ROWS = [
    (
        "key/value lengths",
        lambda m: m(MHA_X, torch.randn(2, 6, 8), torch.randn(2, 7, 8)),
        ValueError,
        "key and value must have the same (B, S)",
    ),
    (
        "key width",
        lambda m: m(MHA_X, torch.randn(2, 6, 4), torch.randn(2, 6, 4)),
        ValueError,
        "query, key and value must be batch-first (B, L, D=8)",
    ),
    (
        "unbatched (L, D)",
        lambda m: m(MHA_X[0], MHA_X[0], MHA_X[0]),
        ValueError,
        "query, key and value must be batch-first (B, L, D=8)",
    ),
    ("query width", lambda m: m(torch.randn(2, 5, 6), MHA_X, MHA_X), ValueError, "(B, L, D=8)"),
    (
        "batch",
        lambda m: m(MHA_X, MHA_X[:1], MHA_X[:1]),
        ValueError,
        "query and key must have the same batch size B",
    ),
    (
        "mask heads",
        lambda m: m(MHA_X, MHA_X, MHA_X, attn_mask=torch.zeros(2, 3, 5, 5, dtype=torch.bool)),
        ValueError,
        "(B, H, L, S) = (2, 2, 5, 5)",
    ),
    (
        "mask batch",
        lambda m: m(MHA_X, MHA_X, MHA_X, attn_mask=torch.zeros(3, 5, 5, dtype=torch.bool)),
        ValueError,
        "(B, L, S) = (2, 5, 5)",
    ),
    (
        "padding mask length",
        lambda m: m(MHA_X, MHA_X, MHA_X, key_padding_mask=torch.zeros(2, 4).bool()),
        ValueError,
        "key_padding_mask has shape (2, 4); expected (B, S) = (2, 5)",
    ),
    (
        "float mask",
        lambda m: m(MHA_X, MHA_X, MHA_X, attn_mask=torch.zeros(5, 5)),
        TypeError,
        "attn_mask must be a bool tensor with True = blocked",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "phrase"),
    [r[1:] for r in MHA_INPUT_ROWS],
    ids=[r[0] for r in MHA_INPUT_ROWS],
)
@pytest.mark.parametrize("need_weights", [False, True])
def test_multi_head_attention_refuses_bad_inputs(call, error, phrase, need_weights):
    mha = MultiHeadAttention(8, 2)
    forward = mha.forward
    mha.forward = lambda *a, **k: forward(*a, need_weights=need_weights, **k)
    raises(lambda: call(mha), error, phrase)


SDPA_Q = torch.randn(2, 2, 5, 4)
SDPA_ROWS = [
    (
        "k/v lengths",
        (SDPA_Q, torch.randn(2, 2, 6, 4), torch.randn(2, 2, 7, 4)),
        {},
        "k and v the same",
    ),
    (
        "q/k widths",
        (SDPA_Q, torch.randn(2, 2, 6, 3), torch.randn(2, 2, 6, 3)),
        {},
        "the width Dk of k",
    ),
    ("q/k batch", (SDPA_Q, SDPA_Q[:1], SDPA_Q[:1]), {}, "q the same (B, [H])"),
    (
        "ranks",
        (SDPA_Q, SDPA_Q[0], SDPA_Q[0]),
        {},
        "must all be (B, L, Dk) or all (B, H, L, Dk)",
    ),
    (
        "one rank differs",
        (SDPA_Q, SDPA_Q[0], SDPA_Q),
        {},
        "q, k, v must all be (B, L, Dk) or all (B, H, L, Dk)",
    ),
    ("dropout_p", (SDPA_Q, SDPA_Q, SDPA_Q), {"dropout_p": 2.0}, "dropout_p must be in [0.0, 1.0]"),
]


@pytest.mark.parametrize(
    ("args", "kwargs", "phrase"), [r[1:] for r in SDPA_ROWS], ids=[r[0] for r in SDPA_ROWS]
)
def test_scaled_dot_product_attention_refuses_bad_inputs(args, kwargs, phrase):
    raises(lambda: scaled_dot_product_attention(*args, **kwargs), ValueError, phrase)


# --- the packed projections (one GEMM) equal the three the chapters teach ----------------------


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in module.named_parameters()}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", ["self", "both"])
def test_packed_projections_equal_separate_ones(case, bias):
    """``forward(x, x, x)`` runs q, k, v as one stacked matrix and ``project_kv(m, m)`` k and v
    as one; given equal but distinct tensors the module runs ``q_proj``, ``k_proj`` and
    ``v_proj`` one by one. Outputs and every weight's gradient agree."""
    ours, _ = _pair(bias=bias)
    query, key, value, masks = _inputs(case)
    for need_weights in (False, True):
        packed, w_packed = ours(query, key, value, need_weights=need_weights, **masks)
        packed.square().sum().backward()
        grads_packed = _grads(ours)
        ours.zero_grad()
        separate, w_separate = ours(
            query, key.clone(), value.clone(), need_weights=need_weights, **masks
        )
        separate.square().sum().backward()
        torch.testing.assert_close(packed, separate, atol=ATOL, rtol=0)
        if need_weights:
            torch.testing.assert_close(w_packed, w_separate, atol=ATOL, rtol=0)
        for name, grad in _grads(ours).items():
            torch.testing.assert_close(grads_packed[name], grad, atol=1e-4, rtol=1e-5, msg=name)
        ours.zero_grad()


def test_project_qkv_equals_the_three_projections():
    ours, _ = _pair()
    x = torch.randn(B, L, D)
    q, kv = ours.project_qkv(x)

    def heads(t: torch.Tensor) -> torch.Tensor:  # (B, L, D) -> (B, H, L, Dh)
        return t.view(B, L, H, D // H).transpose(1, 2)

    with torch.no_grad():
        torch.testing.assert_close(q, heads(ours.q_proj(x)), atol=ATOL, rtol=0)
        torch.testing.assert_close(kv.k, heads(ours.k_proj(x)), atol=ATOL, rtol=0)
        torch.testing.assert_close(kv.v, heads(ours.v_proj(x)), atol=ATOL, rtol=0)
    assert [n for n, _ in ours.named_parameters()] == [
        f"{p}_proj.{w}" for p in ("q", "k", "v", "out") for w in ("weight", "bias")
    ]  # packing adds no parameter: checkpoints and copy_mha are unchanged
