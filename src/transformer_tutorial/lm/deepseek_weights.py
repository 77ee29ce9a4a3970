"""Chapter 21: weights to and from ``transformers``' DeepSeek-V3 (``DeepseekV3ForCausalLM``) with
every feed-forward layer dense, one tested mapping, both directions.

Our model with ``attention="mla"`` and Llama's other choices is DeepSeek-V3 whose first
``first_k_dense_replace`` = all layers are dense. Norms, embeddings and the SwiGLU layers keep
Llama's names (:data:`~transformer_tutorial.lm.hf_weights.LLAMA_NAMES`); the attention's are
:data:`MLA_NAMES`. Each weight is copied as it is: the rotary layout is a setting
(``rope_interleave``), not a permutation of rows. Settings that are not weights must agree, and
a clear error names each that does not.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from transformer_tutorial.lm.config import LLAMA, LMConfig
from transformer_tutorial.lm.hf_weights import (
    LLAMA_NAMES,
    LLAMA_OUTSIDE,
    _check_kind,
    _max_len,
    _require,
    _rope_parameters,
    _rope_settings,
    check_same_settings,
)
from transformer_tutorial.lm.model import LanguageModel

# Our attention's names → theirs (``self_attn.`` on both sides).
MLA_NAMES = {
    "q_proj": "q_proj",  # q_lora_rank None
    "q_a_proj": "q_a_proj",
    "q_a_norm": "q_a_layernorm",
    "q_b_proj": "q_b_proj",
    "kv_a_proj": "kv_a_proj_with_mqa",
    "kv_a_norm": "kv_a_layernorm",
    "kv_b_proj": "kv_b_proj",
    "out_proj": "o_proj",
}
# The settings that change the outputs: equal on both sides or refused.
DEEPSEEK_MATCHING = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_bias",
    "rope_parameters",
    "rope_interleave",
    "first_k_dense_replace",
)
# Our choices beside the attention: Llama's, without its grouped heads.
DEEPSEEK = {**{k: v for k, v in LLAMA.items() if k != "attention"}, "attention": "mla"}


def deepseek_v3_config(config: LMConfig) -> DeepseekV3Config:
    """The ``DeepseekV3Config`` of the model our ``config`` builds: every layer dense
    (``first_k_dense_replace`` = layers). An error names every field to change if ours is not
    DeepSeek's kind."""
    required = {k: v for k, v in DEEPSEEK.items() if k not in ("tie_embeddings", "layer_norm_eps")}
    _require(config, required, "DeepSeek-V3")
    return DeepseekV3Config(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.d_ff,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_heads,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        first_k_dense_replace=config.n_layers,
        max_position_embeddings=config.max_len,
        rms_norm_eps=config.layer_norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        rope_parameters=_rope_parameters(config),
        rope_interleave=config.rope_interleave,
        attention_bias=False,
        attention_dropout=config.dropout,
        hidden_act="silu",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def lm_config_from_deepseek_v3(
    config: DeepseekV3Config, *, max_len: int | None = None
) -> LMConfig:
    """Our :class:`LMConfig` for a ``DeepseekV3Config`` whose layers are all dense
    (``dropout``: its ``attention_dropout``). Mixture-of-experts layers, biases, grouped heads
    and head widths that do not add up are refused, naming the setting. ``max_len`` as
    :func:`~transformer_tutorial.lm.hf_weights.lm_config_from_llama` (YaRN's
    ``factor × original_max_position_embeddings`` if longer than theirs)."""
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r}: ours maps only SwiGLU ('silu')")
    if config.first_k_dense_replace < config.num_hidden_layers:
        raise ValueError(
            f"first_k_dense_replace={config.first_k_dense_replace} < num_hidden_layers="
            f"{config.num_hidden_layers}: DeepSeek's mixture of experts is not mapped; make "
            "every layer dense"
        )
    if config.attention_bias:
        raise ValueError("attention_bias=True: ours gives latent attention no biases")
    if config.num_key_value_heads != config.num_attention_heads:
        raise ValueError(
            f"num_key_value_heads={config.num_key_value_heads} must equal num_attention_heads="
            f"{config.num_attention_heads}: MLA's heads each get their own key from the latent"
        )
    nope, rope = config.qk_nope_head_dim, config.qk_rope_head_dim
    if config.qk_head_dim != nope + rope or config.head_dim != rope:
        raise ValueError(
            f"qk_head_dim={config.qk_head_dim} must be qk_nope_head_dim + qk_rope_head_dim = "
            f"{nope + rope} and head_dim={config.head_dim} the rotary width {rope}"
        )
    rope_base, rope_scaling, partial = _rope_settings(config.rope_parameters)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial}: MLA rotates its whole rotary part")
    return LMConfig(
        vocab_size=config.vocab_size,
        d_model=config.hidden_size,
        n_heads=config.num_attention_heads,
        n_layers=config.num_hidden_layers,
        d_ff=config.intermediate_size,
        max_len=_max_len(config, rope_scaling, max_len),
        dropout=float(config.attention_dropout),
        **DEEPSEEK
        | dict(layer_norm_eps=config.rms_norm_eps, tie_embeddings=config.tie_word_embeddings),
        rope_base=rope_base,
        rope_scaling=rope_scaling,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=config.v_head_dim,
        rope_interleave=bool(config.rope_interleave),
    )


def _pairs(
    ours: LanguageModel, theirs: DeepseekV3ForCausalLM
) -> Iterator[tuple[str, Tensor, Tensor]]:
    """``(their name, our tensor, theirs)`` for every weight."""
    expected = deepseek_v3_config(ours.config)
    check_same_settings(expected, theirs.config, DEEPSEEK_MATCHING)
    for name, mine in ours.named_parameters(remove_duplicate=False):
        if name == "lm_head.weight" and ours.config.tie_embeddings:
            continue  # the embedding, already copied
        module, kind = name.rsplit(".", 1)
        if not name.startswith("layers."):
            their_name = f"{LLAMA_OUTSIDE[module]}.{kind}"
        else:
            _, i, rest = module.split(".", 2)
            if rest.startswith("self_attn."):
                their = "self_attn." + MLA_NAMES[rest.removeprefix("self_attn.")]
            else:
                their = LLAMA_NAMES[rest]
            their_name = f"model.layers.{i}.{their}.{kind}"
        yield their_name, mine, theirs.get_parameter(their_name)


def _copy(ours: LanguageModel, theirs: DeepseekV3ForCausalLM, *, to_theirs: bool) -> None:
    _check_kind(theirs, DeepseekV3ForCausalLM)
    with torch.no_grad():
        for name, mine, their in _pairs(ours, theirs):
            dst, src = (their, mine) if to_theirs else (mine, their)
            if dst.shape != src.shape:
                raise ValueError(
                    f"{name}: shapes differ, {tuple(dst.shape)} vs {tuple(src.shape)}"
                )
            dst.copy_(src)


def copy_from_deepseek_v3(ours: LanguageModel, theirs: DeepseekV3ForCausalLM) -> None:
    """Copy a dense ``DeepseekV3ForCausalLM``'s weights into our :class:`LanguageModel` (same
    sizes and settings): every weight as it is, under :data:`MLA_NAMES` and Llama's names."""
    _copy(ours, theirs, to_theirs=False)


def copy_to_deepseek_v3(ours: LanguageModel, theirs: DeepseekV3ForCausalLM) -> None:
    """Copy our :class:`LanguageModel`'s weights into a dense ``DeepseekV3ForCausalLM``: the
    inverse of :func:`copy_from_deepseek_v3`."""
    _copy(ours, theirs, to_theirs=True)
