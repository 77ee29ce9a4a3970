"""Chapters 5, 7 and 8: LayerNorm, FeedForward and the encoder and decoder layers equal PyTorch's
with copied weights (both ``norm_first`` values); the decoder layer is causal, and both layers
ignore padding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import to_device
from transformer_tutorial import set_seed
from transformer_tutorial.copy_weights import copy_decoder_layer, copy_encoder_layer
from transformer_tutorial.layers import DecoderLayer, EncoderLayer, FeedForward, LayerNorm
from transformer_tutorial.masks import causal_mask, padding_mask

ATOL = 1e-5


def _random_layer_norm(d_model: int, eps: float) -> tuple[nn.LayerNorm, LayerNorm]:
    ref = nn.LayerNorm(d_model, eps=eps)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    ours = LayerNorm(d_model, eps=eps)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


@pytest.mark.parametrize("shape", [(7,), (3, 16), (2, 5, 64), (2, 3, 4, 512)])
@pytest.mark.parametrize("eps", [1e-5, 1e-6, 1e-2])
@pytest.mark.parametrize("scale", [1e-2, 1.0, 30.0])
def test_layer_norm_matches_torch(shape, eps, scale):
    torch.manual_seed(0)
    ref, ours = _random_layer_norm(shape[-1], eps)
    x = scale * (torch.randn(*shape) + 0.5)
    torch.testing.assert_close(ours(x), ref(x), atol=ATOL, rtol=ATOL)


def test_layer_norm_gradients_match_torch():
    torch.manual_seed(0)
    ref, ours = _random_layer_norm(32, 1e-5)
    x = 3 * torch.randn(4, 6, 32)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    target = torch.randn(4, 6, 32)
    ((ref(x_ref) - target) ** 2).sum().backward()
    ((ours(x_ours) - target) ** 2).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad, atol=1e-4, rtol=1e-4)


def test_layer_norm_normalises_each_position_with_biased_variance():
    torch.manual_seed(0)
    x = 4 * torch.randn(3, 5, 8) - 2
    y = LayerNorm(8)(x)
    torch.testing.assert_close(y.mean(-1), torch.zeros(3, 5), atol=1e-5, rtol=0)
    torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(3, 5), atol=1e-3, rtol=0)


@pytest.mark.parametrize("d_model", [7, 64, 512])
def test_unbiased_std_plus_eps_is_detected(d_model):
    """The Annotated Transformer's `(x - mean) / (std + eps)` (unbiased std) is far outside the
    tolerance used above, so the equality test would catch that formula."""
    torch.manual_seed(0)
    x = torch.randn(4, 9, d_model)
    annotated = (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-5)
    expected = nn.LayerNorm(d_model, elementwise_affine=False)(x)
    assert (annotated - expected).abs().max() > 100 * ATOL


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_feed_forward_matches_transformer_encoder_layer(activation):
    torch.manual_seed(0)
    d_model, d_ff = 16, 48
    ref = nn.TransformerEncoderLayer(
        d_model, 4, d_ff, dropout=0.1, activation=activation, batch_first=True
    ).eval()
    ff = FeedForward(d_model, d_ff, dropout=0.1, activation=activation).eval()
    ff.linear1.load_state_dict(ref.linear1.state_dict())
    ff.linear2.load_state_dict(ref.linear2.state_dict())
    x = torch.randn(3, 7, d_model)
    with torch.no_grad():
        torch.testing.assert_close(ff(x), ref._ff_block(x), atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(
            ff(x), ref.linear2(ref.activation(ref.linear1(x))), atol=ATOL, rtol=ATOL
        )


def test_feed_forward_is_the_paper_formula():
    torch.manual_seed(0)
    ff = FeedForward(8, 32)
    x = torch.randn(2, 5, 8)
    w1, b1, w2, b2 = ff.linear1.weight.T, ff.linear1.bias, ff.linear2.weight.T, ff.linear2.bias
    expected = torch.clamp(x @ w1 + b1, min=0) @ w2 + b2  # max(0, x W1 + b1) W2 + b2
    torch.testing.assert_close(ff(x), expected, atol=ATOL, rtol=ATOL)


def test_feed_forward_is_position_wise():
    torch.manual_seed(0)
    ff = FeedForward(8, 32)
    x = torch.randn(2, 6, 8)
    perm = torch.randperm(6)
    torch.testing.assert_close(ff(x[:, perm]), ff(x)[:, perm], atol=1e-6, rtol=1e-6)


def test_feed_forward_dropout_only_in_training():
    torch.manual_seed(0)
    ff = FeedForward(8, 32, dropout=0.5)
    x = torch.randn(2, 6, 8)
    ff.eval()
    torch.testing.assert_close(ff(x), ff(x))
    ff.train()
    assert not torch.allclose(ff(x), ff(x))


def test_feed_forward_rejects_unknown_activation():
    with pytest.raises(
        ValueError, match=r"activation must be one of \['gelu', 'gelu_tanh', 'relu'\], got 'swish'"
    ):
        FeedForward(8, 32, activation="swish")


# --- the encoder and decoder layers -------------------------------------------------------------

B, S, T, D, H, D_FF = 3, 7, 6, 16, 4, 32
PAD = 0


@pytest.fixture
def data(padded_vectors):
    return padded_vectors


def _encoder_pair(norm_first: bool) -> tuple[EncoderLayer, nn.TransformerEncoderLayer]:
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(
        D, H, D_FF, dropout=0.0, batch_first=True, norm_first=norm_first
    ).eval()
    ours = EncoderLayer(D, H, D_FF, 0.0, norm_first=norm_first).eval()
    copy_encoder_layer(ours, ref)
    return ours, ref


def _decoder_pair(norm_first: bool) -> tuple[DecoderLayer, nn.TransformerDecoderLayer]:
    torch.manual_seed(0)
    ref = nn.TransformerDecoderLayer(
        D, H, D_FF, dropout=0.0, batch_first=True, norm_first=norm_first
    ).eval()
    ours = DecoderLayer(D, H, D_FF, 0.0, norm_first=norm_first).eval()
    copy_decoder_layer(ours, ref)
    return ours, ref


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_equals_torch_and_forward_with_weights_agrees(data, norm_first, device):
    src, _, src_pad, _ = to_device(data, device)
    ours, ref = to_device(_encoder_pair(norm_first), device)
    with torch.no_grad():
        out = ours(src, src_key_padding_mask=src_pad)
        written_out, weights = ours.forward_with_weights(src, src_key_padding_mask=src_pad)
        # Layer-level fast path has no nested tensors: every position compared, padding included.
        expected = ref(src, src_key_padding_mask=src_pad)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(written_out, expected, atol=ATOL, rtol=0)
    x = ours.norm1(src) if norm_first else src
    _, per_head = ref.self_attn(
        x, x, x, key_padding_mask=src_pad, need_weights=True, average_attn_weights=False
    )
    assert weights.shape == (B, H, S, S)
    torch.testing.assert_close(weights, per_head, atol=ATOL, rtol=0)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_equals_torch_and_forward_with_weights_agrees(data, norm_first, device):
    src, tgt, src_pad, tgt_pad = to_device(data, device)
    ours, ref = to_device(_decoder_pair(norm_first), device)
    masks = dict(tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)
    causal = causal_mask(T, device=device)
    with torch.no_grad():
        out = ours(tgt, src, **masks)
        written_out, (self_w, cross_w) = ours.forward_with_weights(tgt, src, **masks)
        expected = ref(tgt, src, tgt_mask=causal, tgt_is_causal=True, **masks)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(written_out, expected, atol=ATOL, rtol=0)
    assert self_w.shape == (B, H, T, T) and cross_w.shape == (B, H, T, S)
    assert torch.all(self_w[..., causal] == 0)  # no weight on the future
    assert torch.all(cross_w[2, :, :, 3:] == 0)  # no weight on memory padding
    ones = torch.ones(B, H, T, device=device)
    torch.testing.assert_close(cross_w.sum(-1), ones, atol=ATOL, rtol=0)


def test_copy_into_a_layer_refuses_mismatched_settings():
    ref = nn.TransformerEncoderLayer(D, H, D_FF, dropout=0.0, batch_first=True)
    with pytest.raises(ValueError, match="norm_first differs"):
        copy_encoder_layer(EncoderLayer(D, H, D_FF, norm_first=True), ref)
    with pytest.raises(ValueError, match="shape"):
        copy_encoder_layer(EncoderLayer(D, H, 2 * D_FF), ref)
    ref = nn.TransformerDecoderLayer(D, H, D_FF, dropout=0.0, batch_first=True)
    with pytest.raises(ValueError, match="activation differs"):
        copy_decoder_layer(DecoderLayer(D, H, D_FF, activation="gelu"), ref)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_is_causal(norm_first):
    """Changing target position t changes outputs from t on, never before it."""
    set_seed(0)
    layer = DecoderLayer(D, H, D_FF, dropout=0.0, norm_first=norm_first).eval()
    x, memory = torch.randn(2, T, D), torch.randn(2, 4, D)
    with torch.no_grad():
        out = layer(x, memory)
        for t in range(T):
            changed = x.clone()
            changed[:, t] = torch.randn(2, D)
            out_changed = layer(changed, memory)
            torch.testing.assert_close(out_changed[:, :t], out[:, :t], atol=1e-6, rtol=0)
            moved = (out_changed[:, t:] - out[:, t:]).abs().amax(dim=-1)
            assert moved.min() > 1e-4, f"a position from {t} on ignored input {t}"


@pytest.mark.parametrize("norm_first", [False, True])
def test_layers_ignore_padding(norm_first):
    """Each sentence of a padded batch gets exactly what it gets alone, without its padding, on
    both sides of the decoder (target self-attention and the memory)."""
    set_seed(0)
    encoder = EncoderLayer(D, H, D_FF, dropout=0.0, norm_first=norm_first).eval()
    decoder = DecoderLayer(D, H, D_FF, dropout=0.0, norm_first=norm_first).eval()
    tgt_ids = torch.tensor([[5, 3, 8, 5, 2, 9], [4, 7, 6, PAD, PAD, PAD], [1, 2, 3, 4, PAD, PAD]])
    src_ids = torch.tensor([[1, 2, PAD, PAD, PAD], [3, 4, 5, 6, 7], [8, 9, 1, PAD, PAD]])
    tgt_pad, src_pad = padding_mask(tgt_ids, PAD), padding_mask(src_ids, PAD)
    embed = nn.Embedding(10, D)
    with torch.no_grad():
        x = embed(tgt_ids)
        memory = encoder(embed(src_ids), src_key_padding_mask=src_pad)
        out = decoder(x, memory, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)
        for b in range(tgt_ids.size(0)):
            t, s = int((~tgt_pad[b]).sum()), int((~src_pad[b]).sum())
            memory_alone = encoder(embed(src_ids[b : b + 1, :s]))
            torch.testing.assert_close(memory[b : b + 1, :s], memory_alone, atol=ATOL, rtol=ATOL)
            alone = decoder(x[b : b + 1, :t], memory_alone)
            torch.testing.assert_close(out[b : b + 1, :t], alone, atol=ATOL, rtol=ATOL)


def test_layer_norm_fused_forward_equals_written_out():
    """``forward`` (PyTorch's fused kernel) and ``written_out`` (the formula, chapter 5) agree
    in values and in every gradient."""
    set_seed(0)
    _, ours = _random_layer_norm(64, 1e-5)
    x = (3.0 * torch.randn(2, 5, 64) + 1.0).requires_grad_()
    results = []
    for forward in (ours, ours.written_out):
        y = forward(x)
        (y * torch.linspace(-1, 1, 64)).square().sum().backward()
        results.append((y.detach(), x.grad.clone(), ours.weight.grad.clone(), ours.bias.grad))
        x.grad, ours.weight.grad, ours.bias.grad = None, None, None
    for fused, written in zip(*results, strict=True):
        torch.testing.assert_close(fused, written, atol=1e-4, rtol=1e-5)
