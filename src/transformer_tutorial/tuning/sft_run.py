"""Chapter 26's experiment: instruction-tune the decoder-only model to translate Multi30k
German→English, and score it on test2016 against chapter 10's translator trained for the same
number of floating-point operations.

Each training pair becomes a conversation (:func:`~transformer_tutorial.tuning.chat.
translation_chat`): the user asks "Translate to English: <German>", the assistant answers in
English. The conversations are packed into rows of :data:`ROW_LEN` tokens
(:func:`~transformer_tutorial.tuning.sft.pack_examples`) and the model — chapter 17's
Llama-style :class:`~transformer_tutorial.lm.model.LanguageModel`, about as many weights as
chapter 10's CPU translator (config ``chapter10``) — learns from the assistant's tokens only.
Training stops when its counted FLOPs (:func:`~transformer_tutorial.flops.count_flops`, every
step's forward and backward) reach the baseline's: a finished ``python -m
transformer_tutorial.train`` run, whose steps' FLOPs :func:`translator_flops` counts on the
``meta`` device (shapes only, nothing computed) from the batches that run trained on.
``python -m transformer_tutorial.tuning.sft_run --baseline RUN_DIR --out FILE`` writes the
record; the chapter reads the copies shipped with the package (:func:`load_sft_record`).

Shapes: packed rows ``(ROWS, ROW_LEN)``; prompts ``(B, T0)`` of equal length when decoding.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from transformer_tutorial import data
from transformer_tutorial.checks import ArgumentParser, check_int, check_number, int_arg
from transformer_tutorial.configs import CONFIGS
from transformer_tutorial.decode import bleu
from transformer_tutorial.flops import count_flops
from transformer_tutorial.lm.config import LLAMA, LMConfig
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.sampling import generate
from transformer_tutorial.model import Transformer
from transformer_tutorial.multi30k import load_split
from transformer_tutorial.provenance import finish_record, start_record
from transformer_tutorial.records import shipped_record
from transformer_tutorial.tuning.chat import (
    ChatTokens,
    add_chat_tokens,
    apply_chat_template,
    translation_chat,
)
from transformer_tutorial.tuning.sft import (
    SFTBatch,
    pack_examples,
    packed_logits,
    scored_positions,
)

BASELINE = "chapter10"  # chapter 10's CPU translator: its vocabulary size and sizes
# Chapter 10's CPU translator has 2 + 2 layers of width 128; the same width and 4 layers here,
# the SwiGLU's hidden size chosen for the same weights as a 512-wide ReLU layer.
SIZES = dict(d_model=128, n_heads=4, n_kv_heads=2, n_layers=4, d_ff=344, max_len=160)
ROW_LEN = 128  # tokens a packed row
ROWS = 8  # rows a step: 1,024 tokens, as the baseline's batches of 1,000
MAX_NEW_TOKENS = 80  # an answer's budget when decoding
# The committed runs' records, shipped with the package, by their budget: the FLOPs of 600 and
# of 2,400 steps of chapter 10's CPU translator (its own run, and four times it).
# The committed records, shipped with the package: chapter 10's budget and four times it.
RECORD_FILES = {
    1: "results/sft_translation/record.json",
    4: "results/sft_translation/record_x4.json",
}


def sft_config(vocab_size: int, *, dropout: float = 0.0) -> LMConfig:
    """The instruction-tuned model: Llama-style, :data:`SIZES`, embeddings tied (as the
    baseline's)."""
    return LMConfig(
        vocab_size=vocab_size, dropout=dropout, **(LLAMA | SIZES | dict(tie_embeddings=True))
    )


def prepare_data(
    vocab_size: int, *, train_size: int | None = None
) -> tuple[Tokenizer, ChatTokens, list, tuple[list[str], list[str]]]:
    """Chapter 10's BPE (learned on both sides of the training split) with the chat tokens
    added, the training pairs as conversations in the chat format, and test2016 (German
    sources, English references)."""
    train_de, train_en = (side[:train_size] for side in load_split("train"))
    tokenizer = data.train_tokenizer(train_de + train_en, vocab_size)
    tokens = add_chat_tokens(tokenizer)
    examples = [
        apply_chat_template(tokenizer, translation_chat(de, en))
        for de, en in zip(train_de, train_en, strict=True)
    ]
    return tokenizer, tokens, examples, load_split("test")


def training_loss(model: LanguageModel, batch: SFTBatch) -> torch.Tensor:
    """:func:`~transformer_tutorial.tuning.sft.sft_loss` of packed rows, with the output layer
    run only where a target is scored."""
    positions, targets = scored_positions(batch.labels)
    logits = packed_logits(model, batch.ids, batch.position_ids, logits_at=positions)
    return F.cross_entropy(logits, targets)


def train_to_budget(
    model: LanguageModel,
    rows: SFTBatch,
    *,
    flops: int,
    lr: float = 3e-3,
    warmup: int = 50,
    seed: int = 0,
    max_minutes: float | None = None,
    log_every: int = 20,
) -> dict:
    """Train on ``rows`` (shuffled each epoch, :data:`ROWS` a step) until the counted training
    FLOPs reach ``flops`` (or ``max_minutes`` pass): AdamW, a linear warm-up over ``warmup``
    steps, then a linear decay to 0 over the FLOP budget, gradients clipped at 1.

    Returns ``{"steps", "flops", "train_seconds", "stopped_by", "train": [[step, flops, mean
    loss of the last log_every steps], ...]}``."""
    check_int("flops", flops, at_least=1)
    check_number("lr", lr, low=0.0, low_open=True)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    step = done = 0
    history, block, order = [], [], []
    start, stopped_by = time.perf_counter(), "flops"
    model.train()
    while done < flops:
        if max_minutes is not None and time.perf_counter() - start > 60 * max_minutes:
            stopped_by = "time"
            break
        if not order:  # a new epoch of shuffled rows
            order = torch.randperm(rows.ids.size(0), generator=g).split(ROWS)[::-1]
            order = [o for o in order if len(o) == ROWS]  # full steps only: one shape a step
        pick = order.pop()
        batch = SFTBatch(rows.ids[pick], rows.labels[pick], rows.position_ids[pick], ())
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup) * max(0.0, 1 - done / flops)
        losses: list[float] = []

        def forward_backward(batch: SFTBatch = batch, losses: list[float] = losses) -> None:
            loss = training_loss(model, batch)
            loss.backward()
            losses.append(loss.item())

        optimizer.zero_grad()
        done += count_flops(forward_backward)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        block += losses
        if step % log_every == 0:
            history.append([step, done, sum(block) / len(block)])
            block = []
    model.eval()
    seconds = time.perf_counter() - start
    return dict(
        steps=step, flops=done, train_seconds=seconds, stopped_by=stopped_by, train=history
    )


def translate(
    model: LanguageModel,
    tokenizer: Tokenizer,
    sources: Sequence[str],
    *,
    batch_size: int = 64,
) -> list[str]:
    """Greedy answers to "Translate to English: <source>", decoded to text; prompts of equal
    length share a batch (no padding), each stops at ``<|end|>``."""
    check_int("batch_size", batch_size, at_least=1)
    tokens = add_chat_tokens(tokenizer)  # already there: their ids
    prompts = [
        apply_chat_template(tokenizer, translation_chat(s), add_generation_prompt=True).ids
        for s in sources
    ]
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    answers = [""] * len(sources)
    model.eval()
    for length, members in sorted(by_length.items()):
        budget = min(MAX_NEW_TOKENS, model.config.max_len - length)
        for chunk in range(0, len(members), batch_size):
            rows = members[chunk : chunk + batch_size]
            prompt = torch.tensor([prompts[i] for i in rows])
            out = generate(
                model, prompt, budget, greedy=True, eos_id=tokens.end, pad_id=data.PAD_ID
            )
            for i, ids in zip(rows, out[:, length:].tolist(), strict=True):
                ids = ids[: ids.index(tokens.end)] if tokens.end in ids else ids
                answers[i] = tokenizer.decode(ids)
    return answers


def translator_flops(run_dir: Path, steps: int, *, config: str = BASELINE, seed: int = 0) -> int:
    """The training FLOPs of the first ``steps`` steps of ``python -m transformer_tutorial.train
    --config CONFIG --seed SEED`` whose tokenizer is in ``run_dir``: the same batches, in the
    same order (chapter 10's ``token_batches`` with the run's generator, epoch after epoch),
    each step's forward (logits at the real target tokens only, as the trainer computes them)
    and backward counted on the ``meta`` device."""
    check_int("steps", steps, at_least=1)
    recipe = CONFIGS[config]
    tokenizer = data.load_tokenizer(Path(run_dir) / "tokenizer.json")
    train_de, train_en = (side[: recipe.train_size] for side in load_split("train"))
    max_len = recipe.model.max_len
    pairs = [
        (s, t)
        for s, t in data.encode_pairs(tokenizer, train_de, train_en)
        if len(s) <= max_len and len(t) + 1 <= max_len
    ]
    lengths = data.pair_lengths(pairs)
    with torch.device("meta"):
        model = Transformer(recipe.model)
    g = torch.Generator().manual_seed(seed)
    total = counted = 0
    while counted < steps:
        for batch in data.token_batches(lengths, recipe.max_tokens, generator=g):
            if counted == steps:
                break
            src, tgt_in, tgt_out = data.collate([pairs[i] for i in batch])
            real = (tgt_out != data.PAD_ID).flatten().nonzero().squeeze(1)
            target = tgt_out.flatten()[real]

            def forward_backward(src=src, tgt_in=tgt_in, real=real, target=target) -> None:
                logits = model(
                    src.to("meta"), tgt_in.to("meta"), logits_at=real.to("meta"), check_ids=False
                )
                F.cross_entropy(logits, target.to("meta"), reduction="sum").backward()

            total += count_flops(forward_backward)
            counted += 1
    return total


def load_sft_record(budget: int = 1) -> dict:
    """A committed run's record shipped with the package (see ``results/sft_translation``):
    ``budget`` 1 for the FLOPs of chapter 10's own 600 steps, 4 for four times them."""
    if budget not in RECORD_FILES:
        raise ValueError(f"budget must be one of {sorted(RECORD_FILES)}, got {budget!r}")
    return shipped_record(RECORD_FILES[budget])


def main(argv: Sequence[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--baseline",
        type=Path,
        required=True,
        help="a finished `python -m transformer_tutorial.train --config chapter10` run folder",
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-minutes", type=float, default=None)
    parser.add_argument("--seed", type=int_arg(at_least=0), default=0)
    parser.add_argument("--threads", type=int_arg(at_least=1), default=None)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    baseline = json.loads((args.baseline / "record.json").read_text())
    budget = translator_flops(args.baseline, baseline["steps"], seed=baseline["seed"])
    record = start_record("transformer_tutorial.tuning.sft_run")
    tokenizer, _, examples, (test_de, test_en) = prepare_data(CONFIGS[BASELINE].vocab_size)
    kept = [e for e in examples if len(e.ids) <= ROW_LEN]  # as the baseline keeps its max_len
    rows = pack_examples(kept, ROW_LEN)
    torch.manual_seed(args.seed)
    model = LanguageModel(sft_config(tokenizer.get_vocab_size()))
    result = train_to_budget(
        model, rows, flops=budget, seed=args.seed, max_minutes=args.max_minutes
    )
    start = time.perf_counter()
    hyps = translate(model, tokenizer, test_de)
    score = bleu(hyps, test_en)
    record |= {
        "seed": args.seed,
        "config": dict(SIZES, row_len=ROW_LEN, rows=ROWS, vocab_size=tokenizer.get_vocab_size()),
        "parameters": model.num_parameters(),
        "train_examples": len(kept),
        "longer_than_a_row": len(examples) - len(kept),
        "packed_rows": rows.ids.size(0),
        "padding_share": float((rows.position_ids == 0).sum() - len(kept)) / rows.ids.numel(),
        **result,
        "test2016": {"sentences": len(hyps), "greedy": score.score, "signature": score.signature},
        "eval_seconds": time.perf_counter() - start,
        "samples": [
            {"source": s, "reference": r, "greedy": h}
            for s, r, h in list(zip(test_de, test_en, hyps, strict=True))[:5]
        ],
        "baseline": {
            "command": baseline["command"],
            "config": baseline["config"]["name"],
            "parameters": baseline["parameters"],
            "steps": baseline["steps"],
            "flops": budget,
            "train_time_s": baseline["train_time_s"],
            "test2016": baseline["test2016"],
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(finish_record(record), indent=1) + "\n")


if __name__ == "__main__":
    main()
