"""Chapter 10, what training optimises: label smoothing by hand == PyTorch's, the training loss
== the hand-written one and no leaner, the warm-up schedule, and Adam with the paper's settings."""

from __future__ import annotations

import copy
import io
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import raises
from transformer_tutorial.optim import (
    LinearDecay,
    label_smoothing_loss,
    make_optimizer,
    paper_peak_lr,
    translation_loss,
    warmup_inverse_sqrt,
    warmup_linear_decay,
)

PAD = 0


def _logits_and_target(seed: int = 0, shape: tuple[int, ...] = (40,), vocab: int = 17):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, vocab, generator=g, requires_grad=True)
    target = torch.randint(0, vocab, shape, generator=g)
    target.view(-1)[::3] = PAD  # some padding
    return logits, target


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_label_smoothing_loss_equals_pytorch_value_and_gradient(smoothing):
    logits, target = _logits_and_target()
    ours = label_smoothing_loss(logits, target, smoothing=smoothing, ignore_index=PAD)
    torch_loss = F.cross_entropy(logits, target, label_smoothing=smoothing, ignore_index=PAD)
    torch.testing.assert_close(ours, torch_loss)
    (grad_ours,) = torch.autograd.grad(ours, logits)
    (grad_torch,) = torch.autograd.grad(torch_loss, logits)
    torch.testing.assert_close(grad_ours, grad_torch)


def test_translation_loss_is_label_smoothing_over_b_t_and_sums_on_request():
    logits, target = _logits_and_target(shape=(4, 9))
    by_hand = label_smoothing_loss(
        logits.flatten(0, 1), target.flatten(), smoothing=0.1, ignore_index=PAD
    )
    mean = translation_loss(logits, target, smoothing=0.1, ignore_index=PAD)
    total = translation_loss(logits, target, smoothing=0.1, ignore_index=PAD, reduction="sum")
    torch.testing.assert_close(mean, by_hand)
    torch.testing.assert_close(total, by_hand * (target != PAD).sum())
    half = translation_loss(logits.bfloat16(), target, smoothing=0.1, ignore_index=PAD)
    assert half.dtype == torch.float32  # computed in float32 even under mixed precision


def _saved_for_backward(loss_fn) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward pass of ``loss_fn()``."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn()
    return sum(storages.values())


def test_translation_loss_keeps_the_same_log_probabilities_for_backward_as_ours():
    logits, target = _logits_and_target(shape=(8, 50), vocab=1000)  # (B, T, V)
    log_probs = logits.numel() * logits.element_size()  # one (N, V) float32 tensor
    pytorch = _saved_for_backward(
        lambda: translation_loss(logits, target, smoothing=0.1, ignore_index=PAD)
    )
    ours = _saved_for_backward(
        lambda: label_smoothing_loss(
            logits.flatten(0, 1), target.flatten(), smoothing=0.1, ignore_index=PAD
        )
    )
    assert log_probs <= pytorch < 1.05 * log_probs and log_probs <= ours < 1.05 * log_probs


def test_schedule_warms_up_linearly_then_decays_as_inverse_sqrt():
    warmup = 100
    lrs = [warmup_inverse_sqrt(step, warmup=warmup) for step in range(400)]
    assert lrs[0] == pytest.approx(1 / warmup)
    assert max(lrs) == lrs[warmup - 1] == pytest.approx(1.0)
    assert lrs[4 * warmup - 1] == pytest.approx(0.5)
    assert all(a < b for a, b in itertools.pairwise(lrs[:warmup]))


def test_make_optimizer_with_the_paper_peak_is_the_papers_schedule():
    d_model, warmup = 512, 4000
    optimizer, schedule = make_optimizer(
        torch.nn.Linear(1, 1), lr=paper_peak_lr(d_model, warmup), warmup=warmup
    )
    assert optimizer.defaults["betas"] == (0.9, 0.98) and optimizer.defaults["eps"] == 1e-9
    checked = {1, 2, 3999, 4000, 4001, 6000}
    for step_num in range(1, max(checked) + 1):  # the paper counts steps from 1
        if step_num in checked:
            paper = d_model**-0.5 * min(step_num**-0.5, step_num * warmup**-1.5)
            assert schedule.get_last_lr()[0] == pytest.approx(paper, rel=1e-12)
        optimizer.step()
        schedule.step()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fused_adam_takes_the_steps_of_the_plain_loop(seed, threads):
    """make_optimizer's fused Adam (one kernel for every parameter) against torch's plain loop
    over parameters (``foreach=False``): the same weights after 20 steps, to float32's rounding
    (1e-6 relative, 1e-7 absolute)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    fused = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    plain, start = copy.deepcopy(fused), copy.deepcopy(fused)
    optimizer, schedule = make_optimizer(fused, lr=1e-2, warmup=5)
    reference = torch.optim.Adam(
        plain.parameters(), lr=1e-2, betas=(0.9, 0.98), eps=1e-9, foreach=False
    )
    reference_schedule = torch.optim.lr_scheduler.LambdaLR(
        reference, lambda step: warmup_inverse_sqrt(step, warmup=5)
    )
    assert optimizer.defaults["fused"]
    try:
        for _ in range(20):
            x = torch.randn(32, 8)
            for model, opt, sched in (
                (fused, optimizer, schedule),
                (plain, reference, reference_schedule),
            ):
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
                sched.step()
    finally:
        torch.set_num_threads(before)
    for a, b, c in zip(fused.parameters(), plain.parameters(), start.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert (a - c).abs().max() > 1e-2  # they did move


def test_linear_decay_warms_up_then_falls_to_zero_at_the_last_step():
    warmup, total = 4, 10
    f = [warmup_linear_decay(step, warmup=warmup, total=total) for step in range(total)]
    assert f[:warmup] == [0.25, 0.5, 0.75, 1.0]  # as the paper's warm-up
    # The peak, then down by 1/6 a step: the last step still moves, the step after it would not.
    assert f[warmup:] == pytest.approx([1, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6])
    assert warmup_linear_decay(total, warmup=warmup, total=total) == 0.0
    assert warmup_linear_decay(total + 5, warmup=warmup, total=total) == 0.0  # never negative


def test_make_optimizer_with_total_steps_follows_the_linear_decay():
    model = nn.Linear(2, 2)
    optimizer, schedule = make_optimizer(model, lr=1e-3, warmup=2, total_steps=6)
    lrs = []
    for _ in range(6):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 0.75e-3, 0.5e-3, 0.25e-3])


def test_linear_decay_until_moved_is_warmup_linear_decay_to_the_last_bit():
    """A run without a time limit keeps its schedule: the same floats as before it could move."""
    for warmup, total in ((4, 10), (400, 3600), (50, 51)):
        decay = LinearDecay(warmup=warmup, total=total)
        for step in range(total + 3):
            assert decay(step) == warmup_linear_decay(step, warmup=warmup, total=total), step


def test_moving_the_end_goes_on_from_the_rate_now_in_a_straight_line_to_zero():
    decay = LinearDecay(warmup=4, total=20)
    now = decay(10)  # 10/16 of the peak
    decay.end_at(10, 15)
    assert decay(10) == pytest.approx(now)  # no jump
    assert [decay(s) for s in range(10, 17)] == pytest.approx(
        [now * (15 - s) / 5 for s in range(10, 16)] + [0.0]
    )
    later = LinearDecay(warmup=4, total=20)
    later.end_at(10, 30)  # a longer plan: a gentler slope, never a rise
    assert later(10) == pytest.approx(now) and later(11) < now and later(30) == 0.0
    warming = LinearDecay(warmup=4, total=20)
    warming.end_at(2, 8)  # during the warm-up: the warm-up as it was, then down from the peak
    assert [warming(s) for s in range(9)] == pytest.approx(
        [0.25, 0.5, 0.75, 1, 1, 0.75, 0.5, 0.25, 0]
    )


@pytest.mark.parametrize(("step", "total"), [(10, 10), (10, 9), (2, 4)])
def test_moving_the_end_refuses_one_not_after_the_steps_taken_and_the_warm_up(step, total):
    raises(
        lambda: LinearDecay(warmup=4, total=20).end_at(step, total),
        ValueError,
        f"total must be more than the steps taken ({step}) and the warm-up (4), got {total}",
    )


def test_a_moved_end_is_saved_with_the_schedule_and_restored_from_a_checkpoint():
    """last.pt keeps the schedule's state_dict: a resumed run goes on with the plan it had."""
    model = nn.Linear(2, 2)
    optimizer, schedule = make_optimizer(model, lr=1e-3, warmup=2, total_steps=20)
    for _ in range(8):
        optimizer.step()
        schedule.step()
    schedule.lr_lambdas[0].end_at(8, 12)
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": schedule.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    again, again_schedule = make_optimizer(model, lr=1e-3, warmup=2, total_steps=20)
    again.load_state_dict(saved["optimizer"])
    again_schedule.load_state_dict(saved["scheduler"])
    lrs = []
    for opt, sched in ((optimizer, schedule), (again, again_schedule)):
        lrs.append([])
        for _ in range(5):
            lrs[-1].append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    assert lrs[0] == lrs[1] and lrs[0][-1] == 0.0 and lrs[0][0] > 0
