"""Device choice, seeding and stop signals: decided once, in a notebook or on the command line.

No module picks a device or seeds by itself."""

from __future__ import annotations

import os
import random
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# Names the device for every chapter and test at once (`make check-device DEVICE=cuda`).
DEVICE_VARIABLE = "TRANSFORMER_TUTORIAL_DEVICE"


def get_device(prefer: str | None = None) -> torch.device:
    """Return the device to run on: ``prefer`` if given, else the one the environment variable
    ``TRANSFORMER_TUTORIAL_DEVICE`` names, else CUDA, then Apple's MPS, then CPU."""
    if prefer is None:
        prefer = os.environ.get(DEVICE_VARIABLE) or None
    if prefer is not None:
        return check_device(prefer)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def set_seed(seed: int) -> torch.Generator:
    """Seed Python, NumPy (when installed) and PyTorch on every device; return a seeded generator.

    (Python's string hashing, ``PYTHONHASHSEED``, can only be fixed before the interpreter
    starts; nothing in the package depends on it.)

    The generator is handy where a cell wants its own stream of random numbers that later cells
    cannot disturb.
    """
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # NumPy is optional for the package
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return torch.Generator().manual_seed(seed)


def check_device(name: str | torch.device) -> torch.device:
    """``name`` as a device this machine has, or a ``ValueError`` that says which ones it has."""
    have = ["cpu"]
    if torch.cuda.is_available():
        have += ["cuda"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        have.append("mps")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        msg = f"device {str(name)!r} is not a device name; this machine has {have}"
        raise ValueError(msg) from None
    index_ok = device.index is None or (
        device.type == "cuda" and device.index < torch.cuda.device_count()
    )
    if device.type not in have or not index_ok:
        raise ValueError(f"device {str(name)!r} is not available here; this machine has {have}")
    return device


@dataclass
class StopRequest:
    """What :func:`catch_stop_signals` caught: ``reason`` names the signal (``"SIGINT"``…)."""

    reason: str = ""


@contextmanager
def catch_stop_signals(request: StopRequest) -> Iterator[StopRequest]:
    """While inside, Ctrl-C and SIGTERM do not stop the program at once: they set
    ``request.reason``, so that a loop can stop where its state is whole. A second Ctrl-C stops
    at once (``KeyboardInterrupt``). Outside the main thread, where Python cannot set signal
    handlers, nothing is caught."""
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def ask_to_stop(signum: int, frame: object) -> None:
        if request.reason and signum == signal.SIGINT:
            raise KeyboardInterrupt
        request.reason = signal.Signals(signum).name

    previous = {sig: signal.signal(sig, ask_to_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
