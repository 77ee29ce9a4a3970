"""LoRA beside a frozen linear layer: merged == unmerged, and equal to peft's on a Llama."""

from __future__ import annotations

import copy
import math

import peft
import pytest
import torch
from torch import nn

from helpers import raises
from transformer_tutorial import lora
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
    pairs = _share_adapters(ours, theirs)
    assert len(pairs) == 2 * 2 * len(targets)
    assert trainable_parameters(ours) == trainable_parameters(theirs)
    ids = torch.randint(0, 50, (3, 12))
    logits = ours(ids)
    torch.testing.assert_close(logits, theirs(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    logits.logsumexp(-1).sum().backward()
    theirs(input_ids=ids).logits.logsumexp(-1).sum().backward()
    for mine, their in pairs:
        torch.testing.assert_close(mine.grad, their.grad, atol=1e-5, rtol=1e-5)


def _share_adapters(ours: LanguageModel, theirs) -> list:
    """peft's A, and a random B (B = 0 would hide B's gradient), copied into ours; returns the
    pairs (ours, theirs) of adapter weights, A then B for each layer."""
    pairs = []
    with torch.no_grad():
        for name, mine in ours.named_modules():
            if isinstance(mine, LoRALinear):
                their = theirs.get_submodule(_their_path(name))
                assert mine.scaling == their.scaling["default"]
                mine.lora_A.copy_(their.lora_A["default"].weight)
                their.lora_B["default"].weight.normal_(std=0.1)
                mine.lora_B.copy_(their.lora_B["default"].weight)
                pairs += [
                    (mine.lora_A, their.lora_A["default"].weight),
                    (mine.lora_B, their.lora_B["default"].weight),
                ]
    return pairs


def _their_path(ours: str) -> str:
    """Our layer's name (``layers.0.self_attn.q_proj``) → peft's module path."""
    _, i, rest = ours.split(".", 2)
    return f"base_model.model.model.layers.{i}.{LLAMA_NAMES[rest]}"


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


# Ours on a bf16 base may be at most this many times further from float64 than peft's on the
# same base (both err by bf16's rounding, about 4e-3 for the logits): measured at most 1.03 for
# the logits, 1.16 for the adapters' gradients, 1.01 merged, over 12 seeds and 3 float orders.
WITHIN_PEFT = 1.5


def test_on_a_bf16_base_the_adapters_are_float32_and_equal_peft_within_bf16s_error():
    """As peft's ``autocast_adapter_dtype=True``: float32 adapters on a bf16 Llama, the update
    summed in float32 and rounded once. Logits, adapter gradients and merged logits are as
    close to a float64 copy of peft's model as peft's own, in bf16."""
    targets, rank, alpha = ("q_proj", "v_proj", "down_proj"), 4, 8
    ours = _llama(0)
    theirs = _to_llama(ours).to(torch.bfloat16)
    ours.to(torch.bfloat16)
    theirs = peft.get_peft_model(
        theirs,
        peft.LoraConfig(
            r=rank,
            lora_alpha=alpha,
            lora_dropout=0.0,
            target_modules=[_their_leaf(t) for t in targets],
        ),
    )
    add_lora(ours, targets=targets, rank=rank, alpha=alpha)
    pairs = _share_adapters(ours, theirs)
    for mine, their in pairs:
        assert mine.dtype == their.dtype == torch.float32
    assert ours.layers[0].self_attn.q_proj.base.weight.dtype == torch.bfloat16
    exact = copy.deepcopy(theirs).double()
    ids = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(0))
    logits = {
        "ours": ours(ids),
        "theirs": theirs(input_ids=ids).logits,
        "exact": exact(input_ids=ids).logits,
    }
    assert logits["ours"].dtype == torch.bfloat16
    grads = {}
    for kind, out in logits.items():
        out.double().logsumexp(-1).sum().backward()
        model = ours if kind == "ours" else theirs if kind == "theirs" else exact
        grads[kind] = torch.cat([g.double().flatten() for g in _adapter_grads(ours, model)])
    with torch.no_grad():
        merged = {"ours": merge_lora(ours)(ids), "theirs": theirs.merge_and_unload()(ids).logits}
    assert ours.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    for name, values in (("logits", logits), ("gradients", grads), ("merged", merged)):
        exact_values = (logits if name == "merged" else values)["exact"].double()
        mine, their = (
            ((values[k].double() - exact_values).norm() / exact_values.norm()).item()
            for k in ("ours", "theirs")
        )
        assert mine <= WITHIN_PEFT * their, (name, mine, their)


def _adapter_grads(ours: LanguageModel, model) -> list:
    """The gradients of A and B of each of our LoRA layers, in ``model`` (ours, or peft's)."""
    grads = []
    for name, mine in ours.named_modules():
        if isinstance(mine, LoRALinear):
            layer = mine if model is ours else model.get_submodule(_their_path(name))
            for key in ("lora_A", "lora_B"):
                weight = getattr(layer, key)
                grads.append(weight.grad if model is ours else weight["default"].weight.grad)
    return grads


def test_a_training_step_moves_float32_adapters_where_bf16_ones_would_stay():
    """One AdamW step of 1e-4 (a usual LoRA learning rate) moves every entry of A by about
    1e-4. A's entries are uniform in ±1/√256 = ±0.0625, and above 1/32 bf16's step is 2.4e-4:
    adapters in bf16 (as this module made them) round half of the updates away."""
    torch.manual_seed(0)
    lora = LoRALinear(nn.Linear(256, 64).to(torch.bfloat16), rank=4, alpha=8)
    with torch.no_grad():
        lora.lora_B.normal_(std=0.1)  # B = 0 would give A no gradient
    in_bf16 = copy.deepcopy(lora)
    in_bf16.lora_A = nn.Parameter(in_bf16.lora_A.detach().bfloat16())
    in_bf16.lora_B = nn.Parameter(in_bf16.lora_B.detach().bfloat16())
    x = torch.randn(16, 256).bfloat16()
    moved = []
    for m in (lora, in_bf16):
        before = m.lora_A.detach().clone()
        optimizer = torch.optim.AdamW([m.lora_A, m.lora_B], lr=1e-4, weight_decay=0.0)
        m(x).float().square().mean().backward()
        optimizer.step()
        moved.append((m.lora_A != before).float().mean().item())
    # bf16 moves 48-53 % of the entries over 5 seeds
    assert moved[0] == 1.0 and moved[1] < 0.75, moved
    assert lora.lora_A.dtype == lora.lora_A.grad.dtype == torch.float32


def test_bad_rank_dropout_and_targets_are_refused_by_name():
    raises(
        lambda: LoRALinear(nn.Linear(4, 4), rank=0, alpha=1),
        ValueError,
        "rank must be at least 1, got 0",
    )
    raises(lambda: LoRALinear(nn.Linear(4, 4), rank=-2, alpha=1), ValueError, "rank")
    raises(
        lambda: LoRALinear(nn.Linear(4, 4), rank=2, alpha=1, dropout=1.0),
        ValueError,
        "dropout must be in [0.0, 1.0), got 1.0",
    )
    raises(
        lambda: add_lora(_llama(0), targets=("c_attn",), rank=2, alpha=1),
        ValueError,
        "targets=('c_attn',) name no nn.Linear",
    )


# --- API probes (issue 42): each bad call, and what its error must say ------------------------

LORA_PROBES = {
    "infinite alpha": (
        lambda: LoRALinear(nn.Linear(4, 4), rank=2, alpha=math.inf),
        ValueError,
        "alpha must be a finite number, got inf",
    ),
    "NaN alpha": (
        lambda: LoRALinear(nn.Linear(4, 4), rank=2, alpha=math.nan),
        ValueError,
        "alpha must be a finite number, got nan",
    ),
    "alpha -inf": (
        lambda: LoRALinear(nn.Linear(4, 4), rank=2, alpha=-math.inf),
        ValueError,
        "alpha must be a finite number, got -inf",
    ),
    "alpha a bool": (
        lambda: LoRALinear(nn.Linear(4, 4), rank=2, alpha=True),
        TypeError,
        "alpha must be a number, got True (bool)",
    ),
    "alpha a str": (
        lambda: LoRALinear(nn.Linear(4, 4), rank=2, alpha="1"),
        TypeError,
        "alpha must be a number, got '1' (str)",
    ),
    "dropout a str": (
        lambda: LoRALinear(nn.Linear(4, 4), rank=2, alpha=1, dropout="0"),
        TypeError,
        "dropout must be a number, got '0' (str)",
    ),
    "a convolution": (
        lambda: LoRALinear(nn.Conv1d(4, 4, 1), rank=2, alpha=1),
        TypeError,
        "base must be an nn.Linear, got Conv1d",
    ),
    "use_rslora an int": (
        lambda: LoRALinear(nn.Linear(4, 4), rank=2, alpha=1, use_rslora=1),
        TypeError,
        "use_rslora must be True or False, got 1",
    ),
    "targets one str": (
        lambda: add_lora(_llama(0), targets="q_proj", rank=2, alpha=1),
        TypeError,
        "targets must be a tuple of layer names such as ('q_proj', 'v_proj'), got 'q_proj'",
    ),
    "model an int": (
        lambda: add_lora(3, targets=("q_proj",), rank=2, alpha=1),
        TypeError,
        "model must be an nn.Module, got int",
    ),
    "merge an int": (lambda: merge_lora(3), TypeError, "model must be an nn.Module, got int"),
    "count an int": (
        lambda: trainable_parameters(3),
        TypeError,
        "model must be an nn.Module, got int",
    ),
    "optimizer None": (
        lambda: optimizer_state_bytes(None),
        TypeError,
        "optimizer must be a torch.optim.Optimizer, got NoneType",
    ),
}


@pytest.mark.parametrize(("call", "error", "phrase"), LORA_PROBES.values(), ids=LORA_PROBES.keys())
def test_bad_calls_name_the_argument_and_what_is_valid(call, error, phrase):
    raises(call, error, phrase)


def _trainable_and_layers(model: nn.Module) -> tuple[list[bool], list[type]]:
    return [p.requires_grad for p in model.parameters()], [type(m) for m in model.modules()]


def test_a_refused_add_lora_leaves_the_model_as_it_was(monkeypatch):
    model = _llama(0)
    before = _trainable_and_layers(model)
    raises(lambda: add_lora(model, targets=ALL, rank=2, alpha=math.inf), ValueError, "alpha")
    raises(lambda: add_lora(model, targets=ALL, rank=0, alpha=1), ValueError, "rank")
    assert _trainable_and_layers(model) == before
    # a layer that fails partway: the layers already wrapped are put back, the weights thawed
    built = []

    class FailsThird(LoRALinear):
        def __init__(self, base, **kwargs):
            if len(built) == 2:
                raise RuntimeError("out of memory")
            built.append(base)
            super().__init__(base, **kwargs)

    monkeypatch.setattr(lora, "LoRALinear", FailsThird)
    raises(lambda: add_lora(model, targets=ALL, rank=2, alpha=1), RuntimeError, "out of memory")
    assert len(built) == 2 and _trainable_and_layers(model) == before
