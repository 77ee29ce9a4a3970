"""checkpoint_files: the file layer under ``lm.pretrained`` (whose tests load whole folders,
good and bad, through it): names inside the folder are allowed, including subfolders and
links that stay in it; parts of a tensor stored apart are read into their places, in another
dtype where asked; tensors are written in shards filled in order, with their index."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from helpers import raises
from transformer_tutorial.lm.checkpoint_files import (
    INDEX,
    WEIGHTS,
    Placed,
    inside,
    read_tensors,
    stored_tensors,
    write_tensors,
)


def test_inside_allows_subfolders_and_links_that_stay_in_the_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.safetensors").write_bytes(b"")
    (tmp_path / "b.safetensors").symlink_to(tmp_path / "sub" / "a.safetensors")
    assert inside(tmp_path, "sub/a.safetensors") == tmp_path / "sub" / "a.safetensors"
    assert inside(tmp_path, "b.safetensors") == tmp_path / "b.safetensors"
    assert inside(tmp_path, "not-there.safetensors").name == "not-there.safetensors"
    for name in ("sub/../../x", "../x", str(tmp_path / "sub" / "a.safetensors")):
        raises(lambda n=name: inside(tmp_path, n), ValueError, f"{name!r} leads outside")


def test_parts_stored_apart_are_read_into_their_places_in_the_dtype_asked(tmp_path):
    """Two experts' (F, D) matrices, gate and up, in two shards, read into one (E, 2F, D) stack
    as transformers 5 holds it; bf16 read as float32 exactly, one part at a time."""
    g = torch.Generator().manual_seed(0)
    parts = {f"e{e}.{p}": torch.randn(3, 4, generator=g) for e in range(2) for p in ("gate", "up")}
    parts = {k: v.to(torch.bfloat16) for k, v in parts.items()}
    save_file(dict(list(parts.items())[:3]), tmp_path / "model-1.safetensors")
    save_file(dict(list(parts.items())[3:]), tmp_path / "model-2.safetensors")
    weight_map = {k: f"model-{1 if i < 3 else 2}.safetensors" for i, k in enumerate(parts)}
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    stored = stored_tensors(tmp_path)
    where = [
        (f"e{e}.{p}", (e, slice(3 * j, 3 * j + 3)))
        for e in range(2)
        for j, p in enumerate(("gate", "up"))
    ]
    placed = {"stack": Placed((2, 6, 4), where)}
    for dtype in (None, torch.float32):
        stack = read_tensors(stored, placed, dtype)["stack"]
        assert stack.dtype == (dtype or torch.bfloat16)
        expected = torch.stack(
            [torch.cat([parts[f"e{e}.gate"], parts[f"e{e}.up"]]) for e in range(2)]
        )
        assert torch.equal(stack, expected.to(stack.dtype))


def test_shards_are_filled_in_order_up_to_the_limit_with_an_index(tmp_path):
    tensors = {f"t{i}": torch.full((n,), float(i)) for i, n in enumerate((10, 10, 30, 5))}
    write_tensors(tensors, tmp_path, max_bytes=80)  # float32: 40, 40, 120, 20 bytes
    index = json.loads((tmp_path / INDEX).read_text())
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["weight_map"] == dict(zip(tensors, [shards[0], *shards], strict=True))
    assert index["metadata"]["total_size"] == 220
    assert load_file(tmp_path / shards[1]).keys() == {"t2"}  # larger than the limit: alone
    (tmp_path / "one").mkdir()
    write_tensors(tensors, tmp_path / "one", max_bytes=None)
    assert load_file(tmp_path / "one" / WEIGHTS).keys() == tensors.keys()
