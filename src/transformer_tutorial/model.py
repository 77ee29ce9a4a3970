"""Chapter 9: the whole encoder–decoder Transformer, its config and its decoding cache.

Shapes: source ids ``(B, S)``, target ids ``(B, T)`` → logits ``(B, T, V)``; the encoder's
output, the "memory", is ``(B, S, D)``. The model returns logits: softmax belongs to the loss
(``F.cross_entropy``) and to decoding. The stacks it is built from, :class:`Encoder` and
:class:`Decoder` (chapters 7–8), live in :mod:`~transformer_tutorial.stacks`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from transformer_tutorial.checks import check_bool, check_choice, check_int, check_number
from transformer_tutorial.embeddings import SinusoidalPositionalEncoding, TokenEmbedding
from transformer_tutorial.layers import ACTIVATIONS, DecoderLayer, EncoderLayer, LayerCache
from transformer_tutorial.masks import padding_mask
from transformer_tutorial.stacks import Decoder, Encoder


@dataclass(frozen=True)
class TransformerConfig:
    """Every hyperparameter of the model. Defaults are the paper's base model (Table 3).

    ``share_embeddings`` makes source and target use one embedding table (needs one joint
    vocabulary); ``tie_output`` makes the output layer reuse the target embedding matrix.
    """

    src_vocab_size: int
    tgt_vocab_size: int
    d_model: int = 512
    n_heads: int = 8
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1
    max_len: int = 512
    norm_first: bool = False
    activation: str = "relu"
    layer_norm_eps: float = 1e-5
    pad_id: int = 0
    share_embeddings: bool = False
    tie_output: bool = False

    def __post_init__(self) -> None:
        for name in (
            "src_vocab_size",
            "tgt_vocab_size",
            "d_model",
            "n_heads",
            "n_encoder_layers",
            "n_decoder_layers",
            "d_ff",
            "max_len",
        ):
            check_int(name, getattr(self, name), at_least=1)
        check_number("dropout", self.dropout, low=0.0, high=1.0, high_open=True)
        check_number("layer_norm_eps", self.layer_norm_eps, low=0.0, low_open=True)
        check_choice("activation", self.activation, ACTIVATIONS)
        check_bool("norm_first", self.norm_first)
        check_bool("share_embeddings", self.share_embeddings)
        check_bool("tie_output", self.tie_output)
        check_int("pad_id", self.pad_id, at_least=0)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.d_model % 2:
            raise ValueError(f"d_model={self.d_model} must be even (sine/cosine pairs)")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(
                "share_embeddings needs one joint vocabulary: src_vocab_size "
                f"{self.src_vocab_size} != tgt_vocab_size {self.tgt_vocab_size}"
            )
        if self.pad_id >= min(self.src_vocab_size, self.tgt_vocab_size):
            raise ValueError(f"pad_id={self.pad_id} is not an id of both vocabularies")


@dataclass(frozen=True)
class DecoderCache:
    """Everything incremental decoding carries from one step to the next.

    ``layers``: one :class:`LayerCache` per decoder layer; ``memory_key_padding_mask``: ``(B, S)``;
    ``length``: how many target positions the cache holds.
    """

    layers: tuple[LayerCache, ...]
    memory_key_padding_mask: Tensor | None
    length: int

    def reorder(self, index: Tensor) -> DecoderCache:
        """Select batch rows ``index`` ``(B',)`` of every tensor (beam search)."""
        mask = (
            None
            if self.memory_key_padding_mask is None
            else self.memory_key_padding_mask.index_select(0, index)
        )
        return DecoderCache(tuple(c.reorder(index) for c in self.layers), mask, self.length)


class Transformer(nn.Module):
    """The encoder–decoder Transformer: embeddings → encoder → decoder → generator.

    Padding masks are derived from ``config.pad_id`` when not given, and the decoder's causal
    mask is built inside its self-attention, so ``model(src, tgt)`` is always correctly masked.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = c = config
        self.src_embed = TokenEmbedding(c.src_vocab_size, c.d_model, padding_idx=c.pad_id)
        self.tgt_embed = (
            self.src_embed
            if c.share_embeddings
            else TokenEmbedding(c.tgt_vocab_size, c.d_model, padding_idx=c.pad_id)
        )
        self.positional = SinusoidalPositionalEncoding(c.d_model, c.max_len, c.dropout)
        layer = dict(
            d_model=c.d_model,
            n_heads=c.n_heads,
            d_ff=c.d_ff,
            dropout=c.dropout,
            norm_first=c.norm_first,
            activation=c.activation,
            layer_norm_eps=c.layer_norm_eps,
        )
        self.encoder = Encoder(EncoderLayer(**layer) for _ in range(c.n_encoder_layers))
        self.decoder = Decoder(DecoderLayer(**layer) for _ in range(c.n_decoder_layers))
        self.generator = nn.Linear(c.d_model, c.tgt_vocab_size)
        self.reset_parameters()
        if c.tie_output:
            self.generator.weight = self.tgt_embed.weight

    def reset_parameters(self) -> None:
        """Initialise as the paper's reference code (tensor2tensor) does.

        Every layer matrix is Xavier-uniform and every bias zero (LayerNorm gains stay 1); the
        embedding table is N(0, 1/D), so that after the ×√D scale each token vector has norm
        ≈ √D, √2 times its positional encoding's √(D/2) whatever the vocabulary size, while tied
        output logits still start near zero. Padding rows are zeroed again after the draw.
        """
        embeddings = {self.src_embed.weight, self.tgt_embed.weight}
        for name, p in self.named_parameters():
            if any(p is e for e in embeddings):
                nn.init.normal_(p, std=self.config.d_model**-0.5)
            elif p.dim() > 1:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        with torch.no_grad():
            for embed in {self.src_embed, self.tgt_embed}:
                embed.weight[self.config.pad_id].zero_()

    def encode(
        self, src: Tensor, src_key_padding_mask: Tensor | None = None, *, check_ids: bool = True
    ) -> Tensor:
        """Source ids ``(B, S)`` → memory ``(B, S, D)``.

        ``check_ids=False`` skips the ids' range check, a read back from the device, for ids
        checked where they were made (the trainer checks its pairs once).
        """
        self._check_ids("src", src, self.config.src_vocab_size, check_range=check_ids)
        if src_key_padding_mask is None:
            src_key_padding_mask = padding_mask(src, self.config.pad_id)
        x = self.positional(self.src_embed(src))
        return self.encoder(x, src_key_padding_mask=src_key_padding_mask)

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        *,
        memory_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        logits_at: Tensor | None = None,
        check_ids: bool = True,
    ) -> Tensor:
        """Target ids ``(B, T)`` and memory ``(B, S, D)`` → logits ``(B, T, V)``, all at once.

        ``logits_at``, flat indices ``(N,)`` into the ``B·T`` target positions, asks for the
        logits ``(N, V)`` of those positions only: training asks for the real tokens', so the
        output layer and the loss never run on padding. ``check_ids`` as in :meth:`encode`.
        """
        self._check_ids("tgt", tgt, self.config.tgt_vocab_size, check_range=check_ids)
        D = self.config.d_model
        if memory.dim() != 3 or memory.size(0) != tgt.size(0) or memory.size(-1) != D:
            raise ValueError(
                f"memory must be the encoder's output (B, S, D) = ({tgt.size(0)}, S, {D}) for "
                f"tgt of shape {tuple(tgt.shape)}, got {tuple(memory.shape)}"
            )
        if tgt_key_padding_mask is None:
            tgt_key_padding_mask = padding_mask(tgt, self.config.pad_id)
        x = self.positional(self.tgt_embed(tgt))
        x = self.decoder(
            x,
            memory,
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=memory_key_padding_mask,
        )  # (B, T, D)
        if logits_at is not None:
            x = x.flatten(0, 1).index_select(0, logits_at)  # (N, D)
        return self.generator(x)

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        *,
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        logits_at: Tensor | None = None,
        check_ids: bool = True,
    ) -> Tensor:
        """Source ids ``(B, S)``, target ids ``(B, T)`` → logits ``(B, T, V)``
        (teacher forcing); ``logits_at`` and ``check_ids`` as in :meth:`decode`."""
        if src.dim() == tgt.dim() == 2 and src.size(0) != tgt.size(0):
            raise ValueError(
                f"src and tgt must hold the same number of sentences: src has {src.size(0)} "
                f"rows {tuple(src.shape)}, tgt has {tgt.size(0)} {tuple(tgt.shape)}"
            )
        if src_key_padding_mask is None:
            src_key_padding_mask = padding_mask(src, self.config.pad_id)
        memory = self.encode(src, src_key_padding_mask, check_ids=check_ids)
        return self.decode(
            tgt,
            memory,
            memory_key_padding_mask=src_key_padding_mask,
            tgt_key_padding_mask=tgt_key_padding_mask,
            logits_at=logits_at,
            check_ids=check_ids,
        )

    def init_cache(
        self, memory: Tensor, memory_key_padding_mask: Tensor | None = None
    ) -> DecoderCache:
        """Project the memory's keys/values once per layer for incremental decoding."""
        layers = tuple(layer.init_cache(memory) for layer in self.decoder.layers)
        return DecoderCache(layers, memory_key_padding_mask, 0)

    def decode_step(self, tgt: Tensor, cache: DecoderCache) -> tuple[Tensor, DecoderCache]:
        """New target ids ``(B, T_new)`` after the ``cache.length`` held in ``cache`` → their
        logits ``(B, T_new, V)`` and the grown cache. Equal to :meth:`decode` on the whole prefix.

        The ids' range is not read back here, at every step: decoding checks the source once
        (:meth:`encode`) and feeds back the model's own choices.
        """
        self._check_ids("tgt", tgt, self.config.tgt_vocab_size, check_range=False)
        x = self.positional(self.tgt_embed(tgt), start=cache.length)
        x, layers = self.decoder.step(
            x, cache.layers, memory_key_padding_mask=cache.memory_key_padding_mask
        )
        return self.generator(x), DecoderCache(
            layers, cache.memory_key_padding_mask, cache.length + tgt.size(1)
        )

    @staticmethod
    def _check_ids(name: str, ids: Tensor, vocab_size: int, *, check_range: bool) -> None:
        """Token ids must be an integer ``(B, L)`` tensor (free: shape and dtype only) with, where
        ``check_range``, every id in ``[0, vocab_size)``."""
        if ids.dim() != 2:
            raise ValueError(f"{name} must be token ids of shape (B, L), got {tuple(ids.shape)}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
        # The range check reads the ids' values: on a GPU the host waits for the queue to drain.
        # torch.compile skips it (it would split the graph at every call).
        if not check_range or torch.compiler.is_compiling() or not ids.numel():
            return
        low, high = torch.stack(torch.aminmax(ids)).tolist()  # one read back from the device
        check_id_range(name, low, high, vocab_size)


def check_id_range(name: str, low: int, high: int, vocab_size: int) -> None:
    """Token ids from ``low`` to ``high`` must all lie in ``[0, vocab_size)``."""
    if not 0 <= low <= high < vocab_size:
        raise ValueError(
            f"{name} holds ids from {low} to {high}; valid ids are "
            f"0 to {vocab_size - 1} (the vocabulary has {vocab_size} tokens)"
        )
