"""Chapter 20: chapter 17's Llama-style model against a mixture of experts with the same
active weights, trained for the same CPU time on the English side of Multi30k.

:data:`COMPARED` holds the two configurations. ``"dense"`` is chapter 17's Llama-style side;
``"moe"`` keeps its sizes and replaces each feed-forward layer by 8 SwiGLU experts of half the
width, 2 per token, so that a token runs the same feed-forward weights (plus the router's
D × E). :func:`train_for_cpu` trains one with chapter 17's recipe for a budget of the process's
CPU seconds (validation not counted), adding the load-balancing loss for the mixture, and
records the validation loss and the tokens each expert receives before and after.
``python -m transformer_tutorial.lm.moe_comparison`` runs one side and writes its record;
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

from transformer_tutorial import data
from transformer_tutorial.checks import (
    ArgumentParser,
    check_int,
    check_number,
    number_arg,
    out_file_arg,
    read_record,
)
from transformer_tutorial.lm.comparison import COMPARED as LM_COMPARED
from transformer_tutorial.lm.comparison import prepare_data, samples, validation_loss
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.model import LanguageModel, next_token_loss
from transformer_tutorial.lm.moe import MixtureOfExperts, load_balancing_loss, tokens_per_expert
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
RECORD_FILE = "moe_comparison_run.json"  # the long run's record, shipped with the package


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
        experts = getattr(layer.ff, "experts", None)
        if experts is not None:
            per_expert = sum(p[0].numel() for p in experts.parameters())
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
    mixtures = [layer.ff for layer in model.layers if isinstance(layer.ff, MixtureOfExperts)]
    k = model.config.n_experts_per_token
    return tokens_per_expert(routers, k, padding_mask=pad, layers=mixtures).tolist()


def train_for_cpu(
    model: LanguageModel,
    train_ids: Sequence[Sequence[int]],
    val_batch: torch.Tensor,
    *,
    cpu_seconds: float,
    evaluations: int = 10,
    max_tokens: int = 1024,
    lr: float = 3e-3,
    warmup: int = 30,
    seed: int = 0,
) -> dict:
    """Chapter 17's recipe (``lm.comparison.train_for``) for ``cpu_seconds`` of this process's
    CPU time over the training steps, plus ``router_aux_loss_coef`` × the load-balancing loss
    (padding excluded) where the model has experts.

    Returns ``{"steps", "tokens", "cpu_seconds", "wall_seconds", "val": [[cpu seconds, step,
    loss], ...], "train": [mean next-token loss of each block of steps], "aux": [mean
    load-balancing loss of each block]}``.
    """
    check_number("cpu_seconds", cpu_seconds, low=0.0, low_open=True)
    check_int("evaluations", evaluations, at_least=1)
    if model.config.router != "softmax":
        raise ValueError(
            f"router={model.config.router!r}: the load-balancing loss is the softmax router's "
            "(Qwen3-MoE); DeepSeek-V3's sigmoid router balances by its correction bias "
            "(lm.moe_balancing)"
        )
    torch.manual_seed(seed)
    c = model.config
    lengths = [len(s) for s in train_ids]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    history = {"val": [[0.0, 0, validation_loss(model, val_batch)]], "train": [], "aux": []}
    step = tokens = 0
    used, wall, block, aux_block = 0.0, 0.0, [], []
    batches: list = []
    model.train()
    while used < cpu_seconds:
        if not batches:  # a new epoch of length-bucketed batches
            g = torch.Generator().manual_seed(seed + step)
            batches = list(data.token_batches(lengths, max_tokens, generator=g))
        start, wall_start = time.process_time(), time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup) * max(0.1, 1 - used / cpu_seconds)
        batch = data.pad_batch([train_ids[i] for i in batches.pop()])
        logits, routers = model.forward_with_router_logits(batch)
        loss = next_token_loss(logits, batch, ignore_index=data.PAD_ID)
        total = loss
        if routers:
            aux = load_balancing_loss(
                routers, c.n_experts_per_token, padding_mask=batch == data.PAD_ID
            )
            total = loss + c.router_aux_loss_coef * aux
            aux_block.append(aux.item())
        optimizer.zero_grad()
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        used += time.process_time() - start
        wall += time.perf_counter() - wall_start
        step, tokens = step + 1, tokens + int((batch != data.PAD_ID).sum())
        block.append(loss.item())
        if used >= cpu_seconds * min(1.0, len(history["val"]) / evaluations):
            history["val"].append([round(used, 2), step, validation_loss(model, val_batch)])
            history["train"].append(sum(block) / len(block))
            history["aux"].append(sum(aux_block) / len(aux_block) if aux_block else None)
            block, aux_block = [], []
    model.eval()
    return dict(steps=step, tokens=tokens, cpu_seconds=used, wall_seconds=wall, **history)


def run_one(name: str, cpu_seconds: float, *, seed: int = 0) -> dict:
    """Data, model, :func:`train_for_cpu` and samples for one side: its part of the record."""
    tokenizer, train_ids, val_batch = prepare_data()
    torch.manual_seed(seed)
    model = LanguageModel(comparison_config(name, tokenizer.get_vocab_size()))
    sparse = model.config.n_experts > 0
    load_before = expert_load(model, val_batch) if sparse else None
    result = train_for_cpu(model, train_ids, val_batch, cpu_seconds=cpu_seconds, seed=seed)
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
    """The long run's record shipped with the package (see ``results/moe_comparison``)."""
    text = resources.files("transformer_tutorial").joinpath(RECORD_FILE).read_text()
    return json.loads(text)


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
        args.out.write_text(json.dumps(merged, indent=1) + "\n")
        return
    if args.model is None:
        parser.error("--model is required unless --merge is given")
    record = {
        **start_record("transformer_tutorial.lm.moe_comparison"),
        "cpu_seconds": args.cpu_seconds,
        "runs": {args.model: run_one(args.model, args.cpu_seconds)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(finish_record(record), indent=1) + "\n")


if __name__ == "__main__":
    main()
