"""Argument checks shared by the package: each raises an error that names the argument, the value
it got, and what would be valid, before PyTorch fails somewhere deeper. The command lines use the
same checks through :class:`ArgumentParser` and its converters (:func:`int_arg`,
:func:`number_arg`, :func:`device_arg`): one way to check an argument, in Python or in a shell.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NoReturn

import torch

from transformer_tutorial.runtime import check_device


def check_int(name: str, value: object, *, at_least: int | None = None) -> None:
    """``value`` must be an ``int`` (not a bool) and, if given, ``>= at_least``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if at_least is not None and value < at_least:
        raise ValueError(f"{name} {_too_small(value, at_least)}")


def _too_small(value: float, at_least: float) -> str:
    return f"must be at least {at_least}, got {value}"


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
    problem = _out_of_range(value, low, high, low_open=low_open, high_open=high_open)
    if problem:
        raise ValueError(f"{name} {problem}")


def _out_of_range(
    value: float, low: float, high: float, *, low_open: bool, high_open: bool
) -> str | None:
    """What is wrong with ``value`` for the range, or None when it lies inside."""
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if not (math.isnan(value) or math.isinf(value) or below or above):
        return None
    if math.isinf(low) and math.isinf(high):
        valid = "a finite number"
    elif math.isinf(high):
        valid = f"{'greater than' if low_open else 'at least'} {low}"
    else:
        valid = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    return f"must be {valid}, got {value}"


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_choice(name: str, value: object, choices: Iterable[str]) -> None:
    choices = sorted(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_type(name: str, value: object, kind: type | tuple[type, ...], what: str) -> None:
    """``value`` must be an instance of ``kind``, which ``what`` names ("an nn.Module")."""
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")


# What each kind of tensor check_tensor accepts, and its name in an error.
_TENSOR_KINDS = {
    "float": (lambda dtype: dtype.is_floating_point, "a floating-point tensor"),
    "int": (
        lambda dtype: not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool,
        "an integer tensor",
    ),
    "bool": (lambda dtype: dtype == torch.bool, "a bool tensor"),
}


def check_tensor(
    name: str,
    value: object,
    *,
    kind: str | None = None,
    dims: int | tuple[int, ...] | None = None,
    shape: str = "",
) -> None:
    """``value`` must be a Tensor; of ``kind`` (``"float"``, ``"int"`` or ``"bool"``) if given;
    with ``dims`` dimensions (or one of them) if given, ``shape`` naming them (``"(B, V)"``).
    Reads nothing back from the device."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name} must be a Tensor{' ' + shape if shape else ''}, got {type(value).__name__}"
        )
    if kind is not None:
        accepts, what = _TENSOR_KINDS[kind]
        if not accepts(value.dtype):
            raise TypeError(f"{name} must be {what}, got {value.dtype}")
    if dims is not None and value.dim() not in ((dims,) if isinstance(dims, int) else dims):
        wanted = shape or f"{dims} dimensions"
        raise ValueError(f"{name} must be {wanted}, got shape {tuple(value.shape)}")


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


# --- command lines ----------------------------------------------------------------------------


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose mistakes are one line, ``error: argument --beam: must be at least
    1, got 0``, on standard error and exit status 2 (argparse's own), with no usage block: every
    command line of the package fails this way before it starts any work."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}\n")


def int_arg(*, at_least: int) -> Callable[[str], int]:
    """An argparse ``type``: the text as an int ``>= at_least``."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int, got {text!r}") from None
        if value < at_least:
            raise argparse.ArgumentTypeError(_too_small(value, at_least))
        return value

    return convert


def number_arg(*, low: float, low_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: the text as a finite float ``>= low`` (``> low`` if ``low_open``)."""

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        problem = _out_of_range(value, low, math.inf, low_open=low_open, high_open=True)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    return convert


def device_arg(text: str) -> str:
    """An argparse ``type``: a device this machine has (``cpu``, ``cuda``, ``cuda:1``, ``mps``),
    checked by :func:`transformer_tutorial.runtime.check_device`; returned as the text."""
    try:
        check_device(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def out_file_arg(text: str) -> Path:
    """An argparse ``type``: a path to write a file to, not an existing folder (refused before
    a run, not when its record is written at the end)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; name the file to write")
    return path


def read_record(
    parser: argparse.ArgumentParser, flag: str, path: Path, keys: Iterable[str] = ()
) -> dict:
    """The JSON object in ``path``, a run record named by the command line's ``flag``, holding
    ``keys``; a file that is missing, unreadable, not JSON, not an object or without one of the
    keys is the parser's one-line error (exit status 2), never a traceback."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        parser.error(f"argument {flag}: cannot read {str(path)!r} as JSON: {err}")
    if not isinstance(record, dict):
        parser.error(
            f"argument {flag}: {str(path)!r} holds a JSON {type(record).__name__}, not a record"
        )
    missing = [k for k in keys if k not in record]
    if missing:
        parser.error(
            f"argument {flag}: {str(path)!r} is not a record of this command: no {missing}"
        )
    return record
