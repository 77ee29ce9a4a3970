"""Chapters 13-23: the pieces a config field chooses, each registered by the chapter that adds it.

A switchable piece of the language model — the attention (``LMConfig.attention``), what carries
the positions (``positions``), the attention's kernel (``attention_backend``), the router of a
mixture of experts (``router``) and the kind of cache decoding keeps — is chosen by a string in
the config, as ``transformers``' ``config.json`` chooses it. Each string is looked up in one
:class:`Registry`, and the entry it finds (a :class:`Piece`) checks the config fields only it
reads and builds the module. A chapter that adds a piece writes its module and *one* line,
``ATTENTIONS.register("mla", LatentAttentionPiece())``, in its own file: no earlier chapter's
function gains a branch, and nothing outside a registry compares kind strings.

Why a registry keyed by the config's strings rather than typed specs (one frozen dataclass per
piece inside the config): the config stays the flat mirror of ``config.json`` that chapter 19's
table maps field by field, and every chapter keeps writing ``LMConfig(attention="gqa",
n_kv_heads=2)``; what typed specs would add — a piece validating its own fields and building
itself — each :class:`Piece` does here (``owns``, ``check``, ``build``), the way
``transformers`` keys its attention functions (``ALL_ATTENTION_FUNCTIONS``) and cache classes by
a config string.

This module imports nothing of the model: the config, at the bottom, imports it, and each
piece's module registers itself when imported. A registry imports the modules of the book's own
pieces (its ``modules``) the first time it is asked for one, as ``transformers``' auto classes
import a model's module only when its name is looked up: importing the config alone loads no
piece, and a reader's own piece needs only its module imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any


class Piece:
    """One choice of a config field: the fields only it reads, with their defaults (``owns``: a
    config choosing another piece must leave them at these values), and its own checks of a
    config (:meth:`check`). Each registry's pieces add what that registry builds with."""

    owns: Mapping[str, object] = MappingProxyType({})

    def check(self, config: Any) -> None:
        """Raise if ``config`` (which chose this piece) is not one this piece can build."""


class AttentionPiece(Piece):
    """An ``attention`` choice: :meth:`build` makes the module, which answers the layer's call
    and declares its ``cache_layout``. By default it has no rotary hook (:meth:`rotary_layout`
    None), no kernel of chapter 16's to choose (``takes_kernel``) and no checkpoint family
    (:meth:`saved_as`); a piece that has one says so."""

    takes_kernel = False

    def build(self, config: Any, rotary: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must build its attention")

    def rotary_layout(self, config: Any) -> Any:
        """What rotary positions turn in each head (a ``rotary.RotaryLayout``), or None."""
        return None

    def saved_as(self, config: Any) -> str:
        """The ``transformers`` ``model_type`` a model of this attention is saved as."""
        raise ValueError(
            f"attention={config.attention!r} has no checkpoint family that save_pretrained writes"
        )


class PositionsPiece(Piece):
    """A ``positions`` choice: what it adds to the embeddings (:meth:`build`) and the rotary
    hook it hands every attention (:meth:`rotary`; None: it turns nothing in attention)."""

    in_attention = False  # whether positions enter the attention (per-row position ids)

    def build(self, config: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must build its embedding side")

    def rotary(self, config: Any, *, checked: bool) -> Any:
        return None


class Registry:
    """The pieces one config ``field`` chooses among, by name, in the order registered.

    ``registry[name]`` is the piece (an error naming the field and the valid names otherwise);
    :meth:`check` validates a config's choice; ``name in registry`` and ``tuple(registry)`` list
    the choices. ``modules``: the modules that register the book's pieces, imported on first
    use; ``kind``: the class every piece of this registry is (its protocol)."""

    def __init__(
        self, field: str, modules: tuple[str, ...] = (), kind: type[Piece] = Piece
    ) -> None:
        self.field, self.modules, self.kind = field, modules, kind
        self._pieces: dict[str, Piece] = {}
        self._loaded = False

    @property
    def pieces(self) -> dict[str, Piece]:
        """Every registered piece by name, the book's modules imported first (again on the next
        lookup if one failed)."""
        if not self._loaded:
            for module in self.modules:
                importlib.import_module(module)
            self._loaded = True
        return self._pieces

    def register(self, name: str, piece: Piece) -> Piece:
        """Add ``piece`` under ``name`` (a new name: a piece is never replaced); returns it."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"a {self.field} name must be a non-empty string, got {name!r}")
        if not isinstance(piece, self.kind):
            raise TypeError(
                f"{self.field}={name!r} must be registered as a piece of kind "
                f"{self.kind.__name__}, got {piece!r}"
            )
        if name in self._pieces:
            raise ValueError(f"{self.field}={name!r} is already registered")
        self._pieces[name] = piece
        return piece

    def __getitem__(self, name: object) -> Any:
        piece = self.pieces.get(name) if isinstance(name, str) else None
        if piece is None:
            raise ValueError(f"{self.field} must be one of {sorted(self.pieces)}, got {name!r}")
        return piece

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.pieces

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self.pieces))

    def __len__(self) -> int:
        return len(self.pieces)

    def __repr__(self) -> str:
        return f"Registry({self.field!r}: {', '.join(self.pieces)})"

    def check(self, config: Any) -> Any:
        """The piece ``config`` chose, after refusing the fields only other pieces read (set
        away from their defaults) and running the chosen piece's own checks."""
        chosen = self[getattr(config, self.field)]
        for name, piece in self.pieces.items():
            if piece is chosen:
                continue
            moved = [
                f"{k}={getattr(config, k)!r}"
                for k, default in piece.owns.items()
                if k not in chosen.owns and getattr(config, k) != default
            ]
            if moved:
                choice = f"{self.field}={name!r}"
                raise ValueError(f"{', '.join(moved)}: {choice} only; set {choice}")
        chosen.check(config)
        return chosen


# The registries of the language model's switchable pieces, each with the modules that register
# the book's: one line per module, the chapter's own; the pieces are registered there.
_LM = "transformer_tutorial.lm."
ATTENTIONS = Registry(
    "attention",
    (
        _LM + "pieces",  # "mha", chapter 13
        _LM + "grouped_attention",  # "gqa", chapter 16
        _LM + "latent_attention",  # "mla", chapter 21
    ),
    AttentionPiece,
)
POSITIONS = Registry(  # "learned", "sinusoidal" (chapter 13), "rope" (15)
    "positions", (_LM + "pieces",), PositionsPiece
)
ATTENTION_KERNELS = Registry(
    "attention_backend",
    (
        _LM + "grouped_attention",  # "sdpa", chapter 16
        _LM + "tiled_attention",  # "tiled", chapter 22
    ),
)
ROUTERS = Registry("router", (_LM + "moe",))  # "softmax" (Qwen3-MoE), "sigmoid" (DeepSeek-V3): 20
CACHE_KINDS = Registry(
    "kind",
    (
        _LM + "cache",  # "growing", "preallocated", chapter 16
        _LM + "paged_cache",  # "paged", chapter 23
    ),
)
# What LMConfig checks, in this order (the positions ask the attention for its head widths).
CONFIG_REGISTRIES = (ATTENTIONS, POSITIONS, ATTENTION_KERNELS, ROUTERS)
