"""Chapter 18: rope scaling, read at lengths longer than trained by changing RoPE's frequencies.

A model trained on ``L`` positions has seen every angle ``m · θ_i`` with ``m < L`` only. Each
remedy keeps the positions and changes the frequencies ``θ_i`` (chapter 15's
``base^(-2i/Dh)``), as ``transformers``' ``rope_parameters`` name them (:data:`ROPE_TYPES`):

- ``"default"``: unchanged.
- ``"linear"``: position interpolation (Chen et al. 2023), every ``θ_i / factor``.
- ``"dynamic"``: NTK-aware scaling in its dynamic form, a larger base chosen from the current
  sequence length. Its frequencies are here; the model refuses it (:data:`REFUSED`).
- ``"llama3"``: Llama 3.1's bands: wavelengths shorter than ``L / high_freq_factor`` kept,
  longer than ``L / low_freq_factor`` divided by ``factor``, a smooth blend between (none when
  the two factors are equal, as in Llama 4's configs: a step).
- ``"yarn"``: YaRN (Peng et al. 2023): a ramp between kept and interpolated frequencies by
  their rotations over ``L`` (``beta_fast``, ``beta_slow``), and an attention factor that
  multiplies cos and sin (``0.1 ln(factor) + 1`` unless given).

:func:`scaled_frequencies` returns the frequencies and that attention factor;
:func:`scaled_rotary` builds the position hook of an attention layer from them, with
``partial_rotary_factor`` (GPT-NeoX) rotating the first part of each head only;
:func:`scaled_max_len` is how far a scaled ``transformers`` config reads.

Shapes: frequencies ``(Dr/2,)`` float64 for a rotated width ``Dr ≤ Dh``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from transformer_tutorial.checks import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_type,
)
from transformer_tutorial.lm.rotary import RotaryPositions, rotary_frequencies

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# The fields each type reads, required first; the rest must keep their defaults.
_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "llama3": (
        "factor",
        "original_max_position_embeddings",
        "low_freq_factor",
        "high_freq_factor",
    ),
    "yarn": ("factor", "original_max_position_embeddings"),
}
_OPTIONAL = {
    "yarn": ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")
}
# Why the model refuses a type whose frequencies are here.
REFUSED = {
    "dynamic": (
        "rope_type='dynamic' recomputes the frequencies whenever the sequence grows past its "
        "longest so far: keys already in a KV cache keep their old rotation, so decoding with a "
        "cache differs from reading the whole sequence, and a position's logits depend on how "
        "long the sequence is. Use 'linear', 'llama3' or 'yarn' (fixed frequencies)"
    ),
}


@dataclass(frozen=True)
class RopeScaling:
    """How a rope type changes the frequencies: the fields of ``transformers``'
    ``rope_parameters`` other than ``rope_theta`` and ``partial_rotary_factor``.

    Args:
        rope_type: one of :data:`ROPE_TYPES`.
        factor: how many times longer than trained (≥ 1, as ``transformers`` asks).
        original_max_position_embeddings: ``L``, the length trained at (for ``"dynamic"``:
            ``transformers``' ``max_position_embeddings``, where the scaling starts).
        low_freq_factor, high_freq_factor: ``"llama3"``'s band edges, ``L / wavelength``;
            equal: a step, no blended band.
        beta_fast, beta_slow: ``"yarn"``'s ramp edges, in rotations over ``L``.
        attention_factor: ``"yarn"``'s multiplier of cos and sin; None: from ``factor`` (with
            ``mscale`` and ``mscale_all_dim`` when both are given, as DeepSeek's configs do).
        truncate: ``"yarn"`` rounds the ramp's edges to whole dimensions (floor, ceil).
    """

    rope_type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        check_choice("rope_type", self.rope_type, ROPE_TYPES)
        reads = _REQUIRED[self.rope_type] + _OPTIONAL.get(self.rope_type, ())
        for f in fields(self)[1:]:
            value = getattr(self, f.name)
            if f.name in _REQUIRED[self.rope_type] and value is None:
                raise ValueError(f"rope_type={self.rope_type!r} needs {f.name}; it is missing")
            if f.name not in reads and value != f.default:
                raise ValueError(
                    f"{f.name}={value!r}: rope_type={self.rope_type!r} does not read it "
                    f"(it reads {', '.join(reads) or 'nothing'})"
                )
        if self.factor is not None:
            check_number("factor", self.factor, low=1.0)
        if self.original_max_position_embeddings is not None:
            check_int(
                "original_max_position_embeddings",
                self.original_max_position_embeddings,
                at_least=1,
            )
        if self.rope_type == "llama3":
            check_number("low_freq_factor", self.low_freq_factor, low=0.0, low_open=True)
            check_number("high_freq_factor", self.high_freq_factor, low=0.0, low_open=True)
            if self.high_freq_factor < self.low_freq_factor:
                raise ValueError(
                    f"high_freq_factor={self.high_freq_factor} must be at least low_freq_factor="
                    f"{self.low_freq_factor}: the band kept lies above the band interpolated "
                    "(equal: a step at L / low_freq_factor, as Llama 4's)"
                )
        for name in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name), low=0.0, low_open=True)
        if self.beta_fast <= self.beta_slow:
            raise ValueError(
                f"beta_fast={self.beta_fast} must exceed beta_slow={self.beta_slow}: "
                "frequencies turning more than beta_fast times over L are kept"
            )
        check_bool("truncate", self.truncate)

    @classmethod
    def from_parameters(cls, parameters: Mapping) -> RopeScaling | None:
        """From ``transformers``' ``rope_parameters`` (``"type"`` read as ``"rope_type"``,
        None values as absent); ``rope_theta`` and ``partial_rotary_factor`` are the caller's.
        None for ``"default"``."""
        check_type("rope_parameters", parameters, Mapping, "a mapping (a config's dict)")
        kwargs = {k: v for k, v in parameters.items() if v is not None}
        legacy = kwargs.pop("type", "default")  # transformers 4's name for it
        kwargs.setdefault("rope_type", legacy)
        kwargs.pop("rope_theta", None)
        kwargs.pop("partial_rotary_factor", None)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"rope_parameters {unknown} are not read by the book's rope scaling (it reads "
                f"{sorted(known)}); rope_type={kwargs['rope_type']!r}"
            )
        scaling = cls(**kwargs)
        return None if scaling.rope_type == "default" else scaling

    def to_parameters(self) -> dict:
        """The inverse of :meth:`from_parameters`: only the fields ``rope_type`` reads."""
        reads = _REQUIRED[self.rope_type] + _OPTIONAL.get(self.rope_type, ())
        chosen = {k: getattr(self, k) for k in reads if getattr(self, k) is not None}
        return {"rope_type": self.rope_type} | chosen


def check_scaling(scaling: object, *, rope_type: str | None = None) -> None:
    """``scaling`` must be a :class:`RopeScaling` (of ``rope_type`` if given) or None (when
    ``rope_type`` is not given): ``RopeScaling.from_parameters`` reads a config's dict."""
    if rope_type is None:
        if scaling is not None:
            check_type("scaling", scaling, RopeScaling, "a RopeScaling or None")
        return
    check_type("scaling", scaling, RopeScaling, f"a RopeScaling of rope_type={rope_type!r}")
    if scaling.rope_type != rope_type:
        raise ValueError(f"scaling must be of rope_type={rope_type!r}, got {scaling.rope_type!r}")


def yarn_attention_factor(scaling: RopeScaling) -> float:
    """YaRN's multiplier of cos and sin: ``attention_factor`` if given, else ``0.1 ln(s) + 1``
    for ``s = factor`` (1 for ``s ≤ 1``), or with DeepSeek's ``mscale`` and ``mscale_all_dim``
    the ratio ``(0.1 · mscale · ln s + 1) / (0.1 · mscale_all_dim · ln s + 1)``."""
    check_scaling(scaling, rope_type="yarn")
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)

    def m(scale: float) -> float:
        return 1.0 if scaling.factor <= 1 else 0.1 * scale * math.log(scaling.factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return m(scaling.mscale) / m(scaling.mscale_all_dim)
    return m(1.0)


def yarn_ramp(scaling: RopeScaling, rotary_dim: int, base: float) -> Tensor:
    """YaRN's share of each frequency that is interpolated, ``(Dr/2,)``: 0 for pairs turning
    more than ``beta_fast`` times over ``L``, 1 for those turning fewer than ``beta_slow``
    times, linear in the pair's index between."""
    check_scaling(scaling, rope_type="yarn")
    check_int("rotary_dim", rotary_dim, at_least=2)
    check_number("base", base, low=1.0, low_open=True)
    L = scaling.original_max_position_embeddings

    def index(rotations: float) -> float:  # the pair i whose θ_i turns `rotations` times over L
        return rotary_dim * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = index(scaling.beta_fast), index(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as transformers: a step rather than a division by zero
    i = torch.arange(rotary_dim // 2, dtype=torch.float64)
    return ((i - low) / (high - low)).clamp(0, 1)


def scaled_frequencies(
    rotary_dim: int,
    *,
    base: float = 10000.0,
    scaling: RopeScaling | None = None,
    seq_len: int | None = None,
) -> tuple[Tensor, float]:
    """The frequencies ``θ_i`` of ``scaling``'s rope type and the factor that multiplies cos and
    sin: ``transformers``' ``ROPE_INIT_FUNCTIONS[rope_type]``, in float64.

    Args:
        rotary_dim: Dr, the rotated width of a head (``int(Dh · partial_rotary_factor)``).
        base: ``rope_theta``.
        scaling: a :class:`RopeScaling`, None for ``"default"``.
        seq_len: ``"dynamic"`` only: the sequence's length (None: not past ``L``).
    """
    check_scaling(scaling)
    theta = rotary_frequencies(rotary_dim, base)  # (Dr/2,)
    kind = "default" if scaling is None else scaling.rope_type
    if seq_len is not None and kind != "dynamic":
        raise ValueError(f"seq_len is read by rope_type='dynamic' only, not {kind!r}")
    if kind == "default":
        return theta, 1.0
    s = scaling.factor
    if kind == "linear":
        return theta / s, 1.0
    L = scaling.original_max_position_embeddings
    if kind == "dynamic":
        if seq_len is not None:
            check_int("seq_len", seq_len, at_least=1)
        length = L if seq_len is None else max(seq_len, L)
        grown = base * (s * length / L - (s - 1)) ** (rotary_dim / (rotary_dim - 2))
        return rotary_frequencies(rotary_dim, grown), 1.0
    if kind == "llama3":
        wavelength = 2 * math.pi / theta
        # L / wavelength: how many turns the pair makes over L; > high_freq_factor: kept,
        # < low_freq_factor: divided by factor, in between: blended linearly in the turns.
        turns = L / wavelength
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        if high == low:  # Llama 4's step: kept above `low` turns, divided at or below
            keep = (turns > low).double()  # (a blend would divide 0 by 0 at turns == low)
        else:
            keep = ((turns - low) / (high - low)).clamp(0, 1)  # 1: kept, 0: divided by s
        return theta * keep + theta / s * (1 - keep), 1.0
    ramp = yarn_ramp(scaling, rotary_dim, base)  # 1: interpolated, 0: kept
    return theta / s * ramp + theta * (1 - ramp), yarn_attention_factor(scaling)


def scaled_max_len(max_position_embeddings: int, scaling: RopeScaling | None) -> int:
    """The positions a ``transformers`` config with ``scaling`` is read to: for ``"yarn"`` the
    length it scales to, ``factor × original_max_position_embeddings``, never fewer than
    ``max_position_embeddings`` (Qwen3's model card enables YaRN to 4 × 32,768 and leaves that
    at 40,960; transformers reads past it). As vLLM reads them, other types keep
    ``max_position_embeddings``: a ``"llama3"`` config states its extended length there already
    (Llama 3.2-1B: 131,072, where 32 × 8,192 would be twice its context), and ``"linear"``
    states no trained length."""
    check_int("max_position_embeddings", max_position_embeddings, at_least=1)
    check_scaling(scaling)
    if scaling is None or scaling.rope_type != "yarn":
        return max_position_embeddings
    reach = int(scaling.factor * scaling.original_max_position_embeddings)
    return max(max_position_embeddings, reach)


def rotary_width(head_dim: int, partial_rotary_factor: float = 1.0) -> int:
    """Dr = ``int(Dh · partial_rotary_factor)``, as ``transformers`` truncates it; even."""
    check_int("head_dim", head_dim, at_least=2)
    check_number("partial_rotary_factor", partial_rotary_factor, low=0.0, high=1.0, low_open=True)
    width = int(head_dim * partial_rotary_factor)
    if width < 2 or width % 2:
        raise ValueError(
            f"partial_rotary_factor={partial_rotary_factor} rotates int({head_dim} · "
            f"{partial_rotary_factor}) = {width} coordinates of each head: it must be even, ≥ 2"
        )
    return width


def scaled_rotary(
    head_dim: int,
    *,
    max_len: int = 4096,
    base: float = 10000.0,
    scaling: RopeScaling | None = None,
    partial_rotary_factor: float = 1.0,
    layout: str = "half_split",
    checked: bool = True,
) -> RotaryPositions:
    """The position hook of an attention layer with ``scaling``'s frequencies, its attention
    factor applied once (to the cos and sin tables), rotating the first
    ``int(Dh · partial_rotary_factor)`` coordinates of each head. Refuses :data:`REFUSED`.
    ``checked``: as :class:`~transformer_tutorial.lm.rotary.RotaryEmbedding`."""
    check_scaling(scaling)
    if scaling is not None and scaling.rope_type in REFUSED:
        raise ValueError(REFUSED[scaling.rope_type])
    width = rotary_width(head_dim, partial_rotary_factor)
    with torch.device("cpu"):  # values even when the model is built on the meta device
        theta, attention_scaling = scaled_frequencies(width, base=base, scaling=scaling)
    return RotaryPositions(
        head_dim,
        max_len=max_len,
        base=base,
        layout=layout,
        frequencies=theta,
        attention_scaling=attention_scaling,
        checked=checked,
    )
