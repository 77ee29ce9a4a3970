"""The language model's config sits at the bottom of its imports: no circle."""

import subprocess
import sys

import pytest

from helpers import raises
from transformer_tutorial.lm.config import LLAMA, QWEN3, LMConfig
from transformer_tutorial.lm.grouped_attention import head_width
from transformer_tutorial.lm.registry import ATTENTIONS, POSITIONS
from transformer_tutorial.lm.rope_scaling import RopeScaling


def test_lm_config_imports_none_of_the_modules_that_use_it():
    code = (
        "import sys, transformer_tutorial.lm.config; "
        "print(sorted(m for m in sys.modules if m.startswith('transformer_tutorial.')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    for user in ("lm.model", "lm.layer", "lm.pieces", "lm.hf_weights", "lm.gpt2_weights"):
        assert f"transformer_tutorial.{user}'" not in loaded


def test_presets_are_valid_choices_and_build_configs():
    for preset in (LLAMA, QWEN3):
        assert preset["positions"] in POSITIONS and preset["attention"] in ATTENTIONS
        assert LMConfig(vocab_size=11, d_model=16, n_heads=4, **preset).norm == "rms"
    assert QWEN3["qk_norm"] and not LLAMA.get("qk_norm", False)
    with pytest.raises(TypeError):
        LLAMA["bias"] = True  # read-only: a chapter cannot change the preset for the next


ROPE = dict(vocab_size=11, d_model=16, n_heads=2, **LLAMA)


LINEAR = RopeScaling("linear", factor=2.0)
DYNAMIC = RopeScaling("dynamic", factor=2.0, original_max_position_embeddings=8)


@pytest.mark.parametrize(
    ("changes", "error", "phrase"),
    [
        (
            dict(positions="learned", attention="mha", rope_scaling=LINEAR),
            ValueError,
            ": positions='rope' only; set positions='rope'",
        ),
        (dict(rope_scaling=LINEAR.to_parameters()), TypeError, "RopeScaling.from_parameters"),
        (dict(rope_scaling=DYNAMIC), ValueError, "keys already in a KV cache"),
        (dict(partial_rotary_factor=0.1), ValueError, "partial_rotary_factor=0.1 rotates"),
    ],
)
def test_rope_settings_are_checked(changes, error, phrase):
    raises(lambda: LMConfig(**(ROPE | changes)), error, phrase)


def test_a_config_with_rope_scaling_is_hashable_and_compares_by_value():
    def config():
        return LMConfig(**ROPE, rope_scaling=RopeScaling("linear", factor=2.0))

    assert config() == config() and hash(config()) == hash(config())
    assert head_width(LMConfig(**ROPE, partial_rotary_factor=0.5)) == 8


# --- API probes (issue 42): each bad config, and what its error must say ----------------------

BASE = dict(vocab_size=50, d_model=32, n_heads=4, n_layers=3, d_ff=48, max_len=16)
MOE = dict(BASE, **LLAMA, n_experts=4, n_experts_per_token=2)
MLA = dict(
    BASE,
    **(dict(LLAMA) | dict(attention="mla")),
    kv_lora_rank=8,
    qk_nope_head_dim=4,
    qk_rope_head_dim=4,
    v_head_dim=8,
)
INF, NAN = float("inf"), float("nan")
CONFIG_PROBES = {
    "n_heads a float": (dict(BASE, n_heads=4.0), TypeError, "n_heads must be an int, got 4.0"),
    "d_model a str": (dict(BASE, d_model="32"), TypeError, "d_model must be an int, got '32'"),
    "n_layers a bool": (dict(BASE, n_layers=True), TypeError, "n_layers must be an int, got True"),
    "NaN dropout": (dict(BASE, dropout=NAN), ValueError, "dropout must be in [0.0, 1.0), got nan"),
    "infinite eps": (
        dict(BASE, layer_norm_eps=INF),
        ValueError,
        "layer_norm_eps must be greater than 0.0, got inf",
    ),
    "NaN rope_base": (
        dict(BASE, **LLAMA, rope_base=NAN),
        ValueError,
        "rope_base must be greater than 1.0, got nan",
    ),
    "infinite partial_rotary_factor": (
        dict(BASE, **LLAMA, partial_rotary_factor=INF),
        ValueError,
        "partial_rotary_factor must be in (0.0, 1.0], got inf",
    ),
    "partial_rotary_factor a str": (
        dict(BASE, **LLAMA, partial_rotary_factor="0.5"),
        TypeError,
        "partial_rotary_factor must be a number, got '0.5'",
    ),
    "window a float": (dict(BASE, **LLAMA, window=4.0), TypeError, "window must be an int"),
    "n_kv_heads a bool": (
        dict(BASE, **LLAMA, n_kv_heads=True),
        TypeError,
        "n_kv_heads must be an int, got True",
    ),
    "dense_layers of bools": (
        dict(MOE, dense_layers=(True,)),
        ValueError,
        "dense_layers must be a tuple of layer indices 0 to 2, got (True,)",
    ),
    "dense_layers of floats": (
        dict(MOE, dense_layers=(0.0,)),
        ValueError,
        "dense_layers must be a tuple of layer indices 0 to 2, got (0.0,)",
    ),
    "dense_layers a list": (
        dict(MOE, dense_layers=[0]),
        ValueError,
        "dense_layers must be a tuple of layer indices 0 to 2, got [0]",
    ),
    "dense_layers an int": (
        dict(MOE, dense_layers=1),
        ValueError,
        "dense_layers must be a tuple of layer indices 0 to 2, got 1",
    ),
    "n_experts a float": (dict(MOE, n_experts=4.0), TypeError, "n_experts must be an int"),
    "NaN router_aux_loss_coef": (
        dict(MOE, router_aux_loss_coef=NAN),
        ValueError,
        "router_aux_loss_coef must be at least 0.0, got nan",
    ),
    "infinite routed_scaling_factor": (
        dict(MOE, router="sigmoid", routed_scaling_factor=INF),
        ValueError,
        "routed_scaling_factor must be greater than 0.0, got inf",
    ),
    "n_shared_experts a bool": (
        dict(MOE, router="sigmoid", n_shared_experts=True),
        TypeError,
        "n_shared_experts must be an int, got True",
    ),
    "norm_topk_prob 0 without experts": (
        dict(BASE, norm_topk_prob=0),
        TypeError,
        "norm_topk_prob must be True or False, got 0",
    ),
    "rope_interleave 0 without latent attention": (
        dict(BASE, rope_interleave=0),
        TypeError,
        "rope_interleave must be True or False, got 0",
    ),
    "kv_lora_rank a float": (
        dict(MLA, kv_lora_rank=8.0),
        TypeError,
        "kv_lora_rank must be an int, got 8.0",
    ),
    "router None": (
        dict(MOE, router=None),
        ValueError,
        "router must be one of ['sigmoid', 'softmax'], got None",
    ),
    "rope_scaling a dict": (
        dict(BASE, **LLAMA, rope_scaling={"rope_type": "linear", "factor": 2.0}),
        TypeError,
        "rope_scaling must be a RopeScaling or None",
    ),
}


@pytest.mark.parametrize(
    ("fields", "error", "phrase"), CONFIG_PROBES.values(), ids=CONFIG_PROBES.keys()
)
def test_bad_configs_name_the_field_and_what_is_valid(fields, error, phrase):
    raises(lambda: LMConfig(**fields), error, phrase)
