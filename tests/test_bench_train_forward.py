"""bench/train_forward.py: our side of the training-step row trains as the trainer does, with
logits at the real target tokens only, and gets the gradients of the full step (float32, to
1e-5 relative)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_padding_free_step_gives_the_full_steps_gradients(monkeypatch, seed):
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.models import TrainStep, build_pair, make_batch
    from bench.train_forward import PaddingFreeStep

    ours, _, vocab = build_pair("tiny", torch.device("cpu"))
    ids = make_batch(vocab, 6, 9 + seed, torch.device("cpu"))
    grads = []
    for kind in (PaddingFreeStep, TrainStep):
        model = copy.deepcopy(ours)
        torch.manual_seed(seed)  # the same dropout masks
        kind(model, ids, "fp32").forward_backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(g is not None for g in grads[0])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
