"""hf_weights: Llama's and Qwen3's weights copied into ours (and ours into theirs) make the two
compute the same logits and greedy tokens (also past a sliding window, and for a left-padded
batch), in float32 in eval mode; settings with no equivalent are refused with the field to
change. Every weight is drawn at random first (norms' gains around 1): their own
initialisation sets the norms to 1, which would hide a norm copied to the wrong place."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import (
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from helpers import lm_config as config
from helpers import raises, randomized, refused_unchanged, to_device
from transformer_tutorial.lm.config import LLAMA, QWEN3, LMConfig
from transformer_tutorial.lm.hf_weights import (
    copy_from_llama,
    copy_from_qwen3,
    copy_to_llama,
    copy_to_qwen3,
    llama_config,
    lm_config_from_llama,
    qwen3_config,
)
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.rope_scaling import RopeScaling
from transformer_tutorial.lm.sampling import generate
from transformer_tutorial.lora import add_lora
from transformer_tutorial.quantization import quantize_linears

V, B, T = 50, 3, 16  # helpers.lm_config's vocabulary and positions
ATOL = RTOL = 1e-5  # float32


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# float32: their attention written out (eager) or sdpa, ours F.sdpa, in other orders; logits of
# size ~5 differed by up to 2.3e-5 over 24 seeds and configurations (tables of rotary cos/sin
# copied from theirs: 1.5e-5, so not the angles).
MODERN_ATOL = 1e-4
# Past the trained length, with YaRN's attention factor (1.3 here) scaling cos and sin, the
# scores and logits grow, and so does float32's rounding: worst over 3 seeds and 3 MKL code paths
# (`make portable`'s), 1.1e-4 at a logit of 2.7 (8.5e-5 on this CPU's own path). A relative
# 1e-4 leaves 3x; an unscaled model misses their logits by over 1e-2.
SCALED_RTOL = 1e-4
HF = {  # model: (our choices, config function, their class, copy from, copy to)
    "llama": (LLAMA, llama_config, LlamaForCausalLM, copy_from_llama, copy_to_llama),
    "qwen3": (QWEN3, qwen3_config, Qwen3ForCausalLM, copy_from_qwen3, copy_to_qwen3),
}


def modern(kind: str, **changes) -> LMConfig:
    """Grouped-query attention (2 key/value heads for 4 query heads), no dropout."""
    return config(**(dict(HF[kind][0]) | dict(n_kv_heads=2, dropout=0.0) | changes))


def theirs(kind: str, ours: LMConfig, seed: int | None = None, attn: str = "eager"):
    """Their model of our config, every weight drawn at random (norms around 1) when seeded."""
    _, make_config, cls, _, _ = HF[kind]
    hf_config = make_config(ours)
    hf_config._attn_implementation = attn  # "eager": attention written out, the mask passed in
    model = cls(hf_config).eval()
    return model if seed is None else randomized(model, seed)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", HF)
def test_copy_from_llama_and_qwen3_gives_their_logits(kind, attn, tie, device):
    ours_config = modern(kind, tie_embeddings=tie)
    ref = theirs(kind, ours_config, seed=0, attn=attn)
    ours = LanguageModel(ours_config).eval()
    HF[kind][3](ours, ref)
    ours, ref, x = to_device((ours, ref, ids()), device)
    with torch.no_grad():
        expected = ref(x).logits
        got = ours(x)
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(got, expected, atol=MODERN_ATOL, rtol=RTOL)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("kind", HF)
def test_copy_to_llama_and_qwen3_gives_our_logits(kind, tie, device):
    ours = randomized(LanguageModel(modern(kind, tie_embeddings=tie)), 1)
    ref = theirs(kind, ours.config)
    HF[kind][4](ours, ref)
    ours, ref, x = to_device((ours, ref, ids(1)), device)
    with torch.no_grad():
        torch.testing.assert_close(ref(x).logits, ours(x), atol=MODERN_ATOL, rtol=RTOL)


@pytest.mark.parametrize("kind", HF)
def test_llama_and_qwen3_copied_there_and_back_give_every_weight_exactly(kind):
    ours = randomized(LanguageModel(modern(kind, tie_embeddings=False)), 2)
    ref, back = theirs(kind, ours.config), LanguageModel(ours.config)
    HF[kind][4](ours, ref)
    HF[kind][3](back, ref)
    mine, again = ours.state_dict(), back.state_dict()
    assert mine.keys() == again.keys() and all(torch.equal(mine[k], again[k]) for k in mine)
    assert len(mine) == len(ref.state_dict())  # every weight of theirs has a pair


@pytest.mark.parametrize(
    ("kind", "changes"),
    [("llama", {}), ("llama", {"n_kv_heads": 1}), ("qwen3", {}), ("qwen3", {"window": 5})],
    ids=["llama-gqa", "llama-mqa", "qwen3", "qwen3-window-5"],
)
def test_greedy_generation_with_our_cache_equals_their_generate(kind, changes):
    """13 new tokens after a prompt of 3: past the window of 5 where there is one."""
    ref = theirs(kind, modern(kind, **changes), seed=4)
    ours = LanguageModel(modern(kind, **changes)).eval()
    HF[kind][3](ours, ref)
    prompt = ids(4)[:, :3]
    expected = ref.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=T - 3,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert torch.equal(generate(ours, prompt, T - 3, greedy=True), expected)


def test_a_prompt_longer_than_the_window_decodes_as_their_generate():
    """A prompt of 8 under a window of 4: the prompt itself is cut by the window. Their model
    builds the window's mask and cache itself; without the window its tokens differ, so the
    window is in force on their side too."""
    config = modern("qwen3", window=4)
    ref = theirs("qwen3", config, seed=8)
    ours = LanguageModel(config).eval()
    copy_from_qwen3(ours, ref)
    prompt = ids(8)[:, :8]
    kwargs = dict(max_new_tokens=T - 8, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = ref.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    assert torch.equal(generate(ours, prompt, T - 8, greedy=True), expected)
    unwindowed = theirs("qwen3", modern("qwen3"), seed=8)  # the same weights
    assert not torch.equal(unwindowed.generate(prompt, **kwargs), expected)


def greedy_left_padded(model: LanguageModel, prompt, padding_mask, n: int) -> torch.Tensor:
    """Greedy decoding of a left-padded batch with our cache: the mask grows with each token."""
    logits, cache = model.step(prompt, padding_mask=padding_mask)
    ids_so_far = prompt
    for _ in range(n):
        token = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        ids_so_far = torch.cat([ids_so_far, token], dim=1)
        padding_mask = torch.cat([padding_mask, torch.zeros_like(token, dtype=torch.bool)], 1)
        logits, cache = model.step(token, cache, padding_mask=padding_mask)
    return ids_so_far


@pytest.mark.parametrize(
    ("kind", "changes"),
    [("llama", {}), ("qwen3", {}), ("qwen3", {"window": 4})],
    ids=["llama", "qwen3", "qwen3-window-4"],
)
def test_a_left_padded_batch_decodes_as_their_generate_with_an_attention_mask(kind, changes):
    """Rows of 6, 4 and 2 real tokens padded on the left: our padding mask (positions counted
    from each row's first real token) gives the tokens of generate() with attention_mask, also
    under a window the longest prompt exceeds."""
    ref = theirs(kind, modern(kind, **changes), seed=5)
    ours = LanguageModel(modern(kind, **changes)).eval()
    HF[kind][3](ours, ref)
    prompt = ids(5)[:, :6]
    padding = torch.arange(6) < torch.tensor([[0], [2], [4]])  # (B, 6), True at padding
    prompt = prompt.masked_fill(padding, 0)
    expected = ref.generate(
        prompt,
        attention_mask=(~padding).long(),
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert torch.equal(greedy_left_padded(ours, prompt, padding, 8), expected)
    alone = generate(ours, prompt[2:, 4:], 8, greedy=True)  # the last row without its padding
    assert torch.equal(expected[2, 4:], alone[0])


@pytest.mark.parametrize("kind", HF)
def test_a_head_width_of_its_own_gives_their_logits_and_tokens(kind):
    """Heads × head width ≠ D, as in Qwen3-0.6B (16 × 128 = 2048 for D = 1024): here 4 × 16 =
    64 for D = 32, so q_proj and o_proj are not square. Both directions, and generate()."""
    config = modern(kind, d_head=16)
    ref = theirs(kind, config, seed=6)
    ours = LanguageModel(config).eval()
    HF[kind][3](ours, ref)
    assert ours.layers[0].self_attn.q_proj.weight.shape == (4 * 16, 32)
    x = ids(6)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x).logits, atol=MODERN_ATOL, rtol=RTOL)
        mine, fresh = randomized(LanguageModel(config), 7), theirs(kind, config)
        HF[kind][4](mine, fresh)
        torch.testing.assert_close(fresh(x).logits, mine(x), atol=MODERN_ATOL, rtol=RTOL)
    prompt = x[:, :3]
    expected = ref.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=T - 3,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert torch.equal(generate(ours, prompt, T - 3, greedy=True), expected)


def test_llama_and_qwen3_configs_map_both_ways():
    for ours in (modern("llama"), modern("llama", bias=True, tie_embeddings=True, d_head=6)):
        assert lm_config_from_llama(llama_config(ours)) == ours
    for ours in (modern("qwen3"), modern("qwen3", window=4, rope_base=500.0)):
        assert lm_config_from_llama(qwen3_config(ours)) == ours


@pytest.mark.parametrize(
    ("kind", "changes", "phrase"),
    [
        ("llama", {"norm": "layer"}, "Llama has no equivalent of this config; set norm='rms'"),
        ("llama", {"positions": "learned"}, "set positions='rope'"),
        ("llama", {"qk_norm": True}, "set qk_norm=False"),
        ("llama", {"window": 4}, "set window=None"),
        ("qwen3", {"qk_norm": False}, "Qwen3 has no equivalent of this config; set qk_norm=True"),
        ("qwen3", {"bias": True}, "set bias=False"),
        ("qwen3", {"activation": "gelu"}, "activation='swiglu'"),
        ("llama", {"n_experts": 4}, "set n_experts=0"),  # chapter 20's: moe_weights
        ("qwen3", {"n_experts": 4}, "Qwen3 has no equivalent of this config; set n_experts=0"),
    ],
)
def test_configs_llama_and_qwen3_cannot_express_are_refused(kind, changes, phrase):
    _, make_config, _, copy_from, _ = HF[kind]
    raises(lambda: make_config(modern(kind, **changes)), ValueError, phrase)
    ours = LanguageModel(modern(kind, **changes))
    raises(lambda: copy_from(ours, theirs(kind, modern(kind))), ValueError, phrase)


@pytest.mark.parametrize(
    ("changes", "phrase"),
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
            "rope_type='dynamic' recomputes the frequencies",
        ),
        (
            {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}},
            "rope_type must be one of",
        ),
        (
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            "partial_rotary_factor=0.5: LlamaConfig's models rotate whole heads",
        ),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 0.5}},
            "factor must be at least 1.0",
        ),
        ({"rope_parameters": {"rope_type": "yarn", "factor": None}}, "needs factor"),
        ({"attention_bias": True}, "attention_bias and mlp_bias must agree"),
    ],
)
def test_llama_configs_ours_cannot_express_are_refused(changes, phrase):
    raises(lambda: lm_config_from_llama(LlamaConfig(**changes)), ValueError, phrase)


def test_a_window_in_some_layers_only_is_refused():
    hf = Qwen3Config(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    raises(lambda: lm_config_from_llama(hf), ValueError, "max_window_layers=0")


@pytest.mark.parametrize(
    ("changes", "phrase"),
    [
        ({"n_kv_heads": 4}, "num_key_value_heads: ours 4, theirs 2"),
        ({"rope_base": 500.0}, "rope_parameters"),
        ({"d_ff": 64}, "intermediate_size: ours 64, theirs 48"),
    ],
)
def test_llama_models_of_other_sizes_are_refused(changes, phrase):
    ours = LanguageModel(modern("llama", **changes))
    raises(lambda: copy_from_llama(ours, theirs("llama", modern("llama"))), ValueError, phrase)
    raises(lambda: copy_to_llama(ours, theirs("llama", modern("llama"))), ValueError, phrase)


def test_the_other_family_is_refused():
    ours = LanguageModel(modern("qwen3"))
    raises(lambda: copy_from_llama(ours, theirs("qwen3", ours.config)), TypeError, "a Llama")


# Rope scaling (chapter 18): trained length L = 32, read at 3L = 96. A head width of 16 (8 pairs)
# puts pairs in every band: with base 10000 pair 0 turns 5 times over L, pair 1 1.6 times, the
# rest under once, so llama3 keeps, blends and divides, and yarn's ramp runs from pair 0 to 2.
ROPE_LEN, LONG = 32, 96
SCALED = {
    "linear": dict(rope_type="linear", factor=4.0),
    "llama3": dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0),
    "yarn": dict(rope_type="yarn", factor=4.0),
    "yarn-betas-attention-factor": dict(
        rope_type="yarn", factor=4.0, beta_fast=8.0, beta_slow=0.5, attention_factor=1.3
    ),
    "yarn-mscale-untruncated": dict(
        rope_type="yarn", factor=4.0, mscale=0.707, mscale_all_dim=1.0, truncate=False
    ),
}
SCALED_CASES = [("llama", name) for name in SCALED] + [("qwen3", "yarn")]


def scaled(kind: str, name: str, **changes) -> LMConfig:
    parameters = dict(SCALED[name])
    if parameters["rope_type"] != "linear":
        parameters["original_max_position_embeddings"] = ROPE_LEN
    scaling = RopeScaling.from_parameters(parameters)
    return modern(kind, d_head=16, max_len=4 * ROPE_LEN, rope_scaling=scaling, **changes)


def long_ids(seed: int) -> torch.Tensor:
    return torch.randint(0, V, (B, LONG), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("kind", "name"), SCALED_CASES)
def test_scaled_rope_gives_their_logits_past_the_trained_length(kind, name):
    """Their config from ours maps back to ours; copied weights give their logits at 96
    positions, three times L; the same weights without our scaling do not."""
    config = scaled(kind, name)
    assert lm_config_from_llama(HF[kind][1](config)) == config
    ref = theirs(kind, config, seed=7)
    ours = LanguageModel(config).eval()
    unscaled = LanguageModel(dataclasses.replace(config, rope_scaling=None)).eval()
    HF[kind][3](ours, ref)
    unscaled.load_state_dict(ours.state_dict())  # only the rotary tables differ
    x = long_ids(7)
    with torch.no_grad():
        expected, got = ref(x).logits, ours(x)
        torch.testing.assert_close(got, expected, atol=MODERN_ATOL, rtol=SCALED_RTOL)
        assert (unscaled(x) - expected)[:, ROPE_LEN:].abs().max() > 100 * MODERN_ATOL


@pytest.mark.parametrize(("kind", "name"), SCALED_CASES)
def test_scaled_rope_decodes_as_their_generate_with_and_without_padding(kind, name):
    """Greedy with our cache equals generate(): from a prompt of 40 to 96 tokens; and for a
    batch left-padded by 0, 10 and 20 positions, with their attention mask."""
    ref = theirs(kind, scaled(kind, name), seed=8)
    ours = LanguageModel(scaled(kind, name)).eval()
    HF[kind][3](ours, ref)
    prompt = long_ids(8)[:, :40]
    options = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = ref.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=LONG - 40, **options
    )
    assert torch.equal(generate(ours, prompt, LONG - 40, greedy=True), expected)
    padding = torch.arange(40) < torch.tensor([[0], [10], [20]])  # (B, 40), True at padding
    prompt = prompt.masked_fill(padding, 0)
    expected = ref.generate(prompt, attention_mask=(~padding).long(), max_new_tokens=48, **options)
    assert torch.equal(greedy_left_padded(ours, prompt, padding, 48), expected)


@pytest.mark.parametrize("kind", HF)
def test_yarn_reads_past_max_position_embeddings_as_qwen3s_card_enables_it(kind):
    """Qwen3's model card adds YaRN (factor 4 over 32,768) and leaves max_position_embeddings
    at 40,960; transformers reads past it. Here the same at L = 32, max_position_embeddings 40:
    ours reaches factor × L = 128 and gives their logits at 96 positions."""
    hf = HF[kind][1](scaled(kind, "yarn"))  # YaRN from L = 32, factor 4
    hf.max_position_embeddings = 40
    hf._attn_implementation = "eager"
    config = lm_config_from_llama(hf)
    assert config.max_len == 4 * ROPE_LEN
    assert lm_config_from_llama(hf, max_len=LONG).max_len == LONG  # the reader's own reach
    ref = randomized(HF[kind][2](hf).eval(), 10)
    ours = LanguageModel(config).eval()
    HF[kind][3](ours, ref)
    x = long_ids(10)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x).logits, atol=MODERN_ATOL, rtol=SCALED_RTOL)


@pytest.mark.parametrize(
    ("rope", "max_position_embeddings", "expected"),
    [
        (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32), 40, 128),
        (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32), 200, 200),
        (
            dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            131072,
            131072,
        ),
        (  # Llama 3.2-1B: 32 × 8,192 = 262,144 is twice its context; vLLM does not multiply
            dict(
                rope_type="llama3",
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            131072,
            131072,
        ),
        (dict(rope_type="linear", factor=4.0), 40, 40),  # no trained length stated
        (dict(rope_type="default"), 40, 40),
    ],
    ids=["yarn-past", "yarn-within", "llama3.1", "llama3.2", "linear", "default"],
)
def test_max_len_is_the_scaled_reach_at_least_max_position_embeddings(
    rope, max_position_embeddings, expected
):
    hf = LlamaConfig(
        max_position_embeddings=max_position_embeddings,
        rope_parameters=rope | {"rope_theta": 10000.0},
    )
    assert lm_config_from_llama(hf).max_len == expected
    raises(lambda: lm_config_from_llama(hf, max_len=0), ValueError, "max_len must be")


def test_a_llama_3_1_rope_dict_maps_to_our_scaling():
    """As Llama 3.1's config.json writes it (an old ``"type"`` key read too)."""
    rope = dict(
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
        rope_type="llama3",
        rope_theta=500000.0,
    )
    ours = lm_config_from_llama(LlamaConfig(max_position_embeddings=131072, rope_parameters=rope))
    assert ours.rope_base == 500000.0
    assert ours.rope_scaling == RopeScaling(
        "llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    old = LlamaConfig(rope_scaling={"type": "linear", "factor": 2.0})
    assert lm_config_from_llama(old).rope_scaling == RopeScaling("linear", factor=2.0)


def test_scalings_that_differ_are_refused_when_copying():
    ours = LanguageModel(scaled("llama", "yarn"))
    other = theirs("llama", scaled("llama", "yarn-betas-attention-factor"))
    raises(lambda: copy_from_llama(ours, other), ValueError, "rope_parameters: ours")
    raises(
        lambda: llama_config(modern("llama", partial_rotary_factor=0.5)),
        ValueError,
        "set partial_rotary_factor=1.0",
    )


# --- API probes (issue 42): each bad copy refused by name, both models left as they were -----


def lora(model: torch.nn.Module, target: str) -> torch.nn.Module:
    return add_lora(model, targets=(target,), rank=2, alpha=4.0)


def resized_head(model: LanguageModel) -> LanguageModel:
    model.lm_head = torch.nn.Linear(model.config.d_model, V + 10, bias=False)
    return model


def ours_llama() -> LanguageModel:
    return LanguageModel(modern("llama"))


def their_llama() -> LlamaForCausalLM:
    return theirs("llama", modern("llama"), seed=1)


HF_PROBES = {  # name: (ours, theirs, copy, error, phrase)
    "ours a dict": (
        lambda: {},
        their_llama,
        copy_to_llama,
        TypeError,
        "ours must be a LanguageModel",
    ),
    "ours their model": (
        their_llama,
        their_llama,
        copy_from_llama,
        TypeError,
        "ours must be a LanguageModel, got LlamaForCausalLM",
    ),
    "a Qwen3 for a Llama": (
        ours_llama,
        lambda: theirs("qwen3", modern("qwen3")),
        copy_from_llama,
        TypeError,
        "llama must be a LlamaForCausalLM, got Qwen3ForCausalLM",
    ),
    "a Llama for a Qwen3": (
        lambda: LanguageModel(modern("qwen3")),
        their_llama,
        copy_to_qwen3,
        TypeError,
        "qwen3 must be a Qwen3ForCausalLM, got LlamaForCausalLM",
    ),
    "ours with LoRA layers (from)": (
        lambda: lora(ours_llama(), "v_proj"),
        their_llama,
        copy_from_llama,
        ValueError,
        "ours holds LoRA layers (layers.0.self_attn.v_proj): merge them first (lora.merge_lora)",
    ),
    "theirs with LoRA layers (to)": (
        ours_llama,
        lambda: lora(their_llama(), "v_proj"),
        copy_to_llama,
        ValueError,
        "llama holds LoRA layers (model.layers.0.self_attn.v_proj)",
    ),
    "ours quantized (from)": (
        lambda: quantize_linears(ours_llama(), bits=8),
        their_llama,
        copy_from_llama,
        ValueError,
        "ours is quantized (layers.0.self_attn.q_proj)",
    ),
    "ours' output layer resized (to)": (
        lambda: resized_head(ours_llama()),
        their_llama,
        copy_to_llama,
        ValueError,
        "lm_head.weight: shapes differ, (50, 32) vs (60, 32)",
    ),
}


@pytest.mark.parametrize(
    ("ours", "theirs", "copy", "error", "phrase"), HF_PROBES.values(), ids=HF_PROBES.keys()
)
def test_a_refused_copy_names_what_differs_and_leaves_both_models_as_they_were(
    ours, theirs, copy, error, phrase
):
    ours, theirs = ours(), theirs()
    models = [m for m in (ours, theirs) if isinstance(m, torch.nn.Module)]
    refused_unchanged(lambda: copy(ours, theirs), error, phrase, *models)


def test_configs_of_another_kind_are_refused_by_name():
    raises(
        lambda: llama_config({"d_model": 32}), TypeError, "config must be an LMConfig, got dict"
    )
    raises(
        lambda: lm_config_from_llama(GPT2Config()),
        TypeError,
        "config must be a LlamaConfig or a Qwen3Config, got GPT2Config",
    )
