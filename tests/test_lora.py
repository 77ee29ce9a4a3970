"""LoRA beside a frozen linear layer: merged == unmerged, and equal to peft's on a Llama."""

from __future__ import annotations

import math

import peft
import pytest
import torch
from torch import nn

from helpers import raises
from transformer_tutorial.lm.config import LLAMA, LMConfig
from transformer_tutorial.lm.hf_weights import LLAMA_NAMES, copy_to_llama, llama_config
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lora import (
    LoRALinear,
    add_lora,
    merge_lora,
    optimizer_state_bytes,
    trainable_parameters,
)

ALL = ("q_proj", "k_proj", "v_proj", "out_proj", "gate_proj", "up_proj", "down_proj")


def _llama(seed: int) -> LanguageModel:
    torch.manual_seed(seed)
    cfg = LMConfig(
        vocab_size=50,
        d_model=32,
        n_heads=4,
        n_layers=2,
        d_ff=64,
        max_len=32,
        dropout=0.0,
        n_kv_heads=2,
        **LLAMA,
    )
    return LanguageModel(cfg).eval()


@pytest.mark.parametrize(
    ("targets", "rank", "alpha", "use_rslora"),
    [
        (("q_proj", "v_proj"), 4, 8, False),
        (ALL, 8, 16, False),
        (("out_proj", "down_proj"), 1, 1, True),
        (("up_proj",), 2, 32, True),
    ],
)
def test_equals_peft_outputs_and_adapter_gradients(targets, rank, alpha, use_rslora):
    ours = _llama(rank)
    theirs = peft.get_peft_model(
        _to_llama(ours),
        peft.LoraConfig(
            r=rank,
            lora_alpha=alpha,
            lora_dropout=0.0,
            use_rslora=use_rslora,
            target_modules=[_their_leaf(t) for t in targets],
        ),
    )
    add_lora(ours, targets=targets, rank=rank, alpha=alpha, use_rslora=use_rslora)
    pairs = []
    with torch.no_grad():
        for name, mine in ours.named_modules():
            if isinstance(mine, LoRALinear):
                _, i, rest = name.split(".", 2)
                their = theirs.get_submodule(
                    f"base_model.model.model.layers.{i}.{LLAMA_NAMES[rest]}"
                )
                assert mine.scaling == their.scaling["default"]
                mine.lora_A.copy_(their.lora_A["default"].weight)
                their.lora_B["default"].weight.normal_(std=0.1)  # B = 0 would hide B's gradient
                mine.lora_B.copy_(their.lora_B["default"].weight)
                pairs += [
                    (mine.lora_A, their.lora_A["default"].weight),
                    (mine.lora_B, their.lora_B["default"].weight),
                ]
    assert len(pairs) == 2 * 2 * len(targets)
    assert trainable_parameters(ours) == trainable_parameters(theirs)
    ids = torch.randint(0, 50, (3, 12))
    logits = ours(ids)
    torch.testing.assert_close(logits, theirs(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    logits.logsumexp(-1).sum().backward()
    theirs(input_ids=ids).logits.logsumexp(-1).sum().backward()
    for mine, their in pairs:
        torch.testing.assert_close(mine.grad, their.grad, atol=1e-5, rtol=1e-5)


def _their_leaf(ours: str) -> str:
    name = LLAMA_NAMES.get(f"self_attn.{ours}") or LLAMA_NAMES[f"ff.{ours}"]
    return name.rpartition(".")[2]


def _to_llama(ours: LanguageModel):
    from transformers import LlamaForCausalLM

    theirs = LlamaForCausalLM(llama_config(ours.config)).eval()
    copy_to_llama(ours, theirs)
    return theirs


def test_starts_unchanged_and_merged_equals_unmerged():
    model = _llama(0)
    ids = torch.randint(0, 50, (2, 9))
    before = model(ids)
    add_lora(model, targets=ALL, rank=4, alpha=8)
    torch.testing.assert_close(model(ids), before, atol=0, rtol=0)  # B = 0
    bound = 1 / math.sqrt(32)  # kaiming_uniform_(a=√5) on (r, in): U(-1/√in, 1/√in)
    lora = model.layers[0].self_attn.q_proj
    assert 0.8 * bound < lora.lora_A.abs().max() <= bound and not lora.lora_B.any()
    assert trainable_parameters(model) == sum(
        m.lora_A.numel() + m.lora_B.numel() for m in model.modules() if isinstance(m, LoRALinear)
    )
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.normal_(std=0.1)
    unmerged = model(ids)
    assert (unmerged - before).abs().max() > 1e-2
    merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert all(isinstance(model.layers[i].ff.down_proj, nn.Linear) for i in range(2))
    torch.testing.assert_close(model(ids), unmerged, atol=1e-5, rtol=1e-5)


def test_unmerge_restores_the_weight_and_dropout_acts_on_the_update_only():
    torch.manual_seed(0)
    base = nn.Linear(16, 8)
    weight = base.weight.detach().clone()
    lora = LoRALinear(base, rank=2, alpha=4, dropout=0.5)
    with torch.no_grad():
        lora.lora_B.normal_()
    lora.merge()
    lora.unmerge()
    torch.testing.assert_close(base.weight, weight, atol=1e-6, rtol=0)
    x = torch.randn(4, 16)
    lora.train()
    assert not torch.equal(lora(x), lora(x))  # dropout draws differ
    lora.lora_B.data.zero_()
    torch.testing.assert_close(lora(x), base(x), atol=0, rtol=0)  # the base path has no dropout


def test_only_the_adapters_train_and_adam_keeps_two_moments_of_them():
    model = add_lora(_llama(0), targets=("q_proj", "v_proj"), rank=4, alpha=8)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    assert optimizer_state_bytes(opt) == 0
    model(torch.randint(0, 50, (2, 6))).sum().backward()
    opt.step()
    steps = sum(1 for _ in opt.state) * 4  # one float32 step count per parameter
    assert optimizer_state_bytes(opt) == 2 * 4 * trainable_parameters(model) + steps
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


def test_bad_rank_dropout_and_targets_are_refused_by_name():
    raises(
        lambda: LoRALinear(nn.Linear(4, 4), rank=0, alpha=1),
        ValueError,
        "rank must be a positive int, got 0",
    )
    raises(lambda: LoRALinear(nn.Linear(4, 4), rank=-2, alpha=1), ValueError, "rank")
    raises(
        lambda: LoRALinear(nn.Linear(4, 4), rank=2, alpha=1, dropout=1.0),
        ValueError,
        "dropout must be in [0, 1)",
    )
    raises(
        lambda: add_lora(_llama(0), targets=("c_attn",), rank=2, alpha=1),
        ValueError,
        "targets=('c_attn',) name no nn.Linear",
    )
