"""runtime: the device is chosen once and must exist (a bad device name or one this machine lacks
is refused with the devices it has); one seed makes every generator repeat."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from helpers import raises
from transformer_tutorial.runtime import DEVICE_VARIABLE, get_device, set_seed


def test_get_device_takes_what_is_asked_and_otherwise_the_best_available(monkeypatch):
    monkeypatch.delenv(DEVICE_VARIABLE, raising=False)
    assert get_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert get_device() == torch.device("cpu")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert get_device() == torch.device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert get_device() == torch.device("cuda")


def test_the_environment_names_the_device_and_an_argument_overrides_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv(DEVICE_VARIABLE, "cpu")
    assert get_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(DEVICE_VARIABLE, "bogus")
    raises(get_device, ValueError, "device 'bogus' is not a device name")
    assert get_device("cpu") == torch.device("cpu")
    monkeypatch.setenv(DEVICE_VARIABLE, "")  # empty: as if unset
    assert get_device() == torch.device("cpu")


DEVICE_ROWS = [
    ("cuda", "device 'cuda' is not available here; this machine has ['cpu']"),
    ("cpu:1", "device 'cpu:1' is not available here"),
    ("bogus", "device 'bogus' is not a device name; this machine has ['cpu']"),
]


@pytest.mark.parametrize(("name", "phrase"), DEVICE_ROWS, ids=[r[0] for r in DEVICE_ROWS])
def test_a_device_this_machine_lacks_is_refused_with_what_it_has(monkeypatch, name, phrase):
    """On a machine with CPU only (whatever this one has)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    raises(lambda: get_device(name), ValueError, phrase)


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
