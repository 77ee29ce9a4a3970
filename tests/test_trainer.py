"""Training: label smoothing == PyTorch, the schedule, the configs, checkpoints, and resume == uninterrupted."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from transformer_tutorial.data import pair_lengths, token_batches
from transformer_tutorial.model import Transformer
from transformer_tutorial.train import (
    CONFIGS, fit, label_smoothing_loss, load_model, make_optimizer, paper_peak_lr, warmup_inverse_sqrt,
)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_label_smoothing_loss_equals_pytorch(smoothing):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 17, generator=g, requires_grad=True)
    target = torch.randint(0, 17, (40,), generator=g)
    target[::3] = 0  # some padding
    ours = label_smoothing_loss(logits, target, smoothing=smoothing, ignore_index=0)
    torch_loss = F.cross_entropy(logits, target, label_smoothing=smoothing, ignore_index=0)
    torch.testing.assert_close(ours, torch_loss)
    (grad_ours,) = torch.autograd.grad(ours, logits)
    (grad_torch,) = torch.autograd.grad(torch_loss, logits)
    torch.testing.assert_close(grad_ours, grad_torch)


def test_schedule_warms_up_linearly_then_decays_as_inverse_sqrt():
    warmup = 100
    lrs = [warmup_inverse_sqrt(step, warmup=warmup) for step in range(400)]
    assert lrs[0] == pytest.approx(1 / warmup)
    assert max(lrs) == lrs[warmup - 1] == pytest.approx(1.0)
    assert lrs[4 * warmup - 1] == pytest.approx(0.5)
    assert all(a < b for a, b in zip(lrs[: warmup - 1], lrs[1:warmup]))


def test_peak_times_multiplier_is_the_papers_schedule_in_lambdalr():
    d_model, warmup = 512, 4000
    config = CONFIGS["base"]
    optimizer, schedule = make_optimizer(torch.nn.Linear(1, 1), config)
    assert optimizer.defaults["betas"] == (0.9, 0.98) and optimizer.defaults["eps"] == 1e-9
    assert config.lr == paper_peak_lr(d_model, warmup)
    for step_num in range(1, 6001):  # the paper counts steps from 1
        paper = d_model**-0.5 * min(step_num**-0.5, step_num * warmup**-1.5)
        if step_num in (1, 2, 3999, 4000, 4001, 6000):
            assert schedule.get_last_lr()[0] == pytest.approx(paper, rel=1e-12)
        optimizer.step()
        schedule.step()


def test_small_config_is_the_cpu_reference():
    small = CONFIGS["small"]
    layers = (small.n_encoder_layers, small.n_decoder_layers)
    assert (small.d_model, layers, small.n_heads, small.d_ff) == (256, (3, 3), 8, 1024)
    assert (small.dropout, small.norm_first, small.vocab_size, small.share_embeddings) == (0.1, True, 8000, True)
    # The baseline's optimiser with smaller batches and half its warm-up: an hour on 2 CPU cores
    # is ~1,500 steps, and 800 of them warming up left the baseline's model undertrained.
    schedule = (small.max_tokens, small.lr, small.warmup, small.label_smoothing, small.clip_norm)
    assert schedule == (3000, 1e-3, 400, 0.1, 1.0)
    model = Transformer(small.model_config(8000))
    assert model.generator.weight is model.src_embed.weight is model.tgt_embed.weight
    assert 7.5e6 < sum(p.numel() for p in model.parameters()) < 7.7e6
    assert CONFIGS["base"].d_model == 512 and CONFIGS["base"].n_encoder_layers == 6


def synthetic_pairs(n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """Reverse-the-sequence pairs over ids 4..19."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n):
        src = torch.randint(4, 20, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        pairs.append((src, src[::-1]))
    return pairs


CONFIG = replace(CONFIGS["tiny"], vocab_size=20, max_tokens=60, epochs=3, log_every=2, eval_every=3,
                 checkpoint_every=4)
TRAIN, VAL = synthetic_pairs(48, seed=1), synthetic_pairs(12, seed=2)


def train(out_dir, **kwargs):
    return fit(CONFIG, TRAIN, VAL, vocab_size=20, out_dir=out_dir, seed=3, progress=False, **kwargs)


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(tmp_path):
    first_epoch = len(token_batches(pair_lengths(TRAIN), CONFIG.max_tokens, generator=torch.Generator().manual_seed(3)))
    total = first_epoch + 5
    straight, straight_state = train(tmp_path / "straight", max_steps=total)
    # Stop mid-epoch, then exactly at the end of the first epoch, then run to the end.
    for stop, resume in ((first_epoch - 2, False), (first_epoch, True), (total, True)):
        resumed, state = train(tmp_path / "resumed", max_steps=stop, resume=resume)
        assert state["step"] == stop and state["stopped_by"] == "max_steps"
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    losses = [entry["train_loss"] for entry in straight_state["history"]["train"]]
    assert losses == [entry["train_loss"] for entry in state["history"]["train"]]
    assert [e["epoch"] for e in state["history"]["epochs"]] == [1]


def test_checkpoints_history_and_time_budget(tmp_path):
    model, state = train(tmp_path, max_minutes=0.0)
    assert state["step"] == 1 and state["stopped_by"] == "max_minutes"
    assert {"last.pt", "best.pt"} <= {p.name for p in tmp_path.iterdir()}
    last = torch.load(tmp_path / "last.pt", weights_only=True)
    assert {"model", "model_config", "train_config", "optimizer", "scheduler", "state", "rng", "tokenizer"} <= set(last)
    assert {"torch", "python", "cuda"} <= set(last["rng"]) and "epoch_start" in last["state"]
    _, state = train(tmp_path, resume=True, max_steps=1)
    assert state["step"] == 1 and state["stopped_by"] == "max_steps"
    model, state = train(tmp_path, resume=True)
    assert state["stopped_by"] == "epochs" and state["epoch"] == CONFIG.epochs
    history = state["history"]
    assert len(history["epochs"]) == CONFIG.epochs and history["train"] and history["val"]
    assert all(math.isfinite(e["val_loss"]) for e in history["epochs"])
    best_loss = min(e["val_loss"] for e in history["val"])
    loaded, tokenizer, checkpoint = load_model(tmp_path / "best.pt")
    assert checkpoint["val_loss"] == best_loss and tokenizer is None and not loaded.training
    assert history["epochs"][-1]["train_loss"] < history["epochs"][0]["train_loss"]
