"""Chapter 13: weights to and from ``transformers``' GPT-2, one tested mapping, both directions.

GPT-2 (``GPT2LMHeadModel``) is the book's :class:`LanguageModel` with its defaults — pre-norm,
learned positions, tanh-GELU, tied embeddings — but stores three things differently:

- its projections are ``Conv1D`` modules whose weight is ``(in, out)``, the transpose of
  ``nn.Linear``'s ``(out, in)``: ``y = x @ W + b``;
- the three input projections of attention are one fused ``c_attn``: weight ``(D, 3D)`` whose
  columns are ``[q | k | v]``;
- the output layer ``lm_head`` is tied to the token table ``wte``, like ours.

Both directions read one table of ``(ours, theirs, transposed)`` pairs, so they cannot disagree.
Settings that are not weights must already agree; a clear error names each that does not.
Llama's and Qwen3's mappings (chapter 17) are in :mod:`~transformer_tutorial.lm.hf_weights`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn
from transformers import GPT2Config, GPT2LMHeadModel

from transformer_tutorial.checks import check_type
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lora import LoRALinear
from transformer_tutorial.quantization import QuantizedLinear

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


def check_models(ours: object, theirs: object, kind: type, *, name: str = "theirs") -> None:
    """Refuse a copy between ``ours`` and ``theirs`` (the argument ``name``) before anything is
    copied: ``ours`` must be a :class:`LanguageModel`, ``theirs`` a ``kind``, both holding plain
    weights (LoRA merged, not quantized: those hold no weight where a checkpoint's goes). Every
    copy function of the package's weight mappings calls it first."""
    check_type("ours", ours, LanguageModel, "a LanguageModel")
    check_type(name, theirs, kind, f"a {kind.__name__}")
    for side, model in (("ours", ours), (name, theirs)):
        for name, module in model.named_modules():
            if isinstance(module, LoRALinear):
                raise ValueError(
                    f"{side} holds LoRA layers ({name}): merge them first (lora.merge_lora), "
                    "then copy"
                )
            if isinstance(module, QuantizedLinear):
                raise ValueError(
                    f"{side} is quantized ({name}): copy the float weights, then quantize"
                )


def copy_pairs(
    pairs: Iterable[tuple[str, Tensor, Tensor]],
    ours: nn.Module,
    theirs: nn.Module,
    *,
    name: str = "theirs",
) -> None:
    """Copy each ``(their name, destination, source)`` pair, after checking all of them: every
    shape equal, and every weight of both models written or read (a model changed after it was
    built, with a layer replaced or a table resized, is refused, naming the first difference).
    A refused copy leaves both models as they were."""
    pairs = list(pairs)
    for weight, dst, src in pairs:
        if dst.shape != src.shape:
            shapes = f"{tuple(dst.shape)} vs {tuple(src.shape)}"
            raise ValueError(f"{weight}: shapes differ, {shapes}")
    touched = {id(t) for _, dst, src in pairs for t in (dst, src)}
    touched |= {id(t._base) for _, dst, src in pairs for t in (dst, src) if t._base is not None}
    for side, model in (("ours", ours), (name, theirs)):
        skipped = _tied_head(model)
        left = [n for n, p in model.named_parameters() if id(p) not in touched | skipped]
        if left:
            raise ValueError(
                f"{side} has weights the mapping does not know ({', '.join(left[:3])}): "
                "a layer replaced or added after the model was built"
            )
    with torch.no_grad():
        for _, dst, src in pairs:
            dst.copy_(src)


def _tied_head(model: nn.Module) -> set[int]:
    """The output layer's weight of a model whose config ties it to the embedding (it is
    copied as the embedding; building on ``meta`` and ``to_empty`` can leave it a tensor of its
    own until the weights are tied again), as an id; else none."""
    config = getattr(model, "config", None)
    if isinstance(model, LanguageModel) and model.config.tie_embeddings:
        return {id(model.lm_head.weight)}
    if getattr(config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None:
        return {id(model.get_output_embeddings().weight)}
    return set()


def gpt2_config(config: LMConfig) -> GPT2Config:
    """The ``GPT2Config`` of the model our ``config`` builds; an error if ours is not GPT-2's
    kind (its message lists every field to change)."""
    check_type("config", config, LMConfig, "an LMConfig")
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
    check_type("config", config, GPT2Config, "a GPT2Config")
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


def copy_from_gpt2(ours: LanguageModel, gpt2: GPT2LMHeadModel) -> None:
    """Copy a ``GPT2LMHeadModel``'s weights into our :class:`LanguageModel` (same sizes):
    ``Conv1D`` weights transposed, ``c_attn`` split into ``q_proj``, ``k_proj``, ``v_proj``."""
    check_models(ours, gpt2, GPT2LMHeadModel, name="gpt2")
    pairs = [
        (name, mine, t.T if transposed else t) for name, mine, t, transposed in _pairs(ours, gpt2)
    ]
    copy_pairs(pairs, ours, gpt2, name="gpt2")


def copy_to_gpt2(ours: LanguageModel, gpt2: GPT2LMHeadModel) -> None:
    """Copy our :class:`LanguageModel`'s weights into a ``GPT2LMHeadModel`` (same sizes): the
    inverse of :func:`copy_from_gpt2`."""
    check_models(ours, gpt2, GPT2LMHeadModel, name="gpt2")
    pairs = [
        (name, t, mine.T if transposed else mine)
        for name, mine, t, transposed in _pairs(ours, gpt2)
    ]
    copy_pairs(pairs, ours, gpt2, name="gpt2")
