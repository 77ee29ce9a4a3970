"""Transformer, piece by piece: the encoder–decoder Transformer of Vaswani et al. (2017).

One module per chapter, read in this order: ``embeddings`` → ``masks`` → ``attention`` →
``layers`` → ``model``, then ``data`` → ``train`` → ``decode``.

Shape vocabulary, batch-first everywhere:

====  =========================================
B     batch size
S     source length (encoder side)
T     target length (decoder side)
D     ``d_model``, the width of every residual stream
H     number of attention heads
Dh    ``D // H``, the width of one head
V     vocabulary size
====  =========================================

Mask polarity lives in the name and follows PyTorch's modules: every ``*_key_padding_mask`` is a
bool ``(B, L)`` tensor with True = padding (ignore), and every ``attn_mask`` is bool with
True = blocked. ``torch.nn.functional.scaled_dot_product_attention`` reads a bool mask the other
way round (True = attend); :func:`transformer_tutorial.masks.merge_masks` is the one place that
builds what attention consumes.
"""

from transformer_tutorial.runtime import get_device, set_seed

__version__ = "0.1.0"

__all__ = ["get_device", "set_seed", "__version__"]
