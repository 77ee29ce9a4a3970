"""checks.py: the argument checks and the command lines' parser and converters built on them."""

from __future__ import annotations

import math

import pytest
import torch

from transformer_tutorial.checks import (
    ArgumentParser,
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_tensor,
    check_texts,
    check_type,
    device_arg,
    int_arg,
    number_arg,
)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: check_int("n", 1.0), TypeError, "n must be an int, got 1.0 (float)"),
        (lambda: check_int("n", True), TypeError, "n must be an int, got True (bool)"),
        (lambda: check_int("n", 0, at_least=1), ValueError, "n must be at least 1, got 0"),
        (lambda: check_number("p", "1", low=0), TypeError, "p must be a number, got '1' (str)"),
        (lambda: check_number("p", math.nan, low=0), ValueError, "p must be at least 0, got nan"),
        (
            lambda: check_number("p", 0.0, low=0.0, high=1.0, low_open=True),
            ValueError,
            "p must be in (0.0, 1.0], got 0.0",
        ),
        (
            lambda: check_number("p", 1.0, low=0.0, high=1.0, high_open=True),
            ValueError,
            "p must be in [0.0, 1.0), got 1.0",
        ),
        (
            lambda: check_number("a", math.inf, low=0),
            ValueError,
            "a must be at least 0, got inf",
        ),
        (
            lambda: check_number("a", -math.inf, low=-math.inf),
            ValueError,
            "a must be a finite number, got -inf",
        ),
        (lambda: check_bool("flag", 1), TypeError, "flag must be True or False, got 1"),
        (lambda: check_type("m", 3, torch.nn.Module, "an nn.Module"), TypeError, "m must be an"),
        (lambda: check_tensor("x", [1.0]), TypeError, "x must be a Tensor, got list"),
        (
            lambda: check_tensor("x", torch.ones(2, dtype=torch.long), kind="float"),
            TypeError,
            "x must be a floating-point tensor, got torch.int64",
        ),
        (
            lambda: check_tensor("ids", torch.ones(2, dtype=torch.bool), kind="int"),
            TypeError,
            "ids must be an integer tensor, got torch.bool",
        ),
        (
            lambda: check_tensor("x", torch.ones(2), dims=(2, 3), shape="(B, V)"),
            ValueError,
            "x must be (B, V), got shape (2,)",
        ),
        (lambda: check_choice("c", "x", {"b", "a"}), ValueError, "c must be one of ['a', 'b']"),
        (lambda: check_texts("texts", "Hallo"), TypeError, "pass ['Hallo']"),
        (lambda: check_texts("texts", ["a", 2]), TypeError, "texts[1] must be a str, got int"),
    ],
)
def test_checks_name_the_argument_the_value_and_what_is_valid(call, error, message):
    with pytest.raises(error) as info:
        call()
    assert message in str(info.value)


def test_checks_pass_valid_values():
    check_int("n", 3, at_least=3)
    check_number("p", 1.0, low=0.0, high=1.0)
    check_number("p", 0.5, low=0.0, high=1.0, low_open=True, high_open=True)
    check_bool("flag", False)
    check_choice("c", "a", ["a"])
    check_texts("texts", ("Hallo", "Welt"))
    check_type("m", torch.nn.Linear(1, 1), torch.nn.Module, "an nn.Module")
    check_tensor("x", torch.ones(2, 3, dtype=torch.bfloat16), kind="float", dims=(2, 3))
    check_tensor("ids", torch.ones(2, dtype=torch.int32), kind="int", dims=1)


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="demo")
    p.add_argument("--beam", type=int_arg(at_least=1), default=5)
    p.add_argument("--minutes", type=number_arg(low=0.0, low_open=True))
    p.add_argument("--alpha", type=number_arg(low=0.0))
    p.add_argument("--device", type=device_arg)
    p.add_argument("--mode", choices=["a", "b"])
    return p


def test_the_converters_return_checked_values():
    args = parser().parse_args(["--beam", "3", "--minutes", "0.5", "--alpha", "0", "--device=cpu"])
    assert (args.beam, args.minutes, args.alpha, args.device) == (3, 0.5, 0.0, "cpu")
    assert isinstance(args.beam, int) and isinstance(args.alpha, float)


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--beam", "0"], "error: argument --beam: must be at least 1, got 0"),
        (["--beam", "2.5"], "error: argument --beam: must be an int, got '2.5'"),
        (["--minutes", "0"], "error: argument --minutes: must be greater than 0.0, got 0.0"),
        (["--minutes", "nan"], "error: argument --minutes: must be greater than 0.0, got nan"),
        (["--alpha=-inf"], "error: argument --alpha: must be at least 0.0, got -inf"),
        (["--alpha", "x"], "error: argument --alpha: must be a number, got 'x'"),
        (["--device", "tpu"], "error: argument --device: device 'tpu' is not a device name"),
        (["--mode", "c"], "error: argument --mode: invalid choice: 'c'"),
        (["--bogus"], "error: unrecognized arguments: --bogus"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_status_2(capsys, argv, line):
    with pytest.raises(SystemExit) as stop:
        parser().parse_args(argv)
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and not out
    assert err.startswith(line) and err.count("\n") == 1, err
