"""Copy weights from ``torch.nn``'s Transformer modules into ours, for the equality checks.

Chapters 4 and 7–9 check each of our modules against PyTorch's own: build both, copy PyTorch's
randomly initialised weights into ours with these functions, switch dropout off (``eval()``) and
compare outputs. Only parameters are copied; settings that are not weights (``norm_first``,
activation, ``layer_norm_eps``, number of layers) must already agree, and a clear error says so
when they do not.

PyTorch's ``nn.MultiheadAttention`` packs the three input projections into one
``in_proj_weight`` ``(3D, D)`` = ``[W_q; W_k; W_v]``; ours keeps ``q_proj``, ``k_proj``,
``v_proj`` separate, so the copy splits it into three row blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_tutorial.attention import MultiHeadAttention
from transformer_tutorial.layers import DecoderLayer, EncoderLayer, FeedForward, LayerNorm
from transformer_tutorial.model import Decoder, Encoder, Transformer


def _activation_name(activation: object) -> str | None:
    """``"relu"`` / ``"gelu"`` for PyTorch's function or module form, else None."""
    if activation is F.relu or isinstance(activation, nn.ReLU):
        return "relu"
    if activation is F.gelu or (
        isinstance(activation, nn.GELU) and activation.approximate == "none"
    ):
        return "gelu"
    return None


def _assign(name: str, dst: Tensor, src: Tensor | None) -> None:
    if src is None:
        raise ValueError(
            f"{name}: PyTorch's module has no such tensor (built with bias=False?) but ours does"
        )
    if dst.shape != src.shape:
        raise ValueError(
            f"{name}: ours has shape {tuple(dst.shape)}, PyTorch's {tuple(src.shape)}"
        )
    dst.copy_(src)


def _copy_linear(name: str, ours: nn.Linear, weight: Tensor, bias: Tensor | None) -> None:
    _assign(f"{name}.weight", ours.weight, weight)
    if ours.bias is None:
        if bias is not None:
            raise ValueError(f"{name}.bias: PyTorch's module has a bias but ours has none")
    else:
        _assign(f"{name}.bias", ours.bias, bias)


def _copy_norm(name: str, ours: LayerNorm, ref: nn.LayerNorm) -> None:
    if ours.eps != ref.eps:
        raise ValueError(f"{name}: layer_norm_eps differs, ours {ours.eps}, PyTorch's {ref.eps}")
    _assign(f"{name}.weight", ours.weight, ref.weight)
    _assign(f"{name}.bias", ours.bias, ref.bias)


def copy_mha(ours: MultiHeadAttention, ref: nn.MultiheadAttention) -> None:
    """Copy ``nn.MultiheadAttention``'s weights into our :class:`MultiHeadAttention`."""
    if ours.n_heads != ref.num_heads:
        raise ValueError(f"n_heads differs: ours {ours.n_heads}, PyTorch's {ref.num_heads}")
    if ref.bias_k is not None or ref.add_zero_attn:
        raise ValueError(
            "PyTorch's module uses add_bias_kv or add_zero_attn, which ours does not have"
        )
    D = ours.d_model
    with torch.no_grad():
        if ref.in_proj_weight is not None:  # one packed (3D, D) matrix: rows [q; k; v]
            if ref.in_proj_weight.shape != (3 * D, D):
                raise ValueError(
                    f"in_proj_weight: expected (3D, D) = {(3 * D, D)}, "
                    f"got {tuple(ref.in_proj_weight.shape)}"
                )
            w_q, w_k, w_v = ref.in_proj_weight.split(D, dim=0)
        else:  # kdim/vdim != embed_dim: three separate matrices
            w_q, w_k, w_v = ref.q_proj_weight, ref.k_proj_weight, ref.v_proj_weight
        b_q = b_k = b_v = None
        if ref.in_proj_bias is not None:
            b_q, b_k, b_v = ref.in_proj_bias.split(D, dim=0)
        _copy_linear("q_proj", ours.q_proj, w_q, b_q)
        _copy_linear("k_proj", ours.k_proj, w_k, b_k)
        _copy_linear("v_proj", ours.v_proj, w_v, b_v)
        _copy_linear("out_proj", ours.out_proj, ref.out_proj.weight, ref.out_proj.bias)


def _check_layer_settings(ours: EncoderLayer | DecoderLayer, ref: nn.Module) -> None:
    if ours.norm_first != ref.norm_first:
        raise ValueError(f"norm_first differs: ours {ours.norm_first}, PyTorch's {ref.norm_first}")
    ours_name, ref_name = _activation_name(ours.ff.activation), _activation_name(ref.activation)
    if ref_name is None or ours_name != ref_name:
        raise ValueError(f"activation differs: ours {ours_name!r}, PyTorch's {ref.activation!r}")


def _copy_ff(ours: FeedForward, ref: nn.Module) -> None:
    _copy_linear("ff.linear1", ours.linear1, ref.linear1.weight, ref.linear1.bias)
    _copy_linear("ff.linear2", ours.linear2, ref.linear2.weight, ref.linear2.bias)


def copy_encoder_layer(ours: EncoderLayer, ref: nn.TransformerEncoderLayer) -> None:
    """Copy ``nn.TransformerEncoderLayer``'s weights into our :class:`EncoderLayer`."""
    _check_layer_settings(ours, ref)
    with torch.no_grad():
        copy_mha(ours.self_attn, ref.self_attn)
        _copy_ff(ours.ff, ref)
        _copy_norm("norm1", ours.norm1, ref.norm1)
        _copy_norm("norm2", ours.norm2, ref.norm2)


def copy_decoder_layer(ours: DecoderLayer, ref: nn.TransformerDecoderLayer) -> None:
    """Copy ``nn.TransformerDecoderLayer``'s weights into our :class:`DecoderLayer`
    (PyTorch's ``multihead_attn`` is our ``cross_attn``)."""
    _check_layer_settings(ours, ref)
    with torch.no_grad():
        copy_mha(ours.self_attn, ref.self_attn)
        copy_mha(ours.cross_attn, ref.multihead_attn)
        _copy_ff(ours.ff, ref)
        _copy_norm("norm1", ours.norm1, ref.norm1)
        _copy_norm("norm2", ours.norm2, ref.norm2)
        _copy_norm("norm3", ours.norm3, ref.norm3)


def _check_stack(kind: str, ours: Encoder | Decoder, ref: nn.Module) -> None:
    if len(ours.layers) != len(ref.layers):
        raise ValueError(
            f"{kind}: ours has {len(ours.layers)} layers, PyTorch's {len(ref.layers)}"
        )
    if (ours.norm is None) != (ref.norm is None):
        raise ValueError(
            f"{kind}: ours {'has no' if ours.norm is None else 'has a'} final LayerNorm, "
            f"PyTorch's {'has none' if ref.norm is None else 'has one'}. Ours has one only with "
            "norm_first=True (pre-norm); nn.Transformer adds one to both stacks even for "
            f"post-norm: set `ref.{kind}.norm = None` there, or build "
            f"nn.Transformer{kind.capitalize()}(..., norm=None)."
        )


def copy_encoder(ours: Encoder, ref: nn.TransformerEncoder) -> None:
    """Copy ``nn.TransformerEncoder``'s weights (every layer, and the final norm) into our
    :class:`Encoder`."""
    _copy_stack("encoder", ours, ref, copy_encoder_layer)


def copy_decoder(ours: Decoder, ref: nn.TransformerDecoder) -> None:
    """Copy ``nn.TransformerDecoder``'s weights (every layer, and the final norm) into our
    :class:`Decoder`."""
    _copy_stack("decoder", ours, ref, copy_decoder_layer)


def _copy_stack(
    kind: str,
    ours: Encoder | Decoder,
    ref: nn.Module,
    copy_layer: Callable[[nn.Module, nn.Module], None],
) -> None:
    _check_stack(kind, ours, ref)
    for ours_layer, ref_layer in zip(ours.layers, ref.layers, strict=True):
        copy_layer(ours_layer, ref_layer)
    if ours.norm is not None:
        with torch.no_grad():
            _copy_norm(f"{kind}.norm", ours.norm, ref.norm)


def copy_transformer(ours_model: Transformer, ref: nn.Transformer) -> None:
    """Copy ``nn.Transformer``'s two stacks into our :class:`Transformer`.

    ``nn.Transformer`` has no embeddings, positional encoding or output layer (it maps vectors
    to vectors); ours keeps its own around the copied stacks.
    """
    copy_encoder(ours_model.encoder, ref.encoder)
    copy_decoder(ours_model.decoder, ref.decoder)
