"""Chapter 27: learning from preferences, Direct Preference Optimization (DPO).

A preference pair is one prompt and two completions, the *chosen* one preferred to the
*rejected* one. DPO trains the policy on pairs directly, with no reward model: under the
Bradley–Terry model the preference probability is ``σ(r_chosen − r_rejected)``, and the reward
that the KL-regularised optimum implies is ``r = β (log π(y|x) − log π_ref(y|x))`` (plus a term
of the prompt alone, which cancels in the difference). So the loss needs four numbers per
pair: the sequence log-probabilities of both completions under the policy and under the frozen
reference (:func:`sequence_logprobs`, a sum over the completion's tokens only).

:func:`collate_preferences` lays a batch out as TRL's ``DataCollatorForPreference`` does (the
chosen rows, then the rejected rows, padded on the right, with a completion mask);
:func:`dpo_loss` gives each pair's loss for one of :data:`LOSS_TYPES` (TRL 1.16's formulas);
:func:`implicit_rewards` and :class:`RewardStats` the rewards, their margin and accuracy TRL
logs. :func:`trl_dpo_trainer` builds TRL's own ``DPOTrainer`` on ``transformers`` Llamas with
our weights copied in, the reference the chapter and the tests compare against (it needs the
``[trl]`` extra; nothing else here does); :class:`FusedLogProbs` lets TRL's loss code run on our
model's log-probabilities in its dtype (TRL's fused LM head works in float32).

Shapes: ``B`` pairs; ids and masks ``(2B, T)`` (chosen rows first); log-probabilities, rewards
and losses ``(B,)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_tutorial.checks import check_choice, check_int, check_number, check_tensor
from transformer_tutorial.lm.model import LanguageModel

# TRL 1.16's ``loss_type`` names for the losses written here.
LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")


@dataclass(frozen=True)
class PreferenceBatch:
    """A padded batch of ``B`` pairs: ``ids`` ``(2B, T)``, the chosen rows then the rejected
    rows (each ``prompt + completion``, padded on the right with ``pad_id``); ``attention_mask``
    ``(2B, T)`` 1 at real tokens; ``completion_mask`` ``(2B, T)`` 1 at the completion's tokens,
    the only ones scored."""

    ids: Tensor
    attention_mask: Tensor
    completion_mask: Tensor

    @property
    def num_pairs(self) -> int:
        return self.ids.size(0) // 2


def collate_preferences(
    examples: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]], *, pad_id: int
) -> PreferenceBatch:
    """``(prompt, chosen, rejected)`` id lists → a :class:`PreferenceBatch`, laid out as TRL's
    ``DataCollatorForPreference`` (no truncation)."""
    check_int("pad_id", pad_id, at_least=0)
    if len(examples) == 0:
        raise ValueError("examples must hold at least one (prompt, chosen, rejected) triple")
    rows, masks = [], []
    for side in (1, 2):  # all the chosen rows, then all the rejected rows
        for i, example in enumerate(examples):
            if len(example) != 3:
                raise ValueError(f"examples[{i}] must be (prompt, chosen, rejected) id lists")
            prompt, completion = list(example[0]), list(example[side])
            if len(prompt) == 0 or len(completion) == 0:
                raise ValueError(f"examples[{i}] needs a non-empty prompt and completions")
            rows.append(prompt + completion)
            masks.append([0] * len(prompt) + [1] * len(completion))
    length = max(len(row) for row in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), length), dtype=torch.long)
    completion = torch.zeros((len(rows), length), dtype=torch.long)
    for r, (row, mask) in enumerate(zip(rows, masks, strict=True)):
        ids[r, : len(row)] = torch.tensor(row)
        attention[r, : len(row)] = 1
        completion[r, : len(row)] = torch.tensor(mask)
    return PreferenceBatch(ids, attention, completion)


def completion_logprobs(logits: Tensor, ids: Tensor, completion_mask: Tensor) -> Tensor:
    """Each row's log-probability of its completion: ``Σ_t log p(ids[t + 1] | ids[..t])`` over
    the positions ``t + 1`` where ``completion_mask`` is 1 (the prompt and the padding are not
    scored). ``logits`` ``(N, T, V)``, ``ids`` and ``completion_mask`` ``(N, T)`` → ``(N,)``,
    in the logits' dtype."""
    check_tensor("logits", logits, kind="float", dims=3, shape="(N, T, V)")
    check_tensor("ids", ids, kind="int", dims=2, shape="(N, T)")
    check_tensor("completion_mask", completion_mask, dims=2, shape="(N, T)")
    if logits.shape[:2] != ids.shape or completion_mask.shape != ids.shape:
        raise ValueError(
            f"logits (N, T, V), ids and completion_mask (N, T) must agree, got "
            f"{tuple(logits.shape)}, {tuple(ids.shape)} and {tuple(completion_mask.shape)}"
        )
    log_probs = logits[:, :-1].log_softmax(dim=-1)  # (N, T-1, V): position t scores t + 1
    targets = ids[:, 1:].unsqueeze(-1)  # (N, T-1, 1)
    token_logps = log_probs.gather(-1, targets).squeeze(-1)  # (N, T-1)
    scored = completion_mask[:, 1:].bool()
    return token_logps.masked_fill(~scored, 0.0).sum(dim=-1)


def sequence_logprobs(model: LanguageModel, batch: PreferenceBatch) -> tuple[Tensor, Tensor]:
    """The chosen and the rejected completions' log-probabilities under ``model``, each
    ``(B,)``: one forward pass over the ``2B`` rows (right padding is never seen by a real
    token under the causal mask). Gradients flow unless the caller disables them (the
    reference's are computed under ``torch.no_grad()``)."""
    logps = completion_logprobs(model(batch.ids), batch.ids, batch.completion_mask)
    return logps[: batch.num_pairs], logps[batch.num_pairs :]


def implicit_rewards(policy_logps: Tensor, reference_logps: Tensor, *, beta: float) -> Tensor:
    """DPO's implicit reward of a completion, ``β (log π(y|x) − log π_ref(y|x))``: how much
    more likely the policy made it than the reference did, in units of ``1/β``."""
    check_number("beta", beta, low=0.0, low_open=True)
    return beta * (policy_logps - reference_logps)


@dataclass(frozen=True)
class RewardStats:
    """What TRL logs of a batch's implicit rewards: the chosen and rejected means, the mean
    margin ``r_chosen − r_rejected``, and the accuracy (the share of pairs whose chosen reward
    is strictly larger)."""

    chosen: float
    rejected: float
    margin: float
    accuracy: float

    @classmethod
    def of(cls, chosen_rewards: Tensor, rejected_rewards: Tensor) -> RewardStats:
        margins = chosen_rewards - rejected_rewards
        return cls(
            chosen=chosen_rewards.mean().item(),
            rejected=rejected_rewards.mean().item(),
            margin=margins.mean().item(),
            accuracy=(margins > 0).float().mean().item(),
        )


def _check_loss_settings(beta: float, loss_type: str, label_smoothing: float) -> None:
    check_number("beta", beta, low=0.0, low_open=True)
    check_choice("loss_type", loss_type, LOSS_TYPES)
    check_number("label_smoothing", label_smoothing, low=0.0, high=0.5, high_open=True)
    if loss_type in ("hinge", "ipo") and label_smoothing != 0.0:
        raise ValueError(
            f"label_smoothing applies to the 'sigmoid' and 'robust' losses, got "
            f"label_smoothing={label_smoothing} with loss_type={loss_type!r}"
        )


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    reference_chosen: Tensor,
    reference_rejected: Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
) -> Tensor:
    """Each pair's loss ``(B,)`` from the four sequence log-probabilities ``(B,)``; the batch's
    loss is its mean. With ``Δ = (log π − log π_ref)(chosen) − (log π − log π_ref)(rejected)``:

    - ``"sigmoid"`` (DPO): ``−log σ(βΔ)``; with ``label_smoothing`` ε the conservative DPO
      (cDPO), the preference taken as right with probability ``1 − ε``:
      ``−(1 − ε) log σ(βΔ) − ε log σ(−βΔ)``.
    - ``"robust"`` (rDPO): ``(−(1 − ε) log σ(βΔ) + ε log σ(−βΔ)) / (1 − 2ε)``, unbiased when a
      share ε of the labels are flipped.
    - ``"hinge"`` (SLiC): ``max(0, 1 − βΔ)``.
    - ``"ipo"``: ``(Δ_avg − 1/(2β))²``, where ``Δ_avg`` divides each completion's log-ratio by
      its number of tokens (``chosen_lengths``, ``rejected_lengths``: ``(B,)``, required).

    ε is in ``[0, 0.5)`` and only for ``"sigmoid"`` and ``"robust"``.
    """
    _check_loss_settings(beta, loss_type, label_smoothing)
    for name, value in (
        ("policy_chosen", policy_chosen),
        ("policy_rejected", policy_rejected),
        ("reference_chosen", reference_chosen),
        ("reference_rejected", reference_rejected),
    ):
        check_tensor(name, value, kind="float", dims=1, shape="(B,)")
        if value.shape != policy_chosen.shape:
            raise ValueError(
                f"{name} must have policy_chosen's shape {tuple(policy_chosen.shape)}, got "
                f"{tuple(value.shape)}"
            )
    chosen_ratios = policy_chosen - reference_chosen
    rejected_ratios = policy_rejected - reference_rejected
    if loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("loss_type='ipo' needs chosen_lengths and rejected_lengths")
        for name, value in (
            ("chosen_lengths", chosen_lengths),
            ("rejected_lengths", rejected_lengths),
        ):
            check_tensor(name, value, dims=1, shape="(B,)")
            if value.shape != policy_chosen.shape:  # (1,) or (B, 1) would broadcast
                raise ValueError(
                    f"{name} must have policy_chosen's shape {tuple(policy_chosen.shape)}, got "
                    f"{tuple(value.shape)}"
                )
        delta = chosen_ratios / chosen_lengths.clamp(min=1) - rejected_ratios / (
            rejected_lengths.clamp(min=1)
        )
        return (delta - 1 / (2 * beta)) ** 2
    logits = beta * (chosen_ratios - rejected_ratios)
    eps = label_smoothing
    if loss_type == "sigmoid":
        return -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)
    if loss_type == "robust":
        return (-(1 - eps) * F.logsigmoid(logits) + eps * F.logsigmoid(-logits)) / (1 - 2 * eps)
    return torch.relu(1 - logits)  # hinge


def completion_lengths(batch: PreferenceBatch) -> tuple[Tensor, Tensor]:
    """The number of completion tokens of each chosen and rejected row, each ``(B,)``."""
    lengths = batch.completion_mask.sum(dim=-1)
    return lengths[: batch.num_pairs], lengths[batch.num_pairs :]


def batch_loss(
    policy: LanguageModel,
    batch: PreferenceBatch,
    reference_chosen: Tensor,
    reference_rejected: Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Tensor, RewardStats]:
    """One step's loss (the mean over the pairs, differentiable) and the batch's reward
    statistics, from the policy's forward pass and the reference's log-probabilities."""
    chosen, rejected = sequence_logprobs(policy, batch)
    chosen_lengths, rejected_lengths = completion_lengths(batch)
    losses = dpo_loss(
        chosen,
        rejected,
        reference_chosen,
        reference_rejected,
        beta=beta,
        loss_type=loss_type,
        label_smoothing=label_smoothing,
        chosen_lengths=chosen_lengths,
        rejected_lengths=rejected_lengths,
    )
    stats = RewardStats.of(
        implicit_rewards(chosen.detach(), reference_chosen, beta=beta),
        implicit_rewards(rejected.detach(), reference_rejected, beta=beta),
    )
    return losses.mean(), stats


def trl_dpo_trainer(
    policy: LanguageModel,
    reference: LanguageModel,
    *,
    output_dir: str,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    precompute_ref_log_probs: bool = False,
):
    """TRL's ``DPOTrainer`` on two ``transformers`` Llamas holding ``policy``'s and
    ``reference``'s weights (chapter 17's
    :func:`~transformer_tutorial.lm.hf_weights.copy_to_llama`, in their dtype), for
    ``loss_type`` (any of TRL's), ``beta`` and ``label_smoothing``. Its tokenizer is a
    word-level one over the ids (``"t0"``, ``"t1"``, …; pad ``t0``): the batches come from
    :func:`collate_preferences` or TRL's ``data_collator``, so it only has to exist. With
    ``precompute_ref_log_probs`` its loss reads the reference's log-probabilities from the
    batch (``ref_chosen_logps``, ``ref_rejected_logps``). Needs the ``[trl]`` extra."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import DPOConfig, DPOTrainer

    from transformer_tutorial.lm.hf_weights import copy_to_llama, llama_config

    vocab = {f"t{i}": i for i in range(policy.config.vocab_size)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="t0", unk_token="t1", eos_token="t2"
    )

    def llama(ours: LanguageModel) -> LlamaForCausalLM:
        weight = ours.lm_head.weight
        theirs = LlamaForCausalLM(llama_config(ours.config)).to(weight.dtype)
        copy_to_llama(ours, theirs)
        return theirs.eval()

    args = DPOConfig(
        output_dir=output_dir,
        report_to="none",
        use_cpu=True,
        beta=beta,
        loss_type=[loss_type],
        label_smoothing=label_smoothing,
        max_length=None,
        disable_tqdm=True,
        bf16=False,  # no autocast: the reference's log-probabilities in the models' dtype
        precompute_ref_log_probs=precompute_ref_log_probs,
    )
    # One text example so that the trainer can be built: the batches are made apart.
    dataset = Dataset.from_list([{"prompt": "t3", "chosen": " t4 t2", "rejected": " t5 t2"}])
    return DPOTrainer(
        model=llama(policy),
        ref_model=llama(reference),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )


class FusedLogProbs(nn.Module):
    """Our model answering the call TRL's ``DPOTrainer`` makes of a policy,
    ``model(input_ids=…, attention_mask=…, labels=…, fused_lm_head=True)``, with what TRL's
    ``add_fused_lm_head`` returns: per-token ``log_probs`` ``(N, T - 1)`` of each next label
    (0 where the label is -100), and the ``entropy``, ``mean_logits`` and ``is_top1`` it logs —
    in our model's dtype, where TRL's fused head accumulates in float32. So TRL's loss code runs
    on our float64 log-probabilities, and its gradients reach our weights."""

    def __init__(self, model: LanguageModel) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: Tensor,
        *,
        labels: Tensor,
        attention_mask: Tensor | None = None,
        fused_lm_head: bool = True,
        use_cache: bool = False,
    ) -> SimpleNamespace:
        if not fused_lm_head:
            raise ValueError("FusedLogProbs answers only fused_lm_head=True")
        logits = self.model(input_ids)[:, :-1]  # (N, T-1, V): position t scores t + 1
        targets = labels[:, 1:]
        scored = targets != -100
        log_probs = logits.log_softmax(dim=-1)
        chosen = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
        return SimpleNamespace(
            log_probs=chosen.masked_fill(~scored, 0.0),
            entropy=entropy.masked_fill(~scored, 0.0),
            mean_logits=logits.mean(dim=-1).masked_fill(~scored, 0.0),
            is_top1=(logits.argmax(dim=-1) == targets) & scored,
        )
