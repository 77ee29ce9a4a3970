"""Chapters 13 and 17: weights to and from ``transformers``' models, one tested mapping per model
and direction: GPT-2 (chapter 13), Llama and Qwen3 (chapter 17).

GPT-2 (``GPT2LMHeadModel``) is the book's :class:`LanguageModel` with its defaults — pre-norm,
learned positions, tanh-GELU, tied embeddings — but stores three things differently:

- its projections are ``Conv1D`` modules whose weight is ``(in, out)``, the transpose of
  ``nn.Linear``'s ``(out, in)``: ``y = x @ W + b``;
- the three input projections of attention are one fused ``c_attn``: weight ``(D, 3D)`` whose
  columns are ``[q | k | v]``;
- the output layer ``lm_head`` is tied to the token table ``wte``, like ours.

Both directions read one table of ``(ours, theirs, transposed)`` pairs, so they cannot disagree.
Settings that are not weights must already agree; a clear error names each that does not.

Llama (``LlamaForCausalLM``) and Qwen3 (``Qwen3ForCausalLM``) are our model with the choices of
:data:`~transformer_tutorial.lm_pieces.LLAMA` and :data:`~transformer_tutorial.lm_pieces.QWEN3`:
their weights are ``nn.Linear``'s as ours, one matrix per projection, and their rotary layout is
ours (half-split), so every pair is a rename: :data:`LLAMA_NAMES`. Qwen3 adds the per-head
``q_norm``/``k_norm`` weights, and its sliding window (all layers, ``max_window_layers=0``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from transformer_tutorial.language_model import LanguageModel, LMConfig
from transformer_tutorial.lm_pieces import LLAMA, QWEN3

# The fields of LMConfig a copy needs equal on both sides.
MATCHING = (
    "vocab_size",
    "d_model",
    "n_heads",
    "n_layers",
    "d_ff",
    "max_len",
    "layer_norm_eps",
    "tie_embeddings",
)
# transformers' names of the tanh approximation of GELU (equal up to float rounding).
GPT2_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")


def gpt2_config(config: LMConfig) -> GPT2Config:
    """The ``GPT2Config`` of the model our ``config`` builds; an error if ours is not GPT-2's
    kind (its message lists every field to change)."""
    required = dict(
        norm_first=True,
        norm="layer",
        activation="gelu_tanh",
        positions="learned",
        attention="mha",
        bias=True,
        scale_embeddings=False,
    )
    wrong = [f"{k}={v!r}" for k, v in required.items() if getattr(config, k) != v]
    if wrong:
        raise ValueError(f"GPT-2 has no equivalent of this config; set {', '.join(wrong)}")
    return GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.max_len,
        n_embd=config.d_model,
        n_layer=config.n_layers,
        n_head=config.n_heads,
        n_inner=config.d_ff,
        activation_function="gelu_new",
        resid_pdrop=config.dropout,
        embd_pdrop=config.dropout,
        attn_pdrop=config.dropout,
        layer_norm_epsilon=config.layer_norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        bos_token_id=None,
        eos_token_id=None,
    )


def lm_config_from_gpt2(config: GPT2Config) -> LMConfig:
    """Our :class:`LMConfig` for a ``GPT2Config``. GPT-2's three dropouts (embeddings,
    attention, residual) become our one ``dropout``: its ``resid_pdrop``."""
    if config.activation_function not in GPT2_TANH_GELUS:
        raise ValueError(
            f"activation_function={config.activation_function!r}: ours maps only GELU's tanh "
            f"approximation, one of {list(GPT2_TANH_GELUS)}"
        )
    if not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx:
        raise ValueError(
            "attention scores must be scaled by 1/√Dh only: set scale_attn_weights=True and "
            "scale_attn_by_inverse_layer_idx=False"
        )
    if config.add_cross_attention:
        raise ValueError("add_cross_attention=True: a decoder-only model has no cross-attention")
    return LMConfig(
        vocab_size=config.vocab_size,
        d_model=config.n_embd,
        n_heads=config.n_head,
        n_layers=config.n_layer,
        d_ff=config.n_inner or 4 * config.n_embd,
        max_len=config.n_positions,
        dropout=float(config.resid_pdrop),
        layer_norm_eps=config.layer_norm_epsilon,
        tie_embeddings=config.tie_word_embeddings,
    )


def _pairs(
    ours: LanguageModel, gpt2: GPT2LMHeadModel
) -> Iterator[tuple[str, Tensor, Tensor, bool]]:
    """``(GPT-2's name, our tensor, GPT-2's tensor or a view of it, transposed?)`` for every
    weight. A view of GPT-2's fused ``c_attn`` is written through by ``copy_``."""
    mine, theirs = ours.config, lm_config_from_gpt2(gpt2.config)
    wrong = [
        f"{k}: ours {getattr(mine, k)!r}, GPT-2's {getattr(theirs, k)!r}"
        for k in MATCHING
        if getattr(mine, k) != getattr(theirs, k)
    ]
    gpt2_config(mine)  # ours must be GPT-2's kind
    if wrong:
        raise ValueError("the two models differ in " + "; ".join(wrong))
    t, D = gpt2.transformer, mine.d_model
    yield "transformer.wte.weight", ours.embed.weight, t.wte.weight, False
    yield "transformer.wpe.weight", ours.positions.weight, t.wpe.weight, False
    for i, (layer, block) in enumerate(zip(ours.layers, t.h, strict=True)):
        name = f"transformer.h.{i}"
        attn = layer.self_attn
        for j, proj in enumerate((attn.q_proj, attn.k_proj, attn.v_proj)):
            cols = slice(j * D, (j + 1) * D)  # c_attn's columns: [q | k | v]
            yield (
                f"{name}.attn.c_attn.weight",
                proj.weight,
                block.attn.c_attn.weight[:, cols],
                True,
            )
            yield f"{name}.attn.c_attn.bias", proj.bias, block.attn.c_attn.bias[cols], False
        pairs = [
            ("ln_1", layer.norm1),
            ("attn.c_proj", attn.out_proj),
            ("ln_2", layer.norm2),
            ("mlp.c_fc", layer.ff.linear1),
            ("mlp.c_proj", layer.ff.linear2),
        ]
        for suffix, module in pairs:
            ref = block.get_submodule(suffix)
            conv1d = suffix.startswith(("attn", "mlp"))
            yield f"{name}.{suffix}.weight", module.weight, ref.weight, conv1d
            yield f"{name}.{suffix}.bias", module.bias, ref.bias, False
    yield "transformer.ln_f.weight", ours.norm.weight, t.ln_f.weight, False
    yield "transformer.ln_f.bias", ours.norm.bias, t.ln_f.bias, False
    if not mine.tie_embeddings:
        yield "lm_head.weight", ours.lm_head.weight, gpt2.lm_head.weight, False


def _copy(dst: Tensor, src: Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: shapes differ, {tuple(dst.shape)} vs {tuple(src.shape)}")
    dst.copy_(src)


def copy_from_gpt2(ours: LanguageModel, gpt2: GPT2LMHeadModel) -> None:
    """Copy a ``GPT2LMHeadModel``'s weights into our :class:`LanguageModel` (same sizes):
    ``Conv1D`` weights transposed, ``c_attn`` split into ``q_proj``, ``k_proj``, ``v_proj``."""
    with torch.no_grad():
        for name, mine, theirs, transposed in _pairs(ours, gpt2):
            _copy(mine, theirs.T if transposed else theirs, name)


def copy_to_gpt2(ours: LanguageModel, gpt2: GPT2LMHeadModel) -> None:
    """Copy our :class:`LanguageModel`'s weights into a ``GPT2LMHeadModel`` (same sizes): the
    inverse of :func:`copy_from_gpt2`."""
    with torch.no_grad():
        for name, mine, theirs, transposed in _pairs(ours, gpt2):
            _copy(theirs, mine.T if transposed else mine, name)


# --- Llama and Qwen3 ----------------------------------------------------------------------------

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


def _require(config: LMConfig, required: dict, model: str) -> None:
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
        head_dim=config.head_dim,
        max_position_embeddings=config.max_len,
        rms_norm_eps=config.layer_norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_base},
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
    _require(config, dict(required, qk_norm=False, window=None), "Llama")
    return LlamaConfig(**_shared_fields(config), attention_bias=config.bias, mlp_bias=config.bias)


def qwen3_config(config: LMConfig) -> Qwen3Config:
    """The ``Qwen3Config`` of the model our ``config`` builds; a ``window`` slides in every
    layer (``max_window_layers=0``). An error names every field to change if ours is not
    Qwen3's kind (its feed-forward has no biases: ``bias=False``)."""
    required = {k: v for k, v in QWEN3.items() if k != "tie_embeddings"}
    _require(config, required, "Qwen3")
    return Qwen3Config(
        **_shared_fields(config),
        attention_bias=False,
        use_sliding_window=config.window is not None,
        sliding_window=config.window,
        max_window_layers=0,
    )


def lm_config_from_llama(config: LlamaConfig | Qwen3Config) -> LMConfig:
    """Our :class:`LMConfig` for a ``LlamaConfig`` or a ``Qwen3Config`` (``dropout``: its
    ``attention_dropout``; Llama has no other)."""
    qwen3 = isinstance(config, Qwen3Config)
    rope = config.rope_parameters or {}
    if config.hidden_act != "silu" or rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"hidden_act={config.hidden_act!r}, rope_type={rope.get('rope_type')!r}: ours maps "
            "only SwiGLU ('silu') and unscaled rotary positions ('default')"
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
        max_len=config.max_position_embeddings,
        dropout=float(config.attention_dropout),
        **(QWEN3 if qwen3 else LLAMA)
        | dict(
            layer_norm_eps=config.rms_norm_eps,
            bias=bias,
            tie_embeddings=config.tie_word_embeddings,
        ),
        rope_base=float(rope.get("rope_theta", 10000.0)),
        n_kv_heads=config.num_key_value_heads,
        d_head=None if config.head_dim == config.hidden_size // heads else config.head_dim,
        window=window,
    )


def _llama_pairs(ours: LanguageModel, theirs: HFLlama) -> Iterator[tuple[str, Tensor, Tensor]]:
    """``(their name, our tensor, theirs)`` for every weight of a Llama or Qwen3 model."""
    qwen3 = isinstance(theirs, Qwen3ForCausalLM)
    expected = qwen3_config(ours.config) if qwen3 else llama_config(ours.config)
    wrong = [
        f"{k}: ours {getattr(expected, k)!r}, theirs {getattr(theirs.config, k)!r}"
        for k in LLAMA_MATCHING
        if getattr(expected, k, None) != getattr(theirs.config, k, None)
    ]
    if wrong:
        raise ValueError("the two models differ in " + "; ".join(wrong))
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


def _copy_llama(ours: LanguageModel, theirs: HFLlama, *, to_theirs: bool) -> None:
    with torch.no_grad():
        for name, mine, their in _llama_pairs(ours, theirs):
            dst, src = (their, mine) if to_theirs else (mine, their)
            _copy(dst, src, name)


def copy_from_llama(ours: LanguageModel, llama: LlamaForCausalLM) -> None:
    """Copy a ``LlamaForCausalLM``'s weights into our :class:`LanguageModel` (same sizes,
    Llama's choices): every weight as it is, under the names of :data:`LLAMA_NAMES`."""
    _check_kind(llama, LlamaForCausalLM)
    _copy_llama(ours, llama, to_theirs=False)


def copy_to_llama(ours: LanguageModel, llama: LlamaForCausalLM) -> None:
    """Copy our :class:`LanguageModel`'s weights into a ``LlamaForCausalLM``: the inverse of
    :func:`copy_from_llama`."""
    _check_kind(llama, LlamaForCausalLM)
    _copy_llama(ours, llama, to_theirs=True)


def copy_from_qwen3(ours: LanguageModel, qwen3: Qwen3ForCausalLM) -> None:
    """Copy a ``Qwen3ForCausalLM``'s weights into our :class:`LanguageModel` (Qwen3's choices:
    QK-norm): as :func:`copy_from_llama`, with the ``q_norm`` and ``k_norm`` weights."""
    _check_kind(qwen3, Qwen3ForCausalLM)
    _copy_llama(ours, qwen3, to_theirs=False)


def copy_to_qwen3(ours: LanguageModel, qwen3: Qwen3ForCausalLM) -> None:
    """Copy our :class:`LanguageModel`'s weights into a ``Qwen3ForCausalLM``: the inverse of
    :func:`copy_from_qwen3`."""
    _check_kind(qwen3, Qwen3ForCausalLM)
    _copy_llama(ours, qwen3, to_theirs=True)


def _check_kind(model: nn.Module, kind: type) -> None:
    if not isinstance(model, kind):
        raise TypeError(f"expected a {kind.__name__}, got {type(model).__name__}")
