"""Argument checks shared by the package: each raises an error that names the argument, the value
it got, and what would be valid, before PyTorch fails somewhere deeper."""

from __future__ import annotations

import math
from collections.abc import Iterable


def check_int(name: str, value: object, *, at_least: int | None = None) -> None:
    """``value`` must be an ``int`` (not a bool) and, if given, ``>= at_least``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if at_least is not None and value < at_least:
        raise ValueError(f"{name} must be at least {at_least}, got {value}")


def check_optional_int(name: str, value: object, *, at_least: int) -> None:
    """``value`` must be None or an int ``>= at_least``."""
    if value is not None:
        check_int(name, value, at_least=at_least)


def check_number(
    name: str,
    value: object,
    *,
    low: float,
    high: float = math.inf,
    high_open: bool = False,
    low_open: bool = False,
) -> None:
    """``value`` must be a finite real number in ``[low, high]`` (ends open where asked)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if math.isnan(value) or below or above:
        if math.isinf(high):
            valid = f"{'greater than' if low_open else 'at least'} {low}"
        else:
            valid = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be {valid}, got {value}")


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_choice(name: str, value: object, choices: Iterable[str]) -> None:
    choices = sorted(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_texts(name: str, texts: object) -> None:
    """``texts`` must be a list or tuple of str: a lone str would be read one character at a
    time."""
    if isinstance(texts, str):
        raise TypeError(f"{name} must be a list of sentences, got one str; pass [{texts!r}]")
    if not isinstance(texts, (list, tuple)):
        raise TypeError(f"{name} must be a list of str, got {type(texts).__name__}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"{name}[{i}] must be a str, got {type(text).__name__}")
