"""copy_weights: PyTorch's weights copied into ours make the two compute the same, and every
setting that is not a weight but differs is refused with a message saying what to change.

The layer- and stack-level equality checks that use these functions live with the modules they
check (test_attention.py, test_layers.py, test_stacks.py); here: nn.Transformer as a whole, and
the refusals.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import to_device
from transformer_tutorial.attention import MultiHeadAttention
from transformer_tutorial.copy_weights import (
    copy_decoder,
    copy_encoder,
    copy_mha,
    copy_transformer,
)
from transformer_tutorial.layers import DecoderLayer, EncoderLayer
from transformer_tutorial.masks import causal_mask
from transformer_tutorial.model import Decoder, Encoder, Transformer, TransformerConfig

B, S, T, D, H, D_FF, N = 3, 7, 6, 16, 4, 32, 2
ATOL = 1e-5


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("norm_first", [False, True])
def test_copy_transformer_makes_both_stacks_equal_nn_transformer(norm_first, device):
    g = torch.Generator().manual_seed(0)
    src, tgt = torch.randn(B, S, D, generator=g), torch.randn(B, T, D, generator=g)
    src_pad = torch.zeros(B, S, dtype=torch.bool)
    src_pad[2, 3:] = True
    tgt_pad = torch.zeros(B, T, dtype=torch.bool)
    tgt_pad[0, 4:] = True
    torch.manual_seed(0)
    ref = nn.Transformer(D, H, N, N, D_FF, 0.0, batch_first=True, norm_first=norm_first).eval()
    ref.encoder.use_nested_tensor = False  # keep the memory's padded rows computed, as ours are
    if not norm_first:  # the paper's post-norm stacks end without a LayerNorm
        ref.encoder.norm = None
        ref.decoder.norm = None
    config = TransformerConfig(
        src_vocab_size=11,
        tgt_vocab_size=11,
        d_model=D,
        n_heads=H,
        n_encoder_layers=N,
        n_decoder_layers=N,
        d_ff=D_FF,
        dropout=0.0,
        norm_first=norm_first,
    )
    ours = Transformer(config).eval()
    copy_transformer(ours, ref)
    ours, ref, src, tgt, src_pad, tgt_pad = to_device(
        (ours, ref, src, tgt, src_pad, tgt_pad), device
    )
    with torch.no_grad():
        memory = ours.encoder(src, src_key_padding_mask=src_pad)
        out = ours.decoder(
            tgt, memory, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad
        )
        expected = ref(
            src,
            tgt,
            tgt_mask=causal_mask(T, device=device),
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
        )
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_post_norm_copy_refuses_nn_transformers_extra_final_norm():
    """nn.Transformer's post-norm stacks carry a final LayerNorm that the paper (and ours) has
    not; the error says how to remove it."""
    config = TransformerConfig(
        11, 11, d_model=D, n_heads=H, n_encoder_layers=N, n_decoder_layers=N, d_ff=D_FF
    )
    ref = nn.Transformer(D, H, N, N, D_FF, 0.0, batch_first=True)
    with pytest.raises(ValueError, match=r"final LayerNorm.*ref\.encoder\.norm = None"):
        copy_transformer(Transformer(config), ref)


def test_copy_refuses_a_different_stack():
    ours = Encoder(EncoderLayer(D, H, D_FF) for _ in range(2))
    ref = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(D, H, D_FF, batch_first=True), 3, enable_nested_tensor=False
    )
    with pytest.raises(ValueError, match="encoder: ours has 2 layers, PyTorch's 3"):
        copy_encoder(ours, ref)
    ours = Decoder(DecoderLayer(D, H, D_FF, norm_first=True) for _ in range(2))
    post_norm = nn.TransformerDecoderLayer(D, H, D_FF, batch_first=True)
    ref = nn.TransformerDecoder(post_norm, 2, norm=nn.LayerNorm(D))
    with pytest.raises(ValueError, match="norm_first differs: ours True, PyTorch's False"):
        copy_decoder(ours, ref)


def test_copy_mha_refuses_what_ours_cannot_hold():
    with pytest.raises(ValueError, match="n_heads differs: ours 4, PyTorch's 2"):
        copy_mha(MultiHeadAttention(D, 4), nn.MultiheadAttention(D, 2, batch_first=True))
    with pytest.raises(ValueError, match="add_bias_kv or add_zero_attn"):
        copy_mha(MultiHeadAttention(D, H), nn.MultiheadAttention(D, H, add_bias_kv=True))
    with pytest.raises(ValueError, match="PyTorch's module has no such tensor"):
        copy_mha(MultiHeadAttention(D, H), nn.MultiheadAttention(D, H, bias=False))
    with pytest.raises(ValueError, match="has a bias but ours has none"):
        copy_mha(MultiHeadAttention(D, H, bias=False), nn.MultiheadAttention(D, H))


def test_a_refused_copy_names_the_tensor_and_both_shapes():
    ref = nn.MultiheadAttention(D, H, kdim=8, vdim=8, batch_first=True)  # separate K/V matrices
    with pytest.raises(ValueError, match=r"k_proj\.weight: ours has shape \(16, 16\)"):
        copy_mha(MultiHeadAttention(D, H), ref)
