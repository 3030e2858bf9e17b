"""One writer per run directory: an exclusive ``flock`` on ``RUN_DIR/.lock``.

A trainer (and ``srupp compare``, for each model's directory it trains) holds
the lock while it may write the run; a second process that tries refuses at
once, naming the holder's PID, which the lock file holds. The kernel releases
the lock when its process ends, however it ends (SIGKILL included), so a dead
run leaves no stale lock: the file stays, unlocked, and the next writer takes
it. Reading a run (eval, generate, export) takes no lock.

The file is never removed: a process could be about to lock the old file
while another creates a new one, and both would then hold "the" lock.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
import weakref
from pathlib import Path
from typing import Dict, Iterator, Optional

from ..errors import UserError

try:
    import fcntl
except ImportError:  # Windows: no flock; runs are not locked there
    fcntl = None

LOCK_FILE = ".lock"

# lock files this process holds for a block of work (locked_run_dir, e.g. srupp compare),
# in which a Trainer on the same directory is part of that work, not a second writer
_HELD: Dict[str, "RunLock"] = {}
# every lock this process holds, by lock file, while its object lives
_OURS: "weakref.WeakValueDictionary[str, RunLock]" = weakref.WeakValueDictionary()


class RunLock:
    """An exclusive lock on a run directory; :func:`lock_run_dir` takes it."""

    def __init__(self, run_dir: Path, fd: Optional[int]):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd = fd
        # a lock object dropped without release() frees its lock when it is collected
        self._finalizer = weakref.finalize(self, _close, fd) if fd is not None else None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def write_pid(self) -> None:
        """Put this process's PID in the lock file, for the message of a second writer."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:  # a full disk: say which file
            raise OSError(e.errno, e.strerror, str(self.path)) from e

    def release(self) -> None:
        """Give the lock up (closing the file releases it); a second call does nothing."""
        if self._finalizer is not None:
            self._finalizer()  # closes the file once
        self._fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def lock_run_dir(run_dir, *, write_pid: bool = True) -> RunLock:
    """Take the exclusive lock of ``run_dir`` (which must exist), or refuse.

    Raises:
        UserError: another process (or another open trainer of this process)
            holds it; the message names its PID.
    """
    run_dir = Path(run_dir)
    if fcntl is None:
        return RunLock(run_dir, None)
    path = run_dir / LOCK_FILE
    key = _key(run_dir)
    if key in _OURS:
        # a Trainer of this process that was dropped without being closed holds it until
        # it is collected (its objects form reference cycles)
        gc.collect()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        ours = _OURS.get(key)
        if ours is not None and ours.held:
            raise UserError(f"{run_dir} is being written by another trainer in this process "
                            f"(PID {os.getpid()}); let its train() finish or call its close() "
                            f"first") from None
        raise UserError(_in_use(run_dir, path, _holder(path))) from None
    except BaseException:
        os.close(fd)
        raise
    lock = RunLock(run_dir, fd)
    _OURS[key] = lock
    if write_pid:
        lock.write_pid()
    return lock


def _in_use(run_dir: Path, path: Path, pid: Optional[int]) -> str:
    who = f"PID {pid}" if pid is not None else "its PID not written yet"
    return (f"{run_dir} is in use by another process ({who}; it holds {path}): "
            f"wait for it to end or stop it, or choose another --out")


def _holder(path: Path, wait: float = 1.0) -> Optional[int]:
    """The live PID in the lock file; a new holder may not have written its own yet (the
    file still names the last one, ended): wait a little for it, else None."""
    deadline = time.monotonic() + wait
    while True:
        try:
            pid = int(path.read_text().strip() or "0") or None
        except (OSError, ValueError):
            pid = None
        if pid is not None and _alive(pid):
            return pid
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def trainer_lock(run_dir) -> Optional[RunLock]:
    """The lock a Trainer takes: None when this process holds it for a larger block of
    work on the directory (:func:`locked_run_dir`); its PID is written later."""
    if _key(run_dir) in _HELD:
        return None
    return lock_run_dir(run_dir, write_pid=False)


@contextlib.contextmanager
def locked_run_dir(run_dir) -> Iterator[RunLock]:
    """Hold ``run_dir``'s lock for a block; a Trainer on it inside the block shares it."""
    lock = lock_run_dir(run_dir)
    key = _key(run_dir)
    _HELD[key] = lock
    try:
        yield lock
    finally:
        _HELD.pop(key, None)
        lock.release()


def _key(run_dir) -> str:
    return os.path.realpath(Path(run_dir) / LOCK_FILE)
