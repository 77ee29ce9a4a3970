"""Chapter 10: a subword vocabulary, and batches of similar length.

Shapes: a batch is ``src (B, S)``, ``tgt_in (B, T)`` = ``<bos> y`` and ``tgt_out (B, T)`` =
``y <eos>``, padded with ``PAD_ID``. The corpus itself (Multi30k: its files, their checksums,
its splits) is :mod:`~transformer_tutorial.multi30k`'s; its names are importable from here too,
as the chapters call them (``data.load_split``, ``data.fetch``).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from torch import Tensor

# The corpus's names, re-exported for the chapters, which call them from here (data.load_split).
from transformer_tutorial.multi30k import (  # noqa: F401
    SPLIT_SIZES,
    SPLITS,
    SRC_LANG,
    TGT_LANG,
    URL_BASE,
    ChecksumMismatchError,
    DatasetUnavailableError,
    cache_dir,
    data_dir,
    expected_checksums,
    fetch,
    load_split,
    sha256,
)

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
# Tokens a batch (sources and targets, padded), in training and in decoding: the default of
# :func:`token_batches`' callers (the recipes' ``max_tokens``, translate_sentences).
BATCH_TOKENS = 4000
PAD, BOS, EOS, UNK = SPECIALS


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
