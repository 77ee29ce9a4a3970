"""Chapter 20: chapter 17's Llama-style model against a mixture of experts with the same
active weights, trained for the same CPU time on the English side of Multi30k.

:data:`COMPARED` holds the two configurations. ``"dense"`` is chapter 17's Llama-style side;
``"moe"`` keeps its sizes and replaces each feed-forward layer by 8 SwiGLU experts of half the
width, 2 per token, so that a token runs the same feed-forward weights (plus the router's
D × E). :func:`run_one` trains one with chapter 17's recipe
(:func:`~transformer_tutorial.experiments.harness.train_for`) for a budget of the process's CPU
seconds (validation not counted), adding the load-balancing loss for the mixture
(:func:`balancing_loss`), and records the validation loss and the tokens each expert receives
before and after. ``python -m transformer_tutorial.experiments.moe_comparison`` runs one side
and writes its record; ``--merge`` joins records into one file.

Shapes: sentences are lists of ids ``<bos> … <eos>``; batches ``(B, T)`` padded at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from transformer_tutorial import data
from transformer_tutorial.checks import ArgumentParser, number_arg, out_file_arg, read_record
from transformer_tutorial.experiments.comparison import COMPARED as LM_COMPARED
from transformer_tutorial.experiments.comparison import prepare_data, samples
from transformer_tutorial.experiments.harness import load_record, train_for, write_record
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.moe import load_balancing_loss, tokens_per_expert
from transformer_tutorial.lm.registry import ROUTERS
from transformer_tutorial.provenance import finish_record, start_record

DENSE = LM_COMPARED["llama"]  # chapter 17's Llama-style side: d_ff = 304
COMPARED = {
    "dense": DENSE,
    "moe": dict(
        DENSE,
        n_experts=8,
        n_experts_per_token=2,
        moe_d_ff=DENSE["d_ff"] // 2,  # 2 experts of 152 = one dense layer of 304
        norm_topk_prob=True,
        router_aux_loss_coef=0.01,  # the Switch Transformer's
    ),
}
RECORD = "moe_comparison"  # the long run's record: results/moe_comparison/record.json


def comparison_config(name: str, vocab_size: int) -> LMConfig:
    """The config of one side of the comparison, ``"dense"`` or ``"moe"``."""
    if name not in COMPARED:
        raise ValueError(f"name must be one of {sorted(COMPARED)}, got {name!r}")
    return LMConfig(vocab_size=vocab_size, **COMPARED[name])


def active_parameters(model: LanguageModel) -> int:
    """The weights one token runs through: every weight, less the experts not chosen (each
    sparse layer runs ``k`` of its ``E`` experts)."""
    c = model.config
    idle = 0
    for layer in model.layers:
        if layer.sparse:
            per_expert = sum(p[0].numel() for p in layer.ff.experts.parameters())
            idle += (c.n_experts - c.n_experts_per_token) * per_expert
    return model.num_parameters() - idle


def expert_load(model: LanguageModel, batch: torch.Tensor) -> list[list[int]]:
    """Tokens per expert ``(L, E)`` of ``batch`` in eval mode, padding not counted; each
    mixture chooses as it routes (a ``router="sigmoid"`` one with its correction bias)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        _, routers = model.forward_with_router_logits(batch)
    model.train(was_training)
    pad = batch == data.PAD_ID
    mixtures = [layer.ff for layer in model.layers if layer.sparse]
    k = model.config.n_experts_per_token
    return tokens_per_expert(routers, k, padding_mask=pad, layers=mixtures).tolist()


def balancing_loss(
    model: LanguageModel, batch: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The training loop's ``aux_loss`` (:data:`~.harness.AuxLoss`): the logits, and the
    load-balancing loss of the model's mixtures, padding excluded (None for a dense model); the
    loop weights it by ``router_aux_loss_coef``."""
    if not ROUTERS[model.config.router].balanced_by_loss:
        raise ValueError(
            f"router={model.config.router!r}: the load-balancing loss is the softmax router's "
            "(Qwen3-MoE); DeepSeek-V3's sigmoid router balances by its correction bias "
            "(experiments.moe_balancing)"
        )
    logits, routers = model.forward_with_router_logits(batch)
    if not routers:
        return logits, None
    k = model.config.n_experts_per_token
    return logits, load_balancing_loss(routers, k, padding_mask=batch == data.PAD_ID)


def run_one(name: str, cpu_seconds: float, *, seed: int = 0) -> dict:
    """Data, model, training for ``cpu_seconds`` of CPU time with :func:`balancing_loss`, and
    samples for one side: its part of the record."""
    tokenizer, train_ids, val_batch = prepare_data()
    torch.manual_seed(seed)
    model = LanguageModel(comparison_config(name, tokenizer.get_vocab_size()))
    sparse = model.config.n_experts > 0
    load_before = expert_load(model, val_batch) if sparse else None
    result = train_for(
        model,
        train_ids,
        val_batch,
        seconds=cpu_seconds,
        clock="cpu",
        seed=seed,
        aux_loss=balancing_loss,
        aux_weight=model.config.router_aux_loss_coef,
    )
    return {
        "config": COMPARED[name],
        "parameters": model.num_parameters(),
        "active_parameters": active_parameters(model),
        **result,
        "load_before": load_before,
        "load_after": expert_load(model, val_batch) if sparse else None,
        "samples": samples(model, tokenizer),
    }


def load_comparison_record() -> dict:
    """The long run's record, shipped with the package (``results/moe_comparison``)."""
    return load_record(RECORD)


def main(argv: Sequence[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(COMPARED))
    parser.add_argument("--cpu-seconds", type=number_arg(low=0.0, low_open=True), default=420.0)
    parser.add_argument("--out", type=out_file_arg, required=True)
    parser.add_argument("--merge", type=Path, nargs="+", help="records to join into --out")
    args = parser.parse_args(argv)
    if args.merge:
        keys = ("command", "hardware", "runs")
        runs = [read_record(parser, "--merge", p, keys) for p in args.merge]
        merged = {k: v for k, v in runs[0].items() if k not in ("runs", "command", "hardware")}
        merged["commands"] = [run["command"] for run in runs]  # one process per model
        merged["hardware"] = [run["hardware"] for run in runs]
        merged["runs"] = {k: v for run in runs for k, v in run["runs"].items()}
        write_record(args.out, merged)
        return
    if args.model is None:
        parser.error("--model is required unless --merge is given")
    record = {
        **start_record("transformer_tutorial.experiments.moe_comparison"),
        "cpu_seconds": args.cpu_seconds,
        "runs": {args.model: run_one(args.model, args.cpu_seconds)},
    }
    write_record(args.out, finish_record(record))


if __name__ == "__main__":
    main()
