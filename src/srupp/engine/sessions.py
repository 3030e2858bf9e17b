"""Conversations kept between requests, so that the next one continues without re-reading.

A :class:`Session` is the model state after all of a conversation's tokens but
the last, plus that last token (``pending``): the next request feeds
``pending`` first, then its own new tokens. Keeping the last token unfed lets
the next request start with a step that yields logits, whatever it appends.

:class:`SessionStore` keeps sessions in memory, least recently used first out,
and, given a directory, one safetensors file per session
(``<directory>/<id>.safetensors``, written by :func:`~srupp.models.save_state`
with the scalar fields in its string metadata). Memory is a write-back cache:
``put`` marks a session dirty, ``save``/``save_all`` (or eviction, or
``put(..., persist=True)``) write it. Every write is atomic (a temporary file
beside the target, then a rename), so a kill at any moment leaves the previous
file or none; the temporary files a kill leaves start with a dot, which no
session id may, and are removed when a store opens the directory (so two
processes must not share one directory).

A session belongs to one model: the store's ``model_id`` (a fingerprint the
caller computes) is written with each session, and a session saved for
another model is refused by name rather than fed to the wrong weights.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Union

from .._files import PathLike
from ..models.state import TensorState, load_state, load_state_metadata, save_state
from ..nn.state import SRUppState

State = Union[SRUppState, TensorState]

SUFFIX = ".safetensors"
# ids become file names: letters, digits, '.', '_', '-', and no leading dot (no hidden
# files, no '.' or '..', and never the name of a temporary file, which starts with one)
_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
# the temporaries a kill during a write may leave: atomic_path's ".<id>.safetensors.tmp",
# and the ".tmpXXXXXX" that safetensors itself writes before renaming it to that
_TMP = re.compile(r"\..+\.safetensors\.tmp|\.tmp[A-Za-z0-9]+")

# this module's entries in the state file's string metadata
_FORMAT_KEY = "session.format"
_FORMAT = "1"
_KEYS = ("session.id", "session.pending", "session.tokens", "session.model_id",
         "session.updated")


def check_session_id(session_id: str) -> str:
    """``session_id`` if it may name a session (and a file), else a ValueError."""
    if not isinstance(session_id, str) or not _ID.fullmatch(session_id):
        raise ValueError(
            f"session id {session_id!r} is invalid: use 1 to 128 characters of A-Z, a-z, "
            f"0-9, '.', '_', '-', not starting with '.'")
    return session_id


@dataclass
class Session:
    """One conversation's decoding state, between two requests.

    Attributes:
        state: the model state after every token of the session but the last,
            batch size 1 (an :class:`~srupp.nn.SRUppState` or a
            :class:`~srupp.models.TensorState`). The store keeps this object as
            it is: do not change its tensors in place afterwards.
        pending: the last token id, not yet fed to the model.
        tokens: how many tokens the session has consumed or produced in all.
        model_id: the fingerprint of the model that made ``state``.
        updated: when the session last changed (``time.time()``).
    """

    state: State
    pending: int
    tokens: int
    model_id: str
    updated: float = field(default_factory=time.time)

    def __post_init__(self):
        if not isinstance(self.state, (SRUppState, TensorState)):
            raise TypeError(f"Session.state must be an SRUppState or a TensorState (the "
                            f"state the model returns), got {type(self.state).__name__}")
        if self.state.batch_size not in (1, None):  # None: a TensorState with no batch dim
            raise ValueError(f"Session.state must hold one conversation (batch size 1), "
                             f"got batch size {self.state.batch_size}; index_select the row")
        for name in ("pending", "tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Session.{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.model_id, str):
            raise TypeError(f"Session.model_id must be a str, got {type(self.model_id).__name__}")
        self.updated = float(self.updated)


class SessionStore:
    """Sessions by id: the most recently used in memory, all of them on disk if asked.

    Args:
        directory: where to keep one file per session (created if missing), or
            None to keep sessions in memory only (evicted ones are then gone,
            and ``save``/``persist`` write nothing).
        capacity: how many sessions memory holds; putting or loading one more
            evicts the least recently used (written first if it is dirty).
        model_id: the fingerprint of the model being served; sessions of
            another model are refused.
        device: where loaded states go (the CPU by default).

    Thread-safe: one lock guards the memory and the files.
    """

    def __init__(self, directory: Optional[PathLike], *, capacity: int = 1024,
                 model_id: str, device=None):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"SessionStore capacity must be an int >= 1, got {capacity!r}")
        if not isinstance(model_id, str) or not model_id:
            raise ValueError(f"SessionStore model_id must be a non-empty str (a fingerprint of "
                             f"the model), got {model_id!r}")
        self.capacity = capacity
        self.model_id = model_id
        self.device = device
        self.directory: Optional[Path] = None
        if directory is not None:
            path = Path(directory)
            if path.exists() and not path.is_dir():
                raise ValueError(f"the sessions directory {path} is a file; give a folder")
            path.mkdir(parents=True, exist_ok=True)
            self.directory = path
            # a kill during a write leaves its temporary file: never a session, remove it
            for p in path.iterdir():
                if _TMP.fullmatch(p.name) and p.is_file():
                    with contextlib.suppress(OSError):
                        p.unlink()
        self._memory: "OrderedDict[str, Session]" = OrderedDict()
        self._dirty: set = set()
        self._lock = threading.Lock()

    @property
    def persistent(self) -> bool:
        """Whether sessions outlive memory (a directory was given)."""
        return self.directory is not None

    # ------------------------------------------------------------ reading
    def get(self, session_id: str) -> Optional[Session]:
        """The session, from memory, else from its file (then kept in memory); None if unknown.

        Raises:
            ValueError: the id is invalid, the session was saved for another
                model, or its file is not a session file.
        """
        check_session_id(session_id)
        with self._lock:
            session = self._memory.get(session_id)
            if session is not None:
                self._memory.move_to_end(session_id)
                return session
            path = self._path(session_id)
            if path is None or not path.is_file():
                return None
            session = self._read(session_id, path)
            self._memory[session_id] = session
            self._evict()
            return session

    def __contains__(self, session_id) -> bool:
        try:
            check_session_id(session_id)
        except ValueError:
            return False  # no such id can be stored
        with self._lock:
            if session_id in self._memory:
                return True
            path = self._path(session_id)
            return path is not None and path.is_file()

    def ids(self) -> List[str]:
        """Every session id, in memory or on disk, sorted."""
        with self._lock:
            ids = set(self._memory)
            if self.directory is not None:
                for p in self.directory.iterdir():
                    name = p.name
                    if name.endswith(SUFFIX) and _ID.fullmatch(name[:-len(SUFFIX)]):
                        ids.add(name[:-len(SUFFIX)])
            return sorted(ids)

    def __len__(self) -> int:
        return len(self.ids())

    # ------------------------------------------------------------ writing
    def put(self, session_id: str, session: Session, *, persist: bool = False) -> None:
        """Keep ``session`` under ``session_id`` (most recently used); write it now if ``persist``.

        Raises:
            ValueError: the id is invalid, or the session belongs to another model.
            OSError: a write failed (the session stays in memory, dirty).
        """
        check_session_id(session_id)
        if not isinstance(session, Session):
            raise TypeError(f"SessionStore.put takes a Session, got {type(session).__name__}")
        if session.model_id != self.model_id:
            raise ValueError(f"session {session_id!r} belongs to model {session.model_id!r}, "
                             f"but this store holds sessions of model {self.model_id!r}")
        with self._lock:
            self._memory[session_id] = session
            self._memory.move_to_end(session_id)
            self._dirty.add(session_id)
            if persist:
                self._write(session_id)
            self._evict()

    def save(self, session_id: str) -> bool:
        """Write the session if it changed since it was last written; whether it was written."""
        check_session_id(session_id)
        with self._lock:
            return self._write(session_id)

    def save_all(self) -> int:
        """Write every session that changed since it was last written; how many were."""
        with self._lock:
            return sum(self._write(i) for i in sorted(self._dirty))

    def delete(self, session_id: str) -> bool:
        """Forget the session, in memory and on disk; whether there was one."""
        check_session_id(session_id)
        with self._lock:
            found = self._memory.pop(session_id, None) is not None
            self._dirty.discard(session_id)
            path = self._path(session_id)
            if path is not None:
                try:
                    path.unlink()
                    found = True
                except FileNotFoundError:
                    pass
            return found

    # ------------------------------------------------------------ under the lock
    def _path(self, session_id: str) -> Optional[Path]:
        return None if self.directory is None else self.directory / (session_id + SUFFIX)

    def _write(self, session_id: str) -> bool:
        """Write a dirty session in memory to its file (atomic); whether it was written."""
        if session_id not in self._dirty or self.directory is None:
            return False
        s = self._memory[session_id]
        metadata = {_FORMAT_KEY: _FORMAT, "session.id": session_id,
                    "session.pending": str(s.pending), "session.tokens": str(s.tokens),
                    "session.model_id": s.model_id,
                    "session.updated": repr(s.updated)}  # repr: the float, exactly
        save_state(s.state, self._path(session_id), metadata)
        self._dirty.discard(session_id)
        return True

    def _read(self, session_id: str, path: Path) -> Session:
        # the metadata first: a session of another model is refused before its tensors load
        metadata = load_state_metadata(path)
        if metadata.get(_FORMAT_KEY) != _FORMAT or any(k not in metadata for k in _KEYS):
            raise ValueError(f"{path} is a state file but not a session of this version of "
                             f"srupp (its metadata lacks the session's fields); delete it")
        saved_for = metadata["session.model_id"]
        if saved_for != self.model_id:
            raise ValueError(f"session {session_id!r} was saved for model {saved_for!r}, but "
                             f"this store serves model {self.model_id!r}; serve that model, "
                             f"or delete the session")
        try:
            pending = int(metadata["session.pending"])
            tokens = int(metadata["session.tokens"])
            updated = float(metadata["session.updated"])
        except ValueError:
            raise ValueError(f"{path}: the session's fields are not numbers "
                             f"({ {k: metadata[k] for k in _KEYS} }); delete it") from None
        return Session(load_state(path, self.device), pending, tokens, saved_for, updated)

    def _evict(self) -> None:
        """Drop the least recently used sessions beyond capacity, writing dirty ones first."""
        while len(self._memory) > self.capacity:
            oldest = next(iter(self._memory))
            self._write(oldest)  # a failed write raises and keeps it: nothing is lost
            del self._memory[oldest]
            self._dirty.discard(oldest)


__all__ = ["Session", "SessionStore", "check_session_id"]
