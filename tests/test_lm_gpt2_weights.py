"""gpt2_weights: GPT-2's weights copied into ours (and ours into GPT-2's) make the two compute
the same logits, loss and greedy tokens, in float32 in eval mode; settings with no equivalent
are refused with the field to change. Every GPT-2 weight is drawn at random first: its own
initialisation sets the norms to 1 and the biases to 0, which would hide a bias or a norm
copied to the wrong place."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM
from transformers.activations import ACT2FN

from helpers import lm_config as config
from helpers import raises, randomized, refused_unchanged, to_device
from transformer_tutorial.layers import ACTIVATIONS
from transformer_tutorial.lm.config import LLAMA
from transformer_tutorial.lm.gpt2_weights import (
    copy_from_gpt2,
    copy_to_gpt2,
    gpt2_config,
    lm_config_from_gpt2,
)
from transformer_tutorial.lm.hf_weights import llama_config
from transformer_tutorial.lm.model import LanguageModel, next_token_loss
from transformer_tutorial.lm.sampling import generate
from transformer_tutorial.lora import add_lora
from transformer_tutorial.quantization import quantize_linears

V, B, T = 50, 3, 16  # helpers.lm_config's vocabulary and positions
ATOL = RTOL = 1e-5  # float32


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def gpt2(seed: int = 0, **changes) -> GPT2LMHeadModel:
    return randomized(GPT2LMHeadModel(gpt2_config(config(**changes))), seed)


@pytest.mark.parametrize("tie", [True, False])
def test_copy_from_gpt2_gives_gpt2s_logits(tie, device):
    ref = gpt2(tie_embeddings=tie)
    ours = LanguageModel(config(tie_embeddings=tie)).eval()
    copy_from_gpt2(ours, ref)
    ours, ref, x = to_device((ours, ref, ids()), device)
    with torch.no_grad():
        expected = ref(x).logits
        got = ours(x)
    assert expected.abs().max() > 1.0  # logits of some size: the tolerance means something
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("tie", [True, False])
def test_copy_to_gpt2_gives_our_logits(tie, device):
    ours = randomized(LanguageModel(config(tie_embeddings=tie)), 1)
    ref = GPT2LMHeadModel(gpt2_config(ours.config)).eval()
    copy_to_gpt2(ours, ref)
    ours, ref, x = to_device((ours, ref, ids(1)), device)
    with torch.no_grad():
        torch.testing.assert_close(ref(x).logits, ours(x), atol=ATOL, rtol=RTOL)


def test_copy_to_then_from_gives_back_every_weight_exactly():
    ours = randomized(LanguageModel(config(tie_embeddings=False)), 2)
    ref = GPT2LMHeadModel(gpt2_config(ours.config))
    back = LanguageModel(ours.config)
    copy_to_gpt2(ours, ref)
    copy_from_gpt2(back, ref)
    mine, theirs = ours.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_loss_equals_gpt2s_with_padding_ignored():
    ref = gpt2(3)
    ours = LanguageModel(config()).eval()
    copy_from_gpt2(ours, ref)
    x = ids(3)
    x[0, 10:] = 0  # padding id 0 at the end of row 0
    labels = x.masked_fill(x == 0, -100)  # transformers' "ignore"
    with torch.no_grad():
        expected = ref(x, labels=labels).loss
        got = next_token_loss(ours(x), x, ignore_index=0)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


def test_greedy_generation_equals_gpt2s_generate():
    ref = gpt2(4)
    ours = LanguageModel(config()).eval()
    copy_from_gpt2(ours, ref)
    prompt = ids(4)[:, :3]
    expected = ref.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),  # no padding (id 0 is a token here)
        max_new_tokens=T - 3,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert torch.equal(generate(ours, prompt, T - 3, greedy=True), expected)


def test_tanh_gelu_equals_gpt2s_gelu_new():
    x = torch.linspace(-8, 8, 10_001)
    for name in ("gelu_new", "gelu_pytorch_tanh"):
        torch.testing.assert_close(ACTIVATIONS["gelu_tanh"](x), ACT2FN[name](x))


def test_configs_map_both_ways():
    for ours in (config(), config(tie_embeddings=False, dropout=0.0, layer_norm_eps=1e-6)):
        assert lm_config_from_gpt2(gpt2_config(ours)) == ours
    assert lm_config_from_gpt2(GPT2Config(vocab_size=V, n_embd=32, n_head=4)).d_ff == 128


@pytest.mark.parametrize(
    ("changes", "phrase"),
    [
        ({"norm_first": False}, "set norm_first=True"),
        ({"activation": "relu"}, "activation='gelu_tanh'"),
        ({"positions": "sinusoidal", "scale_embeddings": True}, "positions='learned'"),
        ({"bias": False}, "bias=True"),
    ],
)
def test_configs_gpt2_cannot_express_are_refused(changes, phrase):
    raises(lambda: gpt2_config(config(**changes)), ValueError, phrase)
    ours = LanguageModel(config(**changes))
    raises(lambda: copy_from_gpt2(ours, gpt2()), ValueError, phrase)


@pytest.mark.parametrize(
    ("changes", "phrase"),
    [
        ({"activation_function": "relu"}, "activation_function='relu'"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=False"),
        ({"add_cross_attention": True}, "no cross-attention"),
    ],
)
def test_gpt2_configs_ours_cannot_express_are_refused(changes, phrase):
    raises(lambda: lm_config_from_gpt2(GPT2Config(vocab_size=V, **changes)), ValueError, phrase)


@pytest.mark.parametrize(
    ("changes", "phrase"),
    [
        ({"d_ff": 64}, "d_ff: ours 64, GPT-2's 48"),
        ({"n_layers": 2}, "n_layers: ours 2, GPT-2's 3"),
        ({"tie_embeddings": False}, "tie_embeddings: ours False, GPT-2's True"),
    ],
)
def test_models_of_different_sizes_are_refused(changes, phrase):
    ours = LanguageModel(config(**changes))
    raises(lambda: copy_from_gpt2(ours, gpt2()), ValueError, phrase)
    raises(lambda: copy_to_gpt2(ours, gpt2()), ValueError, phrase)


# --- API probes (issue 42): each bad copy refused by name, both models left as they were -----


def lora(model: torch.nn.Module, target: str) -> torch.nn.Module:
    return add_lora(model, targets=(target,), rank=2, alpha=4.0)


def with_extra_weight(model: torch.nn.Module) -> torch.nn.Module:
    model.register_parameter("extra", torch.nn.Parameter(torch.ones(3)))
    return model


def resized_head(model: LanguageModel) -> LanguageModel:
    model.lm_head = torch.nn.Linear(model.config.d_model, V + 10, bias=False)
    return model


UNTIED = dict(tie_embeddings=False)
GPT2_PROBES = {  # name: (ours, theirs, copy, error, phrase)
    "ours a dict": (
        lambda: {},
        gpt2,
        copy_to_gpt2,
        TypeError,
        "ours must be a LanguageModel, got dict",
    ),
    "theirs a Llama": (
        lambda: LanguageModel(config()),
        lambda: LlamaForCausalLM(llama_config(config(**LLAMA))),
        copy_from_gpt2,
        TypeError,
        "gpt2 must be a GPT2LMHeadModel, got LlamaForCausalLM",
    ),
    "ours with LoRA layers": (
        lambda: lora(LanguageModel(config()), "out_proj"),
        gpt2,
        copy_from_gpt2,
        ValueError,
        "ours holds LoRA layers (layers.0.self_attn.out_proj): merge them first",
    ),
    "ours quantized": (
        lambda: quantize_linears(LanguageModel(config()), bits=8),
        gpt2,
        copy_from_gpt2,
        ValueError,
        "ours is quantized (layers.0.self_attn.q_proj): copy the float weights, then quantize",
    ),
    "ours' output layer resized (to)": (
        lambda: resized_head(LanguageModel(config(**UNTIED))),
        lambda: gpt2(**UNTIED),
        copy_to_gpt2,
        ValueError,
        "lm_head.weight: shapes differ, (50, 32) vs (60, 32)",
    ),
    "a weight added to theirs": (
        lambda: LanguageModel(config()),
        lambda: with_extra_weight(gpt2()),
        copy_from_gpt2,
        ValueError,
        "gpt2 has weights the mapping does not know (extra)",
    ),
    "a weight added to ours": (
        lambda: with_extra_weight(LanguageModel(config())),
        gpt2,
        copy_to_gpt2,
        ValueError,
        "ours has weights the mapping does not know (extra)",
    ),
}


@pytest.mark.parametrize(
    ("ours", "theirs", "copy", "error", "phrase"), GPT2_PROBES.values(), ids=GPT2_PROBES.keys()
)
def test_a_refused_copy_names_what_differs_and_leaves_both_models_as_they_were(
    ours, theirs, copy, error, phrase
):
    ours, theirs = ours(), theirs()
    models = [m for m in (ours, theirs) if isinstance(m, torch.nn.Module)]
    refused_unchanged(lambda: copy(ours, theirs), error, phrase, *models)


def test_configs_of_another_kind_are_refused_by_name():
    raises(lambda: gpt2_config({"d_model": 32}), TypeError, "config must be an LMConfig, got dict")
    raises(
        lambda: lm_config_from_gpt2(llama_config(config(**LLAMA))),
        TypeError,
        "config must be a GPT2Config, got LlamaConfig",
    )
