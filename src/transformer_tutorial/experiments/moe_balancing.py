"""Chapter 20: DeepSeek-V3's auxiliary-loss-free balancing, measured on a tiny model.

A small language model whose second layer is DeepSeek-V3's mixture of experts
(:class:`~transformer_tutorial.lm.moe.DeepSeekMoE`, :data:`CONFIG`) is trained twice from the
same weights on the same batches: once with the correction bias left at zero, once moving it
after every step (:func:`~transformer_tutorial.lm.moe.update_correction_bias`, step size
:data:`STEP_SIZE`, DeepSeek-V3's γ), and once with a step ten times larger
(:data:`STEP_SIZES`). The text is synthetic, so the run needs no corpus: a fixed random Markov
chain over :data:`VOCAB` tokens whose words are far from equally frequent (:func:`batches`).
Every :data:`EVERY` steps each run's load on a held-out batch is recorded: the tokens each
expert receives, their coefficient of variation (standard deviation / mean) and the maximal
violation ``max load / mean load - 1`` (Wang et al. 2024's MaxVio). ``python -m
transformer_tutorial.experiments.moe_balancing --out FILE`` writes the record (under a minute on
one CPU thread).

Shapes: batches ``(B, T)`` of token ids; loads ``(E,)``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from transformer_tutorial.checks import ArgumentParser, check_int, check_number, out_file_arg
from transformer_tutorial.experiments.harness import load_record, write_record
from transformer_tutorial.lm.config import LLAMA, LMConfig
from transformer_tutorial.lm.model import LanguageModel, next_token_loss
from transformer_tutorial.lm.moe import update_correction_bias
from transformer_tutorial.provenance import finish_record, start_record

VOCAB = 64
# Two layers, the first dense (first_k_dense_replace = 1), the second 8 routed experts of which
# each token runs 2, in 2 groups of which it may use 1, plus one shared expert.
CONFIG = dict(
    LLAMA,
    vocab_size=VOCAB,
    d_model=32,
    n_heads=4,
    n_layers=2,
    d_ff=64,
    max_len=32,
    dropout=0.0,
    n_experts=8,
    n_experts_per_token=2,
    moe_d_ff=16,
    norm_topk_prob=True,
    dense_layers=(0,),
    router="sigmoid",
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
)
STEPS = 400
EVERY = 20  # steps between two measurements of the load
STEP_SIZE = 0.001  # γ: DeepSeek-V3's for its first 14.3 T tokens
# The runs: without the update, with it, and with a step 10 times larger.
STEP_SIZES = {"without": 0.0, "with": STEP_SIZE, "ten_times": 10 * STEP_SIZE}
BATCH = (16, 32)  # (B, T)
RECORD = "moe_balancing"  # the record: results/moe_balancing/record.json


def batches(seed: int, *, batch: tuple[int, int] = BATCH) -> Iterator[torch.Tensor]:
    """Endless batches ``(B, T)`` of a fixed Markov chain (the same for every seed): each
    token's next-token distribution is a random, peaked softmax, and the first token of each row
    follows a Zipf law, so that some tokens are far more frequent than others. ``seed`` draws
    the rows."""
    chain = torch.Generator().manual_seed(1234)
    next_token = torch.softmax(3.0 * torch.randn(VOCAB, VOCAB, generator=chain), dim=-1)
    first = 1.0 / torch.arange(1, VOCAB + 1)  # Zipf: frequency ∝ 1 / rank
    g = torch.Generator().manual_seed(seed)
    B, T = batch
    while True:
        ids = torch.empty(B, T, dtype=torch.long)
        ids[:, 0] = torch.multinomial(first, B, replacement=True, generator=g)
        for t in range(1, T):
            ids[:, t] = torch.multinomial(next_token[ids[:, t - 1]], 1, generator=g)[:, 0]
        yield ids


def expert_loads(model: LanguageModel, ids: torch.Tensor) -> list[torch.Tensor]:
    """The tokens each of ``model``'s DeepSeek mixtures sends to each expert for ``ids``,
    chosen as the model chooses them (correction bias included): one ``(E,)`` a mixture."""
    _, routers = model.forward_with_router_logits(ids)
    mixtures = [layer.ff for layer in model.layers if layer.sparse]
    return [
        torch.bincount(moe.route(logits.detach())[1].flatten(), minlength=logits.size(-1))
        for moe, logits in zip(mixtures, routers, strict=True)
    ]


def imbalance(load: torch.Tensor) -> dict:
    """A load ``(E,)`` as the record keeps it: the counts, their coefficient of variation and
    the maximal violation ``max / mean - 1``."""
    counts = load.double()
    return {
        "counts": load.tolist(),
        "cv": round(float(counts.std(correction=0) / counts.mean()), 4),
        "max_violation": round(float(counts.max() / counts.mean() - 1), 4),
    }


def train(
    step_size: float,
    *,
    steps: int = STEPS,
    every: int = EVERY,
    lr: float = 3e-3,
    seed: int = 0,
) -> dict:
    """Train a model of :data:`CONFIG` for ``steps`` steps of AdamW on :func:`batches`, moving
    each mixture's correction bias by ``step_size`` after each step (0: never). The same
    ``seed`` gives the same initial weights and batches whatever ``step_size``.

    Returns ``{"step_size", "steps", "train_loss": [mean loss of each block of ``every``
    steps], "load": [{"step", "counts", "cv", "max_violation"} on the held-out batch, every
    ``every`` steps from 0], "bias": the final correction bias}``.
    """
    check_number("step_size", step_size, low=0.0)
    check_int("steps", steps, at_least=1)
    check_int("every", every, at_least=1)
    torch.manual_seed(seed)
    model = LanguageModel(LMConfig(**CONFIG))
    held_out = next(batches(seed + 1, batch=(64, BATCH[1])))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    mixtures = [layer.ff for layer in model.layers if layer.sparse]
    losses, block, loads, stream = [], [], [], batches(seed)
    for step in range(steps + 1):
        if step % every == 0:
            with torch.no_grad():
                loads.append({"step": step, **imbalance(expert_loads(model, held_out)[0])})
            if block:
                losses.append(round(sum(block) / len(block), 4))
                block = []
        if step == steps:
            break
        ids = next(stream)
        logits, routers = model.forward_with_router_logits(ids)
        loss = next_token_loss(logits, ids)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        block.append(loss.item())
        for moe, router_logits in zip(mixtures, routers, strict=True):
            chosen = moe.route(router_logits.detach())[1]  # (N, k)
            counts = torch.bincount(chosen.flatten(), minlength=moe.experts.n_experts)
            update_correction_bias(moe.correction_bias, counts, step_size)
    bias = [round(b, 4) for b in mixtures[0].correction_bias.tolist()]
    return dict(step_size=step_size, steps=steps, train_loss=losses, load=loads, bias=bias)


def run(*, steps: int = STEPS) -> dict:
    """The runs of :data:`STEP_SIZES`, from the same weights on the same batches: the record's
    ``"runs"``."""
    return {name: train(step_size, steps=steps) for name, step_size in STEP_SIZES.items()}


def load_balancing_record() -> dict:
    """The record, shipped with the package (``results/moe_balancing``)."""
    return load_record(RECORD)


def main(argv: Sequence[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=out_file_arg, required=True)
    args = parser.parse_args(argv)
    record = start_record("transformer_tutorial.experiments.moe_balancing")
    start = time.process_time()
    record |= {"config": CONFIG, "step_sizes": STEP_SIZES, "batch": list(BATCH)}
    record["runs"] = run()
    record["cpu_seconds"] = round(time.process_time() - start, 1)
    write_record(args.out, finish_record(record))


if __name__ == "__main__":
    main()
