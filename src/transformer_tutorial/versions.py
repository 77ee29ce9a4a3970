"""What a chapter needs installed. Its setup cell calls ``require("torch>=2.6",
"transformers>=5,<6")``, which stops at once with one message naming each unmet package, the
version found and the command that installs the right one — instead of a cell failing later, far
from the cause (a Colab runtime with an older ``transformers``, a torch whose FSDP2
``fully_shard`` is not public yet).
"""

from __future__ import annotations

import re
from importlib import metadata

_SPEC = re.compile(r"([A-Za-z0-9_.\-]+)((?:>=|<)\d+(?:\.\d+)*(?:,(?:>=|<)\d+(?:\.\d+)*)*)")
_BOUND = re.compile(r"(>=|<)(\d+(?:\.\d+)*)")


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: '2.6.0+cu124' → (2, 6, 0), '5.0.0rc1' →
    (5, 0, 0), '2.14' → (2, 14)."""
    numbers = []
    for piece in version.split("+")[0].split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        numbers.append(int(digits.group()))
        if digits.group() != piece:  # '0rc1': a pre-release of this number ends the release
            break
    return tuple(numbers)


def _padded(numbers: tuple[int, ...], width: int) -> tuple[int, ...]:
    return numbers + (0,) * (width - len(numbers))


def unmet(spec: str) -> str | None:
    """Why ``spec`` (``name>=A``, ``name<B`` or ``name>=A,<B``) does not hold here, or None."""
    match = _SPEC.fullmatch(spec.replace(" ", ""))
    if match is None:
        raise ValueError(f"spec must look like 'torch>=2.6' or 'transformers>=5,<6', got {spec!r}")
    name, bounds = match.groups()
    try:
        found = metadata.version(name)
    except metadata.PackageNotFoundError:
        return f"{name} is not installed"
    have = release(found)
    for op, number in _BOUND.findall(bounds):
        want = release(number)
        width = max(len(have), len(want))
        ok = _padded(have, width) >= _padded(want, width)
        if ok != (op == ">="):
            return f"{name} {found} is installed"
    return None


def require(*specs: str) -> None:
    """Raise one ``RuntimeError`` naming every spec in ``specs`` that does not hold here, with
    the pip command that installs what is needed (then restart the runtime)."""
    problems = [(spec, why) for spec in specs if (why := unmet(spec)) is not None]
    if problems:
        needs = "; ".join(f"{spec} ({why})" for spec, why in problems)
        command = " ".join(f"'{spec}'" for spec, _ in problems)
        raise RuntimeError(
            f"this chapter needs {needs}: run  pip install {command}  and restart the runtime"
        )
