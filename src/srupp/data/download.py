"""Download, verify and load the standard benchmark corpora and tables.

Three corpora are registered with :func:`~srupp.data.corpora.load_corpus`,
and one table with :func:`~srupp.data.tables.load_table`:

``enwik8``
    ``http://mattmahoney.net/dc/enwik8.zip``, member ``enwik8``: exactly
    100,000,000 bytes of Wikipedia XML, split by *byte* position into the first
    90M (train), next 5M (valid) and last 5M (test) bytes.
``text8``
    ``http://mattmahoney.net/dc/text8.zip``, member ``text8``: 100,000,000
    bytes (lower-case a-z and spaces), split 90M/5M/5M the same way.
``wikitext-103``
    ``wikitext-103-v1.zip``, members ``wikitext-103/wiki.{train,valid,test}.tokens``
    (strict UTF-8), one per split. Each split's token count, counted as its
    whitespace-separated tokens plus one ``<eos>`` per line (the convention
    behind the published 103,227,021 / 217,646 / 245,569), must lie within
    1 % of the published figure.
``iwslt14-de-en`` (a table, columns ``de`` and ``en``)
    ``http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz``, the
    archive of fairseq's ``examples/translation/prepare-iwslt14.sh``, prepared
    as that script does, tokenisation aside: see :func:`prepare_iwslt14`.

Byte-level text (enwik8, text8)
-------------------------------
enwik8 is cut at exactly 100M bytes and its splits at byte positions, so a
split may start or end inside a multi-byte UTF-8 character. To keep every byte
exactly, each split is decoded with ``bytes.decode("utf-8", "surrogateescape")``:
valid UTF-8 becomes ordinary characters, and every byte that is not part of a
valid sequence becomes one lone surrogate U+DC80..U+DCFF.
:class:`~srupp.data.tokenizers.ByteTokenizer` encodes with the same error
handler, so ``ByteTokenizer().encode(split)`` gives back the split's original
bytes, one id per byte.

Cache, download, verification
-----------------------------
Archives live in ``<cache>/<name>/``, where ``<cache>`` is
:func:`~srupp.data.corpora.cache_dir` (``$SRUPP_CACHE`` or ``~/.cache/srupp``).
A missing archive is downloaded with :mod:`urllib` into ``<archive>.part``
(progress bar on stderr). An interrupted download keeps the ``.part`` file and
is resumed with an HTTP ``Range`` request, automatically ``retries`` times and
again on the next call; a server that ignores ``Range`` (answers 200) makes it
start over from zero. The ``.part`` file is the download's own temporary file:
unlike :mod:`srupp._files`' temporaries it outlives a failed run, so that the
next one can resume. The finished file is moved into place with
:func:`os.replace`, then verified: the expected members and their sizes, and
the data's CRC-32s: every member's of a zip archive
(:meth:`zipfile.ZipFile.testzip`), the whole stream's of a gzip-compressed tar
archive (``.tgz``, ``.tar.gz``; gzip keeps one CRC-32 and the length in its
trailer). A file that
fails is deleted and a ``ValueError`` names it, what was expected and what
was found. After a successful check a small stamp file
(``<archive>.verified``, the archive's size and mtime) spares re-checking the
CRCs on every load; an archive put in the cache by hand is checked on first use.

Without a network the error gives the URL and the exact path where the archive
can be put by hand. URLs, sizes and splits live in :data:`DATASETS` (tests
replace entries). Nothing is downloaded at import time.
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import http.client
import itertools
import json
import os
import re
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from tqdm import tqdm

from srupp._files import atomic_write_text

from .corpora import SPLITS, Corpus, _decode, cache_dir, register_corpus
from .tables import TableSplits, register_table
from .tokenizers import _lines

__all__ = [
    "DatasetSpec",
    "DATASETS",
    "cache_dir",
    "archive_path",
    "download",
    "verify_archive",
    "fetch",
    "load_downloaded",
    "count_tokens",
    "prepare_iwslt14",
    "load_iwslt14",
    "IWSLT14_MEMBERS",
]

#: Seconds to wait for a connection or for data before giving up on a request.
TIMEOUT_S = 30.0
#: Seconds to wait before resuming an interrupted download (times the attempt number).
RETRY_WAIT_S = 2.0
#: Read size while downloading.
CHUNK = 1 << 20


@dataclass(frozen=True)
class DatasetSpec:
    """Where a corpus or table comes from and how to check and split it.

    ``archive``: the file name in the cache; its ending gives the format:
    ``.zip``, or ``.tgz`` / ``.tar.gz`` (a gzip-compressed tar archive).
    ``members``: the archive members read, in order. With
    ``split="positional"`` there is one member, cut by byte position in the
    proportions ``fractions`` (train, valid, test); with ``split="members"``
    there are three, one per split (train, valid, test); with
    ``split="table"`` any number, which a table loader turns into
    :class:`~srupp.data.tables.TableSplits` (not a corpus).
    ``sizes``: member -> expected uncompressed size in bytes (a member not
    listed is not size-checked).
    ``encoding``: ``"bytes"`` (UTF-8 with ``surrogateescape``, lossless for
    any bytes) or ``"utf-8"`` (strict).
    ``token_counts``: split -> expected count of whitespace tokens plus lines
    (``None``: not checked), allowed off by ``token_tolerance`` (relative).
    """

    url: str
    archive: str
    members: tuple[str, ...]
    sizes: Mapping[str, int] = field(default_factory=dict)
    split: str = "positional"
    fractions: tuple[int, int, int] = (90, 5, 5)
    encoding: str = "bytes"
    token_counts: Mapping[str, int] | None = None
    token_tolerance: float = 0.01

    def __post_init__(self) -> None:
        if self.split not in ("positional", "members", "table"):
            raise ValueError(f"split must be 'positional', 'members' or 'table', "
                             f"got {self.split!r}")
        want = {"positional": 1, "members": 3}.get(self.split)
        if want is not None and len(self.members) != want:
            raise ValueError(f"split={self.split!r} needs {want} member(s), got {self.members}")
        if not self.members:
            raise ValueError(f"split={self.split!r} needs at least one member, got none")
        if self.encoding not in ("bytes", "utf-8"):
            raise ValueError(f"encoding must be 'bytes' or 'utf-8', got {self.encoding!r}")
        if not self.archive.endswith((".zip", ".tgz", ".tar.gz")):
            raise ValueError(f"archive {self.archive!r} must end in .zip, .tgz or .tar.gz "
                             "(the formats srupp reads)")

    @property
    def is_tar(self) -> bool:
        """Whether the archive is a gzip-compressed tar file (otherwise a zip file)."""
        return not self.archive.endswith(".zip")


#: IWSLT'14 De-En: the training transcripts and the XML files of the test sets,
#: in the order fairseq concatenates them into its test split.
IWSLT14_TEST_SETS = ("IWSLT14.TED.dev2010", "IWSLT14.TEDX.dev2012", "IWSLT14.TED.tst2010",
                     "IWSLT14.TED.tst2011", "IWSLT14.TED.tst2012")
IWSLT14_MEMBERS = (("de-en/train.tags.de-en.de", "de-en/train.tags.de-en.en")
                   + tuple(f"de-en/{name}.de-en.{lang}.xml"
                           for name in IWSLT14_TEST_SETS for lang in ("de", "en")))

#: Known downloadable corpora and tables: name -> spec. Tests may replace entries.
DATASETS: dict[str, DatasetSpec] = {
    "enwik8": DatasetSpec(
        url="http://mattmahoney.net/dc/enwik8.zip",
        archive="enwik8.zip",
        members=("enwik8",),
        sizes={"enwik8": 100_000_000},
    ),
    "text8": DatasetSpec(
        url="http://mattmahoney.net/dc/text8.zip",
        archive="text8.zip",
        members=("text8",),
        sizes={"text8": 100_000_000},
    ),
    "wikitext-103": DatasetSpec(
        url="https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip",
        archive="wikitext-103-v1.zip",
        members=("wikitext-103/wiki.train.tokens", "wikitext-103/wiki.valid.tokens",
                 "wikitext-103/wiki.test.tokens"),
        split="members",
        encoding="utf-8",
        token_counts={"train": 103_227_021, "valid": 217_646, "test": 245_569},
    ),
    # The archive's size and checksum are not pinned: they could not be measured
    # offline. Its structure (every member below present) and gzip's own CRC-32
    # are checked instead, and prepare_iwslt14 checks that the sides pair up.
    "iwslt14-de-en": DatasetSpec(
        url="http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz",
        archive="de-en.tgz",
        members=IWSLT14_MEMBERS,
        split="table",
        encoding="utf-8",
    ),
}


def _spec(name: str) -> DatasetSpec:
    try:
        return DATASETS[name]
    except KeyError:
        raise ValueError(f"unknown downloadable corpus {name!r}; choose one of: "
                         f"{', '.join(sorted(DATASETS))}") from None


def archive_path(name: str) -> Path:
    """Where corpus ``name``'s archive is (or will be) cached."""
    return cache_dir() / name / _spec(name).archive


# ----------------------------------------------------------------------------- download


class _Interrupted(Exception):
    """The transfer stopped early; the ``.part`` file is kept for resuming."""


def _download_once(url: str, part: Path, timeout: float, progress: bool) -> None:
    start = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": "srupp (python urllib)"}
    if start:
        headers["Range"] = f"bytes={start}-"
    req = urllib.request.Request(url, headers=headers)
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and start:  # our partial file is no prefix of theirs
            e.close()
            part.unlink()
            raise _Interrupted("the server refused to resume (HTTP 416); starting over") from None
        raise
    with resp:
        try:
            length = int(resp.headers.get("Content-Length"))
        except (TypeError, ValueError):  # no such header, or not a number
            length = None
        if start and resp.status == 206:
            content_range = resp.headers.get("Content-Range", "")
            if not content_range.startswith(f"bytes {start}-"):
                part.unlink()
                raise _Interrupted(f"the server resumed at the wrong place "
                                   f"(Content-Range {content_range!r}); starting over")
            mode = "ab"
        else:  # a fresh download, or a server that ignored Range: start from zero
            start, mode = 0, "wb"
        total = None if length is None else start + length
        done = start
        with open(part, mode) as f, tqdm(total=total, initial=start, unit="B", unit_scale=True,
                                         unit_divisor=1024, desc=part.name[:-len(".part")],
                                         file=sys.stderr, disable=not progress,
                                         leave=False) as bar:
            try:
                while True:
                    chunk = resp.read(CHUNK)
                    if not chunk:
                        break
                    f.write(chunk)
                    done += len(chunk)
                    bar.update(len(chunk))
            except (OSError, http.client.HTTPException) as e:
                raise _Interrupted(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        if total is not None and done != total:
            raise _Interrupted(f"the connection closed after {done:,} of {total:,} bytes")


def download(url: str, dest: str | Path, *, retries: int = 3, timeout: float = TIMEOUT_S,
             progress: bool = True) -> Path:
    """Download ``url`` to ``dest`` via ``dest.part``, resuming a partial file.

    Interruptions mid-transfer are resumed up to ``retries`` times; then a
    ``ValueError`` says to run again (the ``.part`` file is kept). Connection
    failures and HTTP errors raise a ``ValueError`` naming the URL and
    ``dest``, where the file can be put by hand. The finished file is moved to
    ``dest`` with :func:`os.replace`; it is not verified here.
    """
    dest = Path(dest)
    part = dest.with_name(dest.name + ".part")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the cache folder {str(dest.parent)!r}: "
                         f"{e.strerror or e}; set SRUPP_CACHE to a writable folder") from None
    by_hand = f"download it elsewhere and put it at {dest}"
    for attempt in itertools.count(1):
        try:
            _download_once(url, part, timeout, progress)
            break
        except _Interrupted as e:
            if attempt > retries:
                have = part.stat().st_size if part.exists() else 0
                raise ValueError(f"download of {url} was interrupted ({e}); {have:,} bytes are "
                                 f"kept in {part}: run again to resume, or {by_hand}") from None
            time.sleep(RETRY_WAIT_S * attempt)
        except urllib.error.HTTPError as e:
            raise ValueError(f"cannot download {url}: HTTP {e.code} {e.reason}; "
                             f"{by_hand}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", None) or e
            raise ValueError(f"cannot download {url} (no network? {reason}); "
                             f"{by_hand}") from None
    os.replace(part, dest)
    return dest


# ----------------------------------------------------------------------------- verification


def _stamp_of(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _actual_crc(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> str:
    """The CRC-32 of a member's data as stored, or '?' if it cannot be read."""
    unchecked = copy.copy(info)
    with contextlib.suppress(AttributeError):
        del unchecked.CRC  # ZipExtFile skips its own check when the info has no CRC
    crc = 0
    try:
        with zf.open(unchecked) as f:
            while chunk := f.read(CHUNK):
                crc = zlib.crc32(chunk, crc)
    except Exception:  # noqa: BLE001 - data too damaged to read at all
        return "unreadable data"
    return f"0x{crc:08x}"


def _member_problem(sizes: dict[str, int], spec: DatasetSpec) -> str | None:
    """Why an archive holding files ``sizes`` (name -> bytes) lacks what ``spec`` needs."""
    for member in spec.members:
        if member not in sizes:
            found = ", ".join(sorted(sizes)[:5]) or "nothing"
            return f"member {member!r} is missing (found: {found})"
        want = spec.sizes.get(member)
        if want is not None and sizes[member] != want:
            return (f"member {member!r} should be {want:,} bytes but is "
                    f"{sizes[member]:,} bytes")
    return None


def _tar_problem(path: Path, spec: DatasetSpec) -> str | None:
    """Why ``path`` is not a good ``.tgz`` archive for ``spec`` (``None``: it is)."""
    # The whole gzip stream first: its trailer's CRC-32 and length catch damaged
    # or truncated data, which tarfile alone would miss (it stops reading at the
    # tar end-of-archive blocks).
    try:
        with gzip.open(path, "rb") as f:
            while f.read(CHUNK):
                pass
    except EOFError as e:
        return f"it is truncated ({e})"
    except (gzip.BadGzipFile, zlib.error) as e:
        return f"it is not a valid gzip file, or its data are damaged ({e})"
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    try:
        with tarfile.open(path, "r:gz") as tf:
            sizes = {m.name: m.size for m in tf.getmembers() if m.isfile()}
    except (tarfile.TarError, EOFError, OSError) as e:
        return f"it is not a valid tar archive ({e})"
    return _member_problem(sizes, spec)


def _archive_problem(path: Path, spec: DatasetSpec) -> str | None:
    """Why ``path`` is not a good archive for ``spec`` (``None``: it is)."""
    if spec.is_tar:
        return _tar_problem(path, spec)
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        return f"it is not a valid zip archive ({e})"
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    with zf:
        problem = _member_problem({i.filename: i.file_size for i in zf.infolist()}, spec)
        if problem is not None:
            return problem
        try:
            bad = zf.testzip()
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError) as e:
            return f"its data cannot be decompressed ({e})"
        if bad is not None:
            info = zf.getinfo(bad)
            return (f"member {bad!r} fails its CRC-32 check: expected 0x{info.CRC:08x}, "
                    f"found {_actual_crc(zf, info)}")
    return None


def verify_archive(path: str | Path, spec: DatasetSpec, *, delete_bad: bool = True) -> None:
    """Check a corpus archive: members, their sizes and CRC-32s (see the module doc).

    On failure deletes the file (when ``delete_bad``) and raises a
    ``ValueError`` naming it, what was expected and what was found. On
    success writes the ``.verified`` stamp next to it (when that is possible),
    and a later call with an unchanged file returns at once.
    """
    path = Path(path)
    stamp = path.with_name(path.name + ".verified")
    with contextlib.suppress(OSError, ValueError):
        if json.loads(stamp.read_text()) == _stamp_of(path):
            return
    problem = _archive_problem(path, spec)
    if problem is None:
        with contextlib.suppress(OSError):
            atomic_write_text(stamp, json.dumps(_stamp_of(path)))
        return
    action = "it was not changed"
    if delete_bad:
        try:
            path.unlink()
            stamp.unlink(missing_ok=True)
            action = "it was deleted; run again to download it afresh"
        except OSError as e:
            action = f"deleting it failed ({e.strerror or e}); delete it by hand"
    raise ValueError(f"archive {path} is damaged: {problem}; {action}")


def fetch(name: str, *, retries: int = 3, progress: bool = True) -> Path:
    """The verified archive of corpus or table ``name``, downloading it if it is not cached."""
    spec = _spec(name)
    path = archive_path(name)
    if not path.is_file():
        download(spec.url, path, retries=retries, progress=progress)
    verify_archive(path, spec)
    return path


# ----------------------------------------------------------------------------- loading


def count_tokens(text: str) -> tuple[int, int]:
    """``(whitespace-separated tokens, lines)`` of ``text``; a last line without
    a newline counts too. Works line by line, so huge texts need little memory."""
    words = 0
    start = 0
    n = len(text)
    while start < n:
        end = text.find("\n", start)
        if end < 0:
            end = n
        words += len(text[start:end].split())
        start = end + 1
    lines = text.count("\n") + (1 if text and not text.endswith("\n") else 0)
    return words, lines


def _read_members(path: Path, spec: DatasetSpec) -> list[bytes]:
    """The bytes of ``spec.members`` in archive ``path`` (zip or tgz), in order."""
    fix = "delete the file and run again to download it afresh"
    try:
        if spec.is_tar:
            with tarfile.open(path, "r:gz") as tf:
                # Each member read as the scan reaches it: seeking back in a gzip
                # stream would decompress it again from the start.
                found = {m.name: tf.extractfile(m).read() for m in tf
                         if m.name in spec.members and m.isfile()}
            missing = [m for m in spec.members if m not in found]
            if missing:
                raise ValueError(f"member {missing[0]!r} is missing from {path}; {fix}")
            blobs = [found[m] for m in spec.members]
        else:
            with zipfile.ZipFile(path) as zf:
                blobs = [zf.read(m) for m in spec.members]
    except (KeyError, tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError,
            OSError) as e:
        raise ValueError(f"cannot read the members of {path}: {e}; {fix}") from None
    for member, data in zip(spec.members, blobs):
        want = spec.sizes.get(member)
        if want is not None and len(data) != want:
            raise ValueError(f"member {member!r} of {path} should be {want:,} bytes but is "
                             f"{len(data):,}; {fix}")
    return blobs


def _archive(name: str, spec: DatasetSpec, source: str | Path | None, progress: bool) -> Path:
    """The verified archive of ``name``: ``source`` (a file, or a folder holding
    it; verified but never downloaded or deleted), or the cached one, fetched
    first if missing."""
    if source is None:
        return fetch(name, progress=progress)
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / spec.archive
    if not path.is_file():
        raise ValueError(f"no {name} archive at {str(path)!r}; give the path of "
                         f"{spec.archive} (from {spec.url})")
    verify_archive(path, spec, delete_bad=False)
    return path


def _check_tokens(name: str, split: str, member: str, text: str, spec: DatasetSpec,
                  path: Path) -> None:
    words, lines = count_tokens(text)
    if words == 0:
        raise ValueError(f"corpus {name!r}: {member} ({split} split) in {path} has no tokens; "
                         "it is not the expected archive: delete it and run again")
    want = spec.token_counts.get(split)
    got = words + lines
    if want is not None and abs(got - want) > spec.token_tolerance * want:
        raise ValueError(f"corpus {name!r}: {member} ({split} split) has {got:,} tokens "
                         f"({words:,} words + {lines:,} line ends), expected {want:,} "
                         f"(within {spec.token_tolerance:.0%}); {path} is not the expected "
                         "archive: delete it and run again")


def load_downloaded(name: str, source: str | Path | None = None, *,
                    progress: bool = True) -> Corpus:
    """Load downloadable corpus ``name`` (see the module doc).

    ``source``: an archive file, or a folder holding it, to read instead of
    the cache (it is verified but never downloaded or deleted). Default: the
    cached archive, downloaded first if missing.
    """
    spec = _spec(name)
    if spec.split == "table":
        raise ValueError(f"{name!r} is a table, not a text corpus; load it with "
                         f"srupp.data.load_table({name!r}, columns)")
    path = _archive(name, spec, source, progress)
    blobs = _read_members(path, spec)

    if spec.split == "positional":
        data = blobs[0]
        total = sum(spec.fractions)
        a = len(data) * spec.fractions[0] // total
        b = len(data) * (spec.fractions[0] + spec.fractions[1]) // total
        parts = [data[:a], data[a:b], data[b:]]
        wheres = [f"{spec.members[0]} ({s} split)" for s in SPLITS]
    else:
        parts, wheres = blobs, list(spec.members)

    texts: dict[str, str] = {}
    for i, (split, where) in enumerate(zip(SPLITS, wheres)):
        part, parts[i] = parts[i], b""  # free each split's bytes once decoded
        text = (part.decode("utf-8", errors="surrogateescape") if spec.encoding == "bytes"
                else _decode(part, f"{where} in {path}"))
        if spec.token_counts is not None:
            _check_tokens(name, split, where, text, spec, path)
        texts[split] = text
    return Corpus(name, **texts)


def _make_loader(name: str):
    def loader(source: str | Path | None = None) -> Corpus:
        return load_downloaded(name, source)

    loader.__name__ = loader.__qualname__ = "load_" + name.replace("-", "_")
    loader.__doc__ = (f"The {name} corpus (downloaded to the cache on first use); "
                      "see :mod:`srupp.data.download`.")
    return loader


for _name in tuple(DATASETS):
    if DATASETS[_name].split != "table":
        register_corpus(_name)(_make_loader(_name))
del _name


# ----------------------------------------------------------------------------- IWSLT'14 De-En

#: Training lines that hold one of these are talk metadata and are dropped.
IWSLT14_DROP_TAGS = ("<url>", "<talkid>", "<keywords>")
#: These tags are removed from training lines, keeping the text between them.
IWSLT14_UNWRAP_TAGS = ("<title>", "</title>", "<description>", "</description>")
#: clean-corpus-n.perl's settings in fairseq: ``-ratio 1.5 ... 1 175`` (and its
#: default -max-word-length 1000).
IWSLT14_MIN_WORDS, IWSLT14_MAX_WORDS, IWSLT14_MAX_RATIO, IWSLT14_MAX_WORD_CHARS = 1, 175, 1.5, 1000
#: Every 23rd cleaned training pair (1-based line number divisible by 23) is validation.
IWSLT14_VALID_EVERY = 23

_SEG_OPEN = re.compile(r'<seg id="[0-9]*">\s*')
_SEG_CLOSE = re.compile(r"\s*</seg>\s*")


def _normalise(line: str) -> str:
    """Whitespace runs as one space, none at the ends, lower case."""
    return " ".join(line.split()).lower()


def _train_lines(text: str) -> list[str]:
    lines = []
    for line in _lines(text):
        if any(tag in line for tag in IWSLT14_DROP_TAGS):
            continue
        for tag in IWSLT14_UNWRAP_TAGS:
            line = line.replace(tag, "")
        lines.append(_normalise(line))
    return lines


def _segments(text: str) -> list[str]:
    """The text of each ``<seg id="N">...</seg>`` line, normalised, with the
    right single quote (U+2019) as an apostrophe, as fairseq's sed does."""
    return [_normalise(_SEG_CLOSE.sub("", _SEG_OPEN.sub("", line)).replace("\u2019", "'"))
            for line in _lines(text) if "<seg id" in line]


def _keep_pair(de: str, en: str) -> bool:
    """clean-corpus-n.perl's test on one (whitespace-normalised) pair."""
    d, e = de.split(), en.split()
    if not (IWSLT14_MIN_WORDS <= len(d) <= IWSLT14_MAX_WORDS
            and IWSLT14_MIN_WORDS <= len(e) <= IWSLT14_MAX_WORDS):
        return False  # also drops empty sides
    if len(d) / len(e) > IWSLT14_MAX_RATIO or len(e) / len(d) > IWSLT14_MAX_RATIO:
        return False
    return max(map(len, d + e)) <= IWSLT14_MAX_WORD_CHARS


def prepare_iwslt14(files: Mapping[str, str]) -> dict[str, list[tuple[str, str]]]:
    """IWSLT'14 De-En train, valid and test pairs ``(de, en)`` from the archive's texts.

    ``files``: member name (:data:`IWSLT14_MEMBERS`, e.g.
    ``"de-en/train.tags.de-en.de"``) -> its text. Reproduces fairseq's
    ``examples/translation/prepare-iwslt14.sh`` step by step:

    * training text (``train.tags.de-en.{de,en}``), each side on its own:
      lines holding ``<url>``, ``<talkid>`` or ``<keywords>`` are dropped;
      ``<title>``, ``</title>``, ``<description>``, ``</description>`` are
      removed from the others, keeping the title and description text (the
      script's ``grep -v`` and ``sed``). Then the sides are paired line by
      line and cleaned as ``clean-corpus-n.perl -ratio 1.5 ... 1 175`` does:
      whitespace runs become one space, ends are stripped, and a pair is
      dropped when a side has fewer than 1 or more than 175 words, when one
      side has more than 1.5 times the words of the other, or when a word is
      longer than 1,000 characters. Both sides are lower-cased.
    * valid: the cleaned training pairs whose 1-based line number is
      divisible by 23; train: the others.
    * test: the ``<seg id="N">`` lines of ``IWSLT14.TED.dev2010``,
      ``IWSLT14.TEDX.dev2012``, ``IWSLT14.TED.tst2010``, ``tst2011`` and
      ``tst2012`` (``.de-en.{de,en}.xml``), in that order: the text between
      the tags, U+2019 replaced by ``'``, whitespace normalised, lower-cased.
      Not cleaned (as in fairseq), so every segment is kept.

    Differences from fairseq: no Moses tokenisation (nor its escaping of
    ``&``, ``<``, ``'`` ...) and no BPE; the text stays raw, for a subword
    model (SentencePiece) to tokenise later. So the 1-175 word and 1.5 ratio
    limits count whitespace-separated words of untokenised text, where
    fairseq counts Moses tokens (punctuation split off): a few pairs near the
    limits are kept or dropped differently, and the counts differ slightly
    from fairseq's 160,239 / 7,283 / 6,750. ``str.lower`` stands for
    Moses' ``lowercase.perl`` (Perl's ``lc``).

    Raises a ``ValueError`` when a member is missing or the two sides of a
    file pair do not have the same number of lines (segments).
    """
    missing = [m for m in IWSLT14_MEMBERS if m not in files]
    if missing:
        raise ValueError(f"the IWSLT'14 texts lack {missing[0]}; give the complete de-en.tgz "
                         "archive")

    def paired(de: list[str], en: list[str], what: str) -> list[tuple[str, str]]:
        if len(de) != len(en):
            raise ValueError(f"IWSLT'14 {what}: {len(de):,} German but {len(en):,} English "
                             "lines, which cannot be paired; the archive is not the expected "
                             "one: delete it and run again")
        return list(zip(de, en))

    train_files = [files[f"de-en/train.tags.de-en.{lang}"] for lang in ("de", "en")]
    pairs = [p for p in paired(*map(_train_lines, train_files), "train.tags.de-en")
             if _keep_pair(*p)]
    test = []
    for name in IWSLT14_TEST_SETS:
        test += paired(*(_segments(files[f"de-en/{name}.de-en.{lang}.xml"])
                         for lang in ("de", "en")), f"{name}.de-en.{{de,en}}.xml")
    return {"train": [p for i, p in enumerate(pairs, 1) if i % IWSLT14_VALID_EVERY],
            "valid": [p for i, p in enumerate(pairs, 1) if not i % IWSLT14_VALID_EVERY],
            "test": test}


@register_table("iwslt14-de-en")
def load_iwslt14(source: str | Path | None = None, *, progress: bool = True) -> TableSplits:
    """IWSLT'14 German-English as a table with columns ``("de", "en")``
    (:func:`prepare_iwslt14`), from its archive downloaded to the cache on
    first use (``<cache>/iwslt14-de-en/de-en.tgz``; see the module doc).

    ``source``: the ``de-en.tgz`` file, or a folder holding it, to read
    instead (verified, never downloaded or deleted).
    """
    name = "iwslt14-de-en"
    spec = _spec(name)
    path = _archive(name, spec, source, progress)
    texts = {m: _decode(b, f"{m} in {path}")
             for m, b in zip(spec.members, _read_members(path, spec))}
    return TableSplits(("de", "en"), **prepare_iwslt14(texts))
