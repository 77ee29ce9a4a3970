"""Chapter 10: a model's loss on translation pairs — one batch (what a training step computes)
and a whole set (the validation loss), the ids checked once where the pairs come in.

Pairs are ``(source ids, target ids)`` without specials; :func:`~transformer_tutorial.data.collate`
pads them into ``src (B, S)``, ``tgt_in (B, T)`` and ``tgt_out (B, T)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from transformer_tutorial.data import PAD_ID, collate, id_range, pair_lengths, token_batches
from transformer_tutorial.model import Transformer, TransformerConfig, check_id_range
from transformer_tutorial.optim import translation_loss
from transformer_tutorial.precision import autocast

Pairs = Sequence[tuple[Sequence[int], Sequence[int]]]


def batch_loss(
    model: nn.Module,
    pairs: Pairs,
    *,
    label_smoothing: float,
    device: torch.device,
    precision: str,
) -> tuple[Tensor, int]:
    """The loss summed over the target tokens of the batch ``pairs``, and how many there are.

    The logits are computed at the real target tokens only, never at padding (``logits_at``),
    and nothing is read back from the device: the positions are found on the CPU before the
    batch moves, and the ids' range was checked once where the pairs came in.
    """
    src, tgt_in, tgt_out = collate(pairs)  # (B, S), (B, T), (B, T) on the CPU
    real = (tgt_out != PAD_ID).flatten().nonzero().squeeze(1)  # (N,) flat positions
    target = tgt_out.flatten()[real]  # (N,)
    src, tgt_in, real, target = (x.to(device) for x in (src, tgt_in, real, target))
    with autocast(precision, device):
        logits = model(src, tgt_in, logits_at=real, check_ids=False)  # (N, V)
    loss_sum = translation_loss(
        logits, target, smoothing=label_smoothing, ignore_index=PAD_ID, reduction="sum"
    )
    return loss_sum, len(real)


def check_pair_ids(name: str, pairs: Pairs, config: TransformerConfig) -> None:
    """Every id in ``pairs`` must be a token of the model's vocabularies: checked once, on the
    host, where the pairs come in, so that no batch needs a read back from the device."""
    check_id_range(f"{name} (sources)", *id_range(s for s, _ in pairs), config.src_vocab_size)
    check_id_range(f"{name} (targets)", *id_range(t for _, t in pairs), config.tgt_vocab_size)


@torch.no_grad()
def evaluate_loss(
    model: Transformer,
    pairs: Pairs,
    *,
    max_tokens: int,
    label_smoothing: float,
    device: torch.device,
    precision: str = "auto",
) -> float:
    """The mean loss per target token over ``pairs``, dropout off (training's criterion), the
    forward pass in ``precision`` (:mod:`~transformer_tutorial.precision`)."""
    check_pair_ids("pairs", pairs, model.config)
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device), 0
    for batch in token_batches(pair_lengths(pairs), max_tokens):
        loss_sum, tokens = batch_loss(
            model,
            [pairs[i] for i in batch],
            label_smoothing=label_smoothing,
            device=device,
            precision=precision,
        )
        total += loss_sum
        count += tokens
    model.train(was_training)
    return total.item() / max(count, 1)  # one read back from the device
