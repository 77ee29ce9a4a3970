"""Chapter 27's experiment: DPO on the model's own translations of Multi30k.

1. A small Llama-style decoder (:data:`SIZES`) is instruction-tuned on German→English pairs in
   chapter 26's chat format (:func:`~transformer_tutorial.tuning.chat.translation_chat`, loss on
   the answer only: :func:`~transformer_tutorial.tuning.sft.sft_loss`) for a budget of seconds.
2. Preference pairs, on-policy: for German sentences the fine-tuning never saw (the last
   :data:`HELD_BACK` of the training split), the model samples ``k`` translations; ranked by
   sentence-level chrF against the reference, the best is *chosen* and the worst *rejected*
   (pairs whose two scores tie are dropped). Nothing is downloaded or labelled by hand.
3. DPO (:mod:`~transformer_tutorial.tuning.dpo`) from the fine-tuned model, which is also the
   frozen reference, once for each β.

Measured for the fine-tuned model and after DPO at each β: test2016 BLEU (greedy, sacrebleu as
chapter 10), the mean length of the translations, and on pairs from validation sentences (made
by the fine-tuned model in the same way, never trained on) the implicit reward margin and
accuracy. ``python -m transformer_tutorial.tuning.dpo_run --out FILE`` writes the record;
:func:`load_dpo_record` reads the one shipped with the package.

Shapes: prompts and completions are lists of ids; batches as in :mod:`~transformer_tutorial.
tuning.dpo`.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import sacrebleu
import torch
from tokenizers import Tokenizer

from transformer_tutorial import data
from transformer_tutorial.checks import (
    ArgumentParser,
    check_int,
    check_number,
    int_arg,
    number_arg,
)
from transformer_tutorial.decode import bleu
from transformer_tutorial.lm.config import LLAMA, LMConfig
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.sampling import generate
from transformer_tutorial.multi30k import load_split
from transformer_tutorial.provenance import finish_record, start_record
from transformer_tutorial.records import shipped_record
from transformer_tutorial.tuning.chat import (
    add_chat_tokens,
    apply_chat_template,
    chat_tokens,
    translation_chat,
)
from transformer_tutorial.tuning.dpo import (
    RewardStats,
    batch_loss,
    collate_preferences,
    implicit_rewards,
    sequence_logprobs,
)
from transformer_tutorial.tuning.sft import pad_examples, sft_loss

VOCAB_SIZE = 2000  # one BPE vocabulary for both languages
SIZES = dict(
    LLAMA,
    d_model=128,
    n_heads=4,
    n_kv_heads=2,
    n_layers=3,
    d_ff=384,
    max_len=160,
    tie_embeddings=True,  # at this size an output matrix of its own is a third of the weights
)
HELD_BACK = 4000  # the last training pairs: never fine-tuned on, prompts for the pairs
MAX_NEW_TOKENS = 60  # a translation's budget in tokens
BETAS = (0.05, 0.1, 0.5)
DPO_BATCH = 16  # pairs a DPO step
RECORD_FILE = "results/dpo/record.json"  # the record, shipped with the package


@dataclass(frozen=True)
class Corpus:
    """The tokenizer (with the chat tokens) and the splits' (German, English) sentences."""

    tokenizer: Tokenizer
    train: list[tuple[str, str]]
    val: list[tuple[str, str]]
    test: list[tuple[str, str]]


def prepare_corpus() -> Corpus:
    """Multi30k's splits and a BPE vocabulary learned on the training sentences of both
    languages, with chapter 26's chat tokens added."""
    splits = {split: load_split(split) for split in ("train", "val", "test")}
    train_de, train_en = splits["train"]
    tokenizer = data.train_tokenizer(train_de + train_en, vocab_size=VOCAB_SIZE)
    add_chat_tokens(tokenizer)
    pairs = {split: list(zip(*splits[split], strict=True)) for split in splits}
    return Corpus(tokenizer, pairs["train"], pairs["val"], pairs["test"])


def model_config(tokenizer: Tokenizer) -> LMConfig:
    return LMConfig(vocab_size=tokenizer.get_vocab_size(), dropout=0.0, **SIZES)


def prompt_ids(tokenizer: Tokenizer, german: str) -> list[int]:
    """The chat prompt that asks for ``german``'s translation, ending with ``<|assistant|>``."""
    return apply_chat_template(tokenizer, translation_chat(german), add_generation_prompt=True).ids


def fine_tune(
    model: LanguageModel,
    tokenizer: Tokenizer,
    pairs: Sequence[tuple[str, str]],
    *,
    seconds: float,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
) -> dict:
    """Chapter 26's supervised fine-tuning for ``seconds``: AdamW, a short warm-up, the
    learning rate decayed by elapsed time to a tenth; returns the steps, examples and the last
    loss."""
    check_number("seconds", seconds, low=0.0, low_open=True)
    encoded = [apply_chat_template(tokenizer, translation_chat(de, en)) for de, en in pairs]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    model.train()
    start, step, examples, loss = time.perf_counter(), 0, 0, math.nan
    while (used := (time.perf_counter() - start) / seconds) < 1.0:
        order = torch.randperm(len(encoded), generator=g)[:batch_size].tolist()
        batch = pad_examples([encoded[i] for i in order])
        scale = min(1.0, (step + 1) / 50) * (1.0 - 0.9 * used)
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        loss = sft_loss(model(batch.ids), batch.labels)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step, examples = step + 1, examples + len(order)
    model.eval()
    return {"steps": step, "examples": examples, "last_loss": loss.item()}


@torch.no_grad()
def translate(
    model: LanguageModel,
    tokenizer: Tokenizer,
    germans: Sequence[str],
    *,
    samples: int = 1,
    temperature: float | None = None,
    generator: torch.Generator | None = None,
    batch_size: int = 256,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> list[list[list[int]]]:
    """Each German sentence's completions (ids up to and including ``<|end|>``, or
    ``max_new_tokens`` ids): ``samples`` sampled at ``temperature``, or one greedy when
    ``temperature`` is None. Prompts of one length are decoded together (``generate`` takes no
    padding), ``samples`` rows each."""
    check_int("samples", samples, at_least=1)
    end = chat_tokens(tokenizer).end
    prompts = [prompt_ids(tokenizer, de) for de in germans]
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    out: list[list[list[int]]] = [[] for _ in prompts]
    rows_per_call = max(1, batch_size // samples)
    for length in sorted(by_length):
        group = by_length[length]
        for first in range(0, len(group), rows_per_call):
            chunk = group[first : first + rows_per_call]
            rows = torch.tensor([prompts[i] for i in chunk for _ in range(samples)])
            tokens = generate(
                model,
                rows,
                max_new_tokens,
                greedy=temperature is None,
                temperature=1.0 if temperature is None else temperature,
                eos_id=end,
                pad_id=data.PAD_ID,
                generator=generator,
            )[:, length:]
            for r, i in enumerate(r for r in chunk for _ in range(samples)):
                ids = tokens[r].tolist()
                out[i].append(ids[: ids.index(end) + 1] if end in ids else ids)
    return out


def text_of(tokenizer: Tokenizer, completion: Sequence[int]) -> str:
    """A completion's text (the ``<|end|>`` and other special tokens left out)."""
    return tokenizer.decode(list(completion), skip_special_tokens=True)


@dataclass(frozen=True)
class Pairs:
    """Preference pairs: ``examples`` (prompt, chosen, rejected) ids and the chosen and
    rejected completions' sentence chrF."""

    examples: list[tuple[list[int], list[int], list[int]]]
    chosen_chrf: list[float]
    rejected_chrf: list[float]


def preference_pairs(
    model: LanguageModel,
    tokenizer: Tokenizer,
    pairs: Sequence[tuple[str, str]],
    *,
    samples: int = 4,
    temperature: float = 1.0,
    seed: int = 0,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> Pairs:
    """On-policy pairs: ``samples`` translations of each German sentence sampled from
    ``model``, the best and the worst by sentence chrF against the reference; a sentence whose
    best and worst score the same gives no pair. ``max_new_tokens``: each sample's budget."""
    check_int("samples", samples, at_least=2)
    generator = torch.Generator().manual_seed(seed)
    completions = translate(
        model,
        tokenizer,
        [de for de, _ in pairs],
        samples=samples,
        temperature=temperature,
        generator=generator,
        max_new_tokens=max_new_tokens,
    )
    examples, chosen_chrf, rejected_chrf = [], [], []
    for (de, en), candidates in zip(pairs, completions, strict=True):
        scores = [sacrebleu.sentence_chrf(text_of(tokenizer, c), [en]).score for c in candidates]
        best = max(range(samples), key=lambda i: scores[i])
        worst = min(range(samples), key=lambda i: scores[i])
        if scores[best] == scores[worst]:
            continue
        examples.append((prompt_ids(tokenizer, de), candidates[best], candidates[worst]))
        chosen_chrf.append(scores[best])
        rejected_chrf.append(scores[worst])
    return Pairs(examples, chosen_chrf, rejected_chrf)


@torch.no_grad()
def reference_logps(
    reference: LanguageModel, examples: Sequence, *, batch_size: int = 64
) -> list[tuple[float, float]]:
    """The reference's (chosen, rejected) log-probabilities of every pair, computed once."""
    out = []
    for first in range(0, len(examples), batch_size):
        batch = collate_preferences(examples[first : first + batch_size], pad_id=data.PAD_ID)
        chosen, rejected = sequence_logprobs(reference, batch)
        out += list(zip(chosen.tolist(), rejected.tolist(), strict=True))
    return out


@torch.no_grad()
def reward_stats(
    policy: LanguageModel,
    examples: Sequence,
    references: Sequence[tuple[float, float]],
    *,
    beta: float,
    batch_size: int = 64,
) -> RewardStats:
    """The implicit rewards' statistics of ``policy`` on all of ``examples``."""
    chosen_r, rejected_r = [], []
    for first in range(0, len(examples), batch_size):
        batch = collate_preferences(examples[first : first + batch_size], pad_id=data.PAD_ID)
        chosen, rejected = sequence_logprobs(policy, batch)
        ref = torch.tensor(references[first : first + batch_size], dtype=chosen.dtype)
        chosen_r.append(implicit_rewards(chosen, ref[:, 0], beta=beta))
        rejected_r.append(implicit_rewards(rejected, ref[:, 1], beta=beta))
    return RewardStats.of(torch.cat(chosen_r), torch.cat(rejected_r))


def dpo_train(
    policy: LanguageModel,
    examples: Sequence,
    references: Sequence[tuple[float, float]],
    *,
    beta: float,
    steps: int,
    batch_size: int = DPO_BATCH,
    lr: float = 1e-4,
    seed: int = 0,
    every: int = 10,
) -> list[dict]:
    """DPO (the sigmoid loss) on the pairs for ``steps`` steps of AdamW at a constant
    ``lr``; every ``every`` steps the batch's loss, margin and accuracy (a curve)."""
    check_int("steps", steps, at_least=1)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    policy.train()
    curve = []
    for step in range(steps):
        order = torch.randperm(len(examples), generator=g)[:batch_size].tolist()
        batch = collate_preferences([examples[i] for i in order], pad_id=data.PAD_ID)
        ref = torch.tensor([references[i] for i in order])
        loss, stats = batch_loss(policy, batch, ref[:, 0], ref[:, 1], beta=beta)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        if step % every == 0 or step == steps - 1:
            curve.append(
                {
                    "step": step + 1,
                    "loss": loss.item(),
                    "margin": stats.margin,
                    "accuracy": stats.accuracy,
                }
            )
    policy.eval()
    return curve


def evaluate(model: LanguageModel, tokenizer: Tokenizer, test: Sequence[tuple[str, str]]) -> dict:
    """Greedy test BLEU (sacrebleu, cased) and the translations' mean length in words."""
    completions = translate(model, tokenizer, [de for de, _ in test])
    hyps = [text_of(tokenizer, c[0]) for c in completions]
    return {
        "bleu": bleu(hyps, [en for _, en in test]).score,
        "mean_words": sum(len(h.split()) for h in hyps) / len(hyps),
        "examples": hyps[:3],
    }


def run(
    *,
    sft_seconds: float,
    prompts: int,
    val_prompts: int,
    test_sentences: int,
    dpo_steps: int,
    betas: Sequence[float] = BETAS,
    samples: int = 4,
    lr: float = 1e-4,
    seed: int = 0,
    corpus: Corpus | None = None,
) -> dict:
    """The whole experiment; returns the record's measurements."""
    started, cpu_started = time.perf_counter(), time.process_time()
    corpus = prepare_corpus() if corpus is None else corpus
    tokenizer = corpus.tokenizer
    torch.manual_seed(seed)
    model = LanguageModel(model_config(tokenizer))
    sft = fine_tune(model, tokenizer, corpus.train[:-HELD_BACK], seconds=sft_seconds, seed=seed)
    test = corpus.test[:test_sentences]
    before = evaluate(model, tokenizer, test)
    train_pairs = preference_pairs(
        model, tokenizer, corpus.train[-HELD_BACK:][:prompts], samples=samples, seed=seed
    )
    val_pairs = preference_pairs(
        model, tokenizer, corpus.val[:val_prompts], samples=samples, seed=seed + 1
    )
    train_refs = reference_logps(model, train_pairs.examples)
    val_refs = reference_logps(model, val_pairs.examples)
    runs = []
    for beta in betas:
        policy = copy.deepcopy(model)
        curve = dpo_train(
            policy,
            train_pairs.examples,
            train_refs,
            beta=beta,
            steps=dpo_steps,
            lr=lr,
            seed=seed,
        )
        held_out = reward_stats(policy, val_pairs.examples, val_refs, beta=beta)
        train_stats = reward_stats(policy, train_pairs.examples, train_refs, beta=beta)
        runs.append(
            {
                "beta": beta,
                "curve": curve,
                "train_margin": train_stats.margin,
                "train_accuracy": train_stats.accuracy,
                "val_margin": held_out.margin,
                "val_accuracy": held_out.accuracy,
                "val_chosen_reward": held_out.chosen,
                "val_rejected_reward": held_out.rejected,
                **evaluate(policy, tokenizer, test),
            }
        )
    return {
        "sizes": SIZES
        | {
            "vocab_size": tokenizer.get_vocab_size(),
            "parameters": model.num_parameters(),
        },
        "settings": {
            "sft_seconds": sft_seconds,
            "prompts": prompts,
            "val_prompts": val_prompts,
            "test_sentences": test_sentences,
            "samples": samples,
            "dpo_steps": dpo_steps,
            "dpo_batch_pairs": DPO_BATCH,
            "lr": lr,
            "seed": seed,
        },
        "sft": sft,
        "pairs": {
            "train": len(train_pairs.examples),
            "val": len(val_pairs.examples),
            "chosen_chrf": sum(train_pairs.chosen_chrf) / len(train_pairs.chosen_chrf),
            "rejected_chrf": sum(train_pairs.rejected_chrf) / len(train_pairs.rejected_chrf),
        },
        "before": before,
        "runs": runs,
        "seconds": time.perf_counter() - started,
        "cpu_seconds": time.process_time() - cpu_started,
    }


def load_dpo_record() -> dict:
    """The record shipped with the package (``results/dpo/record.json``)."""
    return shipped_record(RECORD_FILE)


def main(argv: Sequence[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the record's JSON file")
    parser.add_argument("--sft-minutes", type=number_arg(low=0.0, low_open=True), default=8.0)
    parser.add_argument("--prompts", type=int_arg(at_least=1), default=1000)
    parser.add_argument("--val-prompts", type=int_arg(at_least=1), default=200)
    parser.add_argument("--test-sentences", type=int_arg(at_least=1), default=500)
    parser.add_argument("--dpo-steps", type=int_arg(at_least=1), default=80)
    parser.add_argument("--lr", type=number_arg(low=0.0, low_open=True), default=1e-4)
    parser.add_argument("--seed", type=int_arg(at_least=0), default=0)
    args = parser.parse_args(argv)
    record = start_record("transformer_tutorial.tuning.dpo_run")
    record |= run(
        sft_seconds=60 * args.sft_minutes,
        prompts=args.prompts,
        val_prompts=args.val_prompts,
        test_sentences=args.test_sentences,
        dpo_steps=args.dpo_steps,
        lr=args.lr,
        seed=args.seed,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(finish_record(record), indent=1) + "\n")


if __name__ == "__main__":
    main()
