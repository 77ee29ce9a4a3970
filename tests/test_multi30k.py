"""Chapter 10's corpus: where the Multi30k files live, their checksums, downloads (served from
127.0.0.1), the splits' published sizes; and a bad input: a MULTI30K_DIR that is not a
folder."""

from __future__ import annotations

import hashlib
import http.server
import os
import socket
import threading
from pathlib import Path

import pytest

from helpers import raises
from transformer_tutorial import multi30k
from transformer_tutorial.multi30k import ChecksumMismatchError, DatasetUnavailableError

FILES = sorted(multi30k.expected_checksums())


def test_data_dir_follows_the_environment(monkeypatch, tmp_path):
    for name in ("MULTI30K_DIR", "TRANSFORMER_TUTORIAL_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert (
        multi30k.data_dir() == tmp_path / "home" / ".cache" / "transformer_tutorial" / "multi30k"
    )
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert multi30k.data_dir() == tmp_path / "xdg" / "transformer_tutorial" / "multi30k"
    monkeypatch.setenv("TRANSFORMER_TUTORIAL_CACHE", str(tmp_path / "cache"))
    assert multi30k.data_dir() == tmp_path / "cache" / "multi30k"
    (tmp_path / "m30k").mkdir()
    monkeypatch.setenv("MULTI30K_DIR", str(tmp_path / "m30k"))
    assert multi30k.data_dir() == tmp_path / "m30k"


@pytest.mark.corpus
def test_package_checksums_cover_the_six_files(multi30k_dir):
    splits = ("train", "val", "test_2016_flickr")
    assert sorted(f"{split}.{lang}.gz" for split in splits for lang in ("de", "en")) == FILES
    shipped = multi30k_dir / "SHA256SUMS"
    if shipped.exists():
        lines = shipped.read_text().splitlines()
        assert multi30k.expected_checksums() == {
            name: digest for digest, name in (line.split() for line in lines)
        }


@pytest.mark.corpus
def test_read_only_folder_with_verified_files_works(multi30k_dir):
    before = sorted(os.listdir(multi30k_dir))
    for name in FILES:
        assert (
            multi30k.fetch(name, root=multi30k_dir, url_base="http://127.0.0.1:9")
            == multi30k_dir / name
        )
    assert sorted(os.listdir(multi30k_dir)) == before


def test_a_damaged_file_in_the_cache_is_rejected(tmp_path):
    (tmp_path / "val.de.gz").write_bytes(b"not the real file")
    with pytest.raises(ChecksumMismatchError, match=r"val\.de\.gz has SHA-256"):
        multi30k.fetch("val.de.gz", root=tmp_path)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_offline_error_names_the_url_and_the_folder(tmp_path):
    url_base = f"http://127.0.0.1:{closed_port()}/raw"
    with pytest.raises(DatasetUnavailableError) as info:
        multi30k.fetch("train.en.gz", root=tmp_path / "m30k", url_base=url_base)
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
    path = multi30k.fetch("val.en.gz", root=tmp_path / "new" / "folder", url_base=server.url)
    assert path.read_bytes() == (server.source / "val.en.gz").read_bytes()
    assert (
        hashlib.sha256(path.read_bytes()).hexdigest() == multi30k.expected_checksums()["val.en.gz"]
    )
    assert os.listdir(path.parent) == ["val.en.gz"]


@pytest.mark.corpus
def test_corrupted_download_is_rejected_and_nothing_else_is_touched(server, tmp_path):
    multi30k.fetch("val.en.gz", root=tmp_path, url_base=server.url)
    kept = (tmp_path / "val.en.gz").stat()
    server.corrupt.add("val.de.gz")
    with pytest.raises(ChecksumMismatchError, match="discarded"):
        multi30k.fetch("val.de.gz", root=tmp_path, url_base=server.url)
    assert os.listdir(tmp_path) == ["val.en.gz"]
    assert (tmp_path / "val.en.gz").stat().st_mtime_ns == kept.st_mtime_ns


@pytest.mark.corpus
def test_dropped_connection_leaves_no_half_file(server, tmp_path):
    server.drop.add("train.de.gz")
    with pytest.raises(DatasetUnavailableError, match="stopped after"):
        multi30k.fetch("train.de.gz", root=tmp_path, url_base=server.url)
    assert os.listdir(tmp_path) == []
    server.drop.clear()
    assert multi30k.fetch("train.de.gz", root=tmp_path, url_base=server.url).exists()


@pytest.mark.corpus
def test_splits_have_the_published_sizes(multi30k_dir):
    for split, size in multi30k.SPLIT_SIZES.items():
        src, tgt = multi30k.load_split(split)
        assert len(src) == len(tgt) == size and all(isinstance(s, str) and s for s in src + tgt)
    src, tgt = multi30k.load_split("test")
    assert src[0].startswith("Ein Mann mit einem orangefarbenen Hut") and tgt[0].startswith(
        "A man in an orange hat"
    )


# --- bad inputs: the corpus folder ---------------------------------------------------------------


def test_a_multi30k_dir_that_does_not_exist_is_an_error_not_created(tmp_path, monkeypatch):
    """A typo must not download the corpus somewhere unexpected."""
    missing = tmp_path / "typo"
    monkeypatch.setenv("MULTI30K_DIR", str(missing))
    raises(multi30k.data_dir, DatasetUnavailableError, f"MULTI30K_DIR={missing} is not a folder")
    assert not missing.exists()
