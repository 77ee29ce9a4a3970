"""versions.py: a chapter's setup cell stops at once, in one message, when what it needs is not
installed."""

from __future__ import annotations

import pytest
import torch

from helpers import raises
from transformer_tutorial.versions import release, require, unmet

TORCH = ".".join(map(str, release(torch.__version__)))


@pytest.mark.parametrize(
    ("version", "numbers"),
    [("2.6.0+cu124", (2, 6, 0)), ("5.0.0rc1", (5, 0, 0)), ("2.14", (2, 14)), ("1.dev0", (1,))],
)
def test_release_reads_the_numbers_before_any_local_or_pre_release_part(version, numbers):
    assert release(version) == numbers


def test_the_installed_torch_meets_its_own_version_and_range():
    major, minor = release(torch.__version__)[:2]
    assert require(f"torch>={TORCH}", f"torch>={major}.{minor},<{major + 1}") is None
    assert unmet(f"torch>={major}") is None  # 2 == 2.13.0 padded: a bound on the major only


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("torch>=99", f"torch {torch.__version__} is installed"),
        (f"torch<{TORCH}", f"torch {torch.__version__} is installed"),  # the bound is exclusive
        ("no-such-package-here>=1", "no-such-package-here is not installed"),
    ],
)
def test_an_unmet_spec_says_what_is_installed(spec, why):
    assert unmet(spec) == why


def test_require_names_every_unmet_spec_and_the_command_that_installs_them():
    raises(
        lambda: require("torch>=2", "torch>=99", "no-such-package-here>=1,<2"),
        RuntimeError,
        f"this chapter needs torch>=99 (torch {torch.__version__} is installed); "
        "no-such-package-here>=1,<2 (no-such-package-here is not installed): run  "
        "pip install 'torch>=99' 'no-such-package-here>=1,<2'  and restart the runtime",
    )


@pytest.mark.parametrize("spec", ["torch", "torch==2.6", "torch>=2.6,", ">=2.6", "torch>=two"])
def test_a_spec_it_cannot_read_is_refused_by_name(spec):
    raises(lambda: unmet(spec), ValueError, "spec must look like 'torch>=2.6'")
