"""Corpus download, resume, verification and loading, fully offline.

A small HTTP server on 127.0.0.1 (port 0, background thread) serves zip
archives built here; its handler supports Range requests and can be told to
drop a connection halfway or to ignore Range.
"""

import dataclasses
import io
import socket
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from srupp.data import CORPORA, ByteTokenizer, load_corpus
from srupp.data import download as dl


def one_line(excinfo):
    msg = str(excinfo.value)
    assert msg and "\n" not in msg
    return msg


# ----------------------------------------------------------------------------- test server


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep test output quiet
        pass

    def do_GET(self):
        srv = self.server
        srv.requests.append({"path": self.path, "range": self.headers.get("Range")})
        body = srv.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        start = 0
        rng = self.headers.get("Range")
        if rng and not srv.ignore_range:
            assert rng.startswith("bytes=") and rng.endswith("-"), rng
            start = int(rng[len("bytes="):-1])
            if start >= len(body):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(body)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        payload = body[start:]
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if srv.drop_next:  # send half the bytes, then close the connection
            srv.drop_next -= 1
            self.wfile.write(payload[:len(payload) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(payload)


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.files, srv.requests, srv.drop_next, srv.ignore_range = {}, [], 0, False
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    t = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    t.join(5)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("SRUPP_CACHE", str(d))
    monkeypatch.setattr(dl, "RETRY_WAIT_S", 0.0)
    return d


def make_zip(members, compression=zipfile.ZIP_STORED):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


# 1,000 bytes: ASCII, multi-byte UTF-8 (some straddling the 900/950 cuts) and
# bytes that are not valid UTF-8 at all.
ENWIK_BYTES = ((b"<page>caf\xc3\xa9 \xe2\x82\xac \xff\xfe\x80 " * 60)[:898]
               + "€".encode() + b"abcdefghij" * 4 + b"abcdefg" + "€".encode()
               + b"\xc3" + b"xyz" * 16)
assert len(ENWIK_BYTES) == 1000 and ENWIK_BYTES[898:901] == ENWIK_BYTES[948:951] == "€".encode()


def serve_enwik8(server, monkeypatch, data=ENWIK_BYTES, size=None, archive=None):
    archive = archive if archive is not None else make_zip({"enwik8": data})
    server.files["/enwik8.zip"] = archive
    spec = dataclasses.replace(dl.DATASETS["enwik8"], url=server.url + "/enwik8.zip",
                               sizes={"enwik8": len(data) if size is None else size})
    monkeypatch.setitem(dl.DATASETS, "enwik8", spec)
    return archive


# ----------------------------------------------------------------------------- tests


def test_registered_and_nothing_downloaded_at_import(cache):
    assert {"enwik8", "text8", "wikitext-103"} <= set(CORPORA)
    assert dl.DATASETS["enwik8"].sizes == {"enwik8": 100_000_000}
    assert dl.archive_path("enwik8") == cache / "enwik8" / "enwik8.zip"
    assert not cache.exists()


def test_cache_dir_default(monkeypatch, tmp_path):
    monkeypatch.delenv("SRUPP_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert dl.cache_dir() == tmp_path / ".cache" / "srupp"
    from srupp.data import corpora
    assert dl.cache_dir is corpora.cache_dir  # one definition, for downloads and brown.txt


def test_byte_tokenizer_round_trips_surrogateescape():
    raw = bytes(range(256)) * 2 + "h€llo".encode() + b"\xe2\x82"  # truncated char at the end
    text = raw.decode("utf-8", errors="surrogateescape")
    assert ByteTokenizer().encode(text).numpy().astype("uint8").tobytes() == raw
    with pytest.raises(ValueError, match="lone surrogate"):  # not a byte escape: still an error
        ByteTokenizer().encode("a\ud800b")


def test_full_download_and_byte_splits(server, monkeypatch, cache, capsys):
    archive = serve_enwik8(server, monkeypatch)
    c = load_corpus("enwik8")
    path = cache / "enwik8" / "enwik8.zip"
    assert path.read_bytes() == archive
    assert not (cache / "enwik8" / "enwik8.zip.part").exists()
    assert len(server.requests) == 1 and server.requests[0]["range"] is None
    tok = ByteTokenizer()
    got = [tok.encode(s).numpy().astype("uint8").tobytes() for s in (c.train, c.valid, c.test)]
    assert got == [ENWIK_BYTES[:900], ENWIK_BYTES[900:950], ENWIK_BYTES[950:]]
    assert c.name == "enwik8" and "é" in c.train and "€" in c.train
    assert "\udcff" in c.train  # invalid bytes are escaped, not replaced
    # cached: a second load makes no request
    assert load_corpus("enwik8").test == c.test
    assert len(server.requests) == 1


def test_text8_with_compressed_archive(server, monkeypatch):
    data = (b"anarchism originated as a term of abuse " * 50)[:2000]
    server.files["/text8.zip"] = make_zip({"text8": data}, zipfile.ZIP_DEFLATED)
    monkeypatch.setitem(dl.DATASETS, "text8", dataclasses.replace(
        dl.DATASETS["text8"], url=server.url + "/text8.zip", sizes={"text8": 2000}))
    c = load_corpus("text8")
    assert (c.train, c.valid, c.test) == (data[:1800].decode(), data[1800:1900].decode(),
                                          data[1900:].decode())


def test_resume_after_dropped_connection(server, monkeypatch, cache):
    archive = serve_enwik8(server, monkeypatch)
    server.drop_next = 1
    part = cache / "enwik8" / "enwik8.zip.part"
    with pytest.raises(ValueError) as e:
        dl.fetch("enwik8", retries=0, progress=False)
    msg = one_line(e)
    assert "interrupted" in msg and server.url in msg and str(part) in msg and "resume" in msg
    have = part.stat().st_size
    assert 0 < have < len(archive)
    assert not (cache / "enwik8" / "enwik8.zip").exists()

    path = dl.fetch("enwik8", retries=0, progress=False)
    assert server.requests[1]["range"] == f"bytes={have}-"
    assert path.read_bytes() == archive and not part.exists()
    assert load_corpus("enwik8").valid.encode("utf-8", "surrogateescape") == ENWIK_BYTES[900:950]


def test_interruption_is_retried_automatically(server, monkeypatch):
    archive = serve_enwik8(server, monkeypatch)
    server.drop_next = 1
    path = dl.fetch("enwik8", progress=False)  # default retries
    assert [r["range"] is not None for r in server.requests] == [False, True]
    assert path.read_bytes() == archive


def test_server_ignoring_range_restarts_from_zero(server, monkeypatch, cache):
    archive = serve_enwik8(server, monkeypatch)
    server.ignore_range = True
    part = cache / "enwik8" / "enwik8.zip.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"garbage that must not stay in front")
    path = dl.fetch("enwik8", progress=False)
    assert server.requests[0]["range"] == f"bytes={len(b'garbage that must not stay in front')}-"
    assert path.read_bytes() == archive


def test_stale_part_longer_than_file_starts_over(server, monkeypatch, cache):
    archive = serve_enwik8(server, monkeypatch)
    part = cache / "enwik8" / "enwik8.zip.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"x" * (len(archive) + 10))  # server answers 416
    assert dl.fetch("enwik8", progress=False).read_bytes() == archive
    assert [r["range"] is not None for r in server.requests] == [True, False]


def test_bad_crc_deletes_archive(server, monkeypatch, cache):
    good = make_zip({"enwik8": ENWIK_BYTES})
    i = good.index(ENWIK_BYTES) + 10  # stored member: flip one of its data bytes
    bad = good[:i] + bytes([good[i] ^ 0xFF]) + good[i + 1:]
    serve_enwik8(server, monkeypatch, archive=bad)
    with pytest.raises(ValueError) as e:
        load_corpus("enwik8")
    msg = one_line(e)
    path = cache / "enwik8" / "enwik8.zip"
    crc = zipfile.ZipFile(io.BytesIO(good)).getinfo("enwik8").CRC
    assert str(path) in msg and "CRC" in msg and f"expected 0x{crc:08x}" in msg
    assert "found 0x" in msg and "deleted" in msg
    assert not path.exists() and not path.with_name("enwik8.zip.part").exists()


def test_size_mismatch_deletes_archive(server, monkeypatch, cache):
    serve_enwik8(server, monkeypatch, size=999)
    with pytest.raises(ValueError) as e:
        dl.fetch("enwik8", progress=False)
    msg = one_line(e)
    path = cache / "enwik8" / "enwik8.zip"
    assert str(path) in msg and "999 bytes" in msg and "1,000 bytes" in msg
    assert not path.exists()


def test_not_a_zip_and_missing_member(server, monkeypatch, cache):
    serve_enwik8(server, monkeypatch, archive=b"<html>not found</html>")
    with pytest.raises(ValueError, match="not a valid zip"):
        dl.fetch("enwik8", progress=False)
    serve_enwik8(server, monkeypatch, archive=make_zip({"other": b"x"}))
    with pytest.raises(ValueError, match="'enwik8' is missing"):
        dl.fetch("enwik8", progress=False)
    assert not (cache / "enwik8" / "enwik8.zip").exists()


def test_no_server_names_url_and_cache_path(monkeypatch, cache):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connection refused
    url = f"http://127.0.0.1:{port}/enwik8.zip"
    monkeypatch.setitem(dl.DATASETS, "enwik8",
                        dataclasses.replace(dl.DATASETS["enwik8"], url=url))
    with pytest.raises(ValueError) as e:
        load_corpus("enwik8")
    msg = one_line(e)
    assert url in msg and str(cache / "enwik8" / "enwik8.zip") in msg


def test_http_error(server, monkeypatch):
    serve_enwik8(server, monkeypatch)
    del server.files["/enwik8.zip"]
    with pytest.raises(ValueError, match="HTTP 404"):
        dl.fetch("enwik8", progress=False)


def test_archive_put_by_hand_and_source_override(monkeypatch, cache, tmp_path):
    monkeypatch.setitem(dl.DATASETS, "enwik8", dataclasses.replace(
        dl.DATASETS["enwik8"], url="http://127.0.0.1:9/unused", sizes={"enwik8": 1000}))
    path = cache / "enwik8" / "enwik8.zip"
    path.parent.mkdir(parents=True)
    path.write_bytes(make_zip({"enwik8": ENWIK_BYTES}))
    assert load_corpus("enwik8").test.encode("utf-8", "surrogateescape") == ENWIK_BYTES[950:]
    assert path.with_name("enwik8.zip.verified").exists()
    elsewhere = tmp_path / "mine"
    elsewhere.mkdir()
    (elsewhere / "enwik8.zip").write_bytes(path.read_bytes())
    assert CORPORA["enwik8"](elsewhere).valid == load_corpus("enwik8").valid


WT = "wikitext-103/wiki.{}.tokens"


def wikitext_texts():
    # train: 3 lines (2 blank) with 10 words -> 13 tokens; valid 4 + 2; test 6 + 3.
    return {"train": " = Title = \n \n one two three four five six @-@ \n",
            "valid": " a b \n c d \n",
            "test": " x y \n z \n w v u \n"}


def serve_wikitext(server, monkeypatch, texts, counts):
    server.files["/wt.zip"] = make_zip({WT.format(s): t.encode() for s, t in texts.items()},
                                       zipfile.ZIP_DEFLATED)
    monkeypatch.setitem(dl.DATASETS, "wikitext-103", dataclasses.replace(
        dl.DATASETS["wikitext-103"], url=server.url + "/wt.zip", token_counts=counts))


def test_wikitext_splits_and_token_counts(server, monkeypatch):
    texts = wikitext_texts()
    assert dl.count_tokens(texts["train"]) == (10, 3)
    serve_wikitext(server, monkeypatch, texts, {"train": 13, "valid": 6, "test": 9})
    c = load_corpus("wikitext-103")
    assert (c.train, c.valid, c.test) == (texts["train"], texts["valid"], texts["test"])


def test_wikitext_token_tolerance(server, monkeypatch, cache):
    # within 1 %: 1000 tokens counted, 1009 expected
    texts = dict(wikitext_texts(), train="w " * 999 + "\n")
    serve_wikitext(server, monkeypatch, texts, {"train": 1009, "valid": 6, "test": 9})
    load_corpus("wikitext-103")
    # off by more than 1 %
    serve_wikitext(server, monkeypatch, texts, {"train": 1011, "valid": 6, "test": 9})
    with pytest.raises(ValueError) as e:
        load_corpus("wikitext-103")
    msg = one_line(e)
    assert "wiki.train.tokens" in msg and "1,000 tokens" in msg and "1,011" in msg


def test_wikitext_empty_tokens_file(server, monkeypatch):
    texts = dict(wikitext_texts(), valid=" \n \n")
    serve_wikitext(server, monkeypatch, texts, {"train": 13, "valid": 2, "test": 9})
    with pytest.raises(ValueError) as e:
        load_corpus("wikitext-103")
    assert "wiki.valid.tokens" in one_line(e) and "no tokens" in one_line(e)
