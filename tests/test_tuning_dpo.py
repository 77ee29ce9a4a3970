"""tuning.dpo: the preference batch laid out as TRL's collator lays it; the completions'
log-probabilities equal to TRL's for the same padded batch; every loss type equal to TRL 1.16's
``DPOTrainer._compute_loss`` on two ``transformers`` Llamas holding our weights, in float64,
for several β and label smoothings, with the reward margin and accuracy TRL logs; cDPO equal to
TRL's ``aot`` loss on one pair (where its sorting does nothing); invariants by hand; bad input
refused by name."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import lm_config, raises, randomized
from transformer_tutorial.lm.config import LLAMA
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.tuning.dpo import (
    LOSS_TYPES,
    RewardStats,
    batch_loss,
    collate_preferences,
    completion_lengths,
    completion_logprobs,
    dpo_loss,
    implicit_rewards,
    sequence_logprobs,
)

V = 50  # helpers.lm_config's vocabulary
TOL = 1e-12  # float64: the same sums in other orders

# The chapter's configuration is the first; the others change the heads and depth.
CONFIGS = [
    dict(LLAMA, n_kv_heads=2),
    dict(LLAMA, n_heads=4, n_kv_heads=1, n_layers=2, d_model=48, d_ff=64),
    dict(LLAMA, n_kv_heads=4, tie_embeddings=True, rope_base=500.0),
]


def models(settings: dict, seed: int) -> tuple[LanguageModel, LanguageModel]:
    """A policy and a different reference, float64, every weight random."""
    config = lm_config(**settings, dropout=0.0)
    policy = randomized(LanguageModel(config), seed).double()
    reference = randomized(LanguageModel(config), seed + 100).double()
    return policy, reference


def examples(seed: int, pairs: int = 4) -> list[tuple[list[int], list[int], list[int]]]:
    """``pairs`` (prompt, chosen, rejected) of different lengths, no id 0 (the pad)."""
    g = torch.Generator().manual_seed(seed)

    def ids(low: int, high: int) -> list[int]:
        n = int(torch.randint(low, high, (), generator=g))
        return torch.randint(1, V, (n,), generator=g).tolist()

    return [(ids(1, 6), ids(1, 7), ids(1, 7)) for _ in range(pairs)]


def test_collate_equals_trl_collator():
    pytest.importorskip("trl", reason="the [trl] extra compares with TRL's collator")
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    for seed in range(3):
        batch = examples(seed)
        ours = collate_preferences(batch, pad_id=0)
        theirs = DataCollatorForPreference(pad_token_id=0)(
            [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in batch]
        )
        assert torch.equal(ours.ids, theirs["input_ids"])
        assert torch.equal(ours.attention_mask, theirs["attention_mask"])
        assert torch.equal(ours.completion_mask, theirs["completion_mask"])


def test_completion_logprobs_by_hand():
    """Row 0: prompt (1, 2), completion (3, 4), one pad: log p(3 | 1 2) + log p(4 | 1 2 3)."""
    logits = torch.randn(1, 5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[1, 2, 3, 4, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 0]])
    log_probs = logits.log_softmax(-1)
    expected = log_probs[0, 1, 3] + log_probs[0, 2, 4]
    assert torch.allclose(completion_logprobs(logits, ids, mask), expected.view(1), atol=TOL)


def test_padding_changes_nothing():
    """The same pair alone and in a batch padded longer: the same log-probabilities."""
    policy, _ = models(CONFIGS[0], 0)
    pair = (examples(0, 1)[0],)
    long = examples(1, 1)[0]
    long = (long[0] + [5] * 6, long[1] + [6] * 6, long[2])
    alone = sequence_logprobs(policy, collate_preferences(pair, pad_id=0))
    padded = sequence_logprobs(policy, collate_preferences([*pair, long], pad_id=0))
    for a, p in zip(alone, padded, strict=True):
        assert torch.allclose(a, p[:1], atol=TOL)


# TRL's fused LM head accumulates the log-probabilities in float32 whatever the model's dtype,
# and transformers' Llama builds its rotary tables in float32: on the full path (its Llamas
# holding our float64 weights) sequence log-probabilities of about -20 differed from ours by up
# to 6.2e-6 over these configurations and 3 seeds.
FULL_PATH_TOL = 1e-4


def inputs_of(batch, ref_chosen=None, ref_rejected=None) -> dict:
    inputs = {
        "input_ids": batch.ids,
        "attention_mask": batch.attention_mask,
        "completion_mask": batch.completion_mask,
    }
    if ref_chosen is not None:
        inputs |= {"ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    return inputs


def trl_loss(trainer, model, inputs) -> tuple[torch.Tensor, dict]:
    """TRL's ``_compute_loss`` on ``model`` and the metrics it logged for this batch."""
    mode = "train" if trainer.model.training else "eval"  # as TRL reads it
    trainer._metrics[mode].clear()
    loss = trainer._compute_loss(model, inputs, False)
    return loss, {k: v[-1] for k, v in trainer._metrics[mode].items()}


@pytest.mark.parametrize("settings", CONFIGS)
def test_full_path_equals_trl(settings, tmp_path):
    """TRL's whole path on ``transformers`` Llamas with our weights: the sequence
    log-probabilities of the policy and the reference for the padded batch
    (``compute_ref_log_probs``), and the DPO loss (``_compute_loss``), within float32's
    tolerance (TRL's fused head works in float32)."""
    pytest.importorskip("trl", reason="the [trl] extra compares with TRL's DPOTrainer")
    from transformer_tutorial.tuning.dpo import trl_dpo_trainer

    policy, reference = models(settings, 1)
    trainer = trl_dpo_trainer(policy, reference, output_dir=str(tmp_path), beta=0.5)
    batch = collate_preferences(examples(2, 5), pad_id=0)
    with torch.no_grad():
        for ours_model, theirs_model in ((policy, trainer.model), (reference, trainer.ref_model)):
            ours = sequence_logprobs(ours_model, batch)
            theirs = trainer.compute_ref_log_probs(theirs_model, inputs_of(batch))
            for a, b in zip(ours, theirs, strict=True):
                assert torch.allclose(a, b.double(), rtol=0, atol=FULL_PATH_TOL)
        ref_chosen, ref_rejected = sequence_logprobs(reference, batch)
        theirs, _ = trl_loss(trainer, trainer.model, inputs_of(batch))
        ours, _ = batch_loss(policy, batch, ref_chosen, ref_rejected, beta=0.5)
    assert abs(ours.item() - theirs.item()) <= FULL_PATH_TOL


CASES = [("sigmoid", beta, 0.0) for beta in (0.05, 0.1, 0.5, 2.0)] + [
    ("hinge", 0.1, 0.0),
    ("hinge", 1.0, 0.0),
    ("ipo", 0.1, 0.0),
    ("ipo", 0.7, 0.0),
    ("robust", 0.1, 0.0),
    ("robust", 0.1, 0.1),
    ("robust", 0.5, 0.3),
    ("robust", 2.0, 0.45),
]


@pytest.mark.parametrize("settings", [CONFIGS[0], CONFIGS[1]])
def test_loss_equals_trl(settings, tmp_path):
    """TRL's loss code (``_compute_loss``) run on our model's float64 per-token
    log-probabilities (:class:`FusedLogProbs`) with the reference's given in the batch, for
    each case: the loss, the gradient on every weight, and the rewards TRL logs (chosen mean,
    margin, accuracy) equal ours within 1e-12."""
    pytest.importorskip("trl", reason="the [trl] extra compares with TRL's DPOTrainer")
    from transformer_tutorial.tuning.dpo import FusedLogProbs, trl_dpo_trainer

    policy, reference = models(settings, 3)
    batch = collate_preferences(examples(4, 6), pad_id=0)
    with torch.no_grad():
        ref_chosen, ref_rejected = sequence_logprobs(reference, batch)
    inputs = inputs_of(batch, ref_chosen, ref_rejected)
    for loss_type, beta, eps in CASES:
        trainer = trl_dpo_trainer(
            policy,
            reference,
            output_dir=str(tmp_path),
            beta=beta,
            loss_type=loss_type,
            label_smoothing=eps,
            precompute_ref_log_probs=True,
        )
        case = (loss_type, beta, eps)
        theirs, metrics = trl_loss(trainer, FusedLogProbs(policy), inputs)
        theirs.backward()
        theirs_grads = [p.grad.clone() for p in policy.parameters()]
        policy.zero_grad()
        ours, stats = batch_loss(
            policy,
            batch,
            ref_chosen,
            ref_rejected,
            beta=beta,
            loss_type=loss_type,
            label_smoothing=eps,
        )
        ours.backward()
        assert ours.dtype == theirs.dtype == torch.float64, case
        assert abs(ours.item() - theirs.item()) <= TOL, case
        for p, theirs_grad in zip(policy.parameters(), theirs_grads, strict=True):
            assert torch.allclose(p.grad, theirs_grad, rtol=0, atol=TOL), case
        policy.zero_grad()
        assert abs(stats.margin - metrics["rewards/margins"]) <= TOL, case
        assert abs(stats.chosen - metrics["rewards/chosen"]) <= TOL, case
        assert stats.accuracy == metrics["rewards/accuracies"], case


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.25, 0.4])
def test_conservative_dpo_equals_trl_aot_on_one_pair(eps, tmp_path):
    """TRL 1.16's ``sigmoid`` ignores ``label_smoothing``; its ``aot`` loss keeps cDPO's formula
    on the differences of sorted log-ratios, which for one pair are the pair's own."""
    pytest.importorskip("trl", reason="the [trl] extra compares with TRL's DPOTrainer")
    from transformer_tutorial.tuning.dpo import FusedLogProbs, trl_dpo_trainer

    policy, reference = models(CONFIGS[0], 5)
    for beta, pair in zip((0.1, 0.5, 2.0), examples(6, 3), strict=True):
        batch = collate_preferences([pair], pad_id=0)
        with torch.no_grad():
            ref_chosen, ref_rejected = sequence_logprobs(reference, batch)
            trainer = trl_dpo_trainer(
                policy,
                reference,
                output_dir=str(tmp_path),
                beta=beta,
                loss_type="aot",
                label_smoothing=eps,
                precompute_ref_log_probs=True,
            )
            inputs = inputs_of(batch, ref_chosen, ref_rejected)
            theirs, _ = trl_loss(trainer, FusedLogProbs(policy), inputs)
            ours, _ = batch_loss(
                policy, batch, ref_chosen, ref_rejected, beta=beta, label_smoothing=eps
            )
        assert abs(ours.item() - theirs.item()) <= TOL


def test_losses_by_hand():
    """Δ = 0: sigmoid log 2, hinge 1; cDPO is binary cross-entropy with target 1 − ε; rDPO's
    expected loss under flips with probability ε is DPO's; IPO is zero at its target gap."""
    zero = torch.zeros(3, dtype=torch.float64)
    assert torch.allclose(dpo_loss(zero, zero, zero, zero), torch.full_like(zero, math.log(2)))
    assert torch.equal(dpo_loss(zero, zero, zero, zero, loss_type="hinge"), zero + 1)
    g = torch.Generator().manual_seed(0)
    chosen, rejected, ref_c, ref_r = torch.randn(4, 8, dtype=torch.float64, generator=g)
    beta, eps = 0.3, 0.2
    logits = beta * ((chosen - ref_c) - (rejected - ref_r))
    cdpo = dpo_loss(chosen, rejected, ref_c, ref_r, beta=beta, label_smoothing=eps)
    bce = F.binary_cross_entropy_with_logits(
        logits, torch.full_like(logits, 1 - eps), reduction="none"
    )
    assert torch.allclose(cdpo, bce, atol=TOL)
    robust = dpo_loss(
        chosen, rejected, ref_c, ref_r, beta=beta, loss_type="robust", label_smoothing=eps
    )
    flipped = dpo_loss(
        rejected, chosen, ref_r, ref_c, beta=beta, loss_type="robust", label_smoothing=eps
    )
    dpo = dpo_loss(chosen, rejected, ref_c, ref_r, beta=beta)
    assert torch.allclose((1 - eps) * robust + eps * flipped, dpo, atol=TOL)
    lengths = torch.full_like(chosen, 4.0)
    gap = torch.full_like(chosen, 4 / (2 * beta))  # a per-token gap of 1/(2β)
    ipo = dpo_loss(
        gap + ref_c,
        ref_r,
        ref_c,
        ref_r,
        beta=beta,
        loss_type="ipo",
        chosen_lengths=lengths,
        rejected_lengths=lengths,
    )
    assert torch.allclose(ipo, torch.zeros_like(ipo), atol=TOL)


def test_rewards_and_stats():
    policy = torch.tensor([-3.0, -5.0, -2.0, -4.0])
    reference = torch.tensor([-4.0, -4.0, -2.0, -4.0])
    rewards = implicit_rewards(policy, reference, beta=0.5)
    assert torch.equal(rewards, torch.tensor([0.5, -0.5, 0.0, 0.0]))
    stats = RewardStats.of(rewards[:2], rewards[2:])  # pair margins 0.5 and -0.5
    assert stats == RewardStats(chosen=0.0, rejected=0.0, margin=0.0, accuracy=0.5)


def test_training_raises_the_margin():
    """A few steps of DPO on one batch raise its reward margin from 0 (policy == reference)
    and make every pair's chosen reward the larger."""
    torch.manual_seed(0)
    policy, _ = models(CONFIGS[0], 7)
    reference = LanguageModel(policy.config).double().eval()
    reference.load_state_dict(policy.state_dict())
    batch = collate_preferences(examples(8, 6), pad_id=0)
    with torch.no_grad():
        ref_chosen, ref_rejected = sequence_logprobs(reference, batch)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    first = None
    for _ in range(20):
        loss, stats = batch_loss(policy, batch, ref_chosen, ref_rejected, beta=0.1)
        first = stats if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert first.margin == 0.0
    assert stats.margin > 0.5 and stats.accuracy == 1.0


def test_completion_lengths():
    batch = collate_preferences([([1, 2], [3], [4, 5, 6]), ([1], [3, 4], [5])], pad_id=0)
    chosen, rejected = completion_lengths(batch)
    assert chosen.tolist() == [1, 2] and rejected.tolist() == [3, 1]


def test_bad_input_refused():
    x = torch.zeros(2, dtype=torch.float64)
    raises(lambda: dpo_loss(x, x, x, x, beta=0.0), ValueError, "beta")
    raises(lambda: dpo_loss(x, x, x, x, loss_type="kto"), ValueError, "loss_type")
    raises(lambda: dpo_loss(x, x, x, x, label_smoothing=0.5), ValueError, "label_smoothing")
    raises(
        lambda: dpo_loss(x, x, x, x, loss_type="hinge", label_smoothing=0.1),
        ValueError,
        "label_smoothing",
    )
    raises(lambda: dpo_loss(x, x, x, x, loss_type="ipo"), ValueError, "chosen_lengths")
    raises(lambda: dpo_loss(x, x[:1], x, x), ValueError, "policy_rejected")
    for lengths in (torch.ones(1), torch.ones(2, 1)):  # shapes that broadcast
        raises(
            lambda lengths=lengths: dpo_loss(
                x, x, x, x, loss_type="ipo", chosen_lengths=lengths, rejected_lengths=x + 1
            ),
            ValueError,
            "chosen_lengths",
        )
    raises(lambda: dpo_loss(x.long(), x, x, x), TypeError, "policy_chosen")
    raises(lambda: collate_preferences([], pad_id=0), ValueError, "examples")
    raises(lambda: collate_preferences([([1], [], [2])], pad_id=0), ValueError, "examples[0]")
    raises(lambda: collate_preferences([([1], [2])], pad_id=0), ValueError, "examples[0]")
    raises(lambda: collate_preferences([([1], [2], [3])], pad_id=-1), ValueError, "pad_id")
    raises(lambda: implicit_rewards(x, x, beta=-1.0), ValueError, "beta")
    logits = torch.zeros(2, 3, 5)
    raises(
        lambda: completion_logprobs(
            logits, torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4)
        ),
        ValueError,
        "must agree",
    )
    assert set(LOSS_TYPES) == {"sigmoid", "hinge", "ipo", "robust"}
