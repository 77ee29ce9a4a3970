"""Chapter 19: the files of a checkpoint folder. Which files it holds (``config.json``,
``model.safetensors`` or shards named by ``model.safetensors.index.json``), each checked to be
in the folder before it is opened; the stored tensors' names, shapes and dtypes from the
safetensors headers alone; each tensor read into memory of its own, whole or in parts, straight
into its place; tensors written in shards as ``transformers`` writes them. Nothing here knows a
model: :mod:`~transformer_tutorial.lm.pretrained` says what to read where.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Where part of a tensor is stored: the stored name, and the index of the part it fills (``()``:
# the whole tensor).
Part = tuple[str, tuple]


def inside(folder: Path, name: str, named_in: Path | None = None) -> Path:
    """``folder / name``, refused unless it stays in the folder: ``name`` relative, without
    ``..``, and the file it reaches (symlinks followed) in the folder or, in
    ``huggingface_hub``'s cache, whose ``snapshots/<revision>`` folders link each file to the
    model's ``blobs``, there. Checked before the file is opened or its existence tested."""
    path = folder / name
    where = f"{named_in}: " if named_in else ""
    real = folder.resolve()
    roots = [real]
    if real.parent.name == "snapshots":
        roots.append(real.parent.parent / "blobs")
    escapes = Path(name).is_absolute() or ".." in Path(name).parts
    if escapes or not any(path.resolve().is_relative_to(r) for r in roots):
        raise ValueError(
            f"{where}{name!r} leads outside the checkpoint folder {folder}; refused (a "
            "checkpoint's files are read from its folder only)"
        )
    return path


def json_object(path: Path) -> dict:
    """The object a JSON file holds; an error names the file."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: holds a JSON {type(raw).__name__}, not an object {{...}}")
    return raw


@dataclass(frozen=True)
class Stored:
    """Where a stored tensor is, and its shape and dtype (safetensors' name: ``"BF16"``) as the
    file's header gives them."""

    file: Path
    shape: list[int]
    dtype: str


def stored_tensors(folder: Path) -> dict[str, Stored]:
    """Every stored tensor by name, from ``model.safetensors`` or the shard index; each file
    checked to be in the folder, to exist and to hold the names the index gives it. Only
    headers are read."""
    single = inside(folder, WEIGHTS)
    if single.is_file():
        return _header(single)
    index = inside(folder, INDEX)
    if not index.is_file():
        raise FileNotFoundError(
            f"{folder}: no weights; expected {WEIGHTS}, or {INDEX} and its shards "
            "(only safetensors files are read)"
        )
    weight_map = json_object(index).get("weight_map")
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(s, str) for s in weight_map.values())
    ):
        raise ValueError(f"{index}: no weight_map naming each tensor's shard file")
    shards = {s: inside(folder, s, index) for s in sorted(set(weight_map.values()))}
    absent = [s for s, path in shards.items() if not path.is_file()]
    if absent:
        raise FileNotFoundError(f"{folder}: missing {some(absent)}, named in {INDEX}")
    held = {s: _header(path) for s, path in shards.items()}
    lost = [f"{k} ({s})" for k, s in weight_map.items() if k not in held[s]]
    if lost:
        raise ValueError(f"{folder}: {INDEX} puts tensors in shards that lack them: {some(lost)}")
    return {k: held[s][k] for k, s in weight_map.items()}


def _header(path: Path) -> dict[str, Stored]:
    try:
        with safe_open(path, framework="pt") as f:
            slices = {k: f.get_slice(k) for k in f.keys()}  # noqa: SIM118
            return {k: Stored(path, v.get_shape(), v.get_dtype()) for k, v in slices.items()}
    except SafetensorError as error:
        raise ValueError(f"{path}: not a safetensors file ({error})") from error


@dataclass(frozen=True)
class Placed:
    """One tensor to read: its shape, and where it is stored, whole (one part, index ``()``) or
    in parts (a layer's experts, stored one by one, read into their places in one stack)."""

    shape: tuple[int, ...]
    parts: list[Part]


# The dtypes a weight is read in, by safetensors' names.
DTYPES = MappingProxyType(
    {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
)


def read_tensors(
    stored: dict[str, Stored], placed: dict[str, Placed], dtype: torch.dtype | None
) -> dict[str, Tensor]:
    """The tensors ``placed`` describes, under its names, in ``dtype`` (None: as stored), each in
    memory of its own: every part read from its file (each opened once) straight into its place, by
    plain reads at the header's offsets, or into a buffer of its own and converted. A memory
    map (safetensors' ``get_tensor``) would tie the model to the file, and copying out of one
    would hold each weight twice."""
    state, reads = {}, {}
    for k, where in placed.items():
        kind = DTYPES[stored[where.parts[0][0]].dtype]
        state[k] = torch.empty(where.shape, dtype=dtype or kind)
        for s, index in where.parts:
            reads.setdefault(stored[s].file, []).append((s, state[k][index]))
    for path, parts in reads.items():
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))  # the header's length, little-endian
            header = json.loads(f.read(n))
            for s, out in parts:
                _read_into(out, f, 8 + n, header[s], path)
    return state


def _read_into(out: Tensor, f: Any, start: int, entry: dict, path: Path) -> None:
    """One tensor of a header ``entry`` (dtype, shape, offsets from ``start``) into ``out``, a
    contiguous tensor or view of its shape."""
    kind = DTYPES[entry["dtype"]]
    buffer = out if out.dtype == kind else torch.empty(entry["shape"], dtype=kind)
    f.seek(start + entry["data_offsets"][0])
    # Its bytes, as stored: little-endian, as x86 and ARM hold numbers. safe_open has checked
    # the header's offsets against the shapes and the file's length (_header).
    if f.readinto(buffer.view(-1).view(torch.uint8).numpy()) != buffer.nbytes:
        raise ValueError(f"{path}: shorter than its header says")
    if buffer is not out:
        out.copy_(buffer)


def some(names: list[str], shown: int = 5) -> str:
    """A few names of a list, and how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def write_tensors(tensors: dict[str, Tensor], folder: Path, max_bytes: int | None) -> None:
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
