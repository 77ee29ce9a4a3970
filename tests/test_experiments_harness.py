"""experiments.harness: the shared training loop computes exactly what the two loops it
replaces computed (chapter 17's ``comparison.train_for`` and chapter 20's
``moe_comparison.train_for_cpu``), so their committed records stay its records."""

from __future__ import annotations

import itertools
import time

import torch

from transformer_tutorial import data
from transformer_tutorial.experiments import harness
from transformer_tutorial.lm import comparison, moe_comparison
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.moe import load_balancing_loss

V = 40


def sentences(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        start = torch.randint(4, 20, (1,), generator=g).item()
        rows.append([data.BOS_ID, *range(start, start + 6), data.EOS_ID])
    return rows


def tick_clocks(monkeypatch):
    """Both clocks advance by one second a call: a step then takes exactly one second."""
    for name in ("perf_counter", "process_time"):
        monkeypatch.setattr(time, name, itertools.count().__next__)


def model(**moe):
    torch.manual_seed(0)
    sizes = dict(vocab_size=V, d_model=16, n_heads=2, n_layers=2, d_ff=32, max_len=16)
    return LanguageModel(LMConfig(**sizes, **moe))


MOE = dict(
    activation="swiglu",
    bias=False,
    n_experts=4,
    n_experts_per_token=2,
    moe_d_ff=16,
    router_aux_loss_coef=0.01,
)


def with_aux(m, batch):
    logits, routers = m.forward_with_router_logits(batch)
    if not routers:
        return logits, None
    k = m.config.n_experts_per_token
    return logits, load_balancing_loss(routers, k, padding_mask=batch == data.PAD_ID)


def test_against_comparison_train_for(monkeypatch):
    train, val = sentences(64), data.pad_batch(sentences(8, seed=1))
    for budget in (dict(seconds=7.0), dict(seconds=100.0, max_steps=5)):
        tick_clocks(monkeypatch)
        old = comparison.train_for(
            model(), train, val, evaluations=3, max_tokens=96, warmup=2, **budget
        )
        tick_clocks(monkeypatch)
        new = harness.train_for(
            model(), train, val, evaluations=3, max_tokens=96, warmup=2, **budget
        )
        print(budget, old)
        for key in ("steps", "tokens", "train_seconds", "val", "train"):
            assert new[key] == old[key], key


def test_against_moe_comparison_train_for_cpu(monkeypatch):
    train, val = sentences(64), data.pad_batch(sentences(8, seed=1))
    for moe in (MOE, dict(activation="swiglu", bias=False)):
        tick_clocks(monkeypatch)
        old = moe_comparison.train_for_cpu(
            model(**moe), train, val, cpu_seconds=6.0, evaluations=3, max_tokens=96, warmup=2
        )
        tick_clocks(monkeypatch)
        new = harness.train_for(
            model(**moe),
            train,
            val,
            seconds=6.0,
            clock="cpu",
            evaluations=3,
            max_tokens=96,
            warmup=2,
            aux_loss=with_aux,
            aux_weight=0.01,
        )
        print(moe, old)
        assert new["train_seconds"] == old["wall_seconds"]
        for key in ("steps", "tokens", "cpu_seconds", "val", "train", "aux"):
            assert new[key] == old[key], key
