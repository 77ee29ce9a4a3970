"""Shared test setup: where the verified Multi30k copy is.

Tests that need the corpus read ``MULTI30K_DIR`` (CI sets it). When it is unset and the
project's shared read-only copy ``../shared/data/multi30k`` exists beside the repository, that
copy is used; otherwise those tests are skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_COPY = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "multi30k"

@pytest.fixture(scope="session", autouse=True)
def default_multi30k_dir() -> None:
    """Point MULTI30K_DIR at the shared copy, only if it is unset and the copy exists."""
    if not os.environ.get("MULTI30K_DIR") and SHARED_COPY.is_dir():
        os.environ["MULTI30K_DIR"] = str(SHARED_COPY)


@pytest.fixture(scope="session")
def multi30k_dir(default_multi30k_dir: None) -> Path:
    """The folder holding the six verified Multi30k files, or skip."""
    if not os.environ.get("MULTI30K_DIR"):
        pytest.skip(f"Multi30k not available: set MULTI30K_DIR to a folder with the verified files "
                    f"(none found at {SHARED_COPY})")
    return Path(os.environ["MULTI30K_DIR"])


@pytest.fixture(scope="module")
def single_thread():
    """One PyTorch thread for the tests that use it, restored afterwards: their models are tiny, and
    on a busy shared CPU idle worker threads spinning at each parallel region only slow them down."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
