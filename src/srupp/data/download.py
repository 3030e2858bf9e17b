"""Download, verify and load the standard benchmark corpora.

Three corpora are registered with :func:`~srupp.data.corpora.load_corpus`:

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
every member's CRC-32 (:meth:`zipfile.ZipFile.testzip`). A file that
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
import http.client
import itertools
import json
import os
import sys
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
]

#: Seconds to wait for a connection or for data before giving up on a request.
TIMEOUT_S = 30.0
#: Seconds to wait before resuming an interrupted download (times the attempt number).
RETRY_WAIT_S = 2.0
#: Read size while downloading.
CHUNK = 1 << 20


@dataclass(frozen=True)
class DatasetSpec:
    """Where a corpus comes from and how to check and split it.

    ``members``: the zip members read, in order. With ``split="positional"``
    there is one member, cut by byte position in the proportions
    ``fractions`` (train, valid, test); with ``split="members"`` there are
    three, one per split (train, valid, test).
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
        if self.split not in ("positional", "members"):
            raise ValueError(f"split must be 'positional' or 'members', got {self.split!r}")
        want = 1 if self.split == "positional" else 3
        if len(self.members) != want:
            raise ValueError(f"split={self.split!r} needs {want} member(s), got {self.members}")
        if self.encoding not in ("bytes", "utf-8"):
            raise ValueError(f"encoding must be 'bytes' or 'utf-8', got {self.encoding!r}")


#: Known downloadable corpora: name -> spec. Tests may replace entries.
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


def _archive_problem(path: Path, spec: DatasetSpec) -> str | None:
    """Why ``path`` is not a good archive for ``spec`` (``None``: it is)."""
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        return f"it is not a valid zip archive ({e})"
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    with zf:
        infos = {i.filename: i for i in zf.infolist()}
        for member in spec.members:
            if member not in infos:
                found = ", ".join(sorted(infos)[:5]) or "nothing"
                return f"member {member!r} is missing (found: {found})"
            want = spec.sizes.get(member)
            if want is not None and infos[member].file_size != want:
                return (f"member {member!r} should be {want:,} bytes but is "
                        f"{infos[member].file_size:,} bytes")
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
    """Check a corpus archive: members, their sizes and CRC-32s.

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
    """The verified archive of corpus ``name``, downloading it if it is not cached."""
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


def _read_member(zf: zipfile.ZipFile, member: str, spec: DatasetSpec, where: Path) -> bytes:
    try:
        data = zf.read(member)
    except (KeyError, zipfile.BadZipFile, zlib.error, OSError) as e:
        raise ValueError(f"cannot read member {member!r} of {where}: {e}; delete the file "
                         "and run again to download it afresh") from None
    want = spec.sizes.get(member)
    if want is not None and len(data) != want:
        raise ValueError(f"member {member!r} of {where} should be {want:,} bytes but is "
                         f"{len(data):,}; delete the file and run again")
    return data


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
    if source is None:
        path = fetch(name, progress=progress)
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            path = path / spec.archive
        if not path.is_file():
            raise ValueError(f"no {name} archive at {str(path)!r}; give the path of "
                             f"{spec.archive} (from {spec.url})")
        verify_archive(path, spec, delete_bad=False)
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"cannot open {path}: {e}; delete it and run again") from None
    with zf:
        blobs = [_read_member(zf, m, spec, path) for m in spec.members]

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
    register_corpus(_name)(_make_loader(_name))
del _name
