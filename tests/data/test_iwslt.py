"""IWSLT'14 De-En: fairseq's preparation, and download through the corpus machinery, offline.

The archive is a small de-en.tgz built here with the real member names, served
by test_fetch's HTTP server on 127.0.0.1.
"""

import dataclasses
import gzip
import io
import random
import tarfile

import pytest
from test_fetch import one_line, server  # noqa: F401 (server: the HTTP server fixture)

from srupp.data import CORPORA, TABLES, fetch, load_table
from srupp.data import download as dl

NAME = "iwslt14-de-en"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("SRUPP_CACHE", str(d))
    monkeypatch.setattr(fetch, "RETRY_WAIT_S", 0.0)
    return d


# ----------------------------------------------------------------------------- the archive

# Training lines, each (German, English, the cleaned pair or None where it is dropped).
HEADER = [
    ("<url>http://www.ted.com/talks/lang/de/jane.html</url>",
     "<url>http://www.ted.com/talks/jane.html</url>", None),
    ("<keywords>talks, Meer</keywords>", "<keywords>talks, ocean</keywords>", None),
    # fairseq's script keeps lines with other tags (such as <speaker>) as text
    ("<speaker>Jane Doe</speaker>", "<speaker>Jane Doe</speaker>",
     ("<speaker>jane doe</speaker>", "<speaker>jane doe</speaker>")),
    ("<talkid>7</talkid>", "<talkid>7</talkid>", None),
    # title and description keep their text, without the tags
    ("<title>Jane Doe: Das  Meer</title>", "<title>Jane Doe: The Ocean</title>",
     ("jane doe: das meer", "jane doe: the ocean")),
    ("<description>TED-Vortrag über das Meer.</description>",
     "<description>A TED talk on the ocean.</description>",
     ("ted-vortrag über das meer.", "a ted talk on the ocean.")),
]
SPECIAL = [
    ("  Das Meer   ist GROSS.\t\r", "The ocean is BIG. ",
     ("das meer ist gross.", "the ocean is big.")),
    ("", "An English line alone.", None),                       # empty side
    ("Ja.", "Yes, of course it is.", None),                     # ratio 5 > 1.5
    ("Eins zwei drei", "One two", ("eins zwei drei", "one two")),   # ratio exactly 1.5: kept
    ("Eins zwei drei vier", "One two", None),                   # ratio 2
    (" ".join(["wort"] * 175), " ".join(["word"] * 175),
     (" ".join(["wort"] * 175), " ".join(["word"] * 175))),     # 175 words: kept
    (" ".join(["wort"] * 176), " ".join(["word"] * 176), None),  # 176 words
    ("x" * 1001 + " b", "y c", None),                           # a word over 1,000 chars
    ("Es ist’s gut", "It’s good", ("es ist’s gut", "it’s good")),  # train keeps U+2019
]
BULK = [(f"Satz Nummer {i}.", f"Sentence number {i}.", (f"satz nummer {i}.",
                                                         f"sentence number {i}."))
        for i in range(40)]
TRAIN = HEADER + SPECIAL + BULK
CLEAN = [pair for _, _, pair in TRAIN if pair]   # 3 + 4 + 40 = 47 pairs
VALID = [CLEAN[22], CLEAN[45]]                    # lines 23 and 46

# Segments of the XML files, each (German, English, prepared pair).
SETS = {
    "IWSLT14.TED.dev2010": [(" Als ich 11  war. ", "When I was 11.",
                             ("als ich 11 war.", "when i was 11."))],
    "IWSLT14.TEDX.dev2012": [("Das ist’s.", "That’s it.", ("das ist's.", "that's it.")),
                              ("Zweitens", "Second", ("zweitens", "second"))],
    "IWSLT14.TED.tst2010": [("Hallo", "Hello", ("hallo", "hello"))],
    "IWSLT14.TED.tst2011": [("Ja ja ja ja ja ja", "Yes", ("ja ja ja ja ja ja", "yes"))],
    "IWSLT14.TED.tst2012": [("Ende.", "The end.", ("ende.", "the end."))],
}


def xml(set_id, segments):
    segs = "".join(f'<seg id="{i}">{s}</seg>\n' for i, s in enumerate(segments, 1))
    return ('<?xml version="1.0" encoding="UTF-8"?>\n<mteval>\n'
            f'<srcset setid="{set_id}" srclang="german">\n<doc docid="1" genre="lectures">\n'
            "<url>http://www.ted.com/talks/x.html</url>\n"
            "<description>TED Talk Subtitles and Transcript: a talk</description>\n"
            f"<talkid>1</talkid>\n<title>A title</title>\n{segs}</doc>\n</srcset>\n</mteval>\n")


def members(train=TRAIN, sets=SETS):
    files = {}
    for k, lang in enumerate(("de", "en")):
        files[f"de-en/train.tags.de-en.{lang}"] = "\n".join(t[k] for t in train) + "\n"
        for name, segs in sets.items():
            files[f"de-en/{name}.de-en.{lang}.xml"] = xml(name, [s[k] for s in segs])
    return files


def make_tgz(files):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_400_000_000
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def flip_gzip_crc(archive):
    """The archive with one bit of its gzip trailer's CRC-32 flipped."""
    return archive[:-8] + bytes([archive[-8] ^ 1]) + archive[-7:]


def tgz_with_tail(files):
    """A tgz whose tar ends well before the gzip stream: 64 KiB of random bytes follow the
    tar's end-of-archive blocks (tar readers stop there), so only reading the whole
    gzip stream reaches its CRC-32."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tf.addfile(info, io.BytesIO(text.encode()))
    return gzip.compress(buf.getvalue() + random.Random(0).randbytes(1 << 16), mtime=0)


def serve(server, monkeypatch, archive):   # noqa: F811 (server: the fixture)
    server.files["/fairseq/de-en.tgz"] = archive
    monkeypatch.setitem(dl.DATASETS, NAME, dataclasses.replace(
        dl.DATASETS[NAME], url=server.url + "/fairseq/de-en.tgz"))


# ----------------------------------------------------------------------------- tests


def test_registered_as_a_table_not_a_corpus(cache):
    assert NAME in TABLES and NAME not in CORPORA
    spec = dl.DATASETS[NAME]
    assert spec.url == "http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz"
    assert set(spec.members) == set(members()) and len(spec.members) == 12
    assert dl.archive_path(NAME) == cache / NAME / "de-en.tgz"
    with pytest.raises(ValueError, match="is a table"):
        dl.load_downloaded(NAME)


def test_prepare_like_fairseq():
    out = dl.prepare_iwslt14(members())
    assert len(CLEAN) == 47 and VALID[0][0] == "satz nummer 15." == BULK[15][2][0]
    assert out["valid"] == VALID
    assert out["train"] == CLEAN[:22] + CLEAN[23:45] + CLEAN[46:]
    assert out["test"] == [s[2] for name in SETS for s in SETS[name]]


def test_prepare_needs_paired_sides():
    files = members()
    files["de-en/train.tags.de-en.de"] += "Eine Zeile mehr\n"
    with pytest.raises(ValueError, match="train.tags.de-en: 53 German but 52 English"):
        dl.prepare_iwslt14(files)
    files = members(sets=dict(SETS, **{"IWSLT14.TED.tst2011": [("a", "b", None)]}))
    files["de-en/IWSLT14.TED.tst2011.de-en.en.xml"] = xml("t", [])
    with pytest.raises(ValueError, match="tst2011.*1 German but 0 English"):
        dl.prepare_iwslt14(files)
    del files["de-en/IWSLT14.TED.tst2012.de-en.de.xml"]
    with pytest.raises(ValueError, match="tst2012.de-en.de.xml"):
        dl.prepare_iwslt14(files)


def test_download_and_load_table(server, monkeypatch, cache):   # noqa: F811
    archive = make_tgz(members())
    serve(server, monkeypatch, archive)
    t = load_table(NAME, ("en", "de"))
    assert t.columns == ("en", "de")
    assert t.valid == [(en, de) for de, en in VALID]
    assert t.train == [(en, de) for de, en in CLEAN[:22] + CLEAN[23:45] + CLEAN[46:]]
    assert t.test[0] == ("when i was 11.", "als ich 11 war.") and len(t.test) == 6
    path = cache / NAME / "de-en.tgz"
    assert path.read_bytes() == archive and path.with_name("de-en.tgz.verified").exists()
    assert load_table(NAME, ("de",)).test[-1] == ("ende.",)
    assert len(server.requests) == 1   # the second load read the cache
    with pytest.raises(ValueError, match="no column 'fr'"):
        load_table(NAME, ("de", "fr"))
    # the archive given by hand, in a folder
    assert TABLES[NAME](path.parent).train == load_table(NAME, ("de", "en")).train


def test_interrupted_download_resumes(server, monkeypatch, cache):   # noqa: F811
    archive = make_tgz(members())
    serve(server, monkeypatch, archive)
    server.drop_next = 1
    part = cache / NAME / "de-en.tgz.part"
    with pytest.raises(ValueError) as e:
        dl.fetch(NAME, retries=0, progress=False)
    msg = one_line(e)
    assert "interrupted" in msg and str(part) in msg and "resume" in msg
    assert 0 < part.stat().st_size < len(archive)
    assert load_table(NAME, ("de", "en")).valid == VALID
    assert server.requests[1]["range"] == f"bytes={len(archive) // 2}-"


@pytest.mark.parametrize("damage, words", [
    (lambda: make_tgz(members())[:-30], "truncated"),
    (lambda: flip_gzip_crc(make_tgz(members())), "CRC"),
    (lambda: flip_gzip_crc(tgz_with_tail(members())), "CRC"),
    (lambda: b"<html>moved</html>", "not a valid gzip"),
    (lambda: make_tgz({k: v for k, v in members().items() if "tst2010" not in k}),
     "'de-en/IWSLT14.TED.tst2010.de-en.de.xml' is missing"),
], ids=["truncated", "crc", "crc-after-tar-end", "not-gzip", "missing-member"])
def test_bad_archive_is_deleted(server, monkeypatch, cache, damage, words):   # noqa: F811
    serve(server, monkeypatch, damage())
    with pytest.raises(ValueError) as e:
        load_table(NAME, ("de", "en"))
    msg = one_line(e)
    path = cache / NAME / "de-en.tgz"
    assert words in msg and str(path) in msg and "deleted" in msg
    assert not path.exists()
