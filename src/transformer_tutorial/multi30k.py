"""Chapter 10: the Multi30k corpus — where its files live, how they are fetched and checked,
and its splits as lists of sentences.

Multi30k task 1 (Elliott et al., 2016) pairs German image descriptions with English ones:
29,000 training, 1,014 validation and 1,000 test (test2016) pairs. The files are downloaded on
first use, checked against SHA-256 sums shipped with the package, and never redistributed.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import os
import tempfile
import urllib.error
import urllib.request
from importlib import resources
from pathlib import Path
from typing import BinaryIO

URL_BASE = (
    "https://raw.githubusercontent.com/multi30k/dataset/"
    "c9be912dc05a3ebf9ae5bb5f7f58c1791cda43ab/data/task1/raw"
)
SPLITS = {"train": "train", "val": "val", "test": "test_2016_flickr"}
SPLIT_SIZES = {"train": 29_000, "val": 1_014, "test": 1_000}
SRC_LANG, TGT_LANG = "de", "en"


class DatasetUnavailableError(RuntimeError):
    """The corpus cannot be found, downloaded or written; the message says what to do."""


class ChecksumMismatchError(DatasetUnavailableError):
    """A file's SHA-256 differs from the one shipped with the package."""


def cache_dir() -> Path:
    """The book's cache folder, for the corpus and trained runs.

    ``$TRANSFORMER_TUTORIAL_CACHE``, else ``transformer_tutorial`` in the user cache folder
    (``$XDG_CACHE_HOME`` or ``~/.cache``).
    """
    if os.environ.get("TRANSFORMER_TUTORIAL_CACHE"):
        return Path(os.environ["TRANSFORMER_TUTORIAL_CACHE"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "transformer_tutorial"


def data_dir() -> Path:
    """The Multi30k folder: ``$MULTI30K_DIR``, else ``multi30k`` in :func:`cache_dir`.

    ``$MULTI30K_DIR`` names a folder that holds the files: one that does not exist is an error,
    not a place to create (a typo would otherwise download the corpus somewhere unexpected).
    """
    if os.environ.get("MULTI30K_DIR"):
        folder = Path(os.environ["MULTI30K_DIR"]).expanduser()
        if not folder.is_dir():
            raise DatasetUnavailableError(
                f"MULTI30K_DIR={os.environ['MULTI30K_DIR']} is not a folder: point it at the "
                "folder holding the Multi30k files, or unset it to use the cache"
            )
        return folder
    return cache_dir() / "multi30k"


def expected_checksums() -> dict[str, str]:
    """File name → SHA-256 hex digest, read from the package's ``multi30k_sha256sums.txt``."""
    text = resources.files("transformer_tutorial").joinpath("multi30k_sha256sums.txt").read_text()
    return {
        name: digest
        for digest, name in (line.split() for line in text.splitlines() if line.strip())
    }


def sha256(path: Path | str) -> str:
    """The SHA-256 hex digest of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 16), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _by_hand(root: Path, url_base: str) -> str:
    urls = "\n".join(f"  {url_base}/{name}" for name in expected_checksums())
    return (
        f"Without network access, download these files by hand:\n{urls}\n"
        f"and put them in {root} (or point MULTI30K_DIR at a folder that holds them)."
    )


def fetch(
    filename: str,
    *,
    root: Path | str | None = None,
    url_base: str = URL_BASE,
    timeout: float = 60.0,
) -> Path:
    """Return the path of a verified copy of ``filename``, downloading it first if it is missing.

    The download goes to a temporary file in the same folder and gets its final name only once
    its checksum matches, so an interrupted or corrupted download never poses as the real file.
    A read-only folder works as long as it already holds the files.

    Raises:
        DatasetUnavailableError: no network, an interrupted download, or an unwritable folder.
        ChecksumMismatchError: the file on disk or the one downloaded has the wrong SHA-256.
    """
    checksums = expected_checksums()
    if filename not in checksums:
        raise ValueError(
            f"{filename!r} is not a Multi30k file; expected one of {sorted(checksums)}"
        )
    root = data_dir() if root is None else Path(root)
    path = root / filename
    if path.exists():
        actual = sha256(path)
        if actual != checksums[filename]:
            raise ChecksumMismatchError(
                f"{path} has SHA-256 {actual}, expected {checksums[filename]}: the file is "
                "damaged or another version. Delete it and it will be downloaded again."
            )
        return path
    url = f"{url_base}/{filename}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        part = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed by the `with part:` below)
            dir=root, prefix=f".{filename}.", suffix=".part", delete=False
        )
    except OSError as err:
        raise DatasetUnavailableError(
            f"Cannot write {filename} into {root} ({err.strerror}). Set MULTI30K_DIR to a "
            f"writable folder, or place the files there yourself.\n{_by_hand(root, url_base)}"
        ) from None
    try:
        with part:
            actual = _download(url, part, timeout, root, url_base)
        if actual != checksums[filename]:
            raise ChecksumMismatchError(
                f"{url} was downloaded with SHA-256 {actual}, expected {checksums[filename]}; "
                f"the file was discarded.\n{_by_hand(root, url_base)}"
            )
        os.replace(part.name, path)
    finally:
        if os.path.exists(part.name):
            os.unlink(part.name)
    return path


def _download(url: str, out: BinaryIO, timeout: float, root: Path, url_base: str) -> str:
    """Stream ``url`` into the open file ``out``; return the SHA-256 of what was received."""
    digest = hashlib.sha256()
    received = 0
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            expected = response.headers.get("Content-Length")
            for chunk in iter(lambda: response.read(1 << 16), b""):
                out.write(chunk)
                digest.update(chunk)
                received += len(chunk)
    except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
        reason = getattr(err, "reason", None) or err
        raise DatasetUnavailableError(
            f"Could not download {url} ({reason}).\n{_by_hand(root, url_base)}"
        ) from None
    if expected is not None and received != int(expected):
        raise DatasetUnavailableError(
            f"The download of {url} stopped after {received} of {expected} bytes; nothing was "
            f"kept. Try again.\n{_by_hand(root, url_base)}"
        )
    return digest.hexdigest()


def load_split(
    split: str, *, root: Path | str | None = None, url_base: str = URL_BASE
) -> tuple[list[str], list[str]]:
    """The German sources and English targets of ``split`` (``"train"``, ``"val"`` or ``"test"``).

    Returns two aligned lists of str, surrounding whitespace stripped from each line.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    sides = []
    for lang in (SRC_LANG, TGT_LANG):
        path = fetch(f"{SPLITS[split]}.{lang}.gz", root=root, url_base=url_base)
        with gzip.open(path, "rt", encoding="utf-8") as f:
            sides.append([line.strip() for line in f])
    src, tgt = sides
    if not len(src) == len(tgt) == SPLIT_SIZES[split]:
        raise DatasetUnavailableError(
            f"{split}: {len(src)} German and {len(tgt)} English lines, "
            f"expected {SPLIT_SIZES[split]} each"
        )
    return src, tgt
