"""The language model's config sits at the bottom of its imports: no circle."""

import subprocess
import sys

import pytest

from transformer_tutorial.lm_config import ATTENTIONS, LLAMA, POSITIONS, QWEN3, LMConfig


def test_lm_config_imports_none_of_the_modules_that_use_it():
    code = (
        "import sys, transformer_tutorial.lm_config; "
        "print(sorted(m for m in sys.modules if m.startswith('transformer_tutorial.')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    for user in ("language_model", "lm_layer", "lm_pieces", "hf_weights", "gpt2_weights"):
        assert f"transformer_tutorial.{user}'" not in loaded


def test_presets_are_valid_choices_and_build_configs():
    for preset in (LLAMA, QWEN3):
        assert preset["positions"] in POSITIONS and preset["attention"] in ATTENTIONS
        assert LMConfig(vocab_size=11, d_model=16, n_heads=4, **preset).norm == "rms"
    assert QWEN3["qk_norm"] and not LLAMA.get("qk_norm", False)
    with pytest.raises(TypeError):
        LLAMA["bias"] = True  # read-only: a chapter cannot change the preset for the next
