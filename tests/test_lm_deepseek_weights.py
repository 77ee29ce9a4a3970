"""deepseek_weights: a dense ``DeepseekV3ForCausalLM``'s weights copied into ours (and ours
into theirs) give the same logits for a left-padded batch of max_len (3x YaRN's original
length) and the same greedy tokens as generate() through our cache of latents, plain and
left-padded, in float32 in eval mode, for test_latent_attention's configs (q_lora_rank set and
unset, both rotary layouts, YaRN, tied embeddings); every weight there and back exactly; their
configs we cannot map refused by name. The same for DeepSeek-V3 with its mixture of experts
after first_k_dense_replace dense layers (1 or 2 of 3; groups, shared experts, scaling, random
correction biases): logits, cached greedy == generate(), every weight and bias there and back,
the configs both ways (bf16: the block, in test_lm_moe.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from helpers import lm_config, raises, randomized, refused_unchanged
from test_lm_latent_attention import CONFIGS, T, config, count_forms, left_padded
from transformer_tutorial.lm.config import LLAMA, LMConfig
from transformer_tutorial.lm.deepseek_weights import (
    DEEPSEEK_MATCHING,
    DEEPSEEK_MOE_MATCHING,
    copy_block_to_deepseek_v3,
    copy_from_deepseek_v3,
    copy_to_deepseek_v3,
    deepseek_v3_config,
    lm_config_from_deepseek_v3,
)
from transformer_tutorial.lm.hf_weights import check_same_settings, llama_config
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.moe import DeepSeekMoE, MixtureOfExperts
from transformer_tutorial.lm.sampling import generate
from transformer_tutorial.lora import add_lora
from transformer_tutorial.quantization import quantize_linears

RTOL = 1e-5
# Logits after three layers: their attention written out (eager) and their RMSNorm in float32,
# ours F.sdpa: up to ~2e-5 on logits up to ~10; a weight misplaced or a layout swapped: ~1.
LOGITS_ATOL = 1e-4


def theirs(ours: LMConfig, seed: int | None = None) -> DeepseekV3ForCausalLM:
    hf_config = deepseek_v3_config(ours)
    hf_config._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(hf_config).eval()
    return model if seed is None else randomized(model, seed)


@pytest.mark.parametrize("name", CONFIGS)
def test_copy_from_deepseek_v3_gives_their_logits(name):
    """A left-padded batch of max_len (24 = 3x YaRN's original length): every real position."""
    ours_config = config(**CONFIGS[name])
    ref = theirs(ours_config, seed=0)
    ours = LanguageModel(ours_config).eval()
    copy_from_deepseek_v3(ours, ref)
    ids, padding = left_padded()
    with torch.no_grad():
        expected = ref(ids, attention_mask=(~padding).long()).logits
        logits = ours(ids, padding_mask=padding)
    real = ~padding
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(logits[real], expected[real], atol=LOGITS_ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["q-lora-interleaved", "q-direct-yarn-tied"])
def test_copy_to_deepseek_v3_gives_our_logits_and_back_every_weight(name):
    ours = randomized(LanguageModel(config(**CONFIGS[name])), 1)
    ref, back = theirs(ours.config), LanguageModel(ours.config)
    copy_to_deepseek_v3(ours, ref)
    ids = left_padded(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).logits, ours(ids), atol=LOGITS_ATOL, rtol=RTOL)
    copy_from_deepseek_v3(back, ref)
    mine, again = ours.state_dict(), back.state_dict()
    assert mine.keys() == again.keys() and all(torch.equal(mine[k], again[k]) for k in mine)
    assert len(mine) == len(ref.state_dict())  # every weight of theirs has a pair


@pytest.mark.parametrize("name", ["q-lora-interleaved", "q-direct-yarn-tied"])
def test_greedy_generation_with_our_cache_equals_their_generate(name):
    """16 new tokens after a prompt of 8; one-by-one through our cache of latents."""
    ours_config = config(**CONFIGS[name])
    ref = theirs(ours_config, seed=4)
    ours = LanguageModel(ours_config).eval()
    copy_from_deepseek_v3(ours, ref)
    prompt = left_padded(4)[0][:, :8]
    expected = ref.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=T - 8,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert torch.equal(generate(ours, prompt, T - 8, greedy=True), expected)


def test_left_padded_cached_greedy_equals_their_generate(monkeypatch):
    """Our steps after the prompt in the absorbed form (test_latent_attention)."""
    ours_config = config()
    ref = theirs(ours_config, seed=5)
    ours = LanguageModel(ours_config).eval()
    copy_from_deepseek_v3(ours, ref)
    ids, padding = left_padded(5)
    prompt, padding = ids[:, :12], padding[:, :12]
    expected = ref.generate(
        prompt,
        attention_mask=(~padding).long(),
        max_new_tokens=T - 12,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    tokens, cache, new = prompt, None, prompt
    forms = count_forms(monkeypatch)
    with torch.no_grad():
        while tokens.size(1) < T:
            logits, cache = ours.step(new, cache, padding_mask=padding)
            new = logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, new], dim=1)
            padding = torch.cat([padding, torch.zeros_like(new, dtype=torch.bool)], dim=1)
    assert torch.equal(tokens, expected)
    steps = [form for form, _, _ in forms]  # the prompt, then T - 13 tokens: one a step
    assert steps == ["unabsorbed"] * 3 + ["absorbed"] * 3 * (T - 13)  # 3 layers


def test_their_configs_we_cannot_map_are_refused_by_name():
    hf = deepseek_v3_config(config())
    assert lm_config_from_deepseek_v3(hf) == config()
    for key, value, phrase in (
        ("first_k_dense_replace", None, "first_k_dense_replace must be an int >= 0"),
        ("num_key_value_heads", 2, "num_key_value_heads=2 must equal"),
        ("qk_head_dim", 15, "qk_head_dim=15 must be qk_nope_head_dim + qk_rope_head_dim"),
        ("attention_bias", True, "attention_bias=True"),
    ):
        wrong = deepseek_v3_config(config())
        setattr(wrong, key, value)
        raises(lambda wrong=wrong: lm_config_from_deepseek_v3(wrong), ValueError, phrase)
    ref = theirs(config(rope_interleave=False))
    raises(
        lambda: copy_from_deepseek_v3(LanguageModel(config()), ref), ValueError, "rope_interleave"
    )


@pytest.mark.parametrize("name", CONFIGS)
def test_configs_map_both_ways(name):
    """Their max_position_embeddings is our max_len, except where YaRN reaches further:
    ``factor × original_max_position_embeddings`` (4 × 8 = 32 here, past our 24)."""
    ours = config(**CONFIGS[name])
    theirs_config = deepseek_v3_config(ours)
    assert lm_config_from_deepseek_v3(theirs_config, max_len=ours.max_len) == ours
    back = lm_config_from_deepseek_v3(theirs_config)
    assert back.max_len == (32 if ours.rope_scaling else ours.max_len)
    if ours.rope_scaling:  # 32 positions: past their max_position_embeddings, their logits
        ref = theirs(ours, seed=6)
        longer = LanguageModel(back).eval()
        copy_from_deepseek_v3(longer, ref)
        g = torch.Generator().manual_seed(6)
        ids = torch.randint(0, ours.vocab_size, (2, 32), generator=g)
        with torch.no_grad():
            expected = ref(ids).logits
            # YaRN's mscale grows the scores: test_lm_hf_weights' relative 1e-4 (SCALED_RTOL);
            # 6 seeds under 3 MKL code paths used at most 12 % of the tolerance.
            torch.testing.assert_close(longer(ids), expected, atol=LOGITS_ATOL, rtol=1e-4)


# Mixtures after first_k_dense_replace dense layers: (changes to config(), dense layers).
MIXED = {
    "1-dense-2-of-4-groups": dict(
        n_experts=8,
        n_experts_per_token=3,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        dense_layers=(0,),
    ),
    "2-dense-one-group-unnormed": dict(
        n_experts=6,
        n_experts_per_token=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        dense_layers=(0, 1),
    ),
}


def mixed(name: str) -> LMConfig:
    return config(**MIXED[name], router="sigmoid", moe_d_ff=12)


def with_biases(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every correction bias (theirs e_score_correction_bias, ours correction_bias) random."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=g))
    return model


@pytest.mark.parametrize("name", MIXED)
def test_a_mixed_deepseek_v3_gives_their_logits(name):
    """Dense layers first, then DeepSeek's mixtures with random correction biases: every
    real position of a left-padded batch."""
    ours_config = mixed(name)
    ref = with_biases(theirs(ours_config, seed=10), 10)
    assert type(ref.model.layers[-1].mlp).__name__ == "DeepseekV3MoE"
    ours = LanguageModel(ours_config).eval()
    copy_from_deepseek_v3(ours, ref)
    assert isinstance(ours.layers[-1].ff, DeepSeekMoE)
    ids, padding = left_padded(10)
    with torch.no_grad():
        expected = ref(ids, attention_mask=(~padding).long()).logits
        logits = ours(ids, padding_mask=padding)
    real = ~padding
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(logits[real], expected[real], atol=LOGITS_ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", MIXED)
def test_a_mixed_model_copied_there_and_back_keeps_every_weight_and_bias(name):
    ours = with_biases(randomized(LanguageModel(mixed(name)), 11), 11)
    ref, back = theirs(ours.config), LanguageModel(ours.config)
    copy_to_deepseek_v3(ours, ref)
    ids = left_padded(11)[0]
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).logits, ours(ids), atol=LOGITS_ATOL, rtol=RTOL)
    copy_from_deepseek_v3(back, ref)
    mine, again = ours.state_dict(), back.state_dict()
    assert mine.keys() == again.keys() and all(torch.equal(mine[k], again[k]) for k in mine)
    # every weight and bias of theirs has a pair; their gate_up_proj is our two, a mixture
    mixtures = ours.config.n_layers - len(ours.config.dense_layers)
    assert len(mine) == len(ref.state_dict()) + mixtures


@pytest.mark.parametrize("name", MIXED)
def test_mixed_greedy_generation_with_our_cache_equals_their_generate(name):
    ours_config = mixed(name)
    ref = with_biases(theirs(ours_config, seed=12), 12)
    ours = LanguageModel(ours_config).eval()
    copy_from_deepseek_v3(ours, ref)
    prompt = left_padded(12)[0][:, :8]
    expected = ref.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=T - 8,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert torch.equal(generate(ours, prompt, T - 8, greedy=True), expected)


@pytest.mark.parametrize("name", MIXED)
def test_mixed_configs_map_both_ways(name):
    ours = mixed(name)
    theirs_config = deepseek_v3_config(ours)
    assert theirs_config.first_k_dense_replace == len(ours.dense_layers)
    assert lm_config_from_deepseek_v3(theirs_config, max_len=ours.max_len) == ours


def test_mixtures_deepseek_has_no_equivalent_of_are_refused_by_name():
    base = MIXED["1-dense-2-of-4-groups"] | dict(moe_d_ff=12)
    for changes, phrase in (
        (
            dict(
                router="softmax",
                n_group=1,
                topk_group=1,
                n_shared_experts=0,
                routed_scaling_factor=1.0,
            ),
            "router='sigmoid'",
        ),
        (dict(router="sigmoid", dense_layers=(1,)), "dense_layers=(0,)"),
        (dict(router="sigmoid", sparse_step=2), "sparse_step=1"),
    ):
        raises(lambda c=changes: deepseek_v3_config(config(**(base | c))), ValueError, phrase)
    wrong = deepseek_v3_config(mixed("1-dense-2-of-4-groups"))
    wrong.n_group = 3
    raises(lambda: lm_config_from_deepseek_v3(wrong), ValueError, "n_group=3 must divide")
    ref = theirs(mixed("2-dense-one-group-unnormed"))
    other = config(
        **(MIXED["2-dense-one-group-unnormed"] | dict(routed_scaling_factor=2.5)),
        router="sigmoid",
        moe_d_ff=12,
    )
    raises(
        lambda: copy_from_deepseek_v3(LanguageModel(other), ref),
        ValueError,
        "routed_scaling_factor: ours 2.5, theirs 1.5",
    )


def test_deepseek_v3s_published_sizes_map_both_ways():
    """DeepseekV3Config's defaults are DeepSeek-V3's: 256 routed experts in 8 groups, 4 groups
    kept, 8 chosen, one shared, the first 3 layers dense; no model built."""
    published = DeepseekV3Config()
    ours = lm_config_from_deepseek_v3(published)
    groups = (ours.n_experts, ours.n_group, ours.topk_group, ours.n_experts_per_token)
    assert groups == (256, 8, 4, 8)
    assert ours.dense_layers == (0, 1, 2) and ours.router == "sigmoid"
    assert (ours.moe_d_ff, ours.d_ff, ours.routed_scaling_factor) == (2048, 18432, 2.5)
    check_same_settings(
        deepseek_v3_config(ours), published, DEEPSEEK_MATCHING + DEEPSEEK_MOE_MATCHING
    )


# --- API probes (issue 42): each bad copy refused by name, both models left as they were -----


def resized_head(model: LanguageModel) -> LanguageModel:
    model.lm_head = torch.nn.Linear(model.config.d_model, model.config.vocab_size + 10, bias=False)
    return model


DEEPSEEK_PROBES = {  # name: (ours, theirs, copy, error, phrase)
    "ours a dict": (
        dict,
        lambda: theirs(config()),
        copy_from_deepseek_v3,
        TypeError,
        "ours must be a LanguageModel, got dict",
    ),
    "a Llama for a DeepSeek-V3": (
        lambda: LanguageModel(config()),
        lambda: LlamaForCausalLM(llama_config(lm_config(**LLAMA))),
        copy_to_deepseek_v3,
        TypeError,
        "theirs must be a DeepseekV3ForCausalLM, got LlamaForCausalLM",
    ),
    "ours with LoRA layers (from)": (
        lambda: add_lora(LanguageModel(config()), targets=("kv_a_proj",), rank=2, alpha=4.0),
        lambda: theirs(config(), seed=0),
        copy_from_deepseek_v3,
        ValueError,
        "ours holds LoRA layers (layers.0.self_attn.kv_a_proj)",
    ),
    "ours quantized (to)": (
        lambda: quantize_linears(LanguageModel(config()), bits=8),
        lambda: theirs(config(), seed=0),
        copy_to_deepseek_v3,
        ValueError,
        "ours is quantized",
    ),
    "ours' output layer resized (to)": (
        lambda: resized_head(LanguageModel(config())),
        lambda: theirs(config(), seed=0),
        copy_to_deepseek_v3,
        ValueError,
        "lm_head.weight: shapes differ",
    ),
}


@pytest.mark.parametrize(
    ("ours", "theirs", "copy", "error", "phrase"),
    DEEPSEEK_PROBES.values(),
    ids=DEEPSEEK_PROBES.keys(),
)
def test_a_refused_copy_names_what_differs_and_leaves_both_models_as_they_were(
    ours, theirs, copy, error, phrase
):
    ours, theirs = ours(), theirs()
    models = [m for m in (ours, theirs) if isinstance(m, torch.nn.Module)]
    refused_unchanged(lambda: copy(ours, theirs), error, phrase, *models)


def test_blocks_and_configs_of_another_kind_are_refused_by_name():
    block = DeepseekV3MoE(DeepseekV3Config(hidden_size=16, moe_intermediate_size=12))
    raises(
        lambda: copy_block_to_deepseek_v3(MixtureOfExperts(16, 12, 8, 2), block),
        TypeError,
        "ours must be a DeepSeekMoE, got MixtureOfExperts",
    )
    raises(
        lambda: lm_config_from_deepseek_v3(LlamaConfig()),
        TypeError,
        "config must be a DeepseekV3Config, got LlamaConfig",
    )
    raises(lambda: deepseek_v3_config({}), TypeError, "config must be an LMConfig, got dict")
