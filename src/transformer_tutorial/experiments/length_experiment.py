"""Chapter 18: a language model trained at a short length, read at up to eight times that length.

Chapter 17's Llama-style model is trained on windows of :data:`TRAIN_LEN` tokens cut from the
English side of Multi30k (the sentences, each ``<bos> … <eos>``, joined into one stream), then
its loss at every position is measured on validation windows 1, 2, 4 and 8 times as long:
with its rotary frequencies unchanged, with them interpolated (``"linear"``) and with YaRN, and
after a short fine-tune at the longest length.
``python -m transformer_tutorial.experiments.length_experiment --stage train`` trains the model
and keeps its weights; ``--stage extend`` measures, fine-tunes and writes the record the
chapter plots (:func:`load_length_record`). Both train with chapter 17's recipe
(:func:`~transformer_tutorial.experiments.harness.train_for`).

Shapes: windows ``(N, L)`` of token ids; losses per position ``(L,)``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer_tutorial import data
from transformer_tutorial.checks import (
    ArgumentParser,
    check_int,
    int_arg,
    number_arg,
    out_file_arg,
    read_record,
)
from transformer_tutorial.experiments.comparison import COMPARED, prepare_data
from transformer_tutorial.experiments.harness import load_record, train_for, write_record
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.rope_scaling import RopeScaling
from transformer_tutorial.multi30k import load_split
from transformer_tutorial.provenance import finish_record, start_record

TRAIN_LEN = 64  # the length the model is trained at
MULTIPLES = (1, 2, 4, 8)  # the lengths it is read at, in units of TRAIN_LEN
MAX_TOKENS = 2048  # tokens per training step
FACTOR = max(MULTIPLES)  # the scalings are set for the longest length
SCALINGS = {  # each method's rope scaling (None: the frequencies it was trained with)
    "none": None,
    "linear": RopeScaling("linear", factor=FACTOR),
    "yarn": RopeScaling("yarn", factor=FACTOR, original_max_position_embeddings=TRAIN_LEN),
}
FINE_TUNED = ("none", "yarn")  # fine-tuned at the longest length: the control, and YaRN
RECORD = "rope_scaling"  # the record: results/rope_scaling/record.json


def experiment_config(vocab_size: int, **changes) -> LMConfig:
    """Chapter 17's Llama-style sizes, with a rotary table long enough for the longest window."""
    sizes = dict(COMPARED["llama"], max_len=TRAIN_LEN * max(MULTIPLES))
    return LMConfig(vocab_size=vocab_size, **(sizes | changes))


def token_stream(sentences: Sequence[Sequence[int]], *, seed: int | None = None) -> list[int]:
    """The sentences joined into one list of ids, shuffled first when ``seed`` is given."""
    order = list(range(len(sentences)))
    if seed is not None:
        random.Random(seed).shuffle(order)
    return [token for i in order for token in sentences[i]]


def cut_windows(stream: Sequence[int], length: int) -> Tensor:
    """The stream cut into ``(N, length)`` windows, the incomplete last one dropped."""
    check_int("length", length, at_least=2)
    n = len(stream) // length
    if n == 0:
        raise ValueError(f"the stream holds {len(stream)} ids, fewer than one window of {length}")
    return torch.tensor(stream[: n * length]).view(n, length)


def loss_per_position(model: LanguageModel, windows: Tensor, *, batch_size: int = 8) -> Tensor:
    """Mean next-token loss at each position of ``windows`` ``(N, L)`` → ``(L - 1,)``: entry
    ``t`` is the loss of predicting token ``t + 1`` having read ``t + 1`` tokens."""
    model.eval()
    total = torch.zeros(windows.size(1) - 1, dtype=torch.float64)
    with torch.no_grad():
        for batch in windows.split(batch_size):
            logits = model(batch)[:, :-1]  # (b, L - 1, V)
            loss = F.cross_entropy(logits.transpose(1, 2).float(), batch[:, 1:], reduction="none")
            total += loss.sum(0).double()  # (L - 1,)
    return total / windows.size(0)


def prepare_streams(seed: int = 0) -> tuple[int, list[int], list[int]]:
    """Chapter 13's tokenizer; the training sentences shuffled into one stream; the whole
    validation split as another, in order. Returns ``(vocab_size, train, val)``."""
    tokenizer, train_ids, _ = prepare_data()
    _, val_en = load_split("val")
    val_ids = [[data.BOS_ID, *e.ids, data.EOS_ID] for e in tokenizer.encode_batch(val_en)]
    return tokenizer.get_vocab_size(), token_stream(train_ids, seed=seed), token_stream(val_ids)


def train_base(state_path: Path, seconds: float, seed: int) -> dict:
    """Train the model at :data:`TRAIN_LEN` and save its weights: the record's ``"base"``."""
    vocab_size, train, val = prepare_streams(seed)
    torch.manual_seed(seed)
    model = LanguageModel(experiment_config(vocab_size))
    result = train_for(
        model,
        cut_windows(train, TRAIN_LEN).tolist(),
        cut_windows(val, TRAIN_LEN),
        seconds=seconds,
        max_tokens=MAX_TOKENS,
        seed=seed,
    )
    state_path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), state_path)
    return {"config": experiment_config(vocab_size).__dict__, **result}


def evaluate(model: LanguageModel, val: Sequence[int]) -> dict:
    """The mean loss at each multiple of :data:`TRAIN_LEN`, and the loss per position at the
    longest: ``{"mean": {multiple: loss}, "per_position": [...]}``."""
    curves = {n: loss_per_position(model, cut_windows(val, n * TRAIN_LEN)) for n in MULTIPLES}
    return {
        "mean": {str(n): round(c.mean().item(), 4) for n, c in curves.items()},
        "per_position": [round(x, 4) for x in curves[max(MULTIPLES)].tolist()],
    }


def extend(state_path: Path, seconds: float, seed: int) -> dict:
    """Each method of :data:`SCALINGS` on the trained weights, then those of
    :data:`FINE_TUNED` fine-tuned for ``seconds`` on windows of the longest length: the
    record's ``"evaluations"`` (method → :func:`evaluate`) and ``"fine_tunes"``."""
    vocab_size, train, val = prepare_streams(seed)
    state = torch.load(state_path, weights_only=True)
    evaluations, fine_tunes = {}, {}
    for name, scaling in SCALINGS.items():
        model = LanguageModel(experiment_config(vocab_size, rope_scaling=scaling))
        model.load_state_dict(state)
        evaluations[name] = evaluate(model, val)
    longest = TRAIN_LEN * max(MULTIPLES)
    for name in FINE_TUNED:
        model = LanguageModel(experiment_config(vocab_size, rope_scaling=SCALINGS[name]))
        model.load_state_dict(state)
        torch.manual_seed(seed)
        fine_tunes[name] = train_for(
            model,
            cut_windows(train, longest).tolist(),
            cut_windows(val, longest),
            seconds=seconds,
            max_tokens=MAX_TOKENS,
            lr=1e-3,
            warmup=10,
            evaluations=3,
            seed=seed,
        )
        evaluations[f"{name}+fine-tune"] = evaluate(model, val)
    return {"evaluations": evaluations, "fine_tunes": fine_tunes}


def load_length_record() -> dict:
    """The experiment's record, shipped with the package (``results/rope_scaling``)."""
    return load_record(RECORD)


def main(argv: Sequence[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=("train", "extend"), required=True)
    parser.add_argument("--seconds", type=number_arg(low=0.0, low_open=True), default=900.0)
    parser.add_argument("--seed", type=int_arg(at_least=0), default=0)
    parser.add_argument("--state", type=Path, required=True, help="the trained weights (.pt)")
    parser.add_argument("--out", type=out_file_arg, required=True)
    args = parser.parse_args(argv)
    provenance = start_record("transformer_tutorial.experiments.length_experiment")
    command = provenance.pop("command")  # each stage keeps its command and provenance
    if args.stage == "train":
        record = {"train_command": command, "train_provenance": provenance, "seed": args.seed}
        record["base"] = train_base(args.state, args.seconds, args.seed)
    else:
        if not args.state.is_file():
            parser.error(f"argument --state: {str(args.state)!r} is not a file (train first)")
        record = read_record(parser, "--out", args.out, ("base",))  # the training stage's
        record |= {"extend_command": command, "extend_provenance": provenance}
        record["fine_tune_seconds"] = args.seconds
        record |= extend(args.state, args.seconds, args.seed)
    finish_record(provenance)
    write_record(args.out, record)


if __name__ == "__main__":
    main()
