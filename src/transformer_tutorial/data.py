"""Chapter 10: the Multi30k corpus, a subword vocabulary, and batches of similar length.

Multi30k task 1 (Elliott et al., 2016) pairs German image descriptions with English ones:
29,000 training, 1,014 validation and 1,000 test (test2016) pairs. The files are downloaded on
first use, checked against SHA-256 sums shipped with the package, and never redistributed.

Shapes: a batch is ``src (B, S)``, ``tgt_in (B, T)`` = ``<bos> y`` and ``tgt_out (B, T)`` =
``y <eos>``, padded with ``PAD_ID``.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import os
import re
import tempfile
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import BinaryIO

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from torch import Tensor

URL_BASE = (
    "https://raw.githubusercontent.com/multi30k/dataset/"
    "c9be912dc05a3ebf9ae5bb5f7f58c1791cda43ab/data/task1/raw"
)
SPLITS = {"train": "train", "val": "val", "test": "test_2016_flickr"}
SPLIT_SIZES = {"train": 29_000, "val": 1_014, "test": 1_000}
SRC_LANG, TGT_LANG = "de", "en"

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
# Tokens a batch (sources and targets, padded), in training and in decoding: the default of
# :func:`token_batches`' callers (the recipes' ``max_tokens``, translate_sentences).
BATCH_TOKENS = 4000
PAD, BOS, EOS, UNK = SPECIALS


class DatasetUnavailableError(RuntimeError):
    """The corpus cannot be found, downloaded or written; the message says what to do."""


class ChecksumMismatchError(DatasetUnavailableError):
    """A file's SHA-256 differs from the one shipped with the package."""


# --- Files: where they live, how they are fetched and checked -------------------------------


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


# --- Vocabulary: word-level (what torchtext did) and subword (what we use) ------------------


def word_tokenize(sentence: str) -> list[str]:
    """Split into words and single punctuation marks:
    ``"Ein Hund."`` → ``["Ein", "Hund", "."]``."""
    return re.findall(r"\w+|[^\w\s]", sentence)


class Vocab:
    """A word-level vocabulary: specials first, then words seen ``min_freq`` times or more,
    most frequent first. Unknown words map to ``<unk>``."""

    def __init__(
        self, counter: Counter[str], *, min_freq: int = 1, specials: Sequence[str] = SPECIALS
    ) -> None:
        words = sorted(
            (w for w, c in counter.items() if c >= min_freq and w not in specials),
            key=lambda w: (-counter[w], w),
        )
        self.itos = list(specials) + words
        self.stoi = {w: i for i, w in enumerate(self.itos)}
        self.unk_id = self.stoi[UNK]

    @classmethod
    def build(
        cls,
        sentences: Iterable[str],
        *,
        tokenize: Callable[[str], list[str]] = word_tokenize,
        min_freq: int = 1,
    ) -> Vocab:
        return cls(Counter(w for s in sentences for w in tokenize(s)), min_freq=min_freq)

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, words: Iterable[str]) -> list[int]:
        return [self.stoi.get(w, self.unk_id) for w in words]


def unk_rate(encoded: Iterable[Sequence[int]], unk_id: int = UNK_ID) -> float:
    """The share of tokens that are ``unk_id`` in a corpus of encoded sentences."""
    total = unknown = 0
    for ids in encoded:
        total += len(ids)
        unknown += sum(i == unk_id for i in ids)
    return unknown / max(total, 1)


def train_tokenizer(sentences: Iterable[str], vocab_size: int = 8000) -> Tokenizer:
    """Learn one BPE vocabulary of ``vocab_size`` tokens from ``sentences`` (both languages).

    NFKC normalisation, a Metaspace pre-tokenizer (spaces become ``▁``, kept inside the tokens)
    and the matching decoder, so that decoding gives plain detokenised text. The specials
    ``<pad> <bos> <eos> <unk>`` get ids 0, 1, 2, 3.
    """
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False
    )
    tokenizer.train_from_iterator(sentences, trainer)
    _check_specials(tokenizer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, path: Path | str) -> None:
    tokenizer.save(str(path))


def load_tokenizer(path: Path | str) -> Tokenizer:
    """Read a tokenizer saved by :func:`save_tokenizer`; a clear ``ValueError`` otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"tokenizer not found: {path}")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for any unreadable file
        raise ValueError(f"cannot read the tokenizer {path}: {err}") from None
    _check_specials(tokenizer)
    return tokenizer


def _check_specials(tokenizer: Tokenizer) -> None:
    ids = [tokenizer.token_to_id(t) for t in SPECIALS]
    if ids != [PAD_ID, BOS_ID, EOS_ID, UNK_ID]:
        raise ValueError(f"tokenizer maps {list(SPECIALS)} to {ids}, expected [0, 1, 2, 3]")


def encode_pairs(
    tokenizer: Tokenizer, src: Sequence[str], tgt: Sequence[str]
) -> list[tuple[list[int], list[int]]]:
    """Token ids of each (source, target) pair, without specials."""
    src_ids = [e.ids for e in tokenizer.encode_batch(list(src))]
    tgt_ids = [e.ids for e in tokenizer.encode_batch(list(tgt))]
    return list(zip(src_ids, tgt_ids, strict=True))


# --- Batches: by token count, of similar lengths ---------------------------------------------


def pair_lengths(pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[int]:
    """The padded width each pair needs: max(source length, target length + 1 special)."""
    return [max(len(s), len(t) + 1) for s, t in pairs]


def token_batches(
    lengths: Sequence[int],
    max_tokens: int,
    *,
    generator: torch.Generator | None = None,
    bucket: bool = True,
    noise: float = 1.0,
) -> list[list[int]]:
    """Group example indices into batches of at most ``max_tokens`` padded tokens.

    A batch's cost is its longest example times its number of examples, the size of the padded
    tensor. With ``bucket`` the examples are sorted by length (plus uniform noise in
    ``[0, noise)`` so that batches differ between epochs), otherwise taken in random order.
    With a ``generator`` the batch order is shuffled; without one nothing is random and the
    batches come sorted (for evaluation). Every index appears in exactly one batch.
    """
    n = len(lengths)
    if generator is None:
        order = sorted(range(n), key=lambda i: lengths[i]) if bucket else list(range(n))
    elif bucket:
        jitter = noise * torch.rand(n, generator=generator, dtype=torch.float64)
        keys = torch.tensor(lengths, dtype=torch.float64) + jitter
        order = keys.argsort(stable=True).tolist()
    else:
        order = torch.randperm(n, generator=generator).tolist()
    batches, batch, longest = [], [], 0
    for i in order:
        if batch and max(longest, lengths[i]) * (len(batch) + 1) > max_tokens:
            batches.append(batch)
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, lengths[i])
    if batch:
        batches.append(batch)
    if generator is not None:
        batches = [batches[j] for j in torch.randperm(len(batches), generator=generator).tolist()]
    return batches


def pad_share(batches: Iterable[Sequence[int]], lengths: Sequence[int]) -> float:
    """The share of padded positions when each batch is padded to its longest example."""
    real = padded = 0
    for batch in batches:
        real += sum(lengths[i] for i in batch)
        padded += max(lengths[i] for i in batch) * len(batch)
    return 1.0 - real / max(padded, 1)


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int = PAD_ID) -> Tensor:
    """Stack id sequences of different lengths into one ``(B, L)`` tensor, padded at the end."""
    out = torch.full((len(seqs), max(len(s) for s in seqs)), pad_id, dtype=torch.long)
    for b, s in enumerate(seqs):
        out[b, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def id_range(seqs: Iterable[Sequence[int]]) -> tuple[int, int]:
    """The smallest and the largest id in ``seqs`` ((0, 0) when they hold none): what to check
    against a vocabulary once, where the ids come in, rather than in every batch on the device."""
    seqs = [seq for seq in seqs if len(seq)]
    return (min(map(min, seqs)), max(map(max, seqs))) if seqs else (0, 0)


def collate(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    pad_id: int = PAD_ID,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
) -> tuple[Tensor, Tensor, Tensor]:
    """Pad a list of (source ids, target ids) into ``src (B, S)``, ``tgt_in (B, T)``,
    ``tgt_out (B, T)``.

    ``tgt_in`` is ``<bos> y`` and ``tgt_out`` is ``y <eos>``: the decoder reads the one and
    predicts the other, position by position.
    """
    src = pad_batch([s for s, _ in pairs], pad_id)
    tgt_in = pad_batch([[bos_id, *t] for _, t in pairs], pad_id)
    tgt_out = pad_batch([[*t, eos_id] for _, t in pairs], pad_id)
    return src, tgt_in, tgt_out
