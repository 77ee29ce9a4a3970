"""Chapter 10's data: the tokenizer, the word Vocab, token-count batches and collation; and bad
inputs: a tokenizer file that is missing or unreadable. The corpus's files are tested in
``test_multi30k.py``."""

from __future__ import annotations

import unicodedata
from collections import Counter

import pytest
import torch

from helpers import raises
from transformer_tutorial import data
from transformer_tutorial.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIALS,
    UNK_ID,
    Vocab,
)
from transformer_tutorial.multi30k import load_split


@pytest.fixture(scope="module")
def tokenizer(multi30k_dir):
    src, tgt = load_split("train")
    return data.train_tokenizer(src + tgt, 8000)


@pytest.mark.corpus
def test_tokenizer_has_fixed_specials_and_round_trips_the_test_set(tokenizer, tmp_path):
    assert tokenizer.get_vocab_size() == 8000
    assert (
        [tokenizer.token_to_id(t) for t in SPECIALS]
        == [PAD_ID, BOS_ID, EOS_ID, UNK_ID]
        == [0, 1, 2, 3]
    )
    src, tgt = load_split("test")
    sentences = src + tgt
    encoded = [e.ids for e in tokenizer.encode_batch(sentences)]
    decoded = tokenizer.decode_batch(encoded)
    assert [
        d for s, d in zip(sentences, decoded, strict=True) if d != unicodedata.normalize("NFKC", s)
    ] == []
    assert data.unk_rate(encoded) == 0.0
    data.save_tokenizer(tokenizer, tmp_path / "tokenizer.json")
    again = data.load_tokenizer(tmp_path / "tokenizer.json")
    assert [e.ids for e in again.encode_batch(sentences[:50])] == encoded[:50]


def test_word_vocab_and_unknown_rate():
    vocab = Vocab.build(
        ["a dog runs .", "a cat runs", "a dog sits"], tokenize=str.split, min_freq=2
    )
    assert vocab.itos == [*SPECIALS, "a", "dog", "runs"]
    assert vocab.encode(["a", "bird"]) == [4, vocab.unk_id] and vocab.unk_id == UNK_ID
    assert data.unk_rate([vocab.encode(["a", "bird", "runs"])]) == pytest.approx(1 / 3)
    assert data.word_tokenize("Ein Hund, der läuft.") == ["Ein", "Hund", ",", "der", "läuft", "."]
    assert len(Vocab(Counter({"x": 1}))) == 5


@pytest.mark.corpus
def test_word_vocab_meets_unknown_words_on_the_test_set(multi30k_dir):
    vocab = Vocab.build(load_split("train")[0], min_freq=2)
    test_src = load_split("test")[0]
    assert 0.01 < data.unk_rate(vocab.encode(data.word_tokenize(s)) for s in test_src) < 0.1


def test_batches_cover_every_pair_once_and_respect_the_budget():
    g = torch.Generator().manual_seed(0)
    lengths = [*torch.randint(1, 40, (1000,), generator=g).tolist(), 300]
    for bucket in (True, False):
        batches = data.token_batches(
            lengths, 600, generator=torch.Generator().manual_seed(1), bucket=bucket
        )
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        assert all(max(lengths[i] for i in b) * len(b) <= 600 or len(b) == 1 for b in batches)
    first = data.token_batches(lengths, 600, generator=torch.Generator().manual_seed(1))
    assert first == data.token_batches(lengths, 600, generator=torch.Generator().manual_seed(1))
    assert first != data.token_batches(lengths, 600, generator=torch.Generator().manual_seed(2))
    random_order = data.token_batches(
        lengths, 600, generator=torch.Generator().manual_seed(1), bucket=False
    )
    assert data.pad_share(first, lengths) < 0.05 < data.pad_share(random_order, lengths)
    assert data.token_batches([3, 1, 2], 100) == [[1, 2, 0]]


def test_collate_pads_and_shifts_the_target():
    src, tgt_in, tgt_out = data.collate([([5, 6, 7], [8, 9]), ([5], [8, 9, 10, 11])])
    assert src.tolist() == [[5, 6, 7], [5, PAD_ID, PAD_ID]]
    assert tgt_in.tolist() == [[BOS_ID, 8, 9, PAD_ID, PAD_ID], [BOS_ID, 8, 9, 10, 11]]
    assert tgt_out.tolist() == [[8, 9, EOS_ID, PAD_ID, PAD_ID], [8, 9, 10, 11, EOS_ID]]
    assert data.pair_lengths([([5, 6, 7], [8, 9]), ([5], [8, 9, 10, 11])]) == [3, 5]


# --- bad inputs: the tokenizer file --------------------------------------------------------------


TOKENIZER_ROWS = [
    (None, "tokenizer not found"),
    (b"{", "cannot read the tokenizer"),
    (b"", "cannot read"),
]


@pytest.mark.parametrize(
    ("content", "phrase"), TOKENIZER_ROWS, ids=["missing", "corrupt", "empty"]
)
def test_an_unreadable_tokenizer_is_refused(tmp_path, content, phrase):
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_bytes(content)
    raises(lambda: data.load_tokenizer(path), ValueError, phrase)
