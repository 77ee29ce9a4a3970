"""Fixtures shared by the test files: one torch thread, the Multi30k folder, the device, a tiny
model, the digit-reversal task, a tiny trained checkpoint. Plain helpers (``raises`` for the
bad-input tables, ``to_device``, ``tiny_config``) are in helpers.py.

Tests that need the corpus read ``MULTI30K_DIR`` (CI sets it). When it is unset and the
project's shared read-only copy ``../shared/data/multi30k`` exists beside the repository, that
copy is used; otherwise those tests are skipped. Mark them ``@pytest.mark.corpus``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from helpers import DigitReversal, help_entries_of, tiny_config
from transformer_tutorial.model import Transformer
from transformer_tutorial.runtime import DEVICE_VARIABLE, check_device

SHARED_COPY = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "multi30k"


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test of the browser check is ``website``, so ``-m "not website"`` leaves it out, and
    in one xdist group, so that under ``--dist loadgroup`` one worker opens the website once
    while the other tests are dealt out one by one."""
    for item in items:
        if item.path.name == "test_website.py":
            item.add_marker(pytest.mark.website)
            item.add_marker(pytest.mark.xdist_group("website"))


@pytest.fixture(scope="session", autouse=True)
def single_thread():
    """One PyTorch thread for the whole session: the models are tiny, and on a busy shared CPU
    idle worker threads spinning at each parallel region only slow them down (pytest-xdist runs
    two test processes side by side instead)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def default_multi30k_dir() -> None:
    """Point MULTI30K_DIR at the shared copy, only if it is unset and the copy exists."""
    if not os.environ.get("MULTI30K_DIR") and SHARED_COPY.is_dir():
        os.environ["MULTI30K_DIR"] = str(SHARED_COPY)


@pytest.fixture(scope="session")
def multi30k_dir(default_multi30k_dir: None) -> Path:
    """The folder holding the six verified Multi30k files, or skip."""
    if not os.environ.get("MULTI30K_DIR"):
        pytest.skip(
            "Multi30k not available: set MULTI30K_DIR to a folder with the verified files "
            f"(none found at {SHARED_COPY})"
        )
    return Path(os.environ["MULTI30K_DIR"])


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device the reference-equality tests run on: ``TRANSFORMER_TUTORIAL_DEVICE``
    (``make check-device DEVICE=cuda``), else the CPU. On CUDA, TF32 is turned off so that
    float32 products are float32 and the tests' tolerances (1e-5) mean what they say."""
    device = check_device(os.environ.get(DEVICE_VARIABLE) or "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return device


@pytest.fixture
def tiny_model() -> Callable[..., Transformer]:
    """``tiny_model(seed=0, **changes)``: a seeded :func:`tiny_config` Transformer in eval mode;
    ``changes`` override config fields."""

    def make(seed: int = 0, **changes) -> Transformer:
        torch.manual_seed(seed)
        return Transformer(tiny_config(**changes)).eval()

    return make


@pytest.fixture(scope="session")
def package_imports() -> Callable[[str], set[str]]:
    """``package_imports("checkpoint")``: every module of the package that importing
    ``transformer_tutorial.checkpoint`` imports, directly or not (read from the source, so no
    module already imported by another test can hide an import)."""

    def reached(module: str) -> set[str]:
        seen: set[str] = set()
        todo = [module]
        while todo:
            name = todo.pop()
            origin = importlib.util.find_spec(f"transformer_tutorial.{name}").origin
            for node in ast.walk(ast.parse(Path(origin).read_text(encoding="utf-8"))):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                for full in names:
                    package, _, sub = full.partition(".")
                    if package == "transformer_tutorial" and sub and sub not in seen:
                        seen.add(sub)
                        todo.append(sub)
        return seen

    return reached


@pytest.fixture(scope="session")
def help_entries() -> Callable[[str], dict[str, str]]:
    """``help_entries(text)``: each argument shown in an argparse ``--help`` text → its help."""
    return help_entries_of


@pytest.fixture(scope="session")
def digit_reversal() -> DigitReversal:
    return DigitReversal()


SENTENCES = [
    "Ein Mann fährt Fahrrad.",
    "Zwei Hunde spielen im Schnee.",
    "Eine Frau liest ein Buch.",
]
TRANSLATIONS = ["A man rides a bike.", "Two dogs play in the snow.", "A woman reads a book."]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """``best.pt`` of one training step of the ``tiny`` recipe on three sentence pairs, written by
    the real trainer with its ``tokenizer.json`` and ``last.pt`` beside it. Its model's max_len
    is 24."""
    from dataclasses import replace

    from transformer_tutorial.configs import CONFIGS, RunOptions
    from transformer_tutorial.data import encode_pairs, save_tokenizer, train_tokenizer
    from transformer_tutorial.trainer import fit

    folder = tmp_path_factory.mktemp("run")
    tokenizer = train_tokenizer(SENTENCES + TRANSLATIONS, vocab_size=80)
    save_tokenizer(tokenizer, folder / "tokenizer.json")
    pairs = encode_pairs(tokenizer, SENTENCES, TRANSLATIONS)
    tiny = CONFIGS["tiny"]
    config = replace(tiny, model=replace(tiny.model, max_len=24))
    fit(
        config,
        pairs,
        pairs,
        vocab_size=tokenizer.get_vocab_size(),
        out_dir=folder,
        options=RunOptions(max_steps=1, progress=False),
        tokenizer_file="tokenizer.json",
    )
    return folder / "best.pt"


@pytest.fixture
def padded_vectors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Source ``(3, 7, 16)`` and target ``(3, 6, 16)`` vectors and their padding masks: source
    lengths 7, 5, 3; target lengths 4, 6, 6."""
    B, S, T, D = 3, 7, 6, 16
    g = torch.Generator().manual_seed(0)
    src = torch.randn(B, S, D, generator=g)
    tgt = torch.randn(B, T, D, generator=g)
    src_pad = torch.zeros(B, S, dtype=torch.bool)
    src_pad[1, 5:] = True
    src_pad[2, 3:] = True
    tgt_pad = torch.zeros(B, T, dtype=torch.bool)
    tgt_pad[0, 4:] = True
    return src, tgt, src_pad, tgt_pad
