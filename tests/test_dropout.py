"""dropout.py: nn.Dropout's operation with a mask drawn from a quarter of the random numbers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import tiny_config
from transformer_tutorial.dropout import CheapDropout, cheap_dropout, keep_mask, with_cheap_dropout
from transformer_tutorial.model import Transformer


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_each_element_is_kept_with_probability_one_minus_p(p):
    torch.manual_seed(0)
    n = 2_000_000
    kept = keep_mask((n,), p, torch.device("cpu")).double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)  # the binomial's spread of the kept share
    assert abs(kept - (1 - p)) < 5 * sigma + 2**-16  # 2⁻¹⁶: p rounded to 15 bits


def test_neighbouring_elements_are_independent():
    """Four elements come from one 64-bit draw: each of the four keeps independently."""
    torch.manual_seed(0)
    keep = keep_mask((500_000, 4), 0.5, torch.device("cpu")).double()
    both = (keep[:, :, None] * keep[:, None, :]).mean(0)  # P(i and j kept), (4, 4)
    off_diagonal = both[~torch.eye(4, dtype=torch.bool)]
    assert torch.allclose(off_diagonal, torch.full_like(off_diagonal, 0.25), atol=0.005)
    assert torch.allclose(keep.mean(0), torch.full((4,), 0.5, dtype=torch.float64), atol=0.005)


def test_output_and_gradient_are_dropouts_for_the_mask_drawn():
    """Given the mask, the output and the gradient are exactly F.dropout's formula: kept
    elements scaled by 1 / (1 - p), the rest zero, and the same for the gradient."""
    p = 0.25
    x = torch.randn(64, 33, requires_grad=True)
    torch.manual_seed(3)
    out = cheap_dropout(x, p)
    torch.manual_seed(3)
    keep = keep_mask(x.shape, p, x.device)  # the same draws
    torch.testing.assert_close(out, torch.where(keep, x / (1 - p), 0.0), rtol=1e-6, atol=0)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    torch.testing.assert_close(
        x.grad, torch.where(keep, grad_out / (1 - p), 0.0), rtol=1e-6, atol=0
    )


def test_module_is_nn_dropout_when_evaluating_off_the_cpu_or_in_place():
    x = torch.randn(8, 16)
    drop = CheapDropout(0.5).eval()
    assert torch.equal(drop(x), x)
    assert isinstance(drop, nn.Dropout) and drop.p == 0.5
    torch.manual_seed(1)
    in_place = CheapDropout(0.5, inplace=True).train()(x.clone())
    torch.manual_seed(1)
    assert torch.equal(in_place, F.dropout(x.clone(), 0.5, training=True, inplace=True))
    torch.manual_seed(2)
    first = CheapDropout(0.5).train()(x)
    torch.manual_seed(2)
    assert torch.equal(first, CheapDropout(0.5).train()(x))  # the seed fixes the mask


def test_with_cheap_dropout_swaps_every_nn_dropout_and_keeps_the_model_equal_when_evaluating():
    torch.manual_seed(0)
    model = Transformer(tiny_config(dropout=0.2))
    plain = [m for m in model.modules() if type(m) is nn.Dropout]
    src, tgt = torch.randint(4, 11, (3, 7)), torch.randint(4, 13, (3, 6))
    before = model.eval()(src, tgt)
    assert with_cheap_dropout(model) is model
    swapped = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert len(swapped) == len(plain) > 0 and all(type(m) is CheapDropout for m in swapped)
    assert all(m.p == 0.2 for m in swapped)
    assert set(model.state_dict()) == set(Transformer(tiny_config(dropout=0.2)).state_dict())
    assert torch.equal(model.eval()(src, tgt), before)
    model.train()
    torch.manual_seed(5)
    one = model(src, tgt)
    torch.manual_seed(5)
    assert torch.equal(model(src, tgt), one) and not torch.equal(one, before)
