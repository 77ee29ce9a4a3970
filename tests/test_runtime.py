"""runtime: the device is chosen once and must exist; one seed makes every generator repeat."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from transformer_tutorial.runtime import get_device, set_seed


def test_get_device_takes_what_is_asked_and_otherwise_the_best_available(monkeypatch):
    assert get_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert get_device() == torch.device("cpu")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert get_device() == torch.device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert get_device() == torch.device("cuda")


def test_a_device_this_machine_lacks_is_refused_with_what_it_has(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"not available here; this machine has \['cpu'"):
        get_device("cuda")


def test_set_seed_repeats_python_numpy_and_torch():
    def draws():
        set_seed(7)
        return random.random(), np.random.rand(), torch.rand(3)

    first, again = draws(), draws()
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])


def test_the_returned_generator_is_a_stream_later_cells_cannot_disturb():
    generator = set_seed(7)
    torch.rand(100)  # other code drawing from the global generator
    expected = torch.rand(3, generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.rand(3, generator=generator), expected)
