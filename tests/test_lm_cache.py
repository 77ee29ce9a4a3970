"""lm.cache: a growing and a preallocated cache hold the same positions after any sequence of
updates, windows and rewinds; a latent layout is the same storage along its own axis; the
model's cache counts the positions once and rewinds every layer. (Attention with caches:
test_lm_grouped_attention.py, test_lm_latent_attention.py; the model: test_lm_model.py.)"""

from __future__ import annotations

import pytest
import torch

from helpers import raises
from transformer_tutorial.lm.cache import CacheLayout, LMCache, SequenceBuffers

B, HKV, DH = 2, 3, 4


def kv_layout(hkv: int = HKV, dh: int = DH) -> CacheLayout:
    """Chapter 16's keys and values, (B, Hkv, S, Dh) each."""
    return CacheLayout(("k", "v"), ((hkv, dh), (hkv, dh)), seq_dim=2)


def latent_layout(width: int) -> CacheLayout:
    """Chapter 21's latents, (B, S, width)."""
    return CacheLayout(("latent",), ((width,),), seq_dim=1)


def grouped(hkv: int = HKV, dh: int = DH) -> SequenceBuffers:
    return SequenceBuffers(kv_layout(hkv, dh))


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, HKV, n, DH, generator=g), torch.randn(B, HKV, n, DH, generator=g)


# (new positions, keep) per update, or ("rewind", n)
SCRIPTS = {
    "prompt then tokens": [(5, None), (1, None), (1, None), (2, None)],
    "window 3": [(4, 2), (1, 2), (1, 2), (3, 2), (1, 2)],
    "rewinds": [(6, None), ("rewind", 2), (3, None), ("rewind", 4), (1, None)],
}


@pytest.mark.parametrize("script", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_growing_and_preallocated_hold_the_same_positions(script):
    """Every update returns the held positions, new ones last, agreeing with the positions
    written out by hand: all given, less the rewound, the last ``keep`` before the new ones."""
    growing, prealloc = grouped(), SequenceBuffers.preallocate(kv_layout(), B, 16)
    keys: list[torch.Tensor] = []  # the positions given and not rewound, by hand
    for seed, step in enumerate(script):
        if step[0] == "rewind":
            for cache in (growing, prealloc):
                cache.rewind(step[1])
            del keys[len(keys) - step[1] :]
            continue
        n, keep = step
        k, v = kv(n, seed)
        got = [cache.update(k, v, keep=keep) for cache in (growing, prealloc)]
        held = len(keys) if keep is None else min(len(keys), keep)
        expected = torch.cat([*keys[len(keys) - held :], *k.unbind(2)], 0).view(-1)
        keys.extend(k.unbind(2))
        (k_grow, v_grow), (k_pre, v_pre) = got
        # growing: exactly what a later query sees; preallocated: everything its buffers hold
        # (a window drops positions only when full), the same last held + n among them
        assert k_grow.size(2) == held + n and v_grow.shape == k_grow.shape
        assert k_pre.size(2) == len(keys) and v_pre.shape == k_pre.shape
        for k_all in (k_grow, k_pre[:, :, -(held + n) :]):
            assert torch.equal(k_all.permute(2, 0, 1, 3).reshape(-1), expected)
        assert growing.seen == prealloc.seen == len(keys)
    assert prealloc.preallocated and not growing.preallocated


def test_a_latent_layout_is_the_same_storage_along_its_own_axis():
    """Latents (B, S, W): growing == preallocated; rewind; the buffer allocated once."""
    layout = latent_layout(7)
    growing, prealloc = SequenceBuffers(layout), SequenceBuffers.preallocate(layout, B, 10)
    before = prealloc.buffers[0].data_ptr()
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(B, n, 7, generator=g) for n in (4, 1, 2)]
    for chunk in chunks:
        (a,), (b,) = growing.update(chunk), prealloc.update(chunk)
        assert torch.equal(a, b)
    assert torch.equal(a, torch.cat(chunks, 1)) and growing.seen == prealloc.seen == 7
    for cache in (growing, prealloc):
        cache.rewind(3)
    assert torch.equal(growing.update(chunks[0])[0], prealloc.update(chunks[0])[0])
    assert prealloc.buffers[0].data_ptr() == before and prealloc.nbytes == B * 10 * 7 * 4
    raises(lambda: prealloc.update(torch.randn(B, 3, 7)), ValueError, "holds 10 positions")


def test_a_kept_slice_owns_its_storage_and_rewinding_a_window_is_refused():
    """A growing cache past its window keeps only the last positions, in tensors of their own
    (the dropped ones freed); it cannot rewind what it dropped."""
    cache = grouped()
    k, v = kv(8, 0)
    cache.update(k, v, keep=3)
    assert cache.nbytes == 2 * B * HKV * 3 * DH * 4 and (cache.seen, cache.held) == (8, 3)
    raises(lambda: cache.rewind(1), ValueError, "dropped 5 older positions")
    cache.rewind(0)  # nothing to forget: allowed
    assert (cache.seen, cache.held, cache.batch_size) == (8, 3, B)


def test_the_models_cache_counts_once_and_rewinds_every_layer():
    layers = [
        grouped(),
        SequenceBuffers.preallocate(kv_layout(), B, 8),
        SequenceBuffers(latent_layout(6)),
    ]
    cache = LMCache(layers)
    k, v = kv(5, 1)
    for layer in layers[:2]:
        layer.update(k, v)
    layers[2].update(torch.randn(B, 5, 6))
    assert cache.length == 5
    cache.rewind(2)
    assert cache.length == 3 and [layer.seen for layer in layers] == [3, 3, 3]
    assert cache.nbytes == sum(layer.nbytes for layer in layers) > 0


def test_bad_input_is_refused_by_name():
    raises(lambda: LMCache([]), ValueError, "one cache per layer")
    raises(lambda: SequenceBuffers.preallocate(kv_layout(), 0, 4), ValueError, "batch_size")
    raises(lambda: SequenceBuffers.preallocate(latent_layout(4), 1, 0), ValueError, "max_len")
    raises(lambda: SequenceBuffers("keys"), TypeError, "layout must be a CacheLayout")
    raises(lambda: CacheLayout(("k", "v"), ((2, 4),), 2), ValueError, "one shape per name")
    raises(lambda: CacheLayout(("k",), ((2, 0),), 2), ValueError, "positive ints")
    raises(lambda: CacheLayout(("k",), ((2, 4),), 4), ValueError, "seq_dim=4 is past")
    cache = grouped()
    cache.update(*kv(2, 0))
    raises(lambda: cache.rewind(3), ValueError, "n=3 exceeds the 2 positions")
    raises(lambda: cache.update(*kv(1, 0), keep=-1), ValueError, "keep must be at least 0")


# --- API probes (issue 42): each bad call, and what its error must say ------------------------


def _grown(dh: int = 4) -> SequenceBuffers:
    """A growing cache holding 3 positions of (1, 2, ·, dh)."""
    cache = grouped(2, dh)
    cache.update(torch.randn(1, 2, 3, dh), torch.randn(1, 2, 3, dh))
    return cache


CACHE_PROBES = {
    "3-D keys": (
        lambda: grouped(2, 3).update(torch.randn(1, 2, 3), torch.randn(1, 2, 3)),
        ValueError,
        "k must be (B, 2, L, 3), got shape (1, 2, 3)",
    ),
    "keys and values of two shapes": (
        lambda: grouped(2, 4).update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 5)),
        ValueError,
        "v must be (B, 2, L, 4), one B and one L for all, got (1, 2, 3, 5)",
    ),
    "values alone": (
        lambda: grouped(2, 4).update(torch.randn(1, 2, 3, 4)),
        ValueError,
        "update takes 2 tensors (k, v), got 1",
    ),
    "more rows than preallocated": (
        lambda: SequenceBuffers.preallocate(kv_layout(), 1, 8).update(*kv(3, 0)),
        ValueError,
        "k has 2 rows; the cache holds 1: a cache serves the batch it started with",
    ),
    "another head width than held": (
        lambda: _grown().update(torch.randn(1, 2, 1, 5), torch.randn(1, 2, 1, 5)),
        ValueError,
        "k must be (B, 2, L, 4), one B and one L for all, got (1, 2, 1, 5)",
    ),
    "another latent width than preallocated": (
        lambda: SequenceBuffers.preallocate(latent_layout(4), 1, 8).update(torch.randn(1, 2, 5)),
        ValueError,
        "latent must be (B, L, 4), one B and one L for all, got (1, 2, 5)",
    ),
    "dtype a str": (
        lambda: SequenceBuffers.preallocate(kv_layout(2, 4), 1, 8, dtype="float32"),
        TypeError,
        "dtype must be a torch.dtype such as torch.bfloat16 or None, got str",
    ),
    "layers an int": (lambda: LMCache(5), TypeError, "layers must be a list of layer caches"),
    "layers of ints": (
        lambda: LMCache([1, 2]),
        TypeError,
        "layers[0] must be a layer's cache (SequenceBuffers, PagedCache), got int",
    ),
}


@pytest.mark.parametrize(
    ("call", "error", "phrase"), CACHE_PROBES.values(), ids=CACHE_PROBES.keys()
)
def test_bad_calls_name_the_argument_and_what_is_valid(call, error, phrase):
    raises(call, error, phrase)


def test_a_refused_update_or_rewind_leaves_every_cache_as_it_was():
    cache = _grown()
    k_before = cache.buffers[0].clone()
    raises(lambda: cache.update(*kv(1, 0)), ValueError, "must be (B, 2, L, 4)")
    assert (cache.seen, cache.held) == (3, 3) and torch.equal(cache.buffers[0], k_before)
    # one layer with a sliding window that has dropped positions, one that holds them all
    windowed = grouped(2, 4)
    windowed.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), keep=2)
    whole = LMCache([_grown(), windowed])
    raises(lambda: whole.rewind(1), ValueError, "dropped 1 older positions")
    assert [(layer.seen, layer.held) for layer in whole.layers] == [(3, 3), (3, 2)]
