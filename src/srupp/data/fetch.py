"""Fetch a file over HTTP and check an archive: the generic half of the downloads.

:mod:`srupp.data.download` knows the corpora and tables (where they come from,
what their archives hold, how they split); this module knows how to bring a
file over and whether an archive is whole, for any URL and archive.

Download
--------
:func:`download` fetches a URL with :mod:`urllib` into ``<dest>.part``
(progress bar on stderr). An interrupted download keeps the ``.part`` file and
is resumed with an HTTP ``Range`` request, automatically ``retries`` times and
again on the next call; a server that ignores ``Range`` (answers 200) makes it
start over from zero, and one that refuses the range (416) or resumes at
another place does too. The ``.part`` file is the download's own temporary
file: unlike :mod:`srupp._files`' temporaries it outlives a failed run, so that
the next one can resume. The finished file is moved into place with
:func:`os.replace`. Without a network the error gives the URL and the exact
path where the file can be put by hand.

Verification
------------
:func:`verify_archive` checks an archive against its layout (any object with
``members``, ``sizes`` and ``is_tar``, such as
:class:`~srupp.data.download.DatasetSpec`): the expected members and their
sizes, and the data's CRC-32s: every member's of a zip archive
(:meth:`zipfile.ZipFile.testzip`), the whole stream's of a gzip-compressed tar
archive (``.tgz``, ``.tar.gz``; gzip keeps one CRC-32 and the length in its
trailer). A file that fails is deleted and a ``ValueError`` names it, what was
expected and what was found. After a successful check a small stamp file
(``<archive>.verified``, the archive's size and mtime) spares re-checking the
CRCs on every load; an archive put in place by hand is checked on first use.
:func:`read_members` then reads the members.
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import http.client
import itertools
import json
import os
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
import zlib
from pathlib import Path
from typing import Mapping, Protocol

from tqdm import tqdm

from srupp._files import atomic_write_text

__all__ = ["ArchiveLayout", "download", "verify_archive", "read_members"]

#: Seconds to wait for a connection or for data before giving up on a request.
TIMEOUT_S = 30.0
#: Seconds to wait before resuming an interrupted download (times the attempt number).
RETRY_WAIT_S = 2.0
#: Read size while downloading and checking.
CHUNK = 1 << 20


class ArchiveLayout(Protocol):
    """What an archive must hold: ``members`` (names, in the order they are read),
    ``sizes`` (member -> uncompressed bytes; a member not listed is not
    size-checked) and ``is_tar`` (a gzip-compressed tar file, else a zip file)."""

    members: tuple[str, ...]
    sizes: Mapping[str, int]

    @property
    def is_tar(self) -> bool: ...


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


def _member_problem(sizes: dict[str, int], spec: ArchiveLayout) -> str | None:
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


def _tar_problem(path: Path, spec: ArchiveLayout) -> str | None:
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


def _archive_problem(path: Path, spec: ArchiveLayout) -> str | None:
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


def verify_archive(path: str | Path, spec: ArchiveLayout, *, delete_bad: bool = True) -> None:
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


# ----------------------------------------------------------------------------- reading


def read_members(path: Path, spec: ArchiveLayout) -> list[bytes]:
    """The bytes of ``spec.members`` in archive ``path`` (zip or tgz), in order, each
    checked against its size in ``spec.sizes``; a ``ValueError`` names what is wrong."""
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
