"""Chapter 20: weights to and from ``transformers``' Qwen3-MoE (``Qwen3MoeForCausalLM``), one
tested mapping, both directions.

Qwen3-MoE is Qwen3 (chapter 17's :mod:`~transformer_tutorial.lm.hf_weights`) whose feed-forward
layers are, where ``decoder_sparse_step`` and ``mlp_only_layers`` say so, mixtures of experts:
:data:`~transformer_tutorial.lm.config.QWEN3` with ``n_experts`` > 0. Attention, norms,
embeddings and dense layers keep Qwen3's names (:data:`~transformer_tutorial.lm.hf_weights.
LLAMA_NAMES`). In a sparse layer the router ``ff.router`` is their ``mlp.gate``; our experts
keep ``gate_proj`` and ``up_proj`` apart, ``(E, F, D)`` each, where ``transformers`` stacks
them as one ``mlp.experts.gate_up_proj`` ``(E, 2F, D)``, gate first; ``down_proj`` ``(E, D, F)``
is the same on both sides. Settings that are not weights must already agree, and a clear error
names each that does not.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import Tensor
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from transformer_tutorial.checks import check_type
from transformer_tutorial.lm.config import QWEN3, LMConfig
from transformer_tutorial.lm.gpt2_weights import check_models, copy_pairs
from transformer_tutorial.lm.hf_weights import (
    LLAMA_MATCHING,
    LLAMA_NAMES,
    LLAMA_OUTSIDE,
    _max_len,
    _require,
    _rope_settings,
    _shared_fields,
    check_same_settings,
)
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.moe import MixtureOfExperts

# The settings that change the outputs beyond Qwen3's: equal on both sides or refused.
MOE_MATCHING = (
    *LLAMA_MATCHING,
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
)
# Our names → theirs inside a sparse layer's feed-forward (``ff.`` → ``mlp.``).
MOE_NAMES = {"router.weight": "gate.weight", "experts.down_proj": "experts.down_proj"}
GATE_UP = "experts.gate_up_proj"  # our experts.gate_proj and experts.up_proj, stacked


def qwen3_moe_config(config: LMConfig) -> Qwen3MoeConfig:
    """The ``Qwen3MoeConfig`` of the model our ``config`` builds (``moe_d_ff`` None →
    ``moe_intermediate_size`` = ``d_ff``; ``dense_layers`` → ``mlp_only_layers``;
    ``sparse_step`` → ``decoder_sparse_step``). An error names every field to change if ours
    is not Qwen3's kind."""
    required = {k: v for k, v in QWEN3.items() if k != "tie_embeddings"}
    _require(config, dict(required, partial_rotary_factor=1.0, router="softmax"), "Qwen3-MoE")
    return Qwen3MoeConfig(
        **_shared_fields(config),
        attention_bias=False,
        use_sliding_window=config.window is not None,
        sliding_window=config.window,
        num_experts=config.n_experts,
        num_experts_per_tok=config.n_experts_per_token,
        moe_intermediate_size=config.moe_d_ff or config.d_ff,
        norm_topk_prob=config.norm_topk_prob,
        decoder_sparse_step=config.sparse_step,
        mlp_only_layers=list(config.dense_layers),
        router_aux_loss_coef=config.router_aux_loss_coef,
    )


def lm_config_from_qwen3_moe(config: Qwen3MoeConfig, *, max_len: int | None = None) -> LMConfig:
    """Our :class:`LMConfig` for a ``Qwen3MoeConfig`` (``dropout``: its ``attention_dropout``);
    rope types and ``max_len`` as :func:`~transformer_tutorial.lm.hf_weights.
    lm_config_from_llama`."""
    check_type("config", config, Qwen3MoeConfig, "a Qwen3MoeConfig")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r}: ours maps only SwiGLU ('silu')")
    rope_base, rope_scaling, partial = _rope_settings(config.rope_parameters)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial}: Qwen3-MoE rotates whole heads")
    if config.attention_bias:
        raise ValueError("attention_bias=True: ours gives Qwen3's kind no biases")
    heads, sparse = config.num_attention_heads, config.num_experts > 0
    moe = dict(
        n_experts=config.num_experts,
        n_experts_per_token=config.num_experts_per_tok,
        moe_d_ff=config.moe_intermediate_size,
        norm_topk_prob=config.norm_topk_prob,
        sparse_step=config.decoder_sparse_step,
        dense_layers=tuple(config.mlp_only_layers),
        router_aux_loss_coef=config.router_aux_loss_coef,
    )
    return LMConfig(
        vocab_size=config.vocab_size,
        d_model=config.hidden_size,
        n_heads=heads,
        n_layers=config.num_hidden_layers,
        d_ff=config.intermediate_size,
        max_len=_max_len(config, rope_scaling, max_len),
        dropout=float(config.attention_dropout),
        **QWEN3
        | dict(layer_norm_eps=config.rms_norm_eps, tie_embeddings=config.tie_word_embeddings),
        rope_base=rope_base,
        rope_scaling=rope_scaling,
        n_kv_heads=config.num_key_value_heads,
        d_head=None if config.head_dim == config.hidden_size // heads else config.head_dim,
        window=config.sliding_window,
        **(moe if sparse else {}),
    )


def _pairs(
    ours: LanguageModel, theirs: Qwen3MoeForCausalLM
) -> Iterator[tuple[str, list[Tensor], Tensor]]:
    """``(their name, our tensors, theirs)`` for every weight: our tensors are one, or the
    experts' ``[gate_proj, up_proj]`` that their ``gate_up_proj`` stacks."""
    expected = qwen3_moe_config(ours.config)
    check_same_settings(expected, theirs.config, MOE_MATCHING)
    for name, mine in ours.named_parameters(remove_duplicate=False):
        if name == "lm_head.weight" and ours.config.tie_embeddings:
            continue  # the embedding, already copied
        if not name.startswith("layers."):
            module, kind = name.rsplit(".", 1)
            their_name = f"{LLAMA_OUTSIDE[module]}.{kind}"
            yield their_name, [mine], theirs.get_parameter(their_name)
            continue
        _, i, rest = name.split(".", 2)
        prefix = f"model.layers.{i}."
        if rest.startswith("ff.") and ours.config.is_sparse(int(i)):
            if rest == "ff.experts.up_proj":
                continue  # stacked with gate_proj
            if rest == "ff.experts.gate_proj":
                up = ours.get_parameter(f"layers.{i}.ff.experts.up_proj")
                yield (
                    prefix + "mlp." + GATE_UP,
                    [mine, up],
                    theirs.get_parameter(prefix + "mlp." + GATE_UP),
                )
                continue
            their_name = prefix + "mlp." + MOE_NAMES[rest.removeprefix("ff.")]
        else:
            module, kind = rest.rsplit(".", 1)
            their_name = f"{prefix}{LLAMA_NAMES[module]}.{kind}"
        yield their_name, [mine], theirs.get_parameter(their_name)


def _copy(ours: LanguageModel, theirs: Qwen3MoeForCausalLM, *, to_theirs: bool) -> None:
    check_models(ours, theirs, Qwen3MoeForCausalLM)
    copy_pairs(split_pairs(_pairs(ours, theirs), to_theirs=to_theirs), ours, theirs)


def split_pairs(
    named: Iterable[tuple[str, tuple[Tensor, ...], Tensor]], *, to_theirs: bool
) -> list[tuple[str, Tensor, Tensor]]:
    """``(their name, destination, source)`` for each ``(their name, our tensors, theirs)``:
    where we keep two tensors for one of theirs (gate and up of the merged ``gate_up_proj``),
    each pairs with its half of theirs along dim 1 (views, so a copy writes into theirs)."""
    pairs = []
    for name, mine, their in named:
        parts = their.chunk(len(mine), dim=1) if len(mine) > 1 else (their,)
        if len(parts) != len(mine):
            raise ValueError(f"{name}: shapes differ, {tuple(their.shape)} cannot split in two")
        for part, piece in zip(mine, parts, strict=True):
            pairs.append((name, piece, part) if to_theirs else (name, part, piece))
    return pairs


def copy_from_qwen3_moe(ours: LanguageModel, theirs: Qwen3MoeForCausalLM) -> None:
    """Copy a ``Qwen3MoeForCausalLM``'s weights into our :class:`LanguageModel` (same sizes,
    Qwen3's choices, the same sparse layers); ``gate_up_proj`` is split into our experts'
    ``gate_proj`` and ``up_proj``."""
    _copy(ours, theirs, to_theirs=False)


def copy_to_qwen3_moe(ours: LanguageModel, theirs: Qwen3MoeForCausalLM) -> None:
    """Copy our :class:`LanguageModel`'s weights into a ``Qwen3MoeForCausalLM``: the inverse of
    :func:`copy_from_qwen3_moe`."""
    _copy(ours, theirs, to_theirs=True)


def copy_block_to_qwen3_moe(ours: MixtureOfExperts, theirs: Qwen3MoeSparseMoeBlock) -> None:
    """One layer's mapping: our :class:`~transformer_tutorial.lm.moe.MixtureOfExperts` into a
    ``Qwen3MoeSparseMoeBlock`` of the same sizes (router → ``gate``, ``gate_proj`` and
    ``up_proj`` stacked into ``gate_up_proj``)."""
    check_type("ours", ours, MixtureOfExperts, "a MixtureOfExperts")
    check_type("theirs", theirs, Qwen3MoeSparseMoeBlock, "a Qwen3MoeSparseMoeBlock")
    settings = {  # name: (ours, theirs)
        "num_experts_per_tok": (ours.top_k, theirs.gate.top_k),
        "norm_topk_prob": (ours.norm_topk_prob, theirs.gate.norm_topk_prob),
    }
    wrong = [f"{k}: ours {a!r}, theirs {b!r}" for k, (a, b) in settings.items() if a != b]
    if wrong:
        raise ValueError("the two blocks differ in " + "; ".join(wrong))
    e, gate_up = ours.experts, theirs.get_parameter("experts.gate_up_proj")
    pairs = [
        ("gate.weight", theirs.get_parameter("gate.weight"), ours.router.weight),
        *(
            ("experts.gate_up_proj", half, mine)  # gate first
            for half, mine in zip(gate_up.chunk(2, dim=1), (e.gate_proj, e.up_proj), strict=True)
        ),
        ("experts.down_proj", theirs.get_parameter("experts.down_proj"), e.down_proj),
    ]
    copy_pairs(pairs, ours, theirs)
