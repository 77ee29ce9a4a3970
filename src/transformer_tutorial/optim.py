"""Chapter 10: what training optimises — label-smoothed loss, Adam, the warm-up schedule."""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def label_smoothing_loss(
    logits: Tensor, target: Tensor, *, smoothing: float, ignore_index: int
) -> Tensor:
    """Cross-entropy against a smoothed target: ``1 - smoothing`` on the true token plus
    ``smoothing`` spread evenly over all V tokens; positions where ``target == ignore_index``
    do not count. Equal to ``F.cross_entropy(logits, target, label_smoothing=smoothing,
    ignore_index=ignore_index)``.

    Shapes:
        logits ``(N, V)``, target ``(N,)`` → a scalar, the mean over counted positions.
    """
    logp = logits.log_softmax(dim=-1)  # (N, V)
    nll = -logp.gather(-1, target.clamp(min=0)[:, None]).squeeze(-1)  # (N,) -log p(true token)
    uniform = -logp.mean(dim=-1)  # (N,) cross-entropy against the uniform distribution
    loss = (1.0 - smoothing) * nll + smoothing * uniform
    keep = target != ignore_index
    return loss[keep].sum() / keep.sum()


def warmup_inverse_sqrt(step: int, *, warmup: int) -> float:
    """The learning-rate multiplier: up linearly to 1 at step ``warmup``, then down as 1/√step.

    ``step`` counts the optimizer steps already taken, as ``LambdaLR`` passes it (0 for the
    first). Times a peak learning rate; times :func:`paper_peak_lr` it is the paper's schedule.
    """
    step += 1
    return min(step / warmup, math.sqrt(warmup / step))


def warmup_linear_decay(step: int, *, warmup: int, total: int) -> float:
    """The learning-rate multiplier of a run that knows its length: up linearly to 1 at step
    ``warmup``, then down linearly, reaching 0 just after the last of ``total`` steps.

    ``step`` counts the optimizer steps already taken (0 for the first), as in
    :func:`warmup_inverse_sqrt`; steps ``warmup − 1`` and ``warmup`` both take the peak. Decaying
    to zero at the end of the budget lets the last few hundred steps settle into the minimum that
    the noisy updates at full rate only circle. Past ``total`` it stays 0.
    """
    return max(0.0, min((step + 1) / warmup, (total - step) / (total - warmup)))


class LinearDecay:
    """:func:`warmup_linear_decay` as a ``LambdaLR`` multiplier whose last step can move while
    the run goes (:meth:`end_at`): a run that plans its length from a time budget.

    Until moved it is ``warmup_linear_decay(step, warmup=warmup, total=total)`` exactly. Moved
    at a step, it decays in a straight line from that step's value to 0 just after the new last
    step: the learning rate never jumps. Its fields are its state: ``LambdaLR.state_dict`` saves
    a callable object's attributes, so ``last.pt`` keeps the plan and a resumed run follows it.
    """

    def __init__(self, *, warmup: int, total: int) -> None:
        self.warmup, self.total = warmup, total
        self.decay_start, self.decay_from = warmup, 1.0  # the decay's first step and its value

    def __call__(self, step: int) -> float:
        fall = self.decay_from * (self.total - step) / (self.total - self.decay_start)
        return max(0.0, min((step + 1) / self.warmup, fall))

    def end_at(self, step: int, total: int) -> None:
        """From ``step`` (optimizer steps taken) on, decay to 0 just after step ``total``."""
        if total <= max(step, self.warmup):
            raise ValueError(
                f"total must be more than the steps taken ({step}) and the warm-up "
                f"({self.warmup}), got {total}"
            )
        if step > self.warmup:  # decaying already: go on from where the rate is now
            self.decay_start, self.decay_from = step, self(step)
        self.total = total


def paper_peak_lr(d_model: int, warmup: int, factor: float = 1.0) -> float:
    """The peak of the paper's learning rate, reached at ``step = warmup`` (section 5.3):

    lr = factor · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5)
    """
    return factor * d_model**-0.5 * warmup**-0.5


def translation_loss(
    logits: Tensor, target: Tensor, *, smoothing: float, ignore_index: int, reduction: str = "mean"
) -> Tensor:
    """The training criterion: :func:`label_smoothing_loss`, computed by PyTorch's
    ``F.cross_entropy`` in float32 even under mixed precision.

    The same number, and no cheaper: with label smoothing PyTorch composes it from
    ``log_softmax``, ``nll_loss`` and a sum over the vocabulary, as ours does, and keeps the
    same ``(N, V)`` log-probabilities for the backward pass. Training uses it because it is
    PyTorch's own, tested implementation, which ours is checked against.

    Shapes:
        logits ``(B, T, V)``, target ``(B, T)`` (or logits ``(N, V)``, target ``(N,)``) → a
        scalar (``reduction="mean"`` over counted positions, or ``"sum"``).
    """
    return F.cross_entropy(
        logits.float().flatten(0, -2),
        target.flatten(),
        reduction=reduction,
        ignore_index=ignore_index,
        label_smoothing=smoothing,
    )


def make_optimizer(
    model: nn.Module, *, lr: float, warmup: int, total_steps: int | None = None
) -> tuple[torch.optim.Adam, torch.optim.lr_scheduler.LambdaLR]:
    """Adam with the paper's β = (0.9, 0.98), ε = 1e-9, and a schedule peaking at ``lr`` after
    ``warmup`` steps: the paper's inverse square root, or with ``total_steps`` a linear decay to
    zero just after the last step (:class:`LinearDecay`, whose last step a run may move).

    ``fused``: one kernel updates every parameter (on the CPU too), several times faster than
    the default loop over parameters, which also reads each one's step count back as a number.
    """
    optimizer = torch.optim.Adam(
        model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-9, fused=True
    )
    if total_steps is None:
        multiplier = partial(warmup_inverse_sqrt, warmup=warmup)
    else:
        multiplier = LinearDecay(warmup=warmup, total=total_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
    return optimizer, schedule
