"""Writing files so that a crash at any moment leaves the old file or the new one.

Every module that writes something a later run reads (checkpoints, configs,
metrics pointers, downloads, saved models) goes through here: the content is
written to a temporary file beside the target, flushed to disk, then moved
over the target with ``os.replace``, which is atomic on POSIX and Windows.

A write that fails (a full disk, a quota, an I/O error) raises an ``OSError``
that names the file, whatever library did the writing: ``torch.save`` and
safetensors report a failed write as a ``RuntimeError`` or ``SafetensorError``,
which :func:`write_error` turns back into the ``OSError`` it was. The
temporary file is removed, so a failed save leaves the old file and no
debris.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path``.

    The caller writes the temporary file however it likes (``save_file``,
    ``torch.save``, ...). If the block raises, the temporary file is removed
    and ``path`` is left as it was.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        err = write_error(e, path)
        if err is None or err is e:
            raise
        raise err from e


def atomic_write_text(path: PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(text)


def atomic_write_json(path: PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def torch_save(obj: Any, path: PathLike) -> None:
    """``torch.save(obj)`` to ``path`` atomically; a failed write is an ``OSError``.

    The bytes go through a Python file, so that the error of a failed write
    (which ``torch.save`` reports as "unexpected pos") is the one raised.
    """
    import torch

    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        torch.save(obj, f)


# torch.save's words for a write that failed (its writer checks the position after each
# record; with a path, the C++ stream fails on its own) and safetensors' and Rust's errno
_WRITE_FAILED = ("unexpected pos", "iostream error", "file write failed", "failed writing",
                 "error while serializing", "i/o error")
_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)|code: (\d+)")
NEARLY_FULL = 1 << 20  # bytes free below which a failed write is taken for a full disk


def write_error(e: BaseException, path: PathLike) -> Optional[OSError]:
    """The ``OSError`` behind ``e``, a failure while writing ``path``, naming its file.

    ``e`` itself when it is an ``OSError`` that names a file; a new one naming
    ``path`` for one that names none (``write`` and ``fsync`` name no file), or
    for a ``RuntimeError``/``SafetensorError`` of a failed write: its errno is
    that of the ``OSError`` it was raised over, or of its message ("os error
    28"), else ENOSPC when the disk is (nearly) full, else EIO. None when ``e``
    is no failed write (a bug, an interrupt, a bad argument): keep it as it is.
    """
    if isinstance(e, OSError):
        if e.filename is not None:
            return e
        return OSError(e.errno, e.strerror or str(e), str(path))
    if not isinstance(e, Exception) or isinstance(e, (ValueError, TypeError)):
        return None
    text = str(e)
    if not any(w in text.lower() for w in _WRITE_FAILED):
        return None
    cause, seen = e, 0
    while cause is not None and seen < 8:  # the OSError the writer raised the error over
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
        if isinstance(cause, OSError) and cause.errno is not None:
            return OSError(cause.errno, cause.strerror or os.strerror(cause.errno), str(path))
    m = _OS_ERROR_CODE.search(text)
    if m:
        code = int(m.group(1) or m.group(2))
        return OSError(code, os.strerror(code), str(path))
    if free_bytes(Path(path).parent) < NEARLY_FULL:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return OSError(errno.EIO, f"write failed ({first[:200]})", str(path))


def free_bytes(directory: PathLike) -> int:
    """Bytes this process may still write under ``directory`` (root: the reserve too)."""
    try:
        st = os.statvfs(directory)
    except (OSError, AttributeError):  # gone, or no statvfs (Windows)
        return NEARLY_FULL
    blocks = st.f_bfree if hasattr(os, "geteuid") and os.geteuid() == 0 else st.f_bavail
    return blocks * st.f_frsize


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
