"""Chapters 7–8: the encoder and decoder stacks — N layers in turn, and the final LayerNorm
that pre-norm layers need.

Shapes: the encoder takes ``x (B, S, D)`` to the memory ``(B, S, D)``; the decoder takes
``x (B, T, D)`` and the memory to ``(B, T, D)``. :class:`~transformer_tutorial.model.Transformer`
puts them between its embeddings and its output layer.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn

from transformer_tutorial.layers import DecoderLayer, EncoderLayer, LayerCache, LayerNorm


class Encoder(nn.Module):
    """A stack of :class:`EncoderLayer`, plus a final LayerNorm when the layers are pre-norm.

    In pre-norm the residual stream is never normalised inside the stack, so the stack ends with
    one LayerNorm; post-norm layers already end with one. Like ``nn.ModuleList``, it takes the
    layers themselves, each initialised on its own.

    Shapes:
        x ``(B, S, D)``, src_key_padding_mask ``(B, S)`` → memory ``(B, S, D)``.
    """

    def __init__(self, layers: Iterable[EncoderLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = _final_norm(self.layers)

    def forward(self, x: Tensor, *, src_key_padding_mask: Tensor | None = None) -> Tensor:
        x, _ = _run_stack(self, x, need_weights=False, src_key_padding_mask=src_key_padding_mask)
        return x

    def forward_with_weights(
        self, x: Tensor, *, src_key_padding_mask: Tensor | None = None
    ) -> tuple[Tensor, list[Tensor]]:
        """As :meth:`forward`, with every layer's self-attention weights ``(B, H, S, S)``."""
        return _run_stack(self, x, need_weights=True, src_key_padding_mask=src_key_padding_mask)


class Decoder(nn.Module):
    """A stack of :class:`DecoderLayer`, plus a final LayerNorm when the layers are pre-norm.

    Shapes:
        x ``(B, T, D)``, memory ``(B, S, D)`` → ``(B, T, D)``.
    """

    def __init__(self, layers: Iterable[DecoderLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = _final_norm(self.layers)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        masks = dict(
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=memory_key_padding_mask,
        )
        x, _ = _run_stack(self, x, memory, need_weights=False, **masks)
        return x

    def forward_with_weights(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """As :meth:`forward`, with every layer's ``(self-attention, cross-attention)``
        weights."""
        masks = dict(
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=memory_key_padding_mask,
        )
        return _run_stack(self, x, memory, need_weights=True, **masks)

    def step(
        self,
        x: Tensor,
        caches: tuple[LayerCache, ...],
        *,
        memory_key_padding_mask: Tensor | None = None,
    ) -> tuple[Tensor, tuple[LayerCache, ...]]:
        """Run new positions through every layer, each with its own cache."""
        new_caches = []
        for layer, cache in zip(self.layers, caches, strict=True):
            x, cache = layer.step(x, cache, memory_key_padding_mask=memory_key_padding_mask)
            new_caches.append(cache)
        return (x if self.norm is None else self.norm(x)), tuple(new_caches)


def _run_stack(
    stack: Encoder | Decoder, x: Tensor, *args: Tensor, need_weights: bool, **masks: Tensor | None
) -> tuple[Tensor, list]:
    """Both stacks' ``forward`` and ``forward_with_weights``: each layer in turn on ``x`` (and
    the memory in ``args``), then the final norm. With ``need_weights`` each layer runs its
    written-out attention and its weights are returned, one entry a layer; else the list is
    empty."""
    weights = []
    for layer in stack.layers:
        if need_weights:
            x, w = layer.forward_with_weights(x, *args, **masks)
            weights.append(w)
        else:
            x = layer(x, *args, **masks)
    return (x if stack.norm is None else stack.norm(x)), weights


def _final_norm(layers: nn.ModuleList) -> LayerNorm | None:
    """The LayerNorm a pre-norm stack ends with (shaped like its layers' own), else None."""
    if len(layers) == 0:
        raise ValueError("a stack needs at least one layer, got none")
    first = layers[0].norm1
    return LayerNorm(first.weight.numel(), first.eps) if layers[0].norm_first else None
