"""Chapter 19: real checkpoints. A folder as ``transformers`` writes it (``config.json`` and
safetensors weights, whole or in shards that ``model.safetensors.index.json`` names) read into
the book's :class:`LanguageModel`, and ours written the same way, for GPT-2, Llama and Qwen3.

A folder is read into a weightless ``transformers`` model of its config on the ``meta`` device,
whose names are the checkpoint's; the tested mappings of ``lm.gpt2_weights`` and ``lm.hf_weights``
pair its tensors with ours, so no name is repeated here. Files, config, names and shapes are
checked before a weight is read (safetensors: a JSON header, raw bytes, no pickle). Each tensor
is read once, into memory of its own, and ours (also built on ``meta``) takes it as its weight:
loading holds the weights about once, not a random model beside them.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from transformer_tutorial.checks import check_optional_int
from transformer_tutorial.lm import gpt2_weights, hf_weights
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.lm.gpt2_weights import copy_to_gpt2, gpt2_config, lm_config_from_gpt2
from transformer_tutorial.lm.hf_weights import (
    copy_to_llama,
    copy_to_qwen3,
    llama_config,
    lm_config_from_llama,
    qwen3_config,
)
from transformer_tutorial.lm.model import LanguageModel

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
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


@dataclass(frozen=True)
class Family:
    """One ``model_type``: their classes, configs, the pairing of their weights with ours (each
    of ours and the tensor it takes from theirs) and the copy into theirs, the fields that size
    the weights (a folder must state them), a pattern of stored tensors not weights."""

    config_class: type
    model_class: type[nn.Module]
    to_ours: Callable[[Any], LMConfig]
    to_theirs: Callable[[LMConfig], Any]
    weights_from: Callable[[LanguageModel, Any], Iterator[tuple[Tensor, Tensor]]]
    copy_to: Callable[[LanguageModel, Any], None]
    sizes: tuple[str, ...]
    not_weights: str | None = None


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
    """Our :class:`LanguageModel` with the weights of a checkpoint folder (GPT-2, Llama or
    Qwen3), on the CPU, in eval mode. Each tensor is read once, into memory of its own, and
    becomes ours' weight: loading holds about the checkpoint's bytes, plus a copy of GPT-2's
    transposed ``Conv1D`` weights.

    Args:
        folder: holds ``config.json`` and ``model.safetensors``, or
            ``model.safetensors.index.json`` and the shards it names.
        dtype: the model's dtype; None keeps the one its tensors are stored in (converted one
            tensor at a time).
        max_len: the positions a rotary model reads (its tables' length); None: the config's
            ``max_position_embeddings``, or with YaRN rope scaling ``factor ×
            original_max_position_embeddings`` if longer (as Qwen3's card sets YaRN: 131,072
            positions over a ``max_position_embeddings`` of 40,960). GPT-2's table is fixed.

    Raises ``FileNotFoundError`` for a missing config, weights or shard; ``ValueError`` for a
    config ours cannot represent (or a ``max_len`` for GPT-2), and for tensors missing,
    unexpected, of the wrong shape, not stored as floats or in mixed dtypes with no ``dtype``
    given (all before a tensor is read), or a tied output layer stored unlike the token table;
    ``TypeError`` for a ``dtype`` that is not a float dtype.
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be None or a floating torch.dtype, got {dtype!r}")
    check_optional_int("max_len", max_len, at_least=1)
    folder = Path(folder)
    family, their_config = _read_config(folder)
    config = _to_ours(family, their_config, folder, max_len)
    with torch.device("meta"):
        skeleton = family.model_class(their_config)
    stored = _stored(folder)
    names = _match(stored, skeleton, family, tied=config.tie_embeddings, folder=folder)
    kinds = {stored[s].dtype for s in names.values()}
    if not kinds <= DTYPES.keys():
        raise ValueError(
            f"{folder}: tensors are stored as {sorted(kinds - DTYPES.keys())}; ours reads "
            f"weights stored as {', '.join(DTYPES)}"
        )
    stored_dtypes = sorted(str(DTYPES[k]) for k in kinds)
    if dtype is None and len(stored_dtypes) > 1:
        raise ValueError(f"{folder}: tensors are stored as {stored_dtypes}: pass a dtype")
    state = _read(stored, names)
    table = _check_tie(state, skeleton, folder) if config.tie_embeddings else None
    if dtype is not None:
        for k in list(state):  # one tensor at a time: each stored one freed once converted
            state[k] = state[k].to(dtype)
    if table is not None:
        state[HEAD] = state[table]  # one tensor under both names
    skeleton.load_state_dict(state, strict=True, assign=True)  # their model holds the tensors
    with torch.device("meta"):
        ours = LanguageModel(config)  # no weights; its rotary tables are computed on the CPU
    takes = {id(mine): theirs for mine, theirs in family.weights_from(ours, skeleton)}
    # Each weight of ours becomes their tensor, not a copy of it (GPT-2's transposed ones are
    # copied); a tied table is one parameter under both names, as it was.
    weights = {
        k: takes[id(p)].contiguous() for k, p in ours.named_parameters(remove_duplicate=False)
    }
    ours.load_state_dict(weights, strict=True, assign=True)
    return ours.eval()


def _read_config(folder: Path) -> tuple[Family, Any]:
    path = folder / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; a checkpoint folder holds {CONFIG}")
    raw = json.loads(path.read_text(encoding="utf-8"))
    kind = raw.get("model_type")
    if kind not in FAMILIES:
        raise ValueError(f"{path}: model_type={kind!r}; ours reads {sorted(FAMILIES)}")
    family = FAMILIES[kind]
    missing = [k for k in family.sizes if k not in raw]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}, which size {kind}'s weights")
    return family, family.config_class.from_dict(raw)


def _to_ours(family: Family, theirs: Any, folder: Path, max_len: int | None) -> LMConfig:
    try:
        config = family.to_ours(theirs)
    except ValueError as error:
        raise ValueError(f"{folder / CONFIG}: {error}") from error
    if max_len is None:
        return config
    if config.positions != "rope":
        raise ValueError(
            f"max_len={max_len}: {folder / CONFIG} has a learned table of {config.max_len} "
            "positions, which fixes its reach; max_len is for rotary models (llama, qwen3)"
        )
    return replace(config, max_len=max_len)


@dataclass(frozen=True)
class Stored:
    """Where a stored tensor is, and its shape and dtype (safetensors' name: ``"BF16"``) as the
    file's header gives them."""

    file: Path
    shape: list[int]
    dtype: str


def _stored(folder: Path) -> dict[str, Stored]:
    """Every stored tensor by name, from ``model.safetensors`` or the shard index; each file
    checked to exist and to hold the names the index gives it. Only headers are read."""
    single, index = folder / WEIGHTS, folder / INDEX
    if single.is_file():
        return _header(single)
    if not index.is_file():
        raise FileNotFoundError(
            f"{folder}: no weights; expected {WEIGHTS}, or {INDEX} and its shards "
            "(only safetensors files are read)"
        )
    weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: no weight_map naming each tensor's shard")
    shards = sorted(set(weight_map.values()))
    absent = [s for s in shards if not (folder / s).is_file()]
    if absent:
        raise FileNotFoundError(f"{folder}: missing {_some(absent)}, named in {INDEX}")
    held = {s: _header(folder / s) for s in shards}
    lost = [f"{k} ({s})" for k, s in weight_map.items() if k not in held[s]]
    if lost:
        raise ValueError(f"{folder}: {INDEX} puts tensors in shards that lack them: {_some(lost)}")
    return {k: held[s][k] for k, s in weight_map.items()}


def _header(path: Path) -> dict[str, Stored]:
    try:
        with safe_open(path, framework="pt") as f:
            slices = {k: f.get_slice(k) for k in f.keys()}  # noqa: SIM118
            return {k: Stored(path, v.get_shape(), v.get_dtype()) for k, v in slices.items()}
    except SafetensorError as error:
        raise ValueError(f"{path}: not a safetensors file ({error})") from error


def _match(
    stored: dict[str, Stored], skeleton: nn.Module, family: Family, *, tied: bool, folder: Path
) -> dict[str, str]:
    """Their model's name → the stored name, for every weight; an error lists the tensors
    missing, unexpected or of the wrong shape. A file saved from the base model alone
    (``GPT2Model``: ``h.0...``, not ``transformer.h.0...``) gets the prefix its names lack."""
    expected = {k: list(v.shape) for k, v in skeleton.state_dict().items()}
    prefix = f"{skeleton.base_model_prefix}."
    bare = not any(k.startswith(prefix) for k in stored)
    names = {
        (prefix + k if bare and k != HEAD else k): k
        for k in stored
        if not (family.not_weights and re.search(family.not_weights, k))
    }
    missing = [k for k in expected if k not in names and not (tied and k == HEAD)]
    unexpected = [stored_name for k, stored_name in names.items() if k not in expected]
    if missing or unexpected:
        found = [("missing", missing), ("unexpected", unexpected)]
        raise ValueError(
            f"{folder}: tensors " + "; ".join(f"{what} {_some(ks)}" for what, ks in found if ks)
        )
    wrong = [
        f"{s} {stored[s].shape}, expected {expected[k]}"
        for k, s in names.items()
        if stored[s].shape != expected[k]
    ]
    if wrong:
        raise ValueError(f"{folder}: shapes differ from {CONFIG}'s: {_some(wrong)}")
    return names


# The dtypes a weight is read in, by safetensors' names.
DTYPES = MappingProxyType(
    {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
)


def _read(stored: dict[str, Stored], names: dict[str, str]) -> dict[str, Tensor]:
    """The tensors, their model's names as keys: each read from its file (opened once) into
    memory of its own, by plain reads at the header's offsets. A memory map (safetensors'
    ``get_tensor``) would tie the model to the file, and copying out of one would hold each
    weight twice."""
    state = {}
    for path in dict.fromkeys(stored[s].file for s in names.values()):
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))  # the header's length, little-endian
            header = json.loads(f.read(n))
            for k, s in names.items():
                if stored[s].file == path:
                    state[k] = _read_tensor(f, 8 + n, header[s])
    return state


def _read_tensor(f: Any, start: int, entry: dict) -> Tensor:
    """One tensor of a header ``entry`` (dtype, shape, offsets from ``start``)."""
    tensor = torch.empty(entry["shape"], dtype=DTYPES[entry["dtype"]])
    f.seek(start + entry["data_offsets"][0])
    # Its bytes, as stored: little-endian, as x86 and ARM hold numbers. safe_open has checked
    # the header's offsets against the shapes and the file's length (_header).
    f.readinto(tensor.view(-1).view(torch.uint8).numpy())
    return tensor


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


def _some(names: list[str], shown: int = 5) -> str:
    """A few names of a list, and how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def model_type(config: LMConfig) -> str:
    """The ``model_type`` our ``config`` is saved as: ``"qwen3"`` with QK-norm, ``"llama"``
    with rotary positions, ``"gpt2"`` otherwise (its config function then names any other
    field to change)."""
    if config.qk_norm:
        return "qwen3"
    return "llama" if config.positions == "rope" else "gpt2"


def save_pretrained(
    model: LanguageModel, folder: str | os.PathLike, *, max_shard_size: int | None = None
) -> None:
    """Write ``model`` as ``transformers``' ``save_pretrained`` does, for its
    ``AutoModelForCausalLM.from_pretrained``: ``config.json`` and the weights, in their names
    and the model's dtype, in ``model.safetensors`` or — past ``max_shard_size`` bytes — in
    shards with an index. A tied output layer is left out, as theirs leaves it out.

    The folder is created if needed and must not hold a checkpoint already.
    """
    check_optional_int("max_shard_size", max_shard_size, at_least=1)
    family = FAMILIES[model_type(model.config)]
    their_config = family.to_theirs(model.config)
    folder = Path(folder)
    taken = [p.name for p in (folder / CONFIG, folder / INDEX) if p.exists()]
    taken += [p.name for p in sorted(folder.glob("model*.safetensors"))]
    if taken:
        raise FileExistsError(f"{folder} holds a checkpoint already ({_some(taken)})")
    dtype = model.embed.weight.dtype
    with torch.device("meta"):
        theirs = family.model_class(their_config).to(dtype)
    theirs.to_empty(device="cpu")
    family.copy_to(model, theirs)
    tensors = {
        k: t
        for k, t in theirs.state_dict().items()
        if not (k == HEAD and their_config.tie_word_embeddings)
    }
    folder.mkdir(parents=True, exist_ok=True)
    _write_weights(tensors, folder, max_shard_size)
    their_config.architectures = [family.model_class.__name__]
    their_config.dtype = dtype
    their_config.to_json_file(folder / CONFIG)


def _write_weights(tensors: dict[str, Tensor], folder: Path, max_bytes: int | None) -> None:
    """One file, or shards filled in order up to ``max_bytes`` each (a larger tensor alone)."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and max_bytes is not None and size + tensor.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    metadata = {"format": "pt"}  # the framework transformers expects
    if len(shards) == 1:
        save_file(tensors, folder / WEIGHTS, metadata=metadata)
        return
    files = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for file, shard in zip(files, shards, strict=True):
        save_file(shard, folder / file, metadata=metadata)
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
        "weight_map": {
            name: file for file, shard in zip(files, shards, strict=True) for name in shard
        },
    }
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
