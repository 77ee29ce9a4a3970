"""Chapter 10's data: where files live, checksums, downloads (served from 127.0.0.1), the
tokenizer, the word Vocab, token-count batches and collation; and bad inputs: a MULTI30K_DIR
that is not a folder, a tokenizer file that is missing or unreadable."""

from __future__ import annotations

import hashlib
import http.server
import os
import socket
import threading
import unicodedata
from collections import Counter
from pathlib import Path

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
    ChecksumMismatchError,
    DatasetUnavailableError,
    Vocab,
)

FILES = sorted(data.expected_checksums())


def test_data_dir_follows_the_environment(monkeypatch, tmp_path):
    for name in ("MULTI30K_DIR", "TRANSFORMER_TUTORIAL_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data.data_dir() == tmp_path / "home" / ".cache" / "transformer_tutorial" / "multi30k"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data.data_dir() == tmp_path / "xdg" / "transformer_tutorial" / "multi30k"
    monkeypatch.setenv("TRANSFORMER_TUTORIAL_CACHE", str(tmp_path / "cache"))
    assert data.data_dir() == tmp_path / "cache" / "multi30k"
    (tmp_path / "m30k").mkdir()
    monkeypatch.setenv("MULTI30K_DIR", str(tmp_path / "m30k"))
    assert data.data_dir() == tmp_path / "m30k"


@pytest.mark.corpus
def test_package_checksums_cover_the_six_files(multi30k_dir):
    splits = ("train", "val", "test_2016_flickr")
    assert sorted(f"{split}.{lang}.gz" for split in splits for lang in ("de", "en")) == FILES
    shipped = multi30k_dir / "SHA256SUMS"
    if shipped.exists():
        lines = shipped.read_text().splitlines()
        assert data.expected_checksums() == {
            name: digest for digest, name in (line.split() for line in lines)
        }


@pytest.mark.corpus
def test_read_only_folder_with_verified_files_works(multi30k_dir):
    before = sorted(os.listdir(multi30k_dir))
    for name in FILES:
        assert (
            data.fetch(name, root=multi30k_dir, url_base="http://127.0.0.1:9")
            == multi30k_dir / name
        )
    assert sorted(os.listdir(multi30k_dir)) == before


def test_a_damaged_file_in_the_cache_is_rejected(tmp_path):
    (tmp_path / "val.de.gz").write_bytes(b"not the real file")
    with pytest.raises(ChecksumMismatchError, match=r"val\.de\.gz has SHA-256"):
        data.fetch("val.de.gz", root=tmp_path)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_offline_error_names_the_url_and_the_folder(tmp_path):
    url_base = f"http://127.0.0.1:{closed_port()}/raw"
    with pytest.raises(DatasetUnavailableError) as info:
        data.fetch("train.en.gz", root=tmp_path / "m30k", url_base=url_base)
    message = str(info.value)
    assert f"{url_base}/train.en.gz" in message and str(tmp_path / "m30k") in message
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert os.listdir(tmp_path / "m30k") == []


class Server:
    """Serves the shared Multi30k copy over HTTP on 127.0.0.1, with faults on demand."""

    def __init__(self, source: Path) -> None:
        self.source, self.corrupt, self.drop = source, set(), set()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                name = self.path.rsplit("/", 1)[-1]
                if not (server.source / name).exists():
                    self.send_error(404)
                    return
                body = (server.source / name).read_bytes()
                if name in server.corrupt:
                    body = body[:100] + bytes([body[100] ^ 0xFF]) + body[101:]
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2] if name in server.drop else body)
                self.close_connection = True

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/multi30k"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def server(multi30k_dir):
    server = Server(multi30k_dir)
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


@pytest.mark.corpus
def test_download_is_verified_and_lands_under_its_final_name(server, tmp_path):
    path = data.fetch("val.en.gz", root=tmp_path / "new" / "folder", url_base=server.url)
    assert path.read_bytes() == (server.source / "val.en.gz").read_bytes()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == data.expected_checksums()["val.en.gz"]
    assert os.listdir(path.parent) == ["val.en.gz"]


@pytest.mark.corpus
def test_corrupted_download_is_rejected_and_nothing_else_is_touched(server, tmp_path):
    data.fetch("val.en.gz", root=tmp_path, url_base=server.url)
    kept = (tmp_path / "val.en.gz").stat()
    server.corrupt.add("val.de.gz")
    with pytest.raises(ChecksumMismatchError, match="discarded"):
        data.fetch("val.de.gz", root=tmp_path, url_base=server.url)
    assert os.listdir(tmp_path) == ["val.en.gz"]
    assert (tmp_path / "val.en.gz").stat().st_mtime_ns == kept.st_mtime_ns


@pytest.mark.corpus
def test_dropped_connection_leaves_no_half_file(server, tmp_path):
    server.drop.add("train.de.gz")
    with pytest.raises(DatasetUnavailableError, match="stopped after"):
        data.fetch("train.de.gz", root=tmp_path, url_base=server.url)
    assert os.listdir(tmp_path) == []
    server.drop.clear()
    assert data.fetch("train.de.gz", root=tmp_path, url_base=server.url).exists()


@pytest.mark.corpus
def test_splits_have_the_published_sizes(multi30k_dir):
    for split, size in data.SPLIT_SIZES.items():
        src, tgt = data.load_split(split)
        assert len(src) == len(tgt) == size and all(isinstance(s, str) and s for s in src + tgt)
    src, tgt = data.load_split("test")
    assert src[0].startswith("Ein Mann mit einem orangefarbenen Hut") and tgt[0].startswith(
        "A man in an orange hat"
    )


@pytest.fixture(scope="module")
def tokenizer(multi30k_dir):
    src, tgt = data.load_split("train")
    return data.train_tokenizer(src + tgt, 8000)


@pytest.mark.corpus
def test_tokenizer_has_fixed_specials_and_round_trips_the_test_set(tokenizer, tmp_path):
    assert tokenizer.get_vocab_size() == 8000
    assert (
        [tokenizer.token_to_id(t) for t in SPECIALS]
        == [PAD_ID, BOS_ID, EOS_ID, UNK_ID]
        == [0, 1, 2, 3]
    )
    src, tgt = data.load_split("test")
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
    vocab = Vocab.build(data.load_split("train")[0], min_freq=2)
    test_src = data.load_split("test")[0]
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


# --- bad inputs: the corpus folder, the tokenizer file ------------------------------------------


def test_a_multi30k_dir_that_does_not_exist_is_an_error_not_created(tmp_path, monkeypatch):
    """A typo must not download the corpus somewhere unexpected."""
    missing = tmp_path / "typo"
    monkeypatch.setenv("MULTI30K_DIR", str(missing))
    raises(data.data_dir, DatasetUnavailableError, f"MULTI30K_DIR={missing} is not a folder")
    assert not missing.exists()


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
