"""Chapter 6: masks mean True = blocked, merge into one broadcastable bool tensor, and make layers
causal and blind to padding — without NaN when a query has no key left.

The behavioural tests (causality, padding invariance, agreement with ``nn.MultiheadAttention``)
fail if the polarity of any mask is flipped: in ``padding_mask``, in ``causal_mask``, in
``merge_masks`` or where attention hands the mask to ``F.scaled_dot_product_attention``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from transformer_tutorial import set_seed
from transformer_tutorial.attention import MultiHeadAttention, scaled_dot_product_attention
from transformer_tutorial.layers import DecoderLayer, EncoderLayer
from transformer_tutorial.masks import causal_mask, merge_masks, padding_mask
from transformer_tutorial.model import Decoder
from transformer_tutorial.reference import copy_mha

PAD = 0
D, H, D_FF = 16, 4, 32
ATOL = 1e-5


def _ids() -> torch.Tensor:
    """``(3, 6)`` right-padded token ids: lengths 6, 3 and 4."""
    return torch.tensor([[5, 3, 8, 5, 2, 9], [4, 7, 6, PAD, PAD, PAD], [1, 2, 3, 4, PAD, PAD]])


# --- the masks themselves ----------------------------------------------------------------------


def test_padding_mask_is_true_at_padding():
    expected = torch.tensor([[False] * 6, [False] * 3 + [True] * 3, [False] * 4 + [True] * 2])
    mask = padding_mask(_ids(), PAD)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)


def test_causal_mask_is_true_above_the_diagonal():
    mask = causal_mask(4)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]], dtype=torch.bool))
    assert torch.equal(causal_mask(7), nn.Transformer.generate_square_subsequent_mask(7).isinf())


@pytest.mark.parametrize("q_len, k_len", [(1, 5), (2, 5), (5, 5), (3, 8)])
def test_causal_mask_with_offset_is_the_bottom_rows(q_len, k_len):
    assert causal_mask(q_len, k_len).shape == (q_len, k_len)
    assert torch.equal(causal_mask(q_len, k_len), causal_mask(k_len)[-q_len:])
    assert not causal_mask(q_len, k_len)[-1].any()  # the newest query sees every key


def test_causal_mask_refuses_fewer_keys_than_queries():
    with pytest.raises(ValueError, match="k_len=2 must be at least q_len=3"):
        causal_mask(3, 2)


# --- merge_masks -------------------------------------------------------------------------------


def test_merge_masks_shapes():
    B, L, S = 3, 4, 6
    kpm = torch.zeros(B, S, dtype=torch.bool)
    assert merge_masks(None, None, batch_size=B, q_len=L, k_len=S) is None
    assert merge_masks(causal_mask(L, S), None, batch_size=B, q_len=L, k_len=S).shape == (1, 1, L, S)
    assert merge_masks(None, kpm, batch_size=B, q_len=L, k_len=S).shape == (B, 1, 1, S)
    assert merge_masks(causal_mask(L, S), kpm, batch_size=B, q_len=L, k_len=S).shape == (B, 1, L, S)
    per_example = torch.zeros(B, L, S, dtype=torch.bool)
    assert merge_masks(per_example, kpm, batch_size=B, q_len=L, k_len=S).shape == (B, 1, L, S)
    per_head = torch.zeros(B, 2, L, S, dtype=torch.bool)
    assert merge_masks(per_head, kpm, batch_size=B, q_len=L, k_len=S).shape == (B, 2, L, S)


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


@pytest.mark.parametrize("name", ["attn_mask", "key_padding_mask"])
def test_merge_masks_refuses_float_masks(name):
    masks = {"attn_mask": None, "key_padding_mask": None}
    masks[name] = torch.zeros(2, 5) if name == "key_padding_mask" else torch.zeros(5, 5)
    with pytest.raises(TypeError, match=f"{name} must be a bool tensor with True = blocked, got torch.float32"):
        merge_masks(**masks, batch_size=2, q_len=5, k_len=5)


def test_merge_masks_refuses_wrong_shapes():
    with pytest.raises(ValueError, match=r"key_padding_mask has shape \(5, 2\); expected \(B, S\) = \(2, 5\)"):
        merge_masks(None, torch.zeros(5, 2, dtype=torch.bool), batch_size=2, q_len=5, k_len=5)
    with pytest.raises(ValueError, match=r"attn_mask has shape \(4, 5\); expected \(L, S\) = \(5, 5\)"):
        merge_masks(torch.zeros(4, 5, dtype=torch.bool), None, batch_size=2, q_len=5, k_len=5)
    with pytest.raises(ValueError, match=r"attn_mask has shape \(5,\)"):
        merge_masks(torch.zeros(5, dtype=torch.bool), None, batch_size=2, q_len=5, k_len=5)


# --- the masks inside attention, against PyTorch's polarity -------------------------------------


@pytest.mark.parametrize("need_weights", [True, False], ids=["written-out", "fused"])
def test_masked_attention_matches_torch_multihead_attention(need_weights):
    """PyTorch's modules use the same polarity (True = blocked) for both masks."""
    set_seed(0)
    ids = _ids()
    B, T = ids.shape
    x = torch.randn(B, T, D)
    ref = nn.MultiheadAttention(D, H, batch_first=True).eval()
    ours = MultiHeadAttention(D, H).eval()
    copy_mha(ours, ref)
    kpm, future = padding_mask(ids, PAD), causal_mask(T)
    with torch.no_grad():
        expected, _ = ref(x, x, x, key_padding_mask=kpm, attn_mask=future)
        out, _ = ours(x, x, x, key_padding_mask=kpm, attn_mask=future, need_weights=need_weights)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("need_weights", [True, False], ids=["written-out", "fused"])
def test_attention_never_looks_at_padded_keys(need_weights):
    set_seed(0)
    mha = MultiHeadAttention(D, H).eval()
    q, kv = torch.randn(2, 3, D), torch.randn(2, 5, D)
    kpm = torch.tensor([[False] * 5, [False, False, True, True, True]])
    garbage = kv.clone()
    garbage[1, 2:] = 100 * torch.randn(3, D)  # whatever sits at padded keys must not matter
    with torch.no_grad():
        out, _ = mha(q, kv, kv, key_padding_mask=kpm, need_weights=need_weights)
        out_garbage, _ = mha(q, garbage, garbage, key_padding_mask=kpm, need_weights=need_weights)
        short, _ = mha(q[1:], kv[1:, :2], kv[1:, :2], need_weights=need_weights)
    torch.testing.assert_close(out_garbage, out, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(out[1:], short, atol=ATOL, rtol=ATOL)


# --- layers: causality and padding invariance ---------------------------------------------------


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_is_causal(norm_first):
    set_seed(0)
    layer = DecoderLayer(D, H, D_FF, dropout=0.0, norm_first=norm_first).eval()
    x, memory = torch.randn(2, 6, D), torch.randn(2, 4, D)
    for t in range(6):
        changed = x.clone()
        changed[:, t] = torch.randn(2, D)
        with torch.no_grad():
            out, out_changed = layer(x, memory), layer(changed, memory)
        torch.testing.assert_close(out_changed[:, :t], out[:, :t], atol=1e-6, rtol=0)
        assert (out_changed[:, t:] - out[:, t:]).abs().amax(dim=-1).min() > 1e-4, f"position {t} ignored its own input"


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_stack_is_causal(norm_first):
    set_seed(0)
    stack = Decoder(2, D, H, D_FF, dropout=0.0, norm_first=norm_first).eval()
    x, memory = torch.randn(2, 6, D), torch.randn(2, 4, D)
    changed = x.clone()
    changed[:, 4] = torch.randn(2, D)
    with torch.no_grad():
        torch.testing.assert_close(stack(changed, memory)[:, :4], stack(x, memory)[:, :4], atol=1e-6, rtol=0)


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_ignores_padding(norm_first):
    set_seed(0)
    layer = EncoderLayer(D, H, D_FF, dropout=0.0, norm_first=norm_first).eval()
    ids = _ids()
    kpm = padding_mask(ids, PAD)
    x = nn.Embedding(10, D)(ids)
    with torch.no_grad():
        batch = layer(x, src_key_padding_mask=kpm)
        for b in range(ids.size(0)):
            n = int((~kpm[b]).sum())
            alone = layer(x[b:b + 1, :n])
            torch.testing.assert_close(batch[b:b + 1, :n], alone, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_ignores_padding(norm_first):
    set_seed(0)
    layer = DecoderLayer(D, H, D_FF, dropout=0.0, norm_first=norm_first).eval()
    tgt_ids = _ids()
    src_ids = torch.tensor([[1, 2, PAD, PAD, PAD], [3, 4, 5, 6, 7], [8, 9, 1, PAD, PAD]])
    tgt_kpm, src_kpm = padding_mask(tgt_ids, PAD), padding_mask(src_ids, PAD)
    embed = nn.Embedding(10, D)
    x, memory = embed(tgt_ids), embed(src_ids)
    with torch.no_grad():
        batch = layer(x, memory, tgt_key_padding_mask=tgt_kpm, memory_key_padding_mask=src_kpm)
        for b in range(tgt_ids.size(0)):
            t, s = int((~tgt_kpm[b]).sum()), int((~src_kpm[b]).sum())
            alone = layer(x[b:b + 1, :t], memory[b:b + 1, :s])
            torch.testing.assert_close(batch[b:b + 1, :t], alone, atol=ATOL, rtol=ATOL)


# --- a query with no key left: zeros, never NaN ------------------------------------------------


def _left_padded_blocked() -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding + causal mask: queries 0 and 1 of sequence 0 see only padding."""
    ids = torch.tensor([[PAD, PAD, 3, 4, 5], [1, 2, 3, 4, 5]])
    return ids, padding_mask(ids, PAD)


@pytest.mark.parametrize("need_weights", [True, False], ids=["written-out", "fused"])
def test_fully_blocked_rows_give_zero_attention_forward_and_backward(need_weights):
    set_seed(0)
    ids, kpm = _left_padded_blocked()
    mha = MultiHeadAttention(D, H)
    x = torch.randn(2, 5, D, requires_grad=True)
    out, weights = mha(x, x, x, key_padding_mask=kpm, attn_mask=causal_mask(5), need_weights=need_weights)
    # out_proj of a zero vector is its bias: the attention itself returned zeros
    torch.testing.assert_close(out[0, :2], mha.out_proj.bias.expand(2, D), atol=1e-6, rtol=0)
    if need_weights:
        assert torch.equal(weights[0, :, :2], torch.zeros_like(weights[0, :, :2]))
        torch.testing.assert_close(weights[0, :, 2:].sum(-1), torch.ones(H, 3))
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in mha.parameters())


def test_fully_blocked_rows_in_the_function_give_zero_weights():
    set_seed(0)
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    k, v = torch.randn(2, 1, 2, 4, 8).unbind(0)
    blocked = torch.zeros(4, 4, dtype=torch.bool)
    blocked[1] = True
    out, weights = scaled_dot_product_attention(q, k, v, attn_mask=blocked, need_weights=True)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert torch.equal(weights[:, :, 1], torch.zeros_like(weights[:, :, 1]))
    out.sum().backward()
    assert not torch.isnan(q.grad).any()


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_with_left_padding_has_no_nan(norm_first):
    set_seed(0)
    ids, kpm = _left_padded_blocked()
    layer = DecoderLayer(D, H, D_FF, dropout=0.1, norm_first=norm_first).train()
    embed = nn.Embedding(10, D)
    memory = torch.randn(2, 3, D)
    out = layer(embed(ids), memory, tgt_key_padding_mask=kpm)
    assert torch.isfinite(out).all()
    out[:, 2:].sum().backward()
    grads = [p.grad for p in [*layer.parameters(), *embed.parameters()] if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
