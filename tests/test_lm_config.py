"""The language model's config sits at the bottom of its imports: no circle."""

import subprocess
import sys

import pytest

from helpers import raises
from transformer_tutorial.lm.config import ATTENTIONS, LLAMA, POSITIONS, QWEN3, LMConfig
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
            "set positions='rope' (got 'learned')",
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
    assert LMConfig(**ROPE, partial_rotary_factor=0.5).head_dim == 8
