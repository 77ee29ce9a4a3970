"""rope_scaling: every rope type's frequencies and attention factor equal ``transformers``'
``ROPE_INIT_FUNCTIONS`` over many configurations; the factor multiplies cos and sin once; partial
rotary equals GPT-NeoX's rotation of the first part of each head (in every layout); bad settings
are refused naming the field; a model with YaRN and partial rotary decodes with its cache as it
reads whole. Whole Llama and Qwen3 models with scaled rope are in test_lm_hf_weights.py."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers import GPTNeoXConfig, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_neox.modeling_gpt_neox import (
    GPTNeoXRotaryEmbedding,
    apply_rotary_pos_emb,
)

from helpers import raises
from transformer_tutorial.lm.config import LLAMA, LMConfig
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.rope_scaling import (
    RopeScaling,
    rotary_width,
    scaled_frequencies,
    scaled_max_len,
    scaled_rotary,
    yarn_attention_factor,
    yarn_ramp,
)
from transformer_tutorial.lm.rotary import LAYOUTS, RotaryPositions, qk_row_permutation

# Theirs are float32 (base ** (2i/Dr) in float32), ours float64: relative differences up to
# 6.0e-7 over the configurations below.
FREQ_RTOL = 2e-6

SCALINGS = [
    *(dict(rope_type="linear", factor=f) for f in (1.0, 2.0, 8.0, 32.5)),
    *(
        dict(
            rope_type="llama3",
            factor=f,
            low_freq_factor=lo,
            high_freq_factor=hi,
            original_max_position_embeddings=L,
        )
        for f, lo, hi, L in [
            (8.0, 1.0, 4.0, 8192),
            (32.0, 1.0, 4.0, 8192),
            (4.0, 2.0, 8.0, 64),
            (16.0, 1.0, 1.0, 8192),  # Llama 4 Scout's: equal factors, a step at L
            (4.0, 2.0, 2.0, 64),
        ]
    ),
    *(
        dict(rope_type="yarn", factor=f, original_max_position_embeddings=L, **extra)
        for f, L, extra in [
            (4.0, 32768, {}),  # Qwen3's long-context setting
            (16.0, 4096, {}),
            (40.0, 4096, dict(beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
            (40.0, 4096, dict(mscale=0.707, mscale_all_dim=1.0)),
            (8.0, 64, dict(beta_fast=8.0, beta_slow=0.5)),
            (8.0, 64, dict(attention_factor=0.8)),
            (8.0, 2048, dict(truncate=False)),
            (1.0, 2048, {}),
        ]
    ),
]
SHAPES = [  # (head_dim, base, partial_rotary_factor)
    (16, 10000.0, 1.0),
    (64, 10000.0, 1.0),
    (128, 500000.0, 1.0),
    (128, 1000000.0, 0.5),
    (80, 10000.0, 0.25),
]


def their_config(head_dim: int, base: float, partial: float, parameters: dict) -> LlamaConfig:
    rope = dict(parameters, rope_theta=base, partial_rotary_factor=partial)
    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=4 * parameters.get("original_max_position_embeddings", 1024),
        rope_parameters=rope,
    )


@pytest.mark.parametrize(
    ("parameters", "shape"),
    list(itertools.product(SCALINGS, SHAPES)),
    ids=lambda x: "-".join(f"{v}" for v in (x.values() if isinstance(x, dict) else x)),
)
def test_frequencies_and_attention_factor_equal_transformers(parameters, shape):
    head_dim, base, partial = shape
    hf = their_config(head_dim, base, partial, parameters)
    expected, expected_factor = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](hf)
    scaling = RopeScaling.from_parameters(hf.rope_parameters)
    width = rotary_width(head_dim, partial)
    theta, factor = scaled_frequencies(width, base=base, scaling=scaling)
    assert theta.dtype == torch.float64 and theta.shape == expected.shape
    torch.testing.assert_close(theta.float(), expected, rtol=FREQ_RTOL, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)
    unscaled, _ = scaled_frequencies(width, base=base)
    if parameters["factor"] > 1:  # the scaling changed something, so the equality can fail
        assert (theta / unscaled).min() < 1 - 1e-3


@pytest.mark.parametrize("seq_len", [None, 64, 100, 500])
@pytest.mark.parametrize(("head_dim", "partial"), [(16, 1.0), (128, 0.5)])
@pytest.mark.parametrize("factor", [2.0, 4.0])
def test_dynamic_frequencies_equal_transformers_at_each_length(factor, head_dim, partial, seq_len):
    """NTK-aware dynamic scaling: the base grows with the sequence once it passes L = 64."""
    hf = their_config(head_dim, 10000.0, partial, dict(rope_type="dynamic", factor=factor))
    hf.max_position_embeddings = 64
    expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, seq_len=seq_len)
    scaling = RopeScaling("dynamic", factor=factor, original_max_position_embeddings=64)
    theta, attention = scaled_frequencies(
        rotary_width(head_dim, partial), scaling=scaling, seq_len=seq_len
    )
    torch.testing.assert_close(theta.float(), expected, rtol=FREQ_RTOL, atol=0)
    assert attention == 1.0
    assert torch.equal(theta, scaled_frequencies(rotary_width(head_dim, partial))[0]) == (
        seq_len is None or seq_len <= 64
    )


def test_llama3_keeps_the_high_frequencies_and_divides_the_low_ones():
    """The bands by name, as a swap would break them: Llama 3.1's 8192 positions, Dh = 128."""
    scaling = RopeScaling(
        "llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    theta, _ = scaled_frequencies(128, base=500000.0, scaling=scaling)
    ratio = theta / scaled_frequencies(128, base=500000.0)[0]
    wavelength = 2 * math.pi / scaled_frequencies(128, base=500000.0)[0]
    assert torch.all(ratio[wavelength < 8192 / 4] == 1.0)  # short wavelengths: kept
    assert torch.allclose(ratio[wavelength > 8192], torch.tensor(1 / 8, dtype=torch.float64))
    middle = ratio[(wavelength >= 2048) & (wavelength <= 8192)]
    assert middle.numel() > 0 and torch.all((middle > 1 / 8) & (middle < 1))


def test_llama3_with_equal_band_edges_is_a_step_at_the_trained_length():
    """Llama 4's ``low_freq_factor == high_freq_factor == 1``: no band is blended (theirs would
    divide by zero there); wavelengths up to L kept, longer ones divided by ``factor``."""
    scaling = RopeScaling(
        "llama3",
        factor=16.0,
        low_freq_factor=1.0,
        high_freq_factor=1.0,
        original_max_position_embeddings=8192,
    )
    unscaled = scaled_frequencies(128, base=500000.0)[0]
    ratio = scaled_frequencies(128, base=500000.0, scaling=scaling)[0] / unscaled
    wavelength = 2 * math.pi / unscaled
    assert torch.all(ratio[wavelength < 8192] == 1.0)
    assert torch.all(ratio[wavelength > 8192] == 1 / 16)  # exact: θ / 16 is a power of two
    assert (wavelength < 8192).sum() > 0 and (wavelength > 8192).sum() > 0
    assert torch.all(ratio.isfinite())


@pytest.mark.parametrize("partial", [1.0, 0.5, 0.25])
@pytest.mark.parametrize(
    "parameters",
    [
        dict(rope_type="default"),
        dict(rope_type="linear", factor=2.0),
        dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0),
        dict(rope_type="yarn", factor=16.0),
        dict(rope_type="yarn", factor=8.0, attention_factor=0.8),
    ],
    ids=["default", "linear", "llama3", "yarn", "yarn-attention-factor"],
)
def test_rotation_equals_gpt_neox_with_its_attention_factor_once(parameters, partial):
    """GPT-NeoX rotates the first ``int(Dh · partial)`` coordinates (half-split) and multiplies
    its cos and sin by the attention factor once; so do ours, at positions past L."""
    head_dim, base, L = 32, 10000.0, 64
    rope = dict(parameters, rope_theta=base, partial_rotary_factor=partial)
    if parameters["rope_type"] in ("llama3", "yarn"):
        rope["original_max_position_embeddings"] = L
    hf = GPTNeoXConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        max_position_embeddings=4 * L,
        rope_parameters=rope,
    )
    reference = GPTNeoXRotaryEmbedding(hf)
    ours = scaled_rotary(
        head_dim,
        max_len=4 * L,
        base=base,
        scaling=RopeScaling.from_parameters(rope),
        partial_rotary_factor=partial,
    )
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 3 * L, head_dim, generator=g), torch.randn(2, 2, 3 * L, head_dim)
    position_ids = torch.arange(3 * L).expand(2, -1)
    cos, sin = reference(q, position_ids)
    expected = apply_rotary_pos_emb(q, k.repeat(1, 2, 1, 1), cos, sin)
    got_q, got_k = ours(q, k, position_ids)
    torch.testing.assert_close(got_q, expected[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got_k.repeat(1, 2, 1, 1), expected[1], atol=2e-5, rtol=1e-5)
    width = rotary_width(head_dim, partial)
    assert torch.equal(got_q[..., width:], q[..., width:])  # the rest of each head passes
    factor = reference.attention_scaling
    assert factor != 1.0 or parameters["rope_type"] != "yarn"
    norm = got_q[..., :width].norm(dim=-1) / q[..., :width].norm(dim=-1)
    torch.testing.assert_close(norm, torch.full_like(norm, factor), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_rotary_layouts_are_one_function_up_to_a_signed_permutation(layout):
    """The first Dr rows of each head permuted (and signed) as chapter 15's layouts: the same
    scores as half-split; the rest of the head untouched."""
    head_dim, width, L = 16, 8, 40
    index, sign = qk_row_permutation(width, source="half_split", target=layout)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 2, L, head_dim, generator=g), torch.randn(1, 2, L, head_dim, generator=g)

    def permuted(x):
        return torch.cat([x[..., :width][..., index] * sign, x[..., width:]], dim=-1)

    def scores(layout, q, k):
        hook = scaled_rotary(head_dim, max_len=L, partial_rotary_factor=0.5, layout=layout)
        q, k = hook(q, k, torch.arange(L).expand(1, -1))
        return q @ k.transpose(-1, -2)

    expected = scores("half_split", q, k)
    torch.testing.assert_close(scores(layout, permuted(q), permuted(k)), expected)
    if layout != "half_split":  # the permutation matters: without it the scores differ
        assert not torch.allclose(scores(layout, q, k), expected, atol=1e-3)


def test_yarn_attention_factor_defaults_and_overrides():
    def yarn(**kw):
        return RopeScaling("yarn", original_max_position_embeddings=64, **kw)

    assert yarn_attention_factor(yarn(factor=8.0)) == pytest.approx(0.1 * math.log(8) + 1)
    assert yarn_attention_factor(yarn(factor=8.0, attention_factor=0.5)) == 0.5
    assert yarn_attention_factor(yarn(factor=1.0)) == 1.0
    ratio = (0.1 * 0.5 * math.log(8) + 1) / (0.1 * 2 * math.log(8) + 1)
    got = yarn_attention_factor(yarn(factor=8.0, mscale=0.5, mscale_all_dim=2.0))
    assert got == pytest.approx(ratio)


def test_parameters_map_both_ways():
    for parameters in SCALINGS:
        scaling = RopeScaling.from_parameters(dict(parameters, rope_theta=1e4))
        assert RopeScaling.from_parameters(scaling.to_parameters()) == scaling
    assert RopeScaling.from_parameters({"type": "linear", "factor": 2.0}) == RopeScaling(
        "linear", factor=2.0
    )
    assert RopeScaling.from_parameters({"rope_type": "default", "rope_theta": 1e4}) is None
    assert hash(RopeScaling("linear", factor=2.0)) == hash(RopeScaling("linear", factor=2.0))


@pytest.mark.parametrize(
    ("make", "error", "phrase"),
    [
        (lambda: RopeScaling("ntk"), ValueError, "rope_type must be one of"),
        (lambda: RopeScaling("linear"), ValueError, "rope_type='linear' needs factor"),
        (lambda: RopeScaling("linear", factor=0.5), ValueError, "factor must be at least 1.0"),
        (lambda: RopeScaling("linear", factor=1.0, beta_fast=4.0), ValueError, "does not read"),
        (
            lambda: RopeScaling("yarn", factor=4.0),
            ValueError,
            "needs original_max_position_embeddings",
        ),
        (
            lambda: RopeScaling(
                "llama3",
                factor=8.0,
                original_max_position_embeddings=8192,
                low_freq_factor=4.0,
                high_freq_factor=1.0,
            ),
            ValueError,
            "high_freq_factor=1.0 must be at least low_freq_factor=4.0",
        ),
        (
            lambda: RopeScaling("llama3", factor=8.0, original_max_position_embeddings=8192),
            ValueError,
            "needs low_freq_factor",
        ),
        (
            lambda: RopeScaling(
                "yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=1.0
            ),
            ValueError,
            "beta_fast=1.0 must exceed beta_slow=1.0",
        ),
        (
            lambda: RopeScaling(
                "yarn", factor=4.0, original_max_position_embeddings=64, attention_factor=0.0
            ),
            ValueError,
            "attention_factor must be",
        ),
        (
            lambda: RopeScaling.from_parameters(
                {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}
            ),
            ValueError,
            "['long_factor', 'short_factor'] are not read",
        ),
        (lambda: rotary_width(16, 0.2), ValueError, "partial_rotary_factor=0.2 rotates"),
        (lambda: rotary_width(16, 0.0), ValueError, "partial_rotary_factor must be"),
        (
            lambda: scaled_frequencies(16, scaling=RopeScaling("linear", factor=2.0), seq_len=9),
            ValueError,
            "seq_len is read by rope_type='dynamic' only",
        ),
        (
            lambda: scaled_rotary(
                16, scaling=RopeScaling("dynamic", factor=2.0, original_max_position_embeddings=8)
            ),
            ValueError,
            "keys already in a KV cache keep their old rotation",
        ),
        (
            lambda: RotaryPositions(16, frequencies=torch.ones(9)),
            ValueError,
            "frequencies must be 1-D with 1 to head_dim/2 = 8 entries",
        ),
        (
            lambda: RotaryPositions(16, attention_scaling=0.0),
            ValueError,
            "attention_scaling must be",
        ),
    ],
)
def test_bad_settings_are_refused_naming_the_field(make, error, phrase):
    raises(make, error, phrase)


def test_a_model_with_yarn_and_partial_rotary_decodes_with_its_cache_as_it_reads_whole():
    """The whole language model: token by token with the KV cache equals one pass, past L."""
    config = LMConfig(
        vocab_size=30,
        d_model=32,
        n_heads=4,
        n_layers=2,
        d_ff=48,
        max_len=40,
        dropout=0.0,
        **LLAMA,
        n_kv_heads=2,
        rope_scaling=RopeScaling("yarn", factor=4.0, original_max_position_embeddings=8),
        partial_rotary_factor=0.5,
    )
    torch.manual_seed(0)
    model = LanguageModel(config).eval()
    ids = torch.randint(0, 30, (2, 36))
    with torch.no_grad():
        whole = model(ids)
        logits, cache = model.step(ids[:, :5])
        steps = [logits]
        for t in range(5, 36):
            logits, cache = model.step(ids[:, t : t + 1], cache)
            steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=1e-5)


# --- API probes (issue 42): each bad call, and what its error must say ------------------------

LINEAR = RopeScaling("linear", factor=2.0)
YARN8 = RopeScaling("yarn", factor=2.0, original_max_position_embeddings=8)
ROPE_SCALING_PROBES = {
    "scaling a dict": (
        lambda: scaled_frequencies(8, scaling={"rope_type": "linear", "factor": 2.0}),
        TypeError,
        "scaling must be a RopeScaling or None, got dict",
    ),
    "scaling a str (max_len)": (
        lambda: scaled_max_len(10, "yarn"),
        TypeError,
        "scaling must be a RopeScaling or None, got str",
    ),
    "scaling a dict (hook)": (
        lambda: scaled_rotary(8, scaling={"rope_type": "linear"}),
        TypeError,
        "scaling must be a RopeScaling or None, got dict",
    ),
    "ramp of a linear scaling": (
        lambda: yarn_ramp(LINEAR, 8, 10000.0),
        ValueError,
        "scaling must be of rope_type='yarn', got 'linear'",
    ),
    "ramp with base 1": (
        lambda: yarn_ramp(YARN8, 8, 1.0),
        ValueError,
        "base must be greater than 1.0, got 1.0",
    ),
    "ramp of no width": (
        lambda: yarn_ramp(YARN8, 0, 10000.0),
        ValueError,
        "rotary_dim must be at least 2, got 0",
    ),
    "attention factor of a linear scaling": (
        lambda: yarn_attention_factor(LINEAR),
        ValueError,
        "scaling must be of rope_type='yarn', got 'linear'",
    ),
    "parameters a list": (
        lambda: RopeScaling.from_parameters([("rope_type", "linear")]),
        TypeError,
        "rope_parameters must be a mapping (a config's dict), got list",
    ),
    "infinite factor": (
        lambda: RopeScaling("linear", factor=math.inf),
        ValueError,
        "factor must be at least 1.0, got inf",
    ),
    "checked an int": (
        lambda: scaled_rotary(8, checked=1),
        TypeError,
        "checked must be True or False, got 1",
    ),
}


@pytest.mark.parametrize(
    ("call", "error", "phrase"), ROPE_SCALING_PROBES.values(), ids=ROPE_SCALING_PROBES.keys()
)
def test_bad_calls_name_the_argument_and_what_is_valid(call, error, phrase):
    raises(call, error, phrase)
