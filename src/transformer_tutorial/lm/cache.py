"""Chapters 16, 21, 23: one layer's cache, and the model's.

Every attention of the language model keeps what later positions need in a cache that changes
in place, as in every anchor (``transformers``' ``DynamicCache``, gpt-fast's ``KVCache``): the
attention calls ``update`` with the new positions and gets back every position held. What one
position keeps is the attention's to declare, as a :class:`CacheLayout` (chapter 16's keys and
values ``(B, Hkv, S, Dh)``, chapter 21's latents ``(B, S, Dc + Dr)``); the storage is the
cache's, the same for every layout. Each cache counts the positions it was given (``seen``, the
next position id) and can forget the last ones (``rewind``, for speculative decoding). The
caller picks the kind when it starts decoding
(:meth:`~transformer_tutorial.lm.model.LanguageModel.new_cache`, the one door): *growing* (a
concatenation a step, nothing allocated ahead) or *preallocated* (buffers for ``max_len``
positions allocated once, written in place), both :class:`SequenceBuffers`; chapter 23's
*paged* cache (:mod:`~transformer_tutorial.lm.paged_cache`) registers itself beside them.

- :class:`CacheLayout`: what one position of one layer keeps;
- :class:`SequenceBuffers`: a layer's growing or preallocated cache over any layout;
- :class:`LMCache`: one cache per layer; its ``length`` is the layers' count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from transformer_tutorial.checks import (
    check_int,
    check_optional_int,
    check_tensor,
    check_type,
)
from transformer_tutorial.lm.registry import CACHE_KINDS, Piece


@dataclass(frozen=True)
class CacheLayout:
    """What one position of one layer's cache keeps, as its attention declares it: tensors
    named ``names``, the ``i``-th of shape ``(B, *shapes[i])`` with the positions inserted at
    ``seq_dim`` (counting the batch as dimension 0). (Which positions a cache keeps — all, or
    a sliding window's last ones — the attention says at each ``update``, with ``keep``.)

    Chapter 16's keys and values: ``CacheLayout(("k", "v"), ((Hkv, Dh),) * 2, seq_dim=2)``, each
    ``(B, Hkv, S, Dh)``; chapter 21's latents: ``CacheLayout(("latent",), ((Dc + Dr,),), 1)``.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    seq_dim: int

    def __post_init__(self) -> None:
        if not self.names or len(self.names) != len(self.shapes):
            raise ValueError(
                f"a cache layout needs one shape per name, got names={self.names!r} and "
                f"shapes={self.shapes!r}"
            )
        for shape in self.shapes:
            if not all(type(n) is int and n >= 1 for n in shape):
                raise ValueError(f"shapes must hold positive ints, got {self.shapes!r}")
            check_int("seq_dim", self.seq_dim, at_least=1)
            if self.seq_dim > len(shape) + 1:
                raise ValueError(
                    f"seq_dim={self.seq_dim} is past the last dimension of (B, *{shape})"
                )

    def __eq__(self, other: object) -> bool:
        """The same layout: the same object first (what a model's own caches hold, and what
        ``torch.compile`` can always trace), else the same fields."""
        if self is other:
            return True
        if not isinstance(other, CacheLayout):
            return NotImplemented
        return (self.names, self.shapes, self.seq_dim) == (
            other.names,
            other.shapes,
            other.seq_dim,
        )

    def shape(self, i: int, batch_size: int, length: int) -> tuple[int, ...]:
        """Tensor ``i``'s whole shape for ``batch_size`` rows of ``length`` positions."""
        rest = self.shapes[i]
        d = self.seq_dim - 1
        return (batch_size, *rest[:d], length, *rest[d:])

    def label(self, i: int, positions: str = "L") -> str:
        """Tensor ``i``'s shape as an error names it: ``(B, 2, L, 8)``."""
        rest, d = [str(n) for n in self.shapes[i]], self.seq_dim - 1
        return "(" + ", ".join(["B", *rest[:d], positions, *rest[d:]]) + ")"

    def __str__(self) -> str:
        """What it keeps, in words: ``k (B, 2, S, 8), v (B, 2, S, 8)``."""
        return ", ".join(f"{n} {self.label(i, 'S')}" for i, n in enumerate(self.names))


def check_new_positions(layout: CacheLayout, new: tuple[Tensor, ...]) -> None:
    """What a cache's ``update`` is given: one tensor per name of ``layout``, each of its shape
    with one number ``L`` of new positions and one batch."""
    names = layout.names
    if len(new) != len(names):
        raise ValueError(f"update takes {len(names)} tensors ({', '.join(names)}), got {len(new)}")
    for i, (name, x) in enumerate(zip(names, new, strict=True)):
        label = layout.label(i)
        check_tensor(name, x, dims=len(layout.shapes[i]) + 2, shape=label)
        if x.shape != layout.shape(i, new[0].size(0), new[0].size(layout.seq_dim)):
            raise ValueError(
                f"{name} must be {label}, one B and one L for all, got {tuple(x.shape)}"
            )


class LayerCache(Protocol):
    """What the model asks of a layer's cache; the attention also calls its ``update``."""

    layout: CacheLayout
    seen: int

    def update(self, *new: Tensor, keep: int | None = None) -> tuple[Tensor, ...]: ...

    def rewind(self, n: int) -> None: ...


def _own(x: Tensor) -> Tensor:
    """``x`` in a storage of its own: a slice of a larger tensor (the positions a window keeps)
    would keep all of that tensor allocated. Under ``torch.compile`` a storage's size is not
    traceable: the view is kept, and what it holds on to is freed when the next step replaces
    it (a growing cache's buffers are new tensors each step)."""
    if torch.compiler.is_compiling():
        return x
    return x if x.untyped_storage().nbytes() == x.nbytes else x.clone()


class SequenceBuffers:
    """One layer's cache over the ``layout`` its attention declares, growing or preallocated:
    each tensor holds positions along ``layout.seq_dim``.

    ``SequenceBuffers(layout)`` grows by concatenation at every step; :meth:`preallocate`
    allocates its buffers once and writes each step into them. ``seen`` counts every position
    given (the next position id); ``held`` how many the buffers hold now, the last ``held`` of
    them: with a sliding window (:meth:`_append`'s ``keep``) a growing cache drops older
    positions, a preallocated one keeps at most its capacity.
    """

    def __init__(self, layout: CacheLayout) -> None:
        check_type("layout", layout, CacheLayout, "a CacheLayout (an attention's cache_layout)")
        self.layout = layout
        self.seq_dim = layout.seq_dim
        self.buffers: tuple[Tensor, ...] | None = None
        self.seen = 0  # positions given so far
        self.held = 0  # positions held now
        self.preallocated = False

    @classmethod
    def preallocate(
        cls,
        layout: CacheLayout,
        batch_size: int,
        max_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> SequenceBuffers:
        """A cache whose buffers hold ``max_len`` positions of ``batch_size`` rows, allocated
        now (``dtype`` None: PyTorch's default)."""
        cache = cls(layout)
        check_int("batch_size", batch_size, at_least=1)
        check_int("max_len", max_len, at_least=1)
        if dtype is not None:
            check_type("dtype", dtype, torch.dtype, "a torch.dtype such as torch.bfloat16 or None")
        cache.buffers = tuple(
            torch.zeros(layout.shape(i, batch_size, max_len), dtype=dtype, device=device)
            for i in range(len(layout.names))
        )
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

    def update(self, *new: Tensor, keep: int | None = None) -> tuple[Tensor, ...]:
        """Add the new positions, one tensor per name of the layout (keys and values ``(B, Hkv,
        L, Dh)``; a latent ``(B, L, Dc + Dr)``); return every held position's, new ones last.
        ``keep``: see :meth:`_append`."""
        self._check_new(new)
        return self._append(new, keep)

    def _check_new(self, new: tuple[Tensor, ...]) -> None:
        """Before the cache changes: :func:`check_new_positions`, and the rows it holds."""
        check_new_positions(self.layout, new)
        if self.buffers is not None and new[0].size(0) != self.buffers[0].size(0):
            raise ValueError(
                f"{self.layout.names[0]} has {new[0].size(0)} rows; the cache holds "
                f"{self.buffers[0].size(0)}: a cache serves the batch it started with"
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
                    f"layers[{i}] must be a layer's cache (SequenceBuffers, PagedCache), got "
                    f"{type(layer).__name__}"
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


class SequencePiece(Piece):
    """Chapter 16's two kinds of cache, :class:`SequenceBuffers` growing or preallocated."""

    def __init__(self, preallocated: bool) -> None:
        self.preallocated = preallocated

    def new(
        self,
        layouts: Sequence[CacheLayout],
        batch_size: int,
        *,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        **options: Any,
    ) -> LMCache:
        """One empty cache per layout (a model's layers'); a preallocated one holds ``max_len``
        positions of ``batch_size`` rows, in ``dtype`` on ``device``."""
        if options:
            raise TypeError(f"this cache takes no {', '.join(options)} (the paged one does)")
        if not self.preallocated:
            return LMCache([SequenceBuffers(layout) for layout in layouts])
        return LMCache(
            [
                SequenceBuffers.preallocate(
                    layout, batch_size, max_len, dtype=dtype, device=device
                )
                for layout in layouts
            ]
        )


CACHE_KINDS.register("growing", SequencePiece(preallocated=False))
CACHE_KINDS.register("preallocated", SequencePiece(preallocated=True))
