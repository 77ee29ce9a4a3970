"""Chapters 7–8: the encoder and decoder stacks — equal to PyTorch's with copied weights (both
``norm_first`` values, ``forward`` and ``forward_with_weights``), and teacher forcing equal to
decoding one position at a time (recomputed and with the KV cache), a check that fails once the
causal mask is gone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import transformer_tutorial.layers as layers
from helpers import no_causal_mask, to_device
from transformer_tutorial.copy_weights import copy_decoder, copy_encoder
from transformer_tutorial.layers import DecoderLayer, EncoderLayer
from transformer_tutorial.masks import causal_mask
from transformer_tutorial.stacks import Decoder, Encoder

B, S, T, D, H, D_FF, N = 3, 7, 6, 16, 4, 32, 3
ATOL = 1e-5


@pytest.fixture
def vectors(padded_vectors):
    return padded_vectors


def encoder(norm_first: bool, n: int = N) -> Encoder:
    return Encoder(EncoderLayer(D, H, D_FF, 0.0, norm_first=norm_first) for _ in range(n))


def decoder(norm_first: bool, n: int = N) -> Decoder:
    return Decoder(DecoderLayer(D, H, D_FF, 0.0, norm_first=norm_first) for _ in range(n))


# --- the stacks ----------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_stack_equals_torch(vectors, norm_first, device):
    src, _, src_pad, _ = to_device(vectors, device)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        D, H, D_FF, dropout=0.0, batch_first=True, norm_first=norm_first
    )
    final_norm = nn.LayerNorm(D) if norm_first else None  # post-norm layers end normalised
    # enable_nested_tensor=False: otherwise eval() with a padding mask returns zeros at padding.
    ref = nn.TransformerEncoder(layer, N, norm=final_norm, enable_nested_tensor=False).eval()
    ours = encoder(norm_first).eval()
    assert (ours.norm is not None) == norm_first
    copy_encoder(ours, ref)
    ours, ref = to_device((ours, ref), device)
    with torch.no_grad():
        expected = ref(src, src_key_padding_mask=src_pad)
        out = ours(src, src_key_padding_mask=src_pad)
        written_out, weights = ours.forward_with_weights(src, src_key_padding_mask=src_pad)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(written_out, expected, atol=ATOL, rtol=0)
    assert len(weights) == N and all(w.shape == (B, H, S, S) for w in weights)
    assert torch.all(weights[-1][2, :, :, 3:] == 0)  # no query looks at padding


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_stack_equals_torch(vectors, norm_first, device):
    src, tgt, src_pad, tgt_pad = to_device(vectors, device)
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(
        D, H, D_FF, dropout=0.0, batch_first=True, norm_first=norm_first
    )
    final_norm = nn.LayerNorm(D) if norm_first else None
    ref = nn.TransformerDecoder(layer, N, norm=final_norm).eval()
    ours = decoder(norm_first).eval()
    copy_decoder(ours, ref)
    ours, ref = to_device((ours, ref), device)
    masks = dict(tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)
    with torch.no_grad():
        mask = causal_mask(T, device=device)
        expected = ref(tgt, src, tgt_mask=mask, tgt_is_causal=True, **masks)
        out = ours(tgt, src, **masks)
        written_out, weights = ours.forward_with_weights(tgt, src, **masks)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(written_out, expected, atol=ATOL, rtol=0)
    assert len(weights) == N
    for self_w, cross_w in weights:
        assert self_w.shape == (B, H, T, T) and cross_w.shape == (B, H, T, S)


def test_a_stack_needs_a_layer():
    with pytest.raises(ValueError, match="at least one layer"):
        Encoder([])
    with pytest.raises(ValueError, match="at least one layer"):
        Decoder(iter([]))


def decode_three_ways(stack: Decoder, tgt, memory, memory_pad):
    """Teacher-forced outputs (B, T, D); the last position of each prefix recomputed; KV-cache
    steps one position at a time."""
    with torch.no_grad():
        parallel = stack(tgt, memory, memory_key_padding_mask=memory_pad)
        recompute = torch.stack(
            [
                stack(tgt[:, : t + 1], memory, memory_key_padding_mask=memory_pad)[:, -1]
                for t in range(T)
            ],
            dim=1,
        )
        caches = tuple(layer.init_cache(memory) for layer in stack.layers)
        cached = []
        for t in range(T):
            out, caches = stack.step(tgt[:, t : t + 1], caches, memory_key_padding_mask=memory_pad)
            cached.append(out[:, 0])
    return parallel, recompute, torch.stack(cached, dim=1)


@pytest.mark.parametrize("norm_first", [False, True])
def test_teacher_forcing_equals_step_by_step_recomputed_and_with_the_kv_cache(
    vectors, norm_first, device
):
    src, tgt, src_pad, _ = to_device(vectors, device)
    torch.manual_seed(0)
    stack = decoder(norm_first).eval().to(device)
    parallel, recompute, cached = decode_three_ways(stack, tgt, src, src_pad)
    torch.testing.assert_close(recompute, parallel, atol=ATOL, rtol=0)
    torch.testing.assert_close(cached, parallel, atol=ATOL, rtol=0)


def test_without_the_causal_mask_teacher_forcing_sees_the_future(vectors, monkeypatch):
    """The check above has teeth: with the causal mask gone, teacher forcing lets each position
    see later targets, so it no longer equals decoding one position at a time."""
    src, tgt, src_pad, _ = vectors
    torch.manual_seed(0)
    stack = decoder(False).eval()
    with torch.no_grad():
        masked = stack(tgt, src, memory_key_padding_mask=src_pad)
    monkeypatch.setattr(layers, "causal_mask", no_causal_mask)
    parallel, _, cached = decode_three_ways(stack, tgt, src, src_pad)
    # A KV-cache step adds one position that may see every key so far: it never needed the mask.
    torch.testing.assert_close(cached, masked, atol=ATOL, rtol=0)
    for t in range(T - 1):
        assert not torch.allclose(parallel[:, t], cached[:, t], atol=1e-3), f"position {t}"
