"""Chapters 16, 21, 23: one layer's cache, and the model's.

Every attention of the language model keeps what later positions need in a cache that changes
in place, as in every anchor (``transformers``' ``DynamicCache``, gpt-fast's ``KVCache``): the
attention calls ``update`` with the new positions and gets back every position held. Each cache
counts the positions it was given (``seen``, the next position id) and can forget the last ones
(``rewind``, for speculative decoding). The caller picks the kind when it starts decoding
(:meth:`~transformer_tutorial.lm.model.LanguageModel.new_cache`): *growing* (a concatenation a
step, nothing allocated ahead) or *preallocated* (buffers for ``max_len`` positions allocated
once, written in place); chapter 23's paged cache (:mod:`~transformer_tutorial.lm.paged_cache`)
answers the same calls.

- :class:`GroupedKVCache`: keys and values ``(B, Hkv, S, Dh)`` each (chapters 13, 16, 17);
- :class:`LatentKVCache`: latents and shared rotary keys ``(B, S, Dc + Dr)`` (chapter 21);
- :class:`LMCache`: one cache per layer; its ``length`` is the layers' count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from transformer_tutorial.checks import (
    check_choice,
    check_int,
    check_optional_int,
    check_tensor,
    check_type,
)

# The kinds a caller can pick when decoding starts (chapter 23's "paged" has a module of its
# own: it needs a block allocator shared by the layers).
CACHE_KINDS = ("growing", "preallocated")


class LayerCache(Protocol):
    """What the model asks of a layer's cache; the attention also calls its ``update``."""

    seen: int

    def rewind(self, n: int) -> None: ...


def _own(x: Tensor) -> Tensor:
    """``x`` in a storage of its own: a slice of a larger tensor (the positions a window keeps)
    would keep all of that tensor allocated."""
    return x if x.untyped_storage().nbytes() == x.nbytes else x.clone()


class SequenceBuffers:
    """Tensors that hold positions along ``dim`` (``seq_dim``), growing or preallocated.

    ``seen`` counts every position given (the next position id); ``held`` how many the buffers
    hold now, the last ``held`` of them: with a sliding window (:meth:`_append`'s ``keep``) a
    growing cache drops older positions, a preallocated one keeps at most its capacity.
    """

    seq_dim = 2

    def __init__(self) -> None:
        self.buffers: tuple[Tensor, ...] | None = None
        self.seen = 0  # positions given so far
        self.held = 0  # positions held now
        self.preallocated = False

    @classmethod
    def _allocate(
        cls, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype | None, device
    ) -> SequenceBuffers:
        if dtype is not None:
            check_type("dtype", dtype, torch.dtype, "a torch.dtype such as torch.bfloat16 or None")
        cache = cls()
        cache.buffers = tuple(torch.zeros(s, dtype=dtype, device=device) for s in shapes)
        cache.preallocated = True
        return cache

    @property
    def batch_size(self) -> int | None:
        """The rows the cache holds (None: an empty growing cache, which takes any)."""
        return None if self.buffers is None else self.buffers[0].size(0)

    @property
    def nbytes(self) -> int:
        """Bytes the cache keeps allocated: the storage under its tensors, not their views' sizes
        (a preallocated cache: all of its buffers)."""
        if self.buffers is None:
            return 0
        return sum(b.untyped_storage().nbytes() for b in self.buffers)

    def _check_new(self, new: dict[str, Tensor], shape: str) -> None:
        """Before the cache changes: the new positions' tensors (by name), each ``shape``, of one
        shape, and agreeing with what the cache holds in every dimension but the positions'."""
        for name, x in new.items():
            check_tensor(name, x, dims=len(shape.split(",")), shape=shape)
        (first, x0), d = next(iter(new.items())), self.seq_dim
        for name, x in new.items():
            if x.shape != x0.shape:
                raise ValueError(
                    f"{name} {tuple(x.shape)} must have {first}'s shape {tuple(x0.shape)}"
                )
        if self.buffers is not None:
            held = self.buffers[0].shape
            if x0.shape[:d] + x0.shape[d + 1 :] != held[:d] + held[d + 1 :]:
                raise ValueError(
                    f"{first} {tuple(x0.shape)} must match the cache's {shape} {tuple(held)} in "
                    f"every dimension but the positions' (dimension {d})"
                )

    def check_rewind(self, n: int) -> None:
        """The errors :meth:`rewind` would raise, with nothing changed."""
        check_int("n", n, at_least=0)
        if n and self.held < self.seen:
            raise ValueError(
                f"the cache has dropped {self.seen - self.held} older positions (a sliding "
                f"window): rewinding would leave later queries without them; preallocate a "
                f"max_len that holds the whole sequence"
            )
        if n > self.held:
            raise ValueError(f"n={n} exceeds the {self.held} positions the cache holds")

    def _append(self, new: tuple[Tensor, ...], keep: int | None) -> tuple[Tensor, ...]:
        """Add the new positions (``n`` along ``seq_dim`` in each tensor); return every held
        position's, new ones last. ``keep``: a later query needs only this many past positions
        (``window - 1``): a growing cache drops older ones, and a preallocated one, when full,
        moves the last ``keep`` to the front of its buffers instead of failing (which needs
        ``keep + n`` to fit its capacity).

        A preallocated cache writes into its buffers in place: it is for decoding under
        ``torch.no_grad()``; backpropagating through several steps needs a growing cache."""
        check_optional_int("keep", keep, at_least=0)
        d, n = self.seq_dim, new[0].size(self.seq_dim)
        if not self.preallocated:
            whole = (
                new
                if self.buffers is None
                else tuple(
                    torch.cat([b, x], dim=d) for b, x in zip(self.buffers, new, strict=True)
                )
            )
            start = 0 if keep is None else max(0, whole[0].size(d) - keep)
            self.buffers = tuple(_own(w.narrow(d, start, w.size(d) - start)) for w in whole)
            self.seen, self.held = self.seen + n, self.buffers[0].size(d)
            return whole
        capacity = self.buffers[0].size(d)
        if self.held + n > capacity:
            if keep is None or keep + n > capacity:
                raise ValueError(
                    f"the preallocated cache holds {capacity} positions: it has {self.held} "
                    f"and was given {n} more; preallocate a larger max_len"
                )
            for b in self.buffers:
                b.narrow(d, 0, keep).copy_(b.narrow(d, self.held - keep, keep).clone())
            self.held = keep
        for b, x in zip(self.buffers, new, strict=True):
            b.narrow(d, self.held, n).copy_(x)
        self.seen, self.held = self.seen + n, self.held + n
        return tuple(b.narrow(d, 0, self.held) for b in self.buffers)

    def rewind(self, n: int) -> None:
        """Forget the last ``n`` positions, as if they had never been given (speculative
        decoding drops the draft's rejected tokens, chapter 23). A cache that has dropped older
        positions (a sliding window) refuses: the positions a later query needs are gone."""
        self.check_rewind(n)
        self.seen, self.held = self.seen - n, self.held - n
        if not self.preallocated and self.buffers is not None:
            d = self.seq_dim
            self.buffers = tuple(_own(b.narrow(d, 0, self.held)) for b in self.buffers)


class GroupedKVCache(SequenceBuffers):
    """One layer's keys and values of the positions decoded so far, ``(B, Hkv, S, Dh)`` each.

    ``GroupedKVCache()`` grows by concatenation at every step; :meth:`preallocate` allocates its
    buffers once and writes each step into them.
    """

    seq_dim = 2
    holds = "keys and values"  # what an attention must ask for (its ``cache_holds``)

    @classmethod
    def preallocate(
        cls,
        batch_size: int,
        n_kv_heads: int,
        max_len: int,
        d_head: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> GroupedKVCache:
        """A cache whose buffers hold ``max_len`` positions, allocated now."""
        for name, value in (("batch_size", batch_size), ("n_kv_heads", n_kv_heads)):
            check_int(name, value, at_least=1)
        check_int("max_len", max_len, at_least=1)
        check_int("d_head", d_head, at_least=1)
        shape = (batch_size, n_kv_heads, max_len, d_head)
        return cls._allocate([shape, shape], dtype, device)

    @property
    def k(self) -> Tensor | None:
        """The keys' buffer (a preallocated cache: all of it, held or not)."""
        return None if self.buffers is None else self.buffers[0]

    @property
    def v(self) -> Tensor | None:
        """The values' buffer."""
        return None if self.buffers is None else self.buffers[1]

    def update(self, k: Tensor, v: Tensor, *, keep: int | None = None) -> tuple[Tensor, Tensor]:
        """Add the new positions' keys and values ``(B, Hkv, L, Dh)``; return every held
        position's, new ones last, ``(B, Hkv, S, Dh)``. ``keep``: see
        :meth:`SequenceBuffers._append`."""
        self._check_new({"k": k, "v": v}, "(B, Hkv, L, Dh)")
        k_all, v_all = self._append((k, v), keep)
        return k_all, v_all


class LatentKVCache(SequenceBuffers):
    """One layer's cache of MLA (chapter 21): per position the normalised latent then the rotated
    shared key, ``(B, S, Dc + Dr)`` in one tensor; growing, or :meth:`preallocate`."""

    seq_dim = 1
    holds = "latents"

    @classmethod
    def preallocate(
        cls,
        batch_size: int,
        max_len: int,
        width: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> LatentKVCache:
        """A cache whose buffer holds ``max_len`` positions of ``width`` (Dc + Dr), now."""
        check_int("batch_size", batch_size, at_least=1)
        check_int("max_len", max_len, at_least=1)
        check_int("width", width, at_least=1)
        return cls._allocate([(batch_size, max_len, width)], dtype, device)

    @property
    def latent(self) -> Tensor | None:
        """The latents' buffer."""
        return None if self.buffers is None else self.buffers[0]

    def update(self, latent: Tensor) -> Tensor:
        """Add the new positions ``(B, L, Dc + Dr)``; return every position's, new ones last."""
        self._check_new({"latent": latent}, "(B, L, Dc + Dr)")
        return self._append((latent,), None)[0]


class LMCache:
    """What decoding carries from one step to the next: one cache per layer, changed in place by
    :meth:`~transformer_tutorial.lm.model.LanguageModel.step`. ``length``, the positions decoded
    so far, is the layers' own count (with a sliding window a layer holds fewer)."""

    def __init__(self, layers: Sequence[LayerCache]) -> None:
        check_type("layers", layers, (list, tuple), "a list of layer caches")
        if not layers:
            raise ValueError("an LMCache needs one cache per layer, got none")
        for i, layer in enumerate(layers):
            if not (hasattr(layer, "seen") and hasattr(layer, "rewind")):
                raise TypeError(
                    f"layers[{i}] must be a layer's cache (GroupedKVCache, LatentKVCache, "
                    f"PagedKVCache), got {type(layer).__name__}"
                )
        self.layers = tuple(layers)

    @property
    def length(self) -> int:
        return self.layers[0].seen

    def rewind(self, n: int) -> None:
        """Forget the last ``n`` positions in every layer; when one layer refuses, none has
        changed (each is asked first)."""
        for layer in self.layers:
            if hasattr(layer, "check_rewind"):
                layer.check_rewind(n)
        for layer in self.layers:
            layer.rewind(n)

    @property
    def nbytes(self) -> int:
        """Bytes all the layers' caches keep allocated."""
        return sum(layer.nbytes for layer in self.layers)


def check_cache_kind(kind: str) -> None:
    check_choice("kind", kind, CACHE_KINDS)
