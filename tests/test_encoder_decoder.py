"""Chapters 7 and 8: encoder and decoder layers and stacks, equal to torch.nn's with copied weights,
and teacher forcing (all positions at once) equal to decoding one position at a time."""

import pytest
import torch
from torch import nn

import transformer_tutorial.layers as layers
from transformer_tutorial.attention import MultiHeadAttention
from transformer_tutorial.layers import DecoderLayer, EncoderLayer
from transformer_tutorial.masks import causal_mask
from transformer_tutorial.model import Decoder, Encoder, Transformer, TransformerConfig
from transformer_tutorial.reference import (
    copy_decoder,
    copy_decoder_layer,
    copy_encoder,
    copy_encoder_layer,
    copy_mha,
    copy_transformer,
)

B, S, T, D, H, D_FF, N = 3, 7, 6, 16, 4, 32, 3
ATOL = 1e-5


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    src = torch.randn(B, S, D, generator=g)
    tgt = torch.randn(B, T, D, generator=g)
    src_pad = torch.zeros(B, S, dtype=torch.bool)
    src_pad[1, 5:] = True  # sentence 1 has 5 real tokens, sentence 2 has 3
    src_pad[2, 3:] = True
    tgt_pad = torch.zeros(B, T, dtype=torch.bool)
    tgt_pad[0, 4:] = True
    return src, tgt, src_pad, tgt_pad


def torch_encoder_layer(norm_first):
    return nn.TransformerEncoderLayer(D, H, D_FF, dropout=0.0, batch_first=True, norm_first=norm_first)


def torch_decoder_layer(norm_first):
    return nn.TransformerDecoderLayer(D, H, D_FF, dropout=0.0, batch_first=True, norm_first=norm_first)


def test_copy_mha_per_head_weights_equal_torch(data):
    src, tgt, src_pad, _ = data
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(D, H, batch_first=True).eval()
    ours = MultiHeadAttention(D, H).eval()
    copy_mha(ours, ref)
    out, w = ours(tgt, src, src, key_padding_mask=src_pad, need_weights=True)
    ref_out, ref_w = ref(tgt, src, src, key_padding_mask=src_pad, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(w, ref_w, atol=ATOL, rtol=0)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_encoder_layer_equals_torch(data, norm_first, need_weights):
    src, _, src_pad, _ = data
    torch.manual_seed(0)
    ref = torch_encoder_layer(norm_first).eval()
    ours = EncoderLayer(D, H, D_FF, 0.0, norm_first=norm_first).eval()
    copy_encoder_layer(ours, ref)
    with torch.no_grad():
        out = ours(src, src_key_padding_mask=src_pad, need_weights=need_weights)
        out = out[0] if need_weights else out
        # Layer-level fast path has no nested tensors: every position is compared, padding included.
        torch.testing.assert_close(out, ref(src, src_key_padding_mask=src_pad), atol=ATOL, rtol=0)


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_stack_equals_torch(data, norm_first):
    src, _, src_pad, _ = data
    torch.manual_seed(0)
    final_norm = nn.LayerNorm(D) if norm_first else None  # post-norm layers end normalised already
    # enable_nested_tensor=False: otherwise eval() with a padding mask returns zeros at padding.
    ref = nn.TransformerEncoder(torch_encoder_layer(norm_first), N, norm=final_norm, enable_nested_tensor=False).eval()
    ours = Encoder(N, D, H, D_FF, 0.0, norm_first=norm_first).eval()
    copy_encoder(ours, ref)
    with torch.no_grad():
        out, weights = ours(src, src_key_padding_mask=src_pad, need_weights=True)
        torch.testing.assert_close(out, ref(src, src_key_padding_mask=src_pad), atol=ATOL, rtol=0)
    assert len(weights) == N and weights[0].shape == (B, H, S, S)
    assert torch.all(weights[-1][2, :, :, 3:] == 0)  # no query looks at padding


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_ignores_padding(data, norm_first):
    """What sits at padded positions cannot change the real positions' outputs."""
    src, _, src_pad, _ = data
    torch.manual_seed(0)
    ours = Encoder(N, D, H, D_FF, 0.0, norm_first=norm_first).eval()
    noisy = src.masked_fill(src_pad[..., None], 100.0)
    with torch.no_grad():
        a = ours(src, src_key_padding_mask=src_pad)
        b = ours(noisy, src_key_padding_mask=src_pad)
    real = ~src_pad
    torch.testing.assert_close(a[real], b[real], atol=ATOL, rtol=0)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_decoder_layer_equals_torch(data, norm_first, need_weights):
    src, tgt, src_pad, tgt_pad = data
    torch.manual_seed(0)
    ref = torch_decoder_layer(norm_first).eval()
    ours = DecoderLayer(D, H, D_FF, 0.0, norm_first=norm_first).eval()
    copy_decoder_layer(ours, ref)
    with torch.no_grad():
        out = ours(tgt, src, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad, need_weights=need_weights)
        out = out[0] if need_weights else out
        expected = ref(tgt, src, tgt_mask=causal_mask(T), tgt_key_padding_mask=tgt_pad,
                       memory_key_padding_mask=src_pad, tgt_is_causal=True)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_stack_equals_torch(data, norm_first):
    src, tgt, src_pad, tgt_pad = data
    torch.manual_seed(0)
    final_norm = nn.LayerNorm(D) if norm_first else None
    ref = nn.TransformerDecoder(torch_decoder_layer(norm_first), N, norm=final_norm).eval()
    ours = Decoder(N, D, H, D_FF, 0.0, norm_first=norm_first).eval()
    copy_decoder(ours, ref)
    with torch.no_grad():
        out, weights = ours(tgt, src, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad, need_weights=True)
        expected = ref(tgt, src, tgt_mask=causal_mask(T), tgt_key_padding_mask=tgt_pad,
                       memory_key_padding_mask=src_pad, tgt_is_causal=True)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    self_w, cross_w = weights[0]
    assert self_w.shape == (B, H, T, T) and cross_w.shape == (B, H, T, S)
    assert torch.all(self_w[..., causal_mask(T)] == 0)  # the upper triangle: no weight on the future
    assert torch.all(cross_w[2, :, :, 3:] == 0)  # no weight on memory padding


def decode_three_ways(decoder, tgt, memory, memory_pad):
    """Teacher-forced outputs (B, T, D); the last position of each prefix recomputed; KV-cache steps."""
    with torch.no_grad():
        parallel = decoder(tgt, memory, memory_key_padding_mask=memory_pad)
        recompute = torch.stack(
            [decoder(tgt[:, : t + 1], memory, memory_key_padding_mask=memory_pad)[:, -1] for t in range(T)], dim=1
        )
        caches = tuple(layer.init_cache(memory) for layer in decoder.layers)
        cached = []
        for t in range(T):
            out, caches = decoder.step(tgt[:, t : t + 1], caches, memory_key_padding_mask=memory_pad)
            cached.append(out[:, 0])
    return parallel, recompute, torch.stack(cached, dim=1)


def assert_parallel_equals_step_by_step(decoder, tgt, memory, memory_pad):
    parallel, recompute, cached = decode_three_ways(decoder, tgt, memory, memory_pad)
    torch.testing.assert_close(recompute, parallel, atol=ATOL, rtol=0)
    torch.testing.assert_close(cached, parallel, atol=ATOL, rtol=0)


@pytest.mark.parametrize("norm_first", [False, True])
def test_parallel_equals_step_by_step_and_kv_cache(data, norm_first):
    src, tgt, src_pad, _ = data
    torch.manual_seed(0)
    decoder = Decoder(N, D, H, D_FF, 0.0, norm_first=norm_first).eval()
    assert_parallel_equals_step_by_step(decoder, tgt, src, src_pad)


def test_without_causal_mask_parallel_differs_from_step_by_step(data, monkeypatch):
    """The check above has teeth: with the causal mask gone, teacher forcing lets each position see
    later targets, so it no longer equals decoding one position at a time."""
    src, tgt, src_pad, _ = data
    torch.manual_seed(0)
    decoder = Decoder(N, D, H, D_FF, 0.0).eval()
    with torch.no_grad():
        masked = decoder(tgt, src, memory_key_padding_mask=src_pad)
    monkeypatch.setattr(layers, "causal_mask", lambda q_len, k_len=None, *, device=None: torch.zeros(
        q_len, k_len or q_len, dtype=torch.bool, device=device))
    with pytest.raises(AssertionError):
        assert_parallel_equals_step_by_step(decoder, tgt, src, src_pad)
    parallel, recompute, cached = decode_three_ways(decoder, tgt, src, src_pad)
    # A KV-cache step adds one position that may see every key so far: it never needed the mask.
    torch.testing.assert_close(cached, masked, atol=ATOL, rtol=0)
    for t in range(T - 1):
        assert not torch.allclose(parallel[:, t], cached[:, t], atol=1e-3), f"position {t} should see the future"


def test_copy_refuses_mismatched_settings():
    with pytest.raises(ValueError, match="norm_first"):
        copy_encoder_layer(EncoderLayer(D, H, D_FF, 0.0, norm_first=True), torch_encoder_layer(False))
    with pytest.raises(ValueError, match="activation"):
        copy_decoder_layer(DecoderLayer(D, H, D_FF, 0.0, activation="gelu"), torch_decoder_layer(False))
    with pytest.raises(ValueError, match="shape"):
        copy_encoder_layer(EncoderLayer(D, H, 2 * D_FF, 0.0), torch_encoder_layer(False))
    # nn.Transformer's post-norm encoder carries a final LayerNorm that the paper (and ours) has not.
    ref = nn.Transformer(D, H, N, N, D_FF, 0.0, batch_first=True).encoder
    with pytest.raises(ValueError, match="final LayerNorm"):
        copy_encoder(Encoder(N, D, H, D_FF, 0.0), ref)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("norm_first", [False, True])
def test_copy_transformer_copies_both_stacks(data, norm_first):
    src, tgt, src_pad, tgt_pad = data
    torch.manual_seed(0)
    ref = nn.Transformer(D, H, N, N, D_FF, 0.0, batch_first=True, norm_first=norm_first).eval()
    ref.encoder.use_nested_tensor = False  # keep the memory's padded rows computed, as ours are
    if not norm_first:  # the paper's post-norm stacks end without a LayerNorm
        ref.encoder.norm = None
        ref.decoder.norm = None
    config = TransformerConfig(src_vocab_size=11, tgt_vocab_size=11, d_model=D, n_heads=H, n_encoder_layers=N,
                               n_decoder_layers=N, d_ff=D_FF, dropout=0.0, norm_first=norm_first)
    ours = Transformer(config).eval()
    copy_transformer(ours, ref)
    with torch.no_grad():
        memory = ours.encoder(src, src_key_padding_mask=src_pad)
        out = ours.decoder(tgt, memory, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)
        expected = ref(src, tgt, tgt_mask=causal_mask(T), src_key_padding_mask=src_pad,
                       tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
