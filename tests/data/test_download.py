"""Corpus and table specs, the cache, and loading downloaded corpora, fully offline.

The archives are built here and served by test_fetch's HTTP server on 127.0.0.1;
the download and the archive checks themselves are tested in test_fetch.py.
"""

import dataclasses
import socket
import zipfile

import pytest
from test_fetch import make_zip, one_line, server  # noqa: F401 (server: the HTTP server fixture)

from srupp.data import CORPORA, ByteTokenizer, fetch, load_corpus
from srupp.data import download as dl


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("SRUPP_CACHE", str(d))
    monkeypatch.setattr(fetch, "RETRY_WAIT_S", 0.0)
    return d


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


def test_fetch_checks_the_spec_and_deletes_a_bad_download(server, monkeypatch, cache):
    # (the checks themselves: test_fetch.py)
    serve_enwik8(server, monkeypatch, size=999)
    with pytest.raises(ValueError) as e:
        dl.fetch("enwik8", progress=False)
    msg = one_line(e)
    path = cache / "enwik8" / "enwik8.zip"
    assert str(path) in msg and "999 bytes" in msg and "1,000 bytes" in msg
    assert not path.exists()


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
