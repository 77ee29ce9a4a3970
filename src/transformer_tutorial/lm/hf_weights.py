"""Chapter 17: weights to and from ``transformers``' Llama and Qwen3, one tested mapping per
model, both directions (GPT-2's, chapter 13's, is :mod:`~transformer_tutorial.lm.gpt2_weights`).

Llama (``LlamaForCausalLM``) and Qwen3 (``Qwen3ForCausalLM``) are our model with the choices of
:data:`~transformer_tutorial.lm.config.LLAMA` and :data:`~transformer_tutorial.lm.config.QWEN3`:
their weights are ``nn.Linear``'s as ours, one matrix per projection, and their rotary layout is
ours (half-split), so every pair is a rename: :data:`LLAMA_NAMES`. Qwen3 adds the per-head
``q_norm``/``k_norm`` weights, and its sliding window (all layers, ``max_window_layers=0``).
Both directions read the one table; settings that are not weights must already agree, and a
clear error names each that does not. Their ``rope_parameters`` map to ``rope_base`` and
chapter 18's ``rope_scaling`` (``"linear"``, ``"llama3"``, ``"yarn"``); neither model rotates
part of a head (their default rope ignores ``partial_rotary_factor``, their scaled ones fail on
it), so ours keeps ``partial_rotary_factor=1``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import Tensor
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from transformer_tutorial.checks import check_optional_int, check_type
from transformer_tutorial.lm.config import LLAMA, QWEN3, LMConfig
from transformer_tutorial.lm.gpt2_weights import check_models, copy_pairs
from transformer_tutorial.lm.grouped_attention import head_width
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.rope_scaling import REFUSED, RopeScaling, scaled_max_len

# Our names → theirs, per layer (``layers.i.`` → ``model.layers.i.``) and outside the layers.
LLAMA_NAMES = {
    "self_attn.q_proj": "self_attn.q_proj",
    "self_attn.k_proj": "self_attn.k_proj",
    "self_attn.v_proj": "self_attn.v_proj",
    "self_attn.out_proj": "self_attn.o_proj",
    "self_attn.q_norm": "self_attn.q_norm",  # Qwen3 only
    "self_attn.k_norm": "self_attn.k_norm",  # Qwen3 only
    "ff.gate_proj": "mlp.gate_proj",
    "ff.up_proj": "mlp.up_proj",
    "ff.down_proj": "mlp.down_proj",
    "norm1": "input_layernorm",
    "norm2": "post_attention_layernorm",
}
LLAMA_OUTSIDE = {"embed": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"}
# The settings that are not weights but change the outputs: equal on both sides or refused.
LLAMA_MATCHING = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_bias",
    "rope_parameters",
    "sliding_window",
)
HFLlama = LlamaForCausalLM | Qwen3ForCausalLM


def _rope_parameters(config: LMConfig) -> dict:
    """Their ``rope_parameters`` for our ``rope_base`` and ``rope_scaling``."""
    scaling = config.rope_scaling or RopeScaling()
    return scaling.to_parameters() | {"rope_theta": config.rope_base}


def _rope_settings(parameters: dict | None) -> tuple[float, RopeScaling | None, float]:
    """``(rope_theta, RopeScaling, partial_rotary_factor)`` of their ``rope_parameters``: two
    dicts that spell the same rotation alike (defaults written out or not) compare equal."""
    rope = dict(parameters or {})
    kind = rope.get("rope_type", rope.get("type"))
    if kind in REFUSED:
        raise ValueError(REFUSED[kind])
    theta = float(rope.get("rope_theta", 10000.0))
    partial = float(rope.get("partial_rotary_factor") or 1.0)
    return theta, RopeScaling.from_parameters(rope), partial


def _max_len(config: PretrainedConfig, scaling: RopeScaling | None, max_len: int | None) -> int:
    """Ours ``max_len``: the caller's, or how far their config reads (:func:`scaled_max_len`:
    a YaRN config past its ``max_position_embeddings``)."""
    check_optional_int("max_len", max_len, at_least=1)
    return scaled_max_len(config.max_position_embeddings, scaling) if max_len is None else max_len


def _require(config: LMConfig, required: dict, model: str) -> None:
    check_type("config", config, LMConfig, "an LMConfig")
    wrong = [f"{k}={v!r}" for k, v in required.items() if getattr(config, k) != v]
    if wrong:
        raise ValueError(f"{model} has no equivalent of this config; set {', '.join(wrong)}")


def _shared_fields(config: LMConfig) -> dict:
    """The fields ``LlamaConfig`` and ``Qwen3Config`` name alike."""
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.d_ff,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads or config.n_heads,
        head_dim=head_width(config),
        max_position_embeddings=config.max_len,
        rms_norm_eps=config.layer_norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        rope_parameters=_rope_parameters(config),
        attention_dropout=config.dropout,
        hidden_act="silu",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def llama_config(config: LMConfig) -> LlamaConfig:
    """The ``LlamaConfig`` of the model our ``config`` builds (``bias`` → ``attention_bias`` and
    ``mlp_bias``); an error naming every field to change if ours is not Llama's kind."""
    required = {k: v for k, v in LLAMA.items() if k not in ("bias", "tie_embeddings")}
    dense = dict(qk_norm=False, window=None, partial_rotary_factor=1.0, n_experts=0)
    _require(config, dict(required, **dense), "Llama")
    return LlamaConfig(**_shared_fields(config), attention_bias=config.bias, mlp_bias=config.bias)


def qwen3_config(config: LMConfig) -> Qwen3Config:
    """The ``Qwen3Config`` of the model our ``config`` builds; a ``window`` slides in every
    layer (``max_window_layers=0``). An error names every field to change if ours is not
    Qwen3's kind (its feed-forward has no biases: ``bias=False``)."""
    required = {k: v for k, v in QWEN3.items() if k != "tie_embeddings"}
    _require(config, dict(required, partial_rotary_factor=1.0, n_experts=0), "Qwen3")
    return Qwen3Config(
        **_shared_fields(config),
        attention_bias=False,
        use_sliding_window=config.window is not None,
        sliding_window=config.window,
        max_window_layers=0,
    )


def lm_config_from_llama(
    config: LlamaConfig | Qwen3Config, *, max_len: int | None = None
) -> LMConfig:
    """Our :class:`LMConfig` for a ``LlamaConfig`` or a ``Qwen3Config`` (``dropout``: its
    ``attention_dropout``; Llama has no other). Rope types ``"default"``, ``"linear"``,
    ``"llama3"`` and ``"yarn"`` map to ``rope_scaling``; others are refused, naming them.
    ``max_len``: the positions ours reads (its rotary tables' length); None: their
    ``max_position_embeddings``, or for YaRN and llama3 ``factor ×
    original_max_position_embeddings`` if longer
    (:func:`~transformer_tutorial.lm.rope_scaling.scaled_max_len`)."""
    check_type("config", config, (LlamaConfig, Qwen3Config), "a LlamaConfig or a Qwen3Config")
    qwen3 = isinstance(config, Qwen3Config)
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r}: ours maps only SwiGLU ('silu')")
    rope_base, rope_scaling, partial = _rope_settings(config.rope_parameters)
    if partial != 1.0:
        raise ValueError(
            f"partial_rotary_factor={partial}: {type(config).__name__}'s models rotate whole "
            "heads (their default rope ignores the factor, their scaled ones fail on it)"
        )
    bias = config.attention_bias
    if not qwen3 and config.mlp_bias != bias:
        raise ValueError("attention_bias and mlp_bias must agree: ours has one bias switch")
    window = config.sliding_window if qwen3 else None
    if qwen3 and window is not None and set(config.layer_types) != {"sliding_attention"}:
        raise ValueError("ours slides the window in every layer or none: max_window_layers=0")
    heads = config.num_attention_heads
    return LMConfig(
        vocab_size=config.vocab_size,
        d_model=config.hidden_size,
        n_heads=heads,
        n_layers=config.num_hidden_layers,
        d_ff=config.intermediate_size,
        max_len=_max_len(config, rope_scaling, max_len),
        dropout=float(config.attention_dropout),
        **(QWEN3 if qwen3 else LLAMA)
        | dict(
            layer_norm_eps=config.rms_norm_eps,
            bias=bias,
            tie_embeddings=config.tie_word_embeddings,
        ),
        rope_base=rope_base,
        rope_scaling=rope_scaling,
        n_kv_heads=config.num_key_value_heads,
        d_head=None if config.head_dim == config.hidden_size // heads else config.head_dim,
        window=window,
    )


def _llama_pairs(ours: LanguageModel, theirs: HFLlama) -> Iterator[tuple[str, Tensor, Tensor]]:
    """``(their name, our tensor, theirs)`` for every weight of a Llama or Qwen3 model."""
    qwen3 = isinstance(theirs, Qwen3ForCausalLM)
    expected = qwen3_config(ours.config) if qwen3 else llama_config(ours.config)
    check_same_settings(expected, theirs.config, LLAMA_MATCHING)
    mine = dict(ours.named_parameters(remove_duplicate=False))
    for name, mine_p in mine.items():
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            module, kind = rest.rsplit(".", 1)
            their_name = f"model.layers.{i}.{LLAMA_NAMES[module]}.{kind}"
        else:
            module, kind = name.rsplit(".", 1)
            their_name = f"{LLAMA_OUTSIDE[module]}.{kind}"
        if name == "lm_head.weight" and ours.config.tie_embeddings:
            continue  # the embedding, already copied
        yield their_name, mine_p, theirs.get_parameter(their_name)


def _setting(config: PretrainedConfig, key: str) -> object:
    value = getattr(config, key, None)
    return _rope_settings(value) if key == "rope_parameters" else value


def check_same_settings(
    expected: PretrainedConfig, actual: PretrainedConfig, keys: Iterable[str]
) -> None:
    """Refuse two ``transformers`` configs that differ in any of ``keys`` (rope parameters
    compared by meaning: defaults written out or not), naming each difference."""
    wrong = [
        f"{k}: ours {getattr(expected, k)!r}, theirs {getattr(actual, k)!r}"
        for k in keys
        if _setting(expected, k) != _setting(actual, k)
    ]
    if wrong:
        raise ValueError("the two models differ in " + "; ".join(wrong))


def _copy_llama(
    ours: LanguageModel, theirs: HFLlama, kind: type, name: str, *, to_theirs: bool
) -> None:
    check_models(ours, theirs, kind, name=name)
    pairs = [
        (name, their, mine) if to_theirs else (name, mine, their)
        for name, mine, their in _llama_pairs(ours, theirs)
    ]
    copy_pairs(pairs, ours, theirs, name=name)


def copy_from_llama(ours: LanguageModel, llama: LlamaForCausalLM) -> None:
    """Copy a ``LlamaForCausalLM``'s weights into our :class:`LanguageModel` (same sizes,
    Llama's choices): every weight as it is, under the names of :data:`LLAMA_NAMES`."""
    _copy_llama(ours, llama, LlamaForCausalLM, "llama", to_theirs=False)


def copy_to_llama(ours: LanguageModel, llama: LlamaForCausalLM) -> None:
    """Copy our :class:`LanguageModel`'s weights into a ``LlamaForCausalLM``: the inverse of
    :func:`copy_from_llama`."""
    _copy_llama(ours, llama, LlamaForCausalLM, "llama", to_theirs=True)


def copy_from_qwen3(ours: LanguageModel, qwen3: Qwen3ForCausalLM) -> None:
    """Copy a ``Qwen3ForCausalLM``'s weights into our :class:`LanguageModel` (Qwen3's choices:
    QK-norm): as :func:`copy_from_llama`, with the ``q_norm`` and ``k_norm`` weights."""
    _copy_llama(ours, qwen3, Qwen3ForCausalLM, "qwen3", to_theirs=False)


def copy_to_qwen3(ours: LanguageModel, qwen3: Qwen3ForCausalLM) -> None:
    """Copy our :class:`LanguageModel`'s weights into a ``Qwen3ForCausalLM``: the inverse of
    :func:`copy_from_qwen3`."""
    _copy_llama(ours, qwen3, Qwen3ForCausalLM, "qwen3", to_theirs=True)
