"""Chapters 20-21: weights to and from ``transformers``' DeepSeek-V3 (``DeepseekV3ForCausalLM``),
one tested mapping, both directions.

Our model with ``attention="mla"`` and Llama's other choices is DeepSeek-V3 whose first
``first_k_dense_replace`` = all layers are dense. With ``n_experts`` > 0 and ``router="sigmoid"``
(chapter 20's :class:`~transformer_tutorial.lm.moe.DeepSeekMoE`) its layers from
``first_k_dense_replace`` on are mixtures of experts: our ``dense_layers`` are the first ``k``.
Norms, embeddings and the dense SwiGLU layers keep Llama's names
(:data:`~transformer_tutorial.lm.hf_weights.LLAMA_NAMES`); the attention's are
:data:`MLA_NAMES`, a mixture's :data:`MOE_NAMES`, where ``transformers`` 5 stacks our experts'
``gate_proj`` and ``up_proj`` ``(E, F, D)`` into one ``experts.gate_up_proj`` ``(E, 2F, D)``,
gate first. Each weight is copied as it is: the rotary layout is a setting (``rope_interleave``),
not a permutation of rows. Settings that are not weights must agree, and a clear error names
each that does not.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from transformer_tutorial.checks import check_type
from transformer_tutorial.lm.config import LLAMA, LMConfig
from transformer_tutorial.lm.gpt2_weights import check_models, copy_pairs
from transformer_tutorial.lm.hf_weights import (
    LLAMA_NAMES,
    LLAMA_OUTSIDE,
    _max_len,
    _require,
    _rope_parameters,
    _rope_settings,
    check_same_settings,
)
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.moe import DeepSeekMoE
from transformer_tutorial.lm.moe_weights import split_pairs

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
# Our names → theirs inside a mixture of experts (``ff.`` → ``mlp.``); the correction bias is a
# buffer, the rest weights.
MOE_NAMES = {
    "router.weight": "gate.weight",
    "correction_bias": "gate.e_score_correction_bias",
    "experts.down_proj": "experts.down_proj",
    "shared_experts.gate_proj.weight": "shared_experts.gate_proj.weight",
    "shared_experts.up_proj.weight": "shared_experts.up_proj.weight",
    "shared_experts.down_proj.weight": "shared_experts.down_proj.weight",
}
GATE_UP = "experts.gate_up_proj"  # our experts.gate_proj and experts.up_proj, stacked
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
# ... and with a mixture of experts.
DEEPSEEK_MOE_MATCHING = (
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_shared_experts",
    "n_group",
    "topk_group",
    "norm_topk_prob",
    "routed_scaling_factor",
)
# Our choices beside the attention: Llama's, without its grouped heads.
DEEPSEEK = {**{k: v for k, v in LLAMA.items() if k != "attention"}, "attention": "mla"}


def deepseek_v3_config(config: LMConfig) -> DeepseekV3Config:
    """The ``DeepseekV3Config`` of the model our ``config`` builds: every layer dense
    (``first_k_dense_replace`` = layers), or with ``n_experts`` its mixtures from
    ``first_k_dense_replace = len(dense_layers)`` on. An error names every field to change if
    ours is not DeepSeek's kind."""
    check_type("config", config, LMConfig, "an LMConfig")
    required = {k: v for k, v in DEEPSEEK.items() if k not in ("tie_embeddings", "layer_norm_eps")}
    if config.n_experts:
        required |= dict(
            router="sigmoid", sparse_step=1, dense_layers=tuple(range(len(config.dense_layers)))
        )
    _require(config, required, "DeepSeek-V3")
    return DeepseekV3Config(
        **_moe_fields(config),
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


def _moe_fields(config: LMConfig) -> dict:
    """``DeepseekV3Config``'s fields for our mixture of experts (none: every layer dense)."""
    if not config.n_experts:
        return dict(first_k_dense_replace=config.n_layers)
    return dict(
        first_k_dense_replace=len(config.dense_layers),
        n_routed_experts=config.n_experts,
        num_experts_per_tok=config.n_experts_per_token,
        moe_intermediate_size=config.moe_d_ff or config.d_ff,
        n_shared_experts=config.n_shared_experts,
        n_group=config.n_group,
        topk_group=config.topk_group,
        norm_topk_prob=config.norm_topk_prob,
        routed_scaling_factor=config.routed_scaling_factor,
    )


def lm_config_from_deepseek_v3(
    config: DeepseekV3Config, *, max_len: int | None = None
) -> LMConfig:
    """Our :class:`LMConfig` for a ``DeepseekV3Config`` (``dropout``: its ``attention_dropout``):
    its layers from ``first_k_dense_replace`` on mixtures of experts (``router="sigmoid"``, the
    first ``k`` our ``dense_layers``). Biases, grouped heads, head widths that do not add up and
    groups that do not fit the experts are refused, naming the setting. ``max_len`` as
    :func:`~transformer_tutorial.lm.hf_weights.lm_config_from_llama` (YaRN's
    ``factor × original_max_position_embeddings`` if longer than theirs)."""
    check_type("config", config, DeepseekV3Config, "a DeepseekV3Config")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r}: ours maps only SwiGLU ('silu')")
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
        **_our_moe_fields(config),
    )


def _our_moe_fields(config: DeepseekV3Config) -> dict:
    """Our mixture's fields for a ``DeepseekV3Config`` (none if every layer is dense)."""
    dense = config.first_k_dense_replace
    if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
        raise ValueError(f"first_k_dense_replace must be an int >= 0, got {dense!r}")
    if dense >= config.num_hidden_layers:
        return {}
    return dict(
        n_experts=config.n_routed_experts,
        n_experts_per_token=config.num_experts_per_tok,
        moe_d_ff=config.moe_intermediate_size,
        norm_topk_prob=bool(config.norm_topk_prob),
        dense_layers=tuple(range(dense)),
        router="sigmoid",
        n_shared_experts=config.n_shared_experts,
        n_group=config.n_group,
        topk_group=config.topk_group,
        routed_scaling_factor=float(config.routed_scaling_factor),
    )


def _pairs(
    ours: LanguageModel, theirs: DeepseekV3ForCausalLM
) -> Iterator[tuple[str, list[Tensor], Tensor]]:
    """``(their name, our tensors, theirs)`` for every weight and correction bias: our tensors
    are one, or the experts' ``[gate_proj, up_proj]`` that their ``gate_up_proj`` stacks."""
    expected = deepseek_v3_config(ours.config)
    moe = DEEPSEEK_MOE_MATCHING if ours.config.n_experts else ()
    check_same_settings(expected, theirs.config, DEEPSEEK_MATCHING + moe)
    biases = [(n, b) for n, b in ours.named_buffers() if n.endswith(".ff.correction_bias")]
    for name, mine in [*ours.named_parameters(remove_duplicate=False), *biases]:
        if name == "lm_head.weight" and ours.config.tie_embeddings:
            continue  # the embedding, already copied
        if not name.startswith("layers."):
            module, kind = name.rsplit(".", 1)
            their_name = f"{LLAMA_OUTSIDE[module]}.{kind}"
            yield their_name, [mine], theirs.get_parameter(their_name)
            continue
        _, i, rest = name.split(".", 2)
        prefix = f"model.layers.{i}."
        if rest.startswith("self_attn."):
            module, kind = rest.removeprefix("self_attn.").rsplit(".", 1)
            their_name = f"{prefix}self_attn.{MLA_NAMES[module]}.{kind}"
        elif rest.startswith("ff.") and ours.config.is_sparse(int(i)):
            rest = rest.removeprefix("ff.")
            if rest == "experts.up_proj":
                continue  # stacked with gate_proj
            if rest == "experts.gate_proj":
                up = ours.get_parameter(f"layers.{i}.ff.experts.up_proj")
                their_name = f"{prefix}mlp.{GATE_UP}"
                yield their_name, [mine, up], theirs.get_parameter(their_name)
                continue
            their_name = f"{prefix}mlp.{MOE_NAMES[rest]}"
            if rest == "correction_bias":
                yield their_name, [mine], theirs.get_buffer(their_name)
                continue
        else:
            module, kind = rest.rsplit(".", 1)
            their_name = f"{prefix}{LLAMA_NAMES[module]}.{kind}"
        yield their_name, [mine], theirs.get_parameter(their_name)


def _copy(ours: LanguageModel, theirs: DeepseekV3ForCausalLM, *, to_theirs: bool) -> None:
    check_models(ours, theirs, DeepseekV3ForCausalLM)
    copy_pairs(split_pairs(_pairs(ours, theirs), to_theirs=to_theirs), ours, theirs)


def copy_from_deepseek_v3(ours: LanguageModel, theirs: DeepseekV3ForCausalLM) -> None:
    """Copy a ``DeepseekV3ForCausalLM``'s weights into our :class:`LanguageModel` (same sizes
    and settings): every weight as it is, under :data:`MLA_NAMES`, :data:`MOE_NAMES` and
    Llama's names, each ``gate_up_proj`` split into ``gate_proj`` and ``up_proj``, and each
    mixture's correction bias."""
    _copy(ours, theirs, to_theirs=False)


def copy_to_deepseek_v3(ours: LanguageModel, theirs: DeepseekV3ForCausalLM) -> None:
    """Copy our :class:`LanguageModel`'s weights into a ``DeepseekV3ForCausalLM``: the inverse
    of :func:`copy_from_deepseek_v3`."""
    _copy(ours, theirs, to_theirs=True)


def copy_block_to_deepseek_v3(ours: DeepSeekMoE, theirs: DeepseekV3MoE) -> None:
    """One layer's mapping: our :class:`~transformer_tutorial.lm.moe.DeepSeekMoE` into a
    ``DeepseekV3MoE`` of the same sizes (:data:`MOE_NAMES`; ``gate_proj`` and ``up_proj``
    stacked into ``gate_up_proj``), the correction bias included."""
    check_type("ours", ours, DeepSeekMoE, "a DeepSeekMoE")
    check_type("theirs", theirs, DeepseekV3MoE, "a DeepseekV3MoE")
    shared, gate = ours.shared_experts, theirs.gate
    settings = {  # name: (ours, theirs)
        "num_experts_per_tok": (ours.top_k, gate.top_k),
        "n_group": (ours.n_group, gate.num_group),
        "topk_group": (ours.topk_group, gate.topk_group),
        "norm_topk_prob": (ours.norm_topk_prob, gate.norm_topk_prob),
        "routed_scaling_factor": (ours.routed_scaling_factor, gate.routed_scaling_factor),
        "the shared experts' width": (
            0 if shared is None else shared.down_proj.in_features,
            theirs.shared_experts.intermediate_size,
        ),
    }
    wrong = [f"{k}: ours {a!r}, theirs {b!r}" for k, (a, b) in settings.items() if a != b]
    if wrong:
        raise ValueError("the two blocks differ in " + "; ".join(wrong))
    mine = dict(ours.named_parameters()) | dict(ours.named_buffers())
    e = ours.experts
    pairs = {GATE_UP: torch.cat([e.gate_proj, e.up_proj], dim=1)}  # (E, 2F, D)
    pairs |= {MOE_NAMES[name]: mine[name] for name in MOE_NAMES if name in mine}
    theirs_all = dict(theirs.named_parameters()) | dict(theirs.named_buffers())
    for name, tensor in pairs.items():
        if theirs_all[name].shape != tensor.shape:
            shapes = f"{tuple(tensor.shape)} vs {tuple(theirs_all[name].shape)}"
            raise ValueError(f"{name}: shapes differ, {shapes}")
    with torch.no_grad():
        for name, tensor in pairs.items():
            theirs_all[name].copy_(tensor)
