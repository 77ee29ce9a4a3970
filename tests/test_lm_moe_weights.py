"""moe_weights: Qwen3-MoE's weights copied into ours (and ours into theirs) give the same
logits, router logits, load-balancing loss and training loss, for a right-padded batch and an
input of max_len, and the same greedy tokens as generate(), in float32 in eval mode; configs
mix dense and sparse layers (decoder_sparse_step, mlp_only_layers), top-k from 1 to E,
norm_topk_prob both ways. Every weight is drawn at random first (norms around 1). Tolerances:
1e-5, and 1e-4 for the logits (attention in other orders; see LOGITS_ATOL)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeForCausalLM

from helpers import lm_config, raises, randomized, refused_unchanged, to_device
from transformer_tutorial.lm.config import QWEN3, LMConfig
from transformer_tutorial.lm.hf_weights import qwen3_config
from transformer_tutorial.lm.model import LanguageModel, next_token_loss
from transformer_tutorial.lm.moe import MixtureOfExperts, load_balancing_loss
from transformer_tutorial.lm.moe_weights import (
    copy_block_to_qwen3_moe,
    copy_from_qwen3_moe,
    copy_to_qwen3_moe,
    lm_config_from_qwen3_moe,
    qwen3_moe_config,
)
from transformer_tutorial.lm.rope_scaling import RopeScaling
from transformer_tutorial.lm.sampling import generate
from transformer_tutorial.lora import add_lora

V, B, T = 50, 3, 24
ATOL = RTOL = 1e-5  # float32
# Logits after three layers: their attention written out (eager), ours F.sdpa, summed in other
# orders: up to 2.1e-5 over 8 seeds × 5 configs (logits up to ~10); a weight misplaced: ~1.
LOGITS_ATOL = 1e-4
CONFIGS = {  # name: changes to config()
    "all-sparse": {},
    "every-2nd": dict(sparse_step=2, norm_topk_prob=False),
    "mlp-only-0": dict(dense_layers=(0,), n_experts=3, n_experts_per_token=3),
    "top-1-tied": dict(n_experts=6, n_experts_per_token=1, tie_embeddings=True),
    "mlp-only-2-top-3-of-8": dict(
        sparse_step=1, dense_layers=(2,), n_experts=8, n_experts_per_token=3
    ),
}


def config(**changes) -> LMConfig:
    """Qwen3's choices, 2 key/value heads, 4 experts of width 24 (2 per token, renormalised)
    in every layer, 3 layers, 24 positions, no dropout."""
    moe = dict(n_experts=4, n_experts_per_token=2, moe_d_ff=24, norm_topk_prob=True)
    base = dict(QWEN3) | dict(n_kv_heads=2, dropout=0.0, max_len=T, tie_embeddings=False)
    return lm_config(**(base | moe | changes))


def theirs(ours: LMConfig, seed: int | None = None) -> Qwen3MoeForCausalLM:
    hf_config = qwen3_moe_config(ours)
    hf_config._attn_implementation = "eager"
    model = Qwen3MoeForCausalLM(hf_config).eval()
    return model if seed is None else randomized(model, seed)


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids (B, T) and their padding (True): row 0 padded after 10 tokens, row 1 after 17."""
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))
    padding = torch.zeros(B, T, dtype=torch.bool)
    padding[0, 10:], padding[1, 17:] = True, True
    return ids, padding


@pytest.mark.parametrize("name", CONFIGS)
def test_copy_from_qwen3_moe_gives_their_logits_router_logits_and_losses(name, device):
    """Right-padded rows and a full row of max_len: logits and router logits at every real
    position; their aux_loss (output_router_logits, attention_mask) and their training loss
    (labels, router_aux_loss_coef)."""
    ours_config = config(**CONFIGS[name])
    ref = theirs(ours_config, seed=0)
    ours = LanguageModel(ours_config).eval()
    copy_from_qwen3_moe(ours, ref)
    ids, padding = batch()
    labels = ids.masked_fill(padding, -100)
    ours, ref, ids, padding, labels = to_device((ours, ref, ids, padding, labels), device)
    with torch.no_grad():
        out = ref(ids, attention_mask=(~padding).long(), labels=labels, output_router_logits=True)
        logits, routers = ours.forward_with_router_logits(ids)
    real = ~padding
    assert out.logits.abs().max() > 1.0
    torch.testing.assert_close(logits[real], out.logits[real], atol=LOGITS_ATOL, rtol=RTOL)
    sparse = [i for i in range(ours_config.n_layers) if ours_config.is_sparse(i)]
    assert len(routers) == len(out.router_logits) == len(sparse)
    for mine, their in zip(routers, out.router_logits, strict=True):
        torch.testing.assert_close(mine[real.flatten()], their[real.flatten()], atol=ATOL, rtol=0)
    k = ours_config.n_experts_per_token
    aux = load_balancing_loss(routers, k, padding_mask=padding)
    torch.testing.assert_close(aux, out.aux_loss, atol=ATOL, rtol=RTOL)
    loss = next_token_loss(logits, labels, ignore_index=-100)
    total = loss + ours_config.router_aux_loss_coef * aux
    torch.testing.assert_close(total, out.loss, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["all-sparse", "every-2nd"])
def test_copy_to_qwen3_moe_gives_our_logits(name, device):
    ours = randomized(LanguageModel(config(**CONFIGS[name])), 1)
    ref = theirs(ours.config)
    copy_to_qwen3_moe(ours, ref)
    ours, ref, ids = to_device((ours, ref, batch(1)[0]), device)
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).logits, ours(ids), atol=LOGITS_ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["every-2nd", "top-1-tied"])
def test_copied_there_and_back_gives_every_weight_exactly(name):
    ours = randomized(LanguageModel(config(**CONFIGS[name])), 2)
    ref, back = theirs(ours.config), LanguageModel(ours.config)
    copy_to_qwen3_moe(ours, ref)
    copy_from_qwen3_moe(back, ref)
    mine, again = ours.state_dict(), back.state_dict()
    assert mine.keys() == again.keys() and all(torch.equal(mine[k], again[k]) for k in mine)
    # every weight of theirs has a pair: their gate_up_proj is our gate_proj and up_proj
    n_sparse = sum(ours.config.is_sparse(i) for i in range(ours.config.n_layers))
    assert len(mine) == len(ref.state_dict()) + n_sparse


@pytest.mark.parametrize("name", ["all-sparse", "every-2nd", "top-1-tied"])
def test_greedy_generation_with_our_cache_equals_their_generate(name):
    """21 new tokens after a prompt of 3, one token at a time through the router."""
    ours_config = config(**CONFIGS[name])
    ref = theirs(ours_config, seed=4)
    ours = LanguageModel(ours_config).eval()
    copy_from_qwen3_moe(ours, ref)
    prompt = batch(4)[0][:, :3]
    expected = ref.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=T - 3,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert torch.equal(generate(ours, prompt, T - 3, greedy=True), expected)


@pytest.mark.parametrize("name", CONFIGS)
def test_configs_map_both_ways(name):
    ours = config(**CONFIGS[name])
    hf = qwen3_moe_config(ours)
    assert lm_config_from_qwen3_moe(hf) == ours
    layers = [type(m.mlp).__name__ for m in Qwen3MoeForCausalLM(hf).model.layers]
    expected = [
        "Qwen3MoeSparseMoeBlock" if ours.is_sparse(i) else "Qwen3MoeMLP" for i in (0, 1, 2)
    ]
    assert layers == expected


def test_yarn_reads_past_max_position_embeddings():
    """YaRN from 8 positions, factor 4, with max_position_embeddings 24 (as Qwen3's model card
    leaves it below the reach): ours reads 32 positions, giving their logits there."""
    yarn = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=8)
    hf = qwen3_moe_config(config(rope_scaling=yarn))
    hf._attn_implementation = "eager"
    assert hf.max_position_embeddings == T
    ours_config = lm_config_from_qwen3_moe(hf)
    assert ours_config.max_len == 32
    assert lm_config_from_qwen3_moe(hf, max_len=T).max_len == T
    ref = randomized(Qwen3MoeForCausalLM(hf).eval(), 9)
    ours = LanguageModel(ours_config).eval()
    copy_from_qwen3_moe(ours, ref)
    ids = torch.randint(0, V, (B, 32), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        # YaRN's attention factor (1.14) scales the scores: hf_weights' relative 1e-4
        # (SCALED_RTOL); 6 seeds under 3 MKL code paths used at most 8 % of the tolerance.
        torch.testing.assert_close(ours(ids), ref(ids).logits, atol=LOGITS_ATOL, rtol=1e-4)


def test_models_that_differ_are_refused_naming_the_setting():
    ours = LanguageModel(config())
    other = theirs(config(n_experts_per_token=1))
    raises(lambda: copy_from_qwen3_moe(ours, other), ValueError, "num_experts_per_tok")
    raises(lambda: qwen3_moe_config(config(qk_norm=False)), ValueError, "qk_norm=True")
    deepseek_router = config(router="sigmoid", n_shared_experts=1)  # DeepSeek-V3's, not Qwen's
    raises(lambda: qwen3_moe_config(deepseek_router), ValueError, "router='softmax'")
    raises(
        lambda: copy_to_qwen3_moe(ours, torch.nn.Linear(2, 2)), TypeError, "Qwen3MoeForCausalLM"
    )


# --- API probes (issue 42): each bad copy refused by name, both models left as they were -----


def block_pair(top_k: int = 2, norm: bool = True, d_ff: int = 24, n_experts: int = 4):
    ours = MixtureOfExperts(32, d_ff, n_experts, top_k, norm_topk_prob=norm)
    return ours, theirs(config(), seed=0).model.layers[0].mlp


def ours_moe(**changes) -> LanguageModel:
    return LanguageModel(config(**changes))


def resized_head(model: LanguageModel) -> LanguageModel:
    model.lm_head = torch.nn.Linear(model.config.d_model, V + 10, bias=False)
    return model


MOE_WEIGHT_PROBES = {  # name: (ours, theirs, copy, error, phrase)
    "ours a dict": (
        dict,
        lambda: theirs(config()),
        copy_from_qwen3_moe,
        TypeError,
        "ours must be a LanguageModel, got dict",
    ),
    "a Qwen3 for a Qwen3-MoE": (
        ours_moe,
        lambda: Qwen3ForCausalLM(qwen3_config(lm_config(**QWEN3))),
        copy_to_qwen3_moe,
        TypeError,
        "theirs must be a Qwen3MoeForCausalLM, got Qwen3ForCausalLM",
    ),
    "ours with LoRA layers (from)": (
        lambda: add_lora(ours_moe(), targets=("v_proj",), rank=2, alpha=4.0),
        lambda: theirs(config(), seed=0),
        copy_from_qwen3_moe,
        ValueError,
        "ours holds LoRA layers (layers.0.self_attn.v_proj)",
    ),
    "ours' output layer resized (from)": (
        lambda: resized_head(ours_moe()),
        lambda: theirs(config(), seed=0),
        copy_from_qwen3_moe,
        ValueError,
        "lm_head.weight: shapes differ, (60, 32) vs (50, 32)",
    ),
    "other experts": (
        ours_moe,
        lambda: theirs(config(n_experts=8), seed=0),
        copy_from_qwen3_moe,
        ValueError,
        "the two models differ in num_experts: ours 4, theirs 8",
    ),
}


@pytest.mark.parametrize(
    ("ours", "theirs", "copy", "error", "phrase"),
    MOE_WEIGHT_PROBES.values(),
    ids=MOE_WEIGHT_PROBES.keys(),
)
def test_a_refused_copy_names_what_differs_and_leaves_both_models_as_they_were(
    ours, theirs, copy, error, phrase
):
    ours, theirs = ours(), theirs()
    models = [m for m in (ours, theirs) if isinstance(m, torch.nn.Module)]
    refused_unchanged(lambda: copy(ours, theirs), error, phrase, *models)


BLOCK_PROBES = {  # name: (changes to our block, error, phrase)
    "another top_k": (
        dict(top_k=1),
        ValueError,
        "differ in num_experts_per_tok: ours 1, theirs 2",
    ),
    "norm_topk_prob off": (
        dict(norm=False),
        ValueError,
        "norm_topk_prob: ours False, theirs True",
    ),
    "another expert width": (dict(d_ff=12), ValueError, "experts.gate_up_proj: shapes differ"),
}


@pytest.mark.parametrize(
    ("changes", "error", "phrase"), BLOCK_PROBES.values(), ids=BLOCK_PROBES.keys()
)
def test_a_refused_block_copy_names_what_differs_and_changes_nothing(changes, error, phrase):
    """A block of another k or renormalisation gave other outputs without a word; one of
    another width had its router copied before the experts were refused."""
    ours, block = block_pair(**changes)
    refused_unchanged(lambda: copy_block_to_qwen3_moe(ours, block), error, phrase, ours, block)


def test_a_block_of_another_kind_is_refused_by_name():
    _, block = block_pair()
    raises(
        lambda: copy_block_to_qwen3_moe(torch.nn.Linear(2, 2), block),
        TypeError,
        "ours must be a MixtureOfExperts, got Linear",
    )
    raises(
        lambda: lm_config_from_qwen3_moe(Qwen3Config()),
        TypeError,
        "config must be a Qwen3MoeConfig, got Qwen3Config",
    )
