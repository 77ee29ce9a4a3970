"""Helpers the test files import (``from helpers import raises``): plain functions and classes,
not fixtures (those are in conftest.py, which uses these too)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from transformer_tutorial.data import BOS_ID, EOS_ID, PAD_ID
from transformer_tutorial.lm.config import LMConfig
from transformer_tutorial.model import TransformerConfig


def to_device(things, device: torch.device):
    """Tensors and modules moved to ``device``, inside tuples, lists and dicts too."""
    if isinstance(things, torch.Tensor | torch.nn.Module):
        return things.to(device)
    if isinstance(things, tuple | list):
        return type(things)(to_device(x, device) for x in things)
    if isinstance(things, dict):
        return {k: to_device(v, device) for k, v in things.items()}
    return things


def raises(call: Callable[[], object], error: type[Exception], phrase: str) -> BaseException:
    """``call()`` raises ``error`` and its message contains ``phrase``; returns the exception.
    The bad-input tables of the test files (bad input, exception, the phrase a user needs to
    read) all check this."""
    with pytest.raises(error) as info:
        call()
    assert phrase in str(info.value), f"{phrase!r} not in {str(info.value)!r}"
    return info.value


def refused_unchanged(
    call: Callable[[], object], error: type[Exception], phrase: str, *models: torch.nn.Module
) -> None:
    """:func:`raises`, and every weight and buffer of ``models`` as it was before the call."""
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    raises(call, error, phrase)
    for model, saved in zip(models, before, strict=True):
        after = model.state_dict()
        assert after.keys() == saved.keys()
        assert all(torch.equal(after[k], v) for k, v in saved.items()), "a refused call changed"


def bad_command_line(capsys, main: Callable[[list[str]], object], argv: list[str], line: str):
    """``main(argv)`` stops with exit status 2 and one line on standard error that starts with
    ``line``, nothing on standard output: a bad flag never ends in a traceback."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and not out, (stop.value.code, out)
    assert err.startswith(line) and err.count("\n") == 1, err


def no_causal_mask(q_len, k_len=None, *, device=None):
    """A stand-in for ``causal_mask`` that blocks nothing."""
    return torch.zeros(q_len, k_len or q_len, dtype=torch.bool, device=device)


def tiny_config(**changes) -> TransformerConfig:
    """Two layers each side, D = 16, 4 heads, no dropout; vocabularies of 11 and 13 tokens."""
    sizes = dict(
        src_vocab_size=11,
        tgt_vocab_size=13,
        d_model=16,
        n_heads=4,
        n_encoder_layers=2,
        n_decoder_layers=2,
        d_ff=32,
        dropout=0.0,
        max_len=32,
        pad_id=PAD_ID,
    )
    return TransformerConfig(**(sizes | changes))


def help_entries_of(text: str) -> dict[str, str]:
    """The arguments listed in argparse's ``--help`` text → their help, joined into one line.

    An entry starts two spaces in (``  --beam BEAM  beam size…``); its help follows after a gap
    on the same line or on the deeper-indented lines below it.
    """
    entries: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            invocation, _, help_ = line.strip().partition("  ")
            current = entries.setdefault(invocation, [])
            current.append(help_.strip())
        elif line.startswith("   ") and current is not None:
            current.append(line.strip())
        else:
            current = None
    return {k: " ".join(x for x in v if x) for k, v in entries.items()}


@dataclass(frozen=True)
class DigitReversal:
    """The sanity task of chapter 9: a sequence of digits in, the same digits reversed out.

    Ids follow :mod:`transformer_tutorial.data`: 0 padding, 1 ``<bos>``, 2 ``<eos>``, and the
    ten digits are ids 3–12.
    """

    min_len: int = 3
    max_len: int = 8
    vocab_size: int = 13

    def batch(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """src ``(n, max_len)`` padded digits; tgt ``(n, max_len + 2)`` = ``<bos>`` reversed
        digits ``<eos>``, padded."""
        lengths = torch.randint(self.min_len, self.max_len + 1, (n,), generator=generator)
        digits = torch.randint(3, self.vocab_size, (n, self.max_len), generator=generator)
        positions = torch.arange(self.max_len)
        is_pad = positions >= lengths[:, None]
        src = digits.masked_fill(is_pad, PAD_ID)
        backwards = (lengths[:, None] - 1 - positions).clamp(min=0)
        reversed_ = src.gather(1, backwards).masked_fill(is_pad, PAD_ID)
        tgt = torch.cat([torch.full((n, 1), BOS_ID), reversed_, torch.full((n, 1), PAD_ID)], dim=1)
        tgt[torch.arange(n), lengths + 1] = EOS_ID
        return src, tgt

    def pairs(self, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
        """``n`` (digits, reversed digits) id lists, without specials: what the trainer takes."""
        src, _ = self.batch(n, torch.Generator().manual_seed(seed))
        pairs = []
        for row in src.tolist():
            digits = [x for x in row if x != PAD_ID]
            pairs.append((digits, digits[::-1]))
        return pairs


def lm_config(**changes) -> LMConfig:
    """The decoder-only model the reference tests compare: 50 tokens, D = 32, 4 heads, 3 layers,
    F = 48, 16 positions; ``changes`` override fields."""
    sizes = dict(vocab_size=50, d_model=32, n_heads=4, n_layers=3, d_ff=48, max_len=16)
    return LMConfig(**(sizes | changes))


def randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every weight redrawn, norms' gains around 1 (GPT-2's ``ln_*``, every ``*norm*``): nothing
    left at 0 or 1, so a weight copied to the wrong place shows. In eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.3 * torch.randn(p.shape, generator=g)
            norm = "ln" in name or "norm" in name
            p.copy_(noise + 1.0 if norm and name.endswith("weight") else noise)
    return model.eval()


# torch.compile's CPU backend builds C++: without a compiler the compiled paths cannot run.
needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="torch.compile needs a C++ compiler"
)
