"""Chapter 5: LayerNorm equals nn.LayerNorm, FeedForward equals the feed-forward path of
nn.TransformerEncoderLayer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from transformer_tutorial.layers import FeedForward, LayerNorm

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
    ref = nn.TransformerEncoderLayer(d_model, 4, d_ff, dropout=0.1, activation=activation, batch_first=True).eval()
    ff = FeedForward(d_model, d_ff, dropout=0.1, activation=activation).eval()
    ff.linear1.load_state_dict(ref.linear1.state_dict())
    ff.linear2.load_state_dict(ref.linear2.state_dict())
    x = torch.randn(3, 7, d_model)
    with torch.no_grad():
        torch.testing.assert_close(ff(x), ref._ff_block(x), atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(ff(x), ref.linear2(ref.activation(ref.linear1(x))), atol=ATOL, rtol=ATOL)


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
    with pytest.raises(ValueError, match=r"activation must be one of \['gelu', 'relu'\], got 'swish'"):
        FeedForward(8, 32, activation="swish")
