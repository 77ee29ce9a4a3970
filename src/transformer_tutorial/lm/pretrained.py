"""Chapter 19: real checkpoints. A folder as ``transformers`` writes it (``config.json`` and
safetensors weights, whole or in shards that ``model.safetensors.index.json`` names) read into
the book's :class:`LanguageModel`, and ours written the same way, for GPT-2, Llama, Qwen3,
Qwen3-MoE and DeepSeek-V3 (latent attention and its mixture of experts): one table of
families, one reader.

A folder is read into a weightless ``transformers`` model of its config on the ``meta`` device,
whose names are the checkpoint's (where ``transformers`` 5 stacks each layer's experts, files
keep every expert's weights apart, and each is read into its place in the stack); the tested
mappings of ``lm.gpt2_weights``, ``lm.hf_weights``, ``lm.moe_weights`` and
``lm.deepseek_weights`` pair its tensors with ours, so no name is repeated here. Files, config,
names and shapes are checked before a weight is read (safetensors: a JSON header, raw bytes, no
pickle), and no file outside the folder is opened. Each tensor is read once, into memory of its
own, and ours (also built on ``meta``) takes it as its weight: loading holds the weights about
once, not a random model beside them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import Tensor, nn
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from transformer_tutorial.checks import check_optional_int
from transformer_tutorial.lm import deepseek_weights, gpt2_weights, hf_weights, moe_weights
from transformer_tutorial.lm.checkpoint_files import (
    CONFIG,
    DTYPES,
    INDEX,
    Part,
    Placed,
    Stored,
    inside,
    json_object,
    read_tensors,
    some,
    stored_tensors,
    write_tensors,
)
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.deepseek_weights import (
    copy_to_deepseek_v3,
    deepseek_v3_config,
    lm_config_from_deepseek_v3,
)
from transformer_tutorial.lm.gpt2_weights import copy_to_gpt2, gpt2_config, lm_config_from_gpt2
from transformer_tutorial.lm.hf_weights import (
    copy_to_llama,
    copy_to_qwen3,
    llama_config,
    lm_config_from_llama,
    qwen3_config,
)
from transformer_tutorial.lm.model import LanguageModel
from transformer_tutorial.lm.moe_weights import (
    copy_to_qwen3_moe,
    lm_config_from_qwen3_moe,
    qwen3_moe_config,
)
from transformer_tutorial.lm.registry import ATTENTIONS, POSITIONS

HEAD = "lm_head.weight"  # the output layer, left out of a tied checkpoint


def _gpt2_weights(ours: LanguageModel, gpt2: GPT2LMHeadModel) -> Iterator[tuple[Tensor, Tensor]]:
    """Each weight of ours and the tensor of GPT-2's it takes: ``Conv1D`` weights transposed,
    ``c_attn`` split (chapter 13's mapping)."""
    for _, mine, theirs, transposed in gpt2_weights._pairs(ours, gpt2):
        yield mine, theirs.T if transposed else theirs


def _llama_weights(ours: LanguageModel, theirs: nn.Module) -> Iterator[tuple[Tensor, Tensor]]:
    """Each weight of ours and the tensor of Llama's or Qwen3's it takes (chapter 17's)."""
    for _, mine, their in hf_weights._llama_pairs(ours, theirs):
        yield mine, their


def _moe_weights(
    pairs: Callable[[LanguageModel, Any], Iterator[tuple[str, list[Tensor], Tensor]]],
) -> Callable[[LanguageModel, Any], Iterator[tuple[Tensor, Tensor]]]:
    """Each weight of ours and the tensor of theirs it takes, from a mapping with mixtures of
    experts (chapter 20's Qwen3-MoE, chapter 21's DeepSeek-V3): our experts' ``gate_proj`` and
    ``up_proj`` each take their half of ``gate_up_proj``."""

    def weights_from(ours: LanguageModel, theirs: nn.Module) -> Iterator[tuple[Tensor, Tensor]]:
        for _, mine, their in pairs(ours, theirs):
            halves = [their] if len(mine) == 1 else their.chunk(2, dim=1)  # gate first
            yield from zip(mine, halves, strict=True)

    return weights_from


def _experts_apart(name: str, shape: tuple[int, ...]) -> list[Part] | None:
    """Where the parts of a tensor of theirs that stacks a layer's experts are stored, None for
    any other tensor. ``transformers`` 5 holds them as ``experts.gate_up_proj`` ``(E, 2F, D)``
    and ``experts.down_proj`` ``(E, D, F)``; its ``save_pretrained``, as the released
    checkpoints, stores each expert's ``experts.{e}.gate_proj.weight`` and ``up_proj.weight``
    ``(F, D)`` and ``down_proj.weight`` ``(D, F)`` apart."""
    experts, _, kind = name.rpartition(".")
    if not experts.endswith(".experts"):
        return None
    if kind == "down_proj":
        return [(f"{experts}.{e}.down_proj.weight", (e,)) for e in range(shape[0])]
    if kind == "gate_up_proj":
        f = shape[1] // 2
        return [
            (f"{experts}.{e}.{proj}.weight", (e, slice(j * f, (j + 1) * f)))
            for e in range(shape[0])
            for j, proj in enumerate(("gate_proj", "up_proj"))
        ]
    return None


@dataclass(frozen=True)
class Family:
    """One ``model_type``: their classes, configs, the pairing of their weights with ours (each
    of ours and the tensor it takes from theirs) and the copy into theirs, the fields that size
    the weights (a folder must state them), a pattern of stored tensors not weights, and where
    the parts of tensors stored apart are (None: every tensor stored whole, under its name)."""

    config_class: type
    model_class: type[nn.Module]
    to_ours: Callable[[Any], LMConfig]
    to_theirs: Callable[[LMConfig], Any]
    weights_from: Callable[[LanguageModel, Any], Iterator[tuple[Tensor, Tensor]]]
    copy_to: Callable[[LanguageModel, Any], None]
    sizes: tuple[str, ...]
    not_weights: str | None = None
    stored_apart: Callable[[str, tuple[int, ...]], list[Part] | None] | None = None


LLAMA_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
FAMILIES = MappingProxyType(
    {
        "gpt2": Family(
            GPT2Config,
            GPT2LMHeadModel,
            lm_config_from_gpt2,
            gpt2_config,
            _gpt2_weights,
            copy_to_gpt2,
            ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions"),
            # OpenAI's GPT-2 files keep each layer's causal mask as a tensor (``h.0.attn.bias``).
            not_weights=r"(^|\.)attn\.(masked_)?bias$",
        ),
        "llama": Family(
            LlamaConfig,
            LlamaForCausalLM,
            lm_config_from_llama,
            llama_config,
            _llama_weights,
            copy_to_llama,
            LLAMA_SIZES,
        ),
        "qwen3": Family(
            Qwen3Config,
            Qwen3ForCausalLM,
            lm_config_from_llama,
            qwen3_config,
            _llama_weights,
            copy_to_qwen3,
            LLAMA_SIZES,
        ),
        "qwen3_moe": Family(
            Qwen3MoeConfig,
            Qwen3MoeForCausalLM,
            lm_config_from_qwen3_moe,
            qwen3_moe_config,
            _moe_weights(moe_weights._pairs),
            copy_to_qwen3_moe,
            (*LLAMA_SIZES, "num_experts", "moe_intermediate_size"),
            stored_apart=_experts_apart,
        ),
        "deepseek_v3": Family(
            DeepseekV3Config,
            DeepseekV3ForCausalLM,
            lm_config_from_deepseek_v3,
            deepseek_v3_config,
            _moe_weights(deepseek_weights._pairs),
            copy_to_deepseek_v3,
            (
                *LLAMA_SIZES,
                "q_lora_rank",
                "kv_lora_rank",
                "qk_nope_head_dim",
                "qk_rope_head_dim",
                "v_head_dim",
                "first_k_dense_replace",
                "n_routed_experts",
                "moe_intermediate_size",
            ),
            stored_apart=_experts_apart,
        ),
    }
)


def read_config(folder: str | os.PathLike, *, max_len: int | None = None) -> LMConfig:
    """Our config for a folder's ``config.json``; an error names a field ours cannot hold.
    ``max_len``: as :func:`load_pretrained`'s."""
    check_optional_int("max_len", max_len, at_least=1)
    family, theirs = _read_config(Path(folder))
    return _to_ours(family, theirs, Path(folder), max_len)


def load_pretrained(
    folder: str | os.PathLike, *, dtype: torch.dtype | None = None, max_len: int | None = None
) -> LanguageModel:
    """Our :class:`LanguageModel` with the weights of a checkpoint folder (GPT-2, Llama, Qwen3,
    Qwen3-MoE or DeepSeek-V3), on the CPU, in eval mode. Each tensor is read once, into memory
    of its own, and becomes ours' weight: loading holds about the checkpoint's bytes (in
    ``dtype``), plus a copy of one tensor at a time where ours lays it out otherwise (GPT-2's
    transposed ``Conv1D`` weights, an MoE layer's ``gate_up_proj``): at most 1.3x the file's
    bytes at its peak, measured (tests/test_lm_pretrained.py).

    Args:
        folder: holds ``config.json`` and ``model.safetensors``, or
            ``model.safetensors.index.json`` and the shards it names (in the folder: a name
            leading out of it, even through a symlink, is refused unopened; in
            ``huggingface_hub``'s cache a snapshot's links to the model's ``blobs`` are its own).
        dtype: the model's dtype; None keeps the one its tensors are stored in (converted one
            tensor at a time).
        max_len: the positions a rotary model reads (its tables' length); None: the config's
            ``max_position_embeddings``, or with YaRN rope scaling ``factor ×
            original_max_position_embeddings`` if longer (as Qwen3's card sets YaRN: 131,072
            positions over a ``max_position_embeddings`` of 40,960). GPT-2's table is fixed.

    Raises ``FileNotFoundError`` for a missing config, weights or shard; ``ValueError`` for a
    file outside the folder, a config or index that is not a JSON object, a file that is not
    safetensors, a config ours cannot represent (or a ``max_len`` for GPT-2), and for tensors
    missing, unexpected, of the wrong shape, not stored as floats or in mixed dtypes with no
    ``dtype`` given (all before a tensor is read), or a tied output layer stored unlike the
    token table; ``TypeError`` for a ``dtype`` that is not a float dtype.
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be None or a floating torch.dtype, got {dtype!r}")
    check_optional_int("max_len", max_len, at_least=1)
    folder = Path(folder)
    family, their_config = _read_config(folder)
    config = _to_ours(family, their_config, folder, max_len)
    with torch.device("meta"):
        skeleton = family.model_class(their_config)
    stored = stored_tensors(folder)
    placed = _match(stored, skeleton, family, tied=config.tie_embeddings, folder=folder)
    kinds = {stored[s].dtype for where in placed.values() for s, _ in where.parts}
    if not kinds <= DTYPES.keys():
        raise ValueError(
            f"{folder}: tensors are stored as {sorted(kinds - DTYPES.keys())}; ours reads "
            f"weights stored as {', '.join(DTYPES)}"
        )
    stored_dtypes = sorted(str(DTYPES[k]) for k in kinds)
    if dtype is None and len(stored_dtypes) > 1:
        raise ValueError(f"{folder}: tensors are stored as {stored_dtypes}: pass a dtype")
    state = read_tensors(stored, placed, dtype)
    if config.tie_embeddings:
        state[HEAD] = state[_check_tie(state, skeleton, folder)]  # one tensor, both names
    skeleton.load_state_dict(state, strict=True, assign=True)  # their model holds the tensors
    with torch.device("meta"):
        ours = LanguageModel(config)  # no weights; its rotary tables are computed on the CPU
    with torch.no_grad():  # views that hold no graph, which would keep their tensors alive
        takes = {id(mine): theirs for mine, theirs in family.weights_from(ours, skeleton)}
        del state, skeleton  # their tensors are held by `takes` alone, each freed once taken
        # Each weight of ours becomes their tensor, not a copy of it (a view laid out otherwise
        # is copied); a tied table is one parameter under both names, as it was.
        taken: dict[int, Tensor] = {}
        weights = {}
        for k, t in ours.state_dict(keep_vars=True).items():  # weights and stored buffers
            if id(t) not in taken:
                taken[id(t)] = takes.pop(id(t)).contiguous()
            weights[k] = taken[id(t)]
    ours.load_state_dict(weights, strict=True, assign=True)
    return ours.eval()


def _read_config(folder: Path) -> tuple[Family, Any]:
    path = inside(folder, CONFIG)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; a checkpoint folder holds {CONFIG}")
    raw = json_object(path)
    kind = raw.get("model_type")
    if kind not in FAMILIES:
        raise ValueError(f"{path}: model_type={kind!r}; ours reads {sorted(FAMILIES)}")
    family = FAMILIES[kind]
    aliases = family.config_class.attribute_map  # num_experts is num_local_experts in files
    missing = [k for k in family.sizes if k not in raw and aliases.get(k) not in raw]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}, which size {kind}'s weights")
    try:
        return family, family.config_class.from_dict(raw)
    except (TypeError, ValueError, StrictDataclassError) as error:  # a field of a wrong type
        raise ValueError(f"{path}: {error}") from error


def _to_ours(family: Family, theirs: Any, folder: Path, max_len: int | None) -> LMConfig:
    try:
        config = family.to_ours(theirs)
    except ValueError as error:
        raise ValueError(f"{folder / CONFIG}: {error}") from error
    if max_len is None:
        return config
    if not POSITIONS[config.positions].in_attention:
        raise ValueError(
            f"max_len={max_len}: {folder / CONFIG} has a learned table of {config.max_len} "
            "positions, which fixes its reach; max_len is for rotary models (llama, qwen3)"
        )
    return replace(config, max_len=max_len)


def _match(
    stored: dict[str, Stored], skeleton: nn.Module, family: Family, *, tied: bool, folder: Path
) -> dict[str, Placed]:
    """Their model's name → where its tensor is stored, for every weight: under its own name
    or (experts stored apart) in parts; an error lists the tensors missing, unexpected or of the
    wrong shape. A file saved from the base model alone (``GPT2Model``: ``h.0...``, not
    ``transformer.h.0...``) gets the prefix its names lack."""
    expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    prefix = f"{skeleton.base_model_prefix}."
    bare = not any(k.startswith(prefix) for k in stored)
    names = {  # their name → the stored one
        (prefix + k if bare and k != HEAD else k): k
        for k in stored
        if not (family.not_weights and re.search(family.not_weights, k))
    }
    wanted: dict[str, list[Part]] = {}
    for k, shape in expected.items():
        apart = family.stored_apart and k not in names and family.stored_apart(k, shape)
        if not (tied and k == HEAD and k not in names):
            wanted[k] = apart or [(k, ())]
    missing = [n for parts in wanted.values() for n, _ in parts if n not in names]
    used = {n for parts in wanted.values() for n, _ in parts}
    unexpected = [stored_name for k, stored_name in names.items() if k not in used]
    if missing or unexpected:
        found = [("missing", missing), ("unexpected", unexpected)]
        raise ValueError(
            f"{folder}: tensors " + "; ".join(f"{what} {some(ks)}" for what, ks in found if ks)
        )
    wrong = [
        f"{names[n]} {stored[names[n]].shape}, expected {part}"
        for k, parts in wanted.items()
        for n, index in parts
        if stored[names[n]].shape != (part := _shape(expected[k], index))
    ]
    if wrong:
        raise ValueError(f"{folder}: shapes differ from {CONFIG}'s: {some(wrong)}")
    return {
        k: Placed(expected[k], [(names[n], index) for n, index in parts])
        for k, parts in wanted.items()
    }


def _shape(shape: tuple[int, ...], index: tuple) -> list[int]:
    """The shape of ``tensor[index]`` for a tensor of ``shape``."""
    return list(torch.empty(shape, device="meta")[index].shape)


def _check_tie(state: dict[str, Tensor], skeleton: nn.Module, folder: Path) -> str:
    """A tied checkpoint's output layer is its token table: refused where the file holds a
    different one, dropped where it holds the same. Returns the table's name."""
    table = skeleton.get_input_embeddings().weight
    embed = next(k for k, p in skeleton.named_parameters() if p is table)
    head = state.pop(HEAD, None)
    if head is not None and not torch.equal(head, state[embed]):
        raise ValueError(
            f"{folder}: tie_word_embeddings is true in {CONFIG}, but the stored {HEAD} differs "
            f"from {embed}; set it to false if the output layer is its own (transformers then "
            "keeps the two apart)"
        )
    return embed


def model_type(config: LMConfig) -> str:
    """The ``model_type`` our ``config`` is saved as, as its attention's piece says
    (``saved_as``): ``"gpt2"`` with chapter 13's attention, ``"llama"``, ``"qwen3"`` (QK-norm)
    or ``"qwen3_moe"`` (and experts) with chapter 16's, ``"deepseek_v3"`` with latent attention;
    that family's config function then names any other field it cannot hold."""
    return ATTENTIONS[config.attention].saved_as(config)


def save_pretrained(
    model: LanguageModel, folder: str | os.PathLike, *, max_shard_size: int | None = None
) -> None:
    """Write ``model`` as ``transformers``' ``save_pretrained`` does, for its
    ``AutoModelForCausalLM.from_pretrained``: ``config.json`` and the weights, in their names
    (each expert's apart) and the model's dtype, in ``model.safetensors`` or — past
    ``max_shard_size`` bytes — in shards with an index. A tied output layer is left out, as
    theirs leaves it out.

    The folder is created if needed and must not hold a checkpoint already. A model no family
    holds (:func:`model_type`) is refused, naming what to change, before anything is written.
    """
    if not isinstance(model, LanguageModel):
        raise TypeError(f"model must be a LanguageModel, got {type(model).__name__}")
    check_optional_int("max_shard_size", max_shard_size, at_least=1)
    kind = model_type(model.config)
    family = FAMILIES[kind]
    if model.config.n_experts and family.stored_apart is None:
        raise ValueError(
            f"n_experts={model.config.n_experts}: ours saves a mixture of experts as Qwen3-MoE "
            f"(qk_norm=True) or DeepSeek-V3 (attention='mla'); {kind} has dense feed-forward "
            "layers only"
        )
    their_config = family.to_theirs(model.config)
    folder = Path(folder)
    taken = [p.name for p in (folder / CONFIG, folder / INDEX) if p.exists()]
    taken += [p.name for p in sorted(folder.glob("model*.safetensors"))]
    if taken:
        raise FileExistsError(f"{folder} holds a checkpoint already ({some(taken)})")
    dtype = model.embed.weight.dtype
    with torch.device("meta"):
        theirs = family.model_class(their_config).to(dtype)
    theirs.to_empty(device="cpu")
    family.copy_to(model, theirs)
    tensors = {}
    for k, t in theirs.state_dict().items():
        if k == HEAD and their_config.tie_word_embeddings:
            continue
        apart = family.stored_apart and family.stored_apart(k, tuple(t.shape))
        for name, index in apart or [(k, ())]:
            tensors[name] = t[index].clone() if apart else t  # a file's tensors share no memory
    folder.mkdir(parents=True, exist_ok=True)
    write_tensors(tensors, folder, max_shard_size)
    their_config.architectures = [family.model_class.__name__]
    their_config.dtype = dtype
    their_config.to_json_file(folder / CONFIG)
