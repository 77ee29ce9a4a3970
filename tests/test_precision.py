"""Chapter 12's precision choice: ``auto`` per device, autocast to the half type, a loss scaler for
fp16 only; both mixed-precision training paths run on a CPU close to float32, masks give no NaN
in half precision, and the scaler's state survives a resume."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from transformer_tutorial.configs import CONFIGS, RunOptions
from transformer_tutorial.data import PAD_ID
from transformer_tutorial.precision import autocast, grad_scaler, resolve_precision
from transformer_tutorial.trainer import fit

VOCAB = 13  # the digit-reversal task's
CONFIG = replace(
    CONFIGS["tiny"], max_tokens=60, epochs=3, log_every=1, eval_every=0, checkpoint_every=0
)
STEPS = 8
# Largest gap in the per-step training loss from float32 over STEPS steps (losses ≈ 3.0–3.5).
# Measured on CPU, torch 2.13: bf16 (8 significant bits) 2.2e-3, fp16 (11 bits) 2.2e-4.
TOLERANCE = {"bf16": 1e-2, "fp16": 2e-3}


@pytest.fixture(scope="module")
def pairs(digit_reversal):
    return digit_reversal.pairs(48, seed=1), digit_reversal.pairs(12, seed=2)


def train(pairs, out_dir, **options):
    train_pairs, val_pairs = pairs
    options = RunOptions(seed=3, progress=False, **options)
    return fit(CONFIG, train_pairs, val_pairs, vocab_size=VOCAB, out_dir=out_dir, options=options)


def test_auto_is_bf16_on_gpus_that_have_it_fp16_on_others_fp32_on_cpu(monkeypatch):
    assert resolve_precision("auto", "cpu") == "fp32"
    for native, expected in ((True, "bf16"), (False, "fp16")):
        monkeypatch.setattr(
            torch.cuda, "is_bf16_supported", lambda including_emulation, n=native: n
        )
        assert resolve_precision("auto", torch.device("cuda")) == expected
    for asked in ("fp32", "bf16", "fp16"):  # an explicit choice is kept, on a CPU too
        assert resolve_precision(asked, "cpu") == asked
    with pytest.raises(ValueError, match="precision must be one of"):
        resolve_precision("float16", "cpu")
    with pytest.raises(ValueError, match="precision must be one of"):
        RunOptions(precision="half")


def test_autocast_computes_in_the_half_type_and_only_fp16_scales_the_loss():
    a = torch.randn(4, 4)
    for precision, dtype in (
        ("fp32", torch.float32),
        ("bf16", torch.bfloat16),
        ("fp16", torch.float16),
    ):
        with autocast(precision, "cpu"):
            assert (a @ a).dtype == dtype
        assert grad_scaler(precision, "cpu").is_enabled() == (precision == "fp16")
    loss = torch.tensor(2.0)
    assert grad_scaler("fp32", "cpu").scale(loss) is loss  # disabled: passed through
    assert grad_scaler("fp16", "cpu").scale(loss).item() == 2.0 * 2**16


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fully_padded_rows_give_no_nan_in_half_precision(tiny_model, precision):
    model = tiny_model(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB).train()
    src = torch.tensor([[3, 4, 5, 6], [PAD_ID] * 4])  # the second source is all padding
    tgt = torch.tensor([[1, 6, 5, 4], [1, 7, PAD_ID, PAD_ID]])
    with autocast(precision, "cpu"):
        logits = model(src, tgt)
    assert logits.dtype == (torch.bfloat16 if precision == "bf16" else torch.float16)
    assert torch.isfinite(logits.float()).all()
    logits.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_mixed_precision_training_stays_close_to_float32(pairs, tmp_path):
    losses = {}
    for precision in ("fp32", "bf16", "fp16"):
        _, state = train(pairs, tmp_path / precision, precision=precision, max_steps=STEPS)
        losses[precision] = [e["train_loss"] for e in state.history["train"]]
        assert len(losses[precision]) == STEPS
        assert all(math.isfinite(x) for x in losses[precision])
        assert math.isfinite(state.best_val_loss)
    for precision, tolerance in TOLERANCE.items():
        gaps = [abs(a - b) for a, b in zip(losses[precision], losses["fp32"], strict=True)]
        assert 0 < max(gaps) < tolerance, (precision, gaps)  # > 0: autocast did take effect
    assert losses["fp32"][-1] < losses["fp32"][0]


def test_the_loss_scaler_state_is_saved_and_restored_on_resume(pairs, tmp_path):
    straight, _ = train(pairs, tmp_path / "straight", precision="fp16", max_steps=STEPS)
    train(pairs, tmp_path / "resumed", precision="fp16", max_steps=STEPS // 2)
    resumed, _ = train(pairs, tmp_path / "resumed", precision="fp16", max_steps=STEPS, resume=True)
    scalers = [
        torch.load(tmp_path / r / "last.pt", weights_only=True)["scaler"]
        for r in ("straight", "resumed")
    ]
    # Without restoring, the resumed scaler would count only the steps since the resume.
    assert scalers[0] == scalers[1] and scalers[0]["_growth_tracker"] == STEPS
    for (name, a), b in zip(
        straight.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
