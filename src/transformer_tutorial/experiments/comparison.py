"""Chapter 17: the 2017/GPT-2-style and the Llama-style language model, trained for the same
wall-clock time on the English side of Multi30k.

:data:`COMPARED` holds the two configurations: chapter 13's model, and the same sizes with
Llama 3's choices (RMSNorm, SwiGLU, rotary positions, grouped-query attention, no biases) with
the feed-forward widened so that both hold the same number of weights (within 0.2%). Both keep
the embeddings tied and the same dropout: at this size an output layer of its own would be
nearly half the weights. :func:`train_for` trains one for a budget of seconds with one recipe
(AdamW, warm-up, a decay by elapsed time, clipping) and records the validation loss against
time. ``python -m transformer_tutorial.lm.comparison`` runs one of them and writes its record;
``--merge`` joins records into one file.

Shapes: sentences are lists of ids ``<bos> … <eos>``; batches ``(B, T)`` padded at the end.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import torch
from tokenizers import Tokenizer

from transformer_tutorial import data
from transformer_tutorial.checks import (
    ArgumentParser,
    check_int,
    check_number,
    check_optional_int,
    int_arg,
    number_arg,
    out_file_arg,
    read_record,
)
from transformer_tutorial.lm.config import LLAMA, LMConfig
from transformer_tutorial.lm.model import LanguageModel, next_token_loss
from transformer_tutorial.lm.sampling import generate
from transformer_tutorial.multi30k import load_split
from transformer_tutorial.provenance import finish_record, start_record

VOCAB_SIZE = 2000  # chapter 13's BPE vocabulary
VAL_SENTENCES = 500  # the first 500 validation sentences, as chapter 13
SIZES = dict(d_model=96, n_heads=4, n_layers=2, max_len=80, dropout=0.1)
COMPARED = {
    "gpt2": dict(SIZES, d_ff=384),  # chapter 13's model: GPT-2's choices
    "llama": dict(SIZES, **(LLAMA | dict(tie_embeddings=True)), n_kv_heads=2, d_ff=304),
}
RECORD_FILE = "lm_comparison_run.json"  # the long run's record, shipped with the package


def comparison_config(name: str, vocab_size: int) -> LMConfig:
    """The config of one side of the comparison, ``"gpt2"`` or ``"llama"``."""
    if name not in COMPARED:
        raise ValueError(f"name must be one of {sorted(COMPARED)}, got {name!r}")
    return LMConfig(vocab_size=vocab_size, **COMPARED[name])


def prepare_data() -> tuple[Tokenizer, list[list[int]], torch.Tensor]:
    """Chapter 13's data: a 2,000-subword BPE learned on the English training sentences, the
    training sentences as ids, and the first 500 validation sentences as one padded batch."""
    _, train_en = load_split("train")
    _, val_en = load_split("val")
    tokenizer = data.train_tokenizer(train_en, vocab_size=VOCAB_SIZE)

    def encode(sentences: Sequence[str]) -> list[list[int]]:
        return [[data.BOS_ID, *e.ids, data.EOS_ID] for e in tokenizer.encode_batch(sentences)]

    return tokenizer, encode(train_en), data.pad_batch(encode(val_en[:VAL_SENTENCES]))


def validation_loss(model: LanguageModel, val_batch: torch.Tensor) -> float:
    """Mean next-token loss on ``val_batch`` in eval mode, padding ignored."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        loss = next_token_loss(model(val_batch), val_batch, ignore_index=data.PAD_ID).item()
    model.train(was_training)
    return loss


def train_for(
    model: LanguageModel,
    train_ids: Sequence[Sequence[int]],
    val_batch: torch.Tensor,
    *,
    seconds: float,
    max_steps: int | None = None,
    evaluations: int = 10,
    max_tokens: int = 1024,
    lr: float = 3e-3,
    warmup: int = 30,
    seed: int = 0,
) -> dict:
    """Train ``model`` for ``seconds`` of wall-clock training time (validation not counted), or
    ``max_steps`` steps if that comes first, with chapter 13's recipe; the learning rate decays
    linearly to 10% over the budget (the time, or the steps), and the validation loss is
    measured ``evaluations`` times along it.

    Returns ``{"steps", "tokens", "train_seconds", "cpu_seconds", "val": [[seconds, step,
    loss], ...], "train": [mean loss of each block of steps between evaluations]}``;
    ``cpu_seconds`` is the process's CPU time over the loop, validations included (on a shared
    machine, what the wall-clock budget actually bought).
    """
    check_number("seconds", seconds, low=0.0, low_open=True)
    check_int("evaluations", evaluations, at_least=1)
    check_optional_int("max_steps", max_steps, at_least=1)

    def progress() -> float:  # the share of the budget used
        return max(elapsed / seconds, 0.0 if max_steps is None else step / max_steps)

    torch.manual_seed(seed)
    lengths = [len(s) for s in train_ids]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    history = {"val": [[0.0, 0, validation_loss(model, val_batch)]], "train": []}
    step = tokens = 0
    elapsed, cpu_start, block = 0.0, time.process_time(), []
    batches: list = []
    model.train()
    while progress() < 1.0:
        if not batches:  # a new epoch of length-bucketed batches
            g = torch.Generator().manual_seed(seed + step)
            batches = list(data.token_batches(lengths, max_tokens, generator=g))
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup) * max(0.1, 1 - progress())
        batch = data.pad_batch([train_ids[i] for i in batches.pop()])
        loss = next_token_loss(model(batch), batch, ignore_index=data.PAD_ID)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        elapsed += time.perf_counter() - start
        step, tokens = step + 1, tokens + int((batch != data.PAD_ID).sum())
        block.append(loss.item())
        if progress() >= min(1.0, len(history["val"]) / evaluations):
            history["val"].append([round(elapsed, 2), step, validation_loss(model, val_batch)])
            history["train"].append(sum(block) / len(block))
            block = []
    model.eval()
    cpu = time.process_time() - cpu_start
    return dict(steps=step, tokens=tokens, train_seconds=elapsed, cpu_seconds=cpu, **history)


def samples(model: LanguageModel, tokenizer: Tokenizer, *, n: int = 5, seed: int = 0) -> dict:
    """Greedy, and ``n`` top-p 0.9 samples from ``<bos>``, decoded to text."""
    model.eval()
    start = torch.full((n, 1), data.BOS_ID)
    kwargs = dict(eos_id=data.EOS_ID, pad_id=data.PAD_ID)
    greedy = generate(model, start[:1], 40, greedy=True, **kwargs)
    sampled = generate(
        model, start, 40, top_p=0.9, generator=torch.Generator().manual_seed(seed), **kwargs
    )
    decode = lambda rows: [tokenizer.decode(row) for row in rows.tolist()]  # noqa: E731
    return {"greedy": decode(greedy), "top_p_0.9": decode(sampled)}


def run_one(name: str, seconds: float, *, seed: int = 0) -> dict:
    """Data, model, :func:`train_for` and samples for one side: its part of the record."""
    tokenizer, train_ids, val_batch = prepare_data()
    torch.manual_seed(seed)
    model = LanguageModel(comparison_config(name, tokenizer.get_vocab_size()))
    result = train_for(model, train_ids, val_batch, seconds=seconds, seed=seed)
    return {
        "config": COMPARED[name],
        "parameters": model.num_parameters(),
        **result,
        "samples": samples(model, tokenizer),
    }


def load_comparison_record() -> dict:
    """The long run's record shipped with the package (see ``results/lm_comparison``)."""
    text = resources.files("transformer_tutorial").joinpath(RECORD_FILE).read_text()
    return json.loads(text)


def main(argv: Sequence[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(COMPARED))
    parser.add_argument("--seconds", type=number_arg(low=0.0, low_open=True), default=600.0)
    parser.add_argument("--seed", type=int_arg(at_least=0), default=0)
    parser.add_argument("--out", type=out_file_arg, required=True)
    parser.add_argument("--merge", type=Path, nargs="+", help="records to join into --out")
    args = parser.parse_args(argv)
    if args.merge:
        runs = [read_record(parser, "--merge", p, ("command", "runs")) for p in args.merge]
        merged = {k: v for k, v in runs[0].items() if k not in ("runs", "command")}
        merged["commands"] = [run["command"] for run in runs]  # one process per model
        merged["runs"] = {k: v for run in runs for k, v in run["runs"].items()}
        args.out.write_text(json.dumps(merged, indent=1) + "\n")
        return
    if args.model is None:
        parser.error("--model is required unless --merge is given")
    record = {
        **start_record("transformer_tutorial.lm.comparison"),
        "seconds": args.seconds,
        "seed": args.seed,
        "runs": {args.model: run_one(args.model, args.seconds, seed=args.seed)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(finish_record(record), indent=1) + "\n")


if __name__ == "__main__":
    main()
