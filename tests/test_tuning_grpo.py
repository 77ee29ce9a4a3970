"""tuning.grpo: TRL 1.16's GRPOTrainer run on the same inputs is the reference — its own
_compute_loss for each loss type, β, ε and group size on padded completions (loss and
gradients, float64), its per-token log-probabilities, and the advantages its
_generate_and_score_completions computes from our reward function's rewards; then the
pieces' invariants by hand (k3, clipping's zero gradient, groups of equal rewards), sampling,
and bad arguments refused by name."""

from __future__ import annotations

import pytest
import torch

from transformer_tutorial.lm.config import LLAMA, LMConfig
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.tuning.grpo import (
    GroupSample,
    clipped_surrogate,
    completion_logprobs,
    group_advantages,
    grpo_loss,
    k3_kl,
    sample_group,
)

PAD, EOS = 0, 1
VOCAB = ["<pad>", "<eos>", "<bos>", ">", *"0123456789"]
CONFIG = LMConfig(
    vocab_size=len(VOCAB), d_model=32, n_heads=4, n_layers=2, d_ff=64, max_len=32, dropout=0.0,
    **{**LLAMA, "n_kv_heads": 2},
)  # fmt: skip


def _model(seed: int = 0, dtype: torch.dtype = torch.float64) -> LanguageModel:
    torch.manual_seed(seed)
    return LanguageModel(CONFIG).to(dtype).eval()


def _trainer(tmp_path, ours: LanguageModel, **settings):
    """TRL's GRPOTrainer on a Llama holding ``ours``'s weights (saved, then loaded by TRL in
    float64, policy and reference alike)."""
    pytest.importorskip("trl", reason="the reference is TRL's GRPOTrainer (pip install trl)")
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    from transformer_tutorial.lm.hf_weights import copy_to_llama, llama_config

    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    llama = LlamaForCausalLM(llama_config(CONFIG)).to(torch.float64)
    copy_to_llama(ours, llama)
    llama.generation_config.pad_token_id, llama.generation_config.eos_token_id = PAD, EOS
    folder = tmp_path / "llama"
    llama.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    reward = settings.pop("reward", None)
    settings = {"num_generations": 4, "per_device_train_batch_size": 8, **settings}
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        report_to=[],
        use_cpu=True,
        bf16=False,  # TRL turns bf16 autocast on by default
        model_init_kwargs={"dtype": torch.float64},
        **settings,
    )
    trainer = GRPOTrainer(
        model=str(folder),
        reward_funcs=reward or (lambda completions, **_: [0.0] * len(completions)),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["12>"] * 8}),
        processing_class=tokenizer,
    )
    trainer.model.eval()  # the loss's own normaliser: 1 (no gradient accumulation in eval)
    return trainer


def _batch(seed: int, groups: int, group_size: int, length: int):
    """A fixed batch: prompts (no padding), completions of lengths 1..length padded on the
    right, rewards with one group all equal."""
    g = torch.Generator().manual_seed(seed)
    B = groups * group_size
    prompts = torch.randint(3, len(VOCAB), (groups, 5), generator=g).repeat_interleave(
        group_size, 0
    )
    completions = torch.randint(3, len(VOCAB), (B, length), generator=g)
    lengths = torch.randint(1, length + 1, (B,), generator=g)
    lengths[0] = length
    mask = torch.arange(length)[None] < lengths[:, None]  # (B, T)
    completions[torch.arange(B), lengths - 1] = EOS
    completions = completions.masked_fill(~mask, PAD)
    rewards = torch.randint(0, 3, (B,), generator=g).double()
    rewards[:group_size] = 1.0  # a group that teaches nothing
    return prompts, completions, mask, rewards, g


CASES = [  # loss type, β, ε low, ε high, group size, completion length, KL bias correction
    ("grpo", 0.0, 0.2, 0.2, 4, 6, True),
    ("grpo", 0.04, 0.2, 0.28, 3, 7, True),
    ("grpo", 0.04, 0.2, 0.28, 3, 7, False),
    ("bnpo", 0.1, 0.1, 0.3, 4, 5, True),
    ("dr_grpo", 0.0, 0.2, 0.2, 2, 6, True),
    ("dr_grpo", 0.05, 0.3, 0.3, 4, 8, False),
    ("dapo", 0.0, 0.2, 0.28, 4, 6, True),
    ("dapo", 0.2, 0.15, 0.25, 3, 4, True),
]


@pytest.mark.parametrize(("loss_type", "beta", "eps_low", "eps_high", "G", "T", "kl_fix"), CASES)
def test_loss_and_gradients_equal_trls_compute_loss(
    tmp_path, loss_type, beta, eps_low, eps_high, G, T, kl_fix
):
    ours = _model(1)
    groups = 3
    trainer = _trainer(
        tmp_path,
        ours,
        loss_type=loss_type,
        beta=beta,
        epsilon=eps_low,
        epsilon_high=eps_high,
        num_generations=G,
        per_device_train_batch_size=groups * G,
        max_completion_length=T + 2,  # dr_grpo's divisor is the budget, not the batch's T
        use_bias_correction_kl=kl_fix,
    )
    prompts, completions, mask, rewards, g = _batch(7, groups, G, T)
    advantages = group_advantages(rewards, G)
    logprobs = completion_logprobs(ours, prompts, completions)
    # Old and reference policies a little away from the current one: ratios both sides of
    # the clip range.
    old = (logprobs + 0.3 * torch.randn(logprobs.shape, generator=g, dtype=torch.float64)).detach()
    ref = (logprobs + 0.5 * torch.randn(logprobs.shape, generator=g, dtype=torch.float64)).detach()
    loss = grpo_loss(
        logprobs, old, advantages, mask, ref_logprobs=ref, beta=beta, epsilon_low=eps_low,
        epsilon_high=eps_high, loss_type=loss_type, max_completion_length=T + 2,
        kl_bias_correction=kl_fix,
    )  # fmt: skip
    inputs = {
        "prompt_ids": prompts,
        "prompt_mask": torch.ones_like(prompts),
        "completion_ids": completions,
        "completion_mask": mask.long(),
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    ratio = torch.exp(logprobs - old)[mask]
    assert ((ratio < 1 - eps_low) | (ratio > 1 + eps_high)).any()  # the clip is exercised

    # 1) TRL's loss arithmetic in float64: its _compute_loss handed our model's log-probs.
    def our_logprobs(*_, **__):
        return logprobs, torch.zeros_like(logprobs), None

    trainer._get_per_token_logps_and_entropies = our_logprobs
    theirs = trainer._compute_loss(trainer.model, inputs)
    torch.testing.assert_close(loss, theirs, rtol=0, atol=1e-12)
    (mine_grads,) = torch.autograd.grad(loss, [ours.lm_head.weight], retain_graph=True)
    (their_grads,) = torch.autograd.grad(theirs, [ours.lm_head.weight], retain_graph=True)
    torch.testing.assert_close(mine_grads, their_grads, rtol=0, atol=1e-12)

    # 2) End to end: TRL's own Llama and fused log-prob head (it sums the softmax in float32).
    del trainer._get_per_token_logps_and_entropies
    theirs = trainer._compute_loss(trainer.model, inputs)
    torch.testing.assert_close(loss.float(), theirs.float(), rtol=0, atol=1e-6)
    loss.backward()
    theirs.backward()
    llama = trainer.model.model
    for mine, their in (
        (ours.lm_head.weight, trainer.model.lm_head.weight),
        (ours.embed.weight, llama.embed_tokens.weight),
        (ours.layers[0].self_attn.q_proj.weight, llama.layers[0].self_attn.q_proj.weight),
    ):
        torch.testing.assert_close(mine.grad, their.grad.double(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completion_logprobs_equal_trls(tmp_path, temperature):
    ours = _model(2)
    trainer = _trainer(tmp_path, ours, temperature=temperature)
    prompts, completions, mask, _, _ = _batch(3, 2, 4, 6)
    mine = completion_logprobs(ours, prompts, completions, temperature=temperature)
    ids = torch.cat([prompts, completions], 1)
    attention = torch.cat([torch.ones_like(prompts), mask.long()], 1)
    theirs, _, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, ids, attention, completions.size(1)
    )
    # TRL's fused head sums the softmax in float32, whatever the model's dtype.
    torch.testing.assert_close(mine[mask].float(), theirs[mask], rtol=0, atol=1e-6)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_equal_trls_from_the_same_rewards(tmp_path, scale_rewards):
    seen: list[float] = []

    def reward(completion_ids, **_):  # deterministic, with ties: the number of 7s, mod 3
        values = [float(sum(t == VOCAB.index("7") for t in ids) % 3) for ids in completion_ids]
        seen.extend(values)
        return values

    G = 4
    trainer = _trainer(
        tmp_path, _model(3), num_generations=G, scale_rewards=scale_rewards, reward=reward,
        max_completion_length=8, per_device_train_batch_size=12,
    )  # fmt: skip
    torch.manual_seed(0)
    batch = [{"prompt": p} for p in ("12>", "345>", "6>") for _ in range(G)]
    theirs = trainer._generate_and_score_completions(batch)["advantages"]
    rewards = torch.tensor(seen, dtype=torch.float64)
    assert len(set(seen)) > 1
    mine = group_advantages(rewards, G, scale_rewards=scale_rewards)
    torch.testing.assert_close(mine, theirs.double(), rtol=0, atol=1e-6)


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    std = (1 / 3) ** 0.5  # Bessel-corrected std of (1, 0, 0, 1)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4)
    got = group_advantages(rewards, 4)
    torch.testing.assert_close(got[:4], expected)
    assert got[4:].eq(0).all()  # equal rewards: no signal
    torch.testing.assert_close(
        group_advantages(rewards, 4, scale_rewards="none"),
        torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]),
    )


def test_k3_is_never_negative_and_zero_only_at_equality():
    logprobs = torch.linspace(-5, 0, 11)
    ref = torch.linspace(0, -5, 11)
    kl = k3_kl(logprobs, ref)
    assert (kl >= 0).all() and kl[5] == 0 and (kl[:5] > 0).all()
    assert k3_kl(logprobs, logprobs).eq(0).all()


def test_a_clipped_token_has_no_gradient():
    old = torch.zeros(1, 4)
    logprobs = torch.log(torch.tensor([[0.5, 0.95, 1.1, 1.5]])).requires_grad_()
    cases = ((1.0, [False, False, False, True]), (-1.0, [True, False, False, False]))
    for advantage, dead in cases:
        logprobs.grad = None
        loss = clipped_surrogate(logprobs, old, torch.tensor([advantage]), epsilon_low=0.2)
        loss.sum().backward()
        assert (logprobs.grad[0] == 0).tolist() == dead


def test_loss_types_weigh_lengths_as_named():
    # One long completion (4 tokens, loss 1 each) and one short (1 token, loss 3).
    mask = torch.tensor([[True, True, True, True], [True, False, False, False]])
    zero = torch.zeros(2, 4)
    advantages = torch.tensor([-1.0, -3.0])  # ratio 1: per-token loss = -A
    losses = {
        kind: grpo_loss(zero, zero, advantages, mask, loss_type=kind, max_completion_length=8)
        for kind in ("grpo", "bnpo", "dr_grpo", "dapo")
    }
    assert losses["grpo"] == pytest.approx((1 + 3) / 2)
    assert losses["bnpo"] == losses["dapo"] == pytest.approx((4 + 3) / 5)
    assert losses["dr_grpo"] == pytest.approx((4 + 3) / (2 * 8))


def test_sample_group_keeps_groups_together_and_scores_what_it_sampled():
    model = _model(4, torch.float32)
    prompts = torch.tensor([[5, 6, 3], [7, 8, 3]])
    sample = sample_group(
        model, prompts, 3, 6, eos_id=EOS, pad_id=PAD, generator=torch.Generator().manual_seed(0)
    )
    assert isinstance(sample, GroupSample)
    assert sample.prompt_ids.tolist() == [[5, 6, 3]] * 3 + [[7, 8, 3]] * 3
    for row, mask in zip(
        sample.completion_ids.tolist(), sample.completion_mask.tolist(), strict=True
    ):
        length = row.index(EOS) + 1 if EOS in row else len(row)
        assert mask == [True] * length + [False] * (len(row) - length)
    again = completion_logprobs(model, sample.prompt_ids, sample.completion_ids)
    torch.testing.assert_close(sample.logprobs, again.masked_fill(~sample.completion_mask, 0))
    assert (sample.logprobs[~sample.completion_mask] == 0).all()


def test_bad_arguments_are_refused_by_name():
    rewards = torch.ones(6)
    with pytest.raises(ValueError, match="group_size=4"):
        group_advantages(rewards, 4)
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(rewards, 3, scale_rewards="mean")
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(rewards, 1)
    zero, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="loss_type"):
        grpo_loss(zero, zero, torch.zeros(2), mask, loss_type="ppo")
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(zero, zero, torch.zeros(2), mask, beta=0.1)
    with pytest.raises(ValueError, match="old_logprobs"):
        grpo_loss(zero, torch.zeros(2, 4), torch.zeros(2), mask)
    with pytest.raises(TypeError, match="completion_mask"):
        grpo_loss(zero, zero, torch.zeros(2), mask.long())
    # Shapes that broadcast: one advantage for every row, a reference of (T,) or (B, 1).
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(zero, zero, torch.ones(1), mask)
    for ref in (torch.zeros(3), torch.zeros(2, 1)):
        with pytest.raises(ValueError, match="ref_logprobs"):
            grpo_loss(zero, zero, torch.zeros(2), mask, ref_logprobs=ref, beta=0.1)
    with pytest.raises(ValueError, match="epsilon_high"):
        clipped_surrogate(zero, zero, torch.zeros(2), epsilon_high=-0.1)
