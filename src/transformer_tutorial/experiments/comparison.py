"""Chapter 17: the 2017/GPT-2-style and the Llama-style language model, trained for the same
wall-clock time on the English side of Multi30k.

:data:`COMPARED` holds the two configurations: chapter 13's model, and the same sizes with
Llama 3's choices (RMSNorm, SwiGLU, rotary positions, grouped-query attention, no biases) with
the feed-forward widened so that both hold the same number of weights (within 0.2%). Both keep
the embeddings tied and the same dropout: at this size an output layer of its own would be
nearly half the weights. :func:`run_one` trains one for a budget of wall-clock seconds with
chapter 13's recipe (:func:`~transformer_tutorial.experiments.harness.train_for`) and records
the validation loss against time. ``python -m transformer_tutorial.experiments.comparison`` runs
one of them and writes its record; ``--merge`` joins records into one file.

Shapes: sentences are lists of ids ``<bos> … <eos>``; batches ``(B, T)`` padded at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer

from transformer_tutorial import data
from transformer_tutorial.checks import (
    ArgumentParser,
    int_arg,
    number_arg,
    out_file_arg,
    read_record,
)
from transformer_tutorial.experiments.harness import load_record, train_for, write_record
from transformer_tutorial.lm.config import LLAMA, LMConfig
from transformer_tutorial.lm.model import LanguageModel
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
RECORD = "lm_comparison"  # the long run's record: results/lm_comparison/record.json


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
    """Data, model, training for ``seconds`` of wall-clock time and samples for one side: its
    part of the record."""
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
    """The long run's record, shipped with the package (``results/lm_comparison``)."""
    return load_record(RECORD)


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
        write_record(args.out, merged)
        return
    if args.model is None:
        parser.error("--model is required unless --merge is given")
    record = {
        **start_record("transformer_tutorial.experiments.comparison"),
        "seconds": args.seconds,
        "seed": args.seed,
        "runs": {args.model: run_one(args.model, args.seconds, seed=args.seed)},
    }
    write_record(args.out, finish_record(record))


if __name__ == "__main__":
    main()
