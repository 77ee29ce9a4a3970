"""Chapter 23: a target and a small draft language model trained side by side on the English
side of Multi30k, then speculative decoding measured with them.

:data:`COMPARED` holds the two configurations: the target, a Llama-style model twice
chapter 17's in width and depth, and the draft, chapter 17's Llama-style model itself. Both are
trained with chapter 17's recipe (:func:`~transformer_tutorial.experiments.harness.train_for`)
for a budget of wall-clock seconds; ``python -m
transformer_tutorial.experiments.speculative_comparison --model {target,draft}`` trains one and
saves its weights, ``--measure`` loads both and times greedy decoding with and without the
draft, writing the record the chapter reads.

Shapes: sentences are lists of ids ``<bos> … <eos>``; prompts ``(1, T0)``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch

from transformer_tutorial import data
from transformer_tutorial.checks import (
    ArgumentParser,
    int_arg,
    number_arg,
    out_file_arg,
    read_record,
)
from transformer_tutorial.experiments.comparison import COMPARED as LM_COMPARED
from transformer_tutorial.experiments.comparison import prepare_data
from transformer_tutorial.experiments.harness import load_record, train_for, write_record
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.sampling import generate
from transformer_tutorial.lm.speculative import speculative_generate
from transformer_tutorial.provenance import finish_record, start_record

DRAFT = LM_COMPARED["llama"]  # chapter 17's Llama-style model: D 96, 2 layers
COMPARED = {
    "draft": DRAFT,
    "target": dict(DRAFT, d_model=192, n_heads=6, n_kv_heads=2, n_layers=4, d_ff=512),
}
KS = (2, 4, 6)  # draft tokens a round, measured
MODULE = "transformer_tutorial.experiments.speculative_comparison"
RECORD = "speculative"  # the run's record: results/speculative/record.json


def comparison_config(name: str, vocab_size: int) -> LMConfig:
    """The config of ``"target"`` or ``"draft"``."""
    if name not in COMPARED:
        raise ValueError(f"name must be one of {sorted(COMPARED)}, got {name!r}")
    return LMConfig(vocab_size=vocab_size, **COMPARED[name])


def train_one(name: str, seconds: float, weights: Path, *, seed: int = 0) -> dict:
    """Train one side for ``seconds`` and save its weights to ``weights``: its record."""
    tokenizer, train_ids, val_batch = prepare_data()
    torch.manual_seed(seed)
    model = LanguageModel(comparison_config(name, tokenizer.get_vocab_size()))
    result = train_for(model, train_ids, val_batch, seconds=seconds, seed=seed)
    torch.save(model.state_dict(), weights)
    return {"config": COMPARED[name], "parameters": model.num_parameters(), **result}


def measure(
    folder: Path, *, prompts: int = 30, max_new_tokens: int = 40, repeats: int = 3
) -> dict:
    """Greedy decoding of the first ``prompts`` validation sentences' first word by the target
    alone and with the draft (k = 2, 4, 6), each ``repeats`` times in turn, the fastest kept:
    the tokens (checked equal), the acceptance rate and the speed-up."""
    tokenizer, _, val_batch = prepare_data()
    models = {}
    for name in COMPARED:
        models[name] = LanguageModel(comparison_config(name, tokenizer.get_vocab_size())).eval()
        models[name].load_state_dict(torch.load(folder / f"{name}.pt", weights_only=True))
    target, draft = models["target"], models["draft"]
    starts = [val_batch[i : i + 1, :2] for i in range(prompts)]  # <bos> and the first subword
    eos = dict(eos_id=data.EOS_ID)

    def alone() -> list[list[int]]:
        return [
            generate(target, s, max_new_tokens, greedy=True, **eos)[0].tolist() for s in starts
        ]

    def with_draft(k: int) -> list:
        return [
            speculative_generate(target, draft, s, max_new_tokens, k=k, greedy=True, **eos)
            for s in starts
        ]

    runs: dict[str, list[float]] = {}
    results: dict = {}
    for _ in range(repeats):
        for key, call in [("alone", alone)] + [(f"k={k}", partial(with_draft, k)) for k in KS]:
            start = time.perf_counter()
            results[key] = call()
            runs.setdefault(key, []).append(time.perf_counter() - start)
    want = results["alone"]
    record = {"seconds_alone": min(runs["alone"]), "tokens": sum(len(r) - 2 for r in want)}
    for k in KS:
        outs = results[f"k={k}"]
        if [o.ids[0].tolist() for o in outs] != want:
            raise AssertionError(f"k={k}: speculative decoding changed the greedy tokens")
        proposed, accepted = sum(o.proposed for o in outs), sum(o.accepted for o in outs)
        record[f"k={k}"] = {
            "acceptance_rate": accepted / proposed,
            "target_calls": sum(o.target_calls for o in outs),
            "seconds": min(runs[f"k={k}"]),
            "speed_up": min(runs["alone"]) / min(runs[f"k={k}"]),
        }
    return record


def load_comparison_record() -> dict:
    """The run's record, shipped with the package (``results/speculative``)."""
    return load_record(RECORD)


def main(argv: Sequence[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(COMPARED))
    parser.add_argument("--seconds", type=number_arg(low=0.0, low_open=True), default=200.0)
    parser.add_argument("--seed", type=int_arg(at_least=0), default=0)
    parser.add_argument("--out", type=out_file_arg, required=True)
    parser.add_argument("--measure", type=Path, help="folder of the two runs: measure, merge")
    args = parser.parse_args(argv)
    if args.measure:
        runs = {
            n: read_record(parser, "--measure", args.measure / f"{n}.json", ("command", "run"))
            for n in COMPARED
        }
        missing = [n for n in COMPARED if not (args.measure / f"{n}.pt").is_file()]
        if missing:
            parser.error(f"argument --measure: {str(args.measure)!r} lacks {missing} .pt weights")
        provenance = start_record(MODULE)
        record = {
            "commands": [run["command"] for run in runs.values()],
            "runs": {n: run["run"] for n, run in runs.items()},
            "measure_command": provenance.pop("command"),
            **provenance,
        }
        record["decoding"] = measure(args.measure)
        write_record(args.out, finish_record(record))
        return
    if args.model is None:
        parser.error("--model is required unless --measure is given")
    record = start_record(MODULE)
    weights = args.out.with_suffix(".pt")
    start = time.perf_counter()
    record["run"] = train_one(args.model, args.seconds, weights, seed=args.seed)
    record["wall_seconds"] = time.perf_counter() - start
    write_record(args.out, finish_record(record))


if __name__ == "__main__":
    main()
