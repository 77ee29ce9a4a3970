"""What both sides run: ``nn.Transformer`` inside the book's embeddings and generator, one batch
with padding, and the timed calls — a training step of the trainer's kind and a forward pass."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from transformer_tutorial.configs import CONFIGS
from transformer_tutorial.data import PAD_ID
from transformer_tutorial.masks import causal_mask
from transformer_tutorial.model import Transformer
from transformer_tutorial.optim import make_optimizer, translation_loss
from transformer_tutorial.precision import autocast

# nn.Transformer's note that pre-norm layers cannot use its nested-tensor fast path.
warnings.filterwarnings("ignore", message="enable_nested_tensor is True")


class TorchTransformer(nn.Module):
    """``nn.Transformer`` inside our embeddings, positional encoding and generator."""

    def __init__(self, ours: Transformer) -> None:
        super().__init__()
        c = ours.config
        self.src_embed, self.tgt_embed = ours.src_embed, ours.tgt_embed
        self.positional = ours.positional
        self.pad_id = c.pad_id
        self.core = nn.Transformer(
            c.d_model,
            c.n_heads,
            c.n_encoder_layers,
            c.n_decoder_layers,
            c.d_ff,
            c.dropout,
            activation=c.activation,
            layer_norm_eps=c.layer_norm_eps,
            batch_first=True,
            norm_first=c.norm_first,
        )
        self.generator = nn.Linear(c.d_model, c.tgt_vocab_size)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        src_pad, tgt_pad = src == self.pad_id, tgt == self.pad_id
        out = self.core(
            self.positional(self.src_embed(src)),
            self.positional(self.tgt_embed(tgt)),
            tgt_mask=causal_mask(tgt.size(1), device=tgt.device),
            tgt_is_causal=True,
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
        )
        return self.generator(out)


def build_pair(name: str, device: torch.device) -> tuple[Transformer, TorchTransformer, int]:
    """Our model of recipe ``name``, ``nn.Transformer`` of the same sizes around its embeddings,
    and the vocabulary size."""
    recipe = CONFIGS[name]
    torch.manual_seed(0)
    ours = Transformer(recipe.model_config(recipe.vocab_size)).to(device)
    theirs = TorchTransformer(ours).to(device)
    return ours, theirs, recipe.vocab_size


def make_batch(vocab: int, sentences: int, length: int, device: torch.device) -> Tensor:
    """Token ids ``(2, B, length)``, source and target, lengths spread from 60% to 100%."""
    gen = torch.Generator().manual_seed(length)
    lengths = torch.linspace(0.6 * length, length, sentences).long()
    ids = torch.randint(4, vocab, (2, sentences, length), generator=gen)
    ids = ids.masked_fill(torch.arange(length)[None, :] >= lengths[:, None], PAD_ID)
    return ids.to(device)


class TrainStep:
    """One training step of the trainer's kind: forward, label-smoothed loss, backward, Adam.

    Calling it runs the whole step; :meth:`forward_backward` runs it without the optimizer
    step (what the FLOPs are counted on)."""

    def __init__(self, model: nn.Module, ids: Tensor, precision: str) -> None:
        self.model, self.precision = model, precision
        self.optimizer, _ = make_optimizer(model, lr=1e-4, warmup=100)
        self.src, tgt = ids[0], ids[1]
        self.tgt_in, self.tgt_out = tgt[:, :-1], tgt[:, 1:]

    def forward_backward(self) -> None:
        self.model.train()
        with autocast(self.precision, self.src.device):
            logits = self.model(self.src, self.tgt_in)
        loss = translation_loss(logits, self.tgt_out, smoothing=0.1, ignore_index=PAD_ID)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()

    def __call__(self) -> None:
        self.forward_backward()
        self.optimizer.step()


def forward_fn(model: nn.Module, ids: Tensor, precision: str) -> Callable[[], None]:
    """An inference forward pass (eval mode, no grad) on the batch ``ids``."""

    @torch.no_grad()
    def forward() -> None:
        model.eval()
        with autocast(precision, ids.device):
            model(ids[0], ids[1])

    return forward
