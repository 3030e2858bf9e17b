"""The state the backbones other than SRU++ carry between calls, and state files.

:class:`TensorState` is a named set of tensors, each with the index of its
batch dimension (None for tensors shared by the whole batch), so that the
trainer (``detach()``), beam search (``index_select``) and checkpoints
(``to_dict``/``from_dict``) handle every backbone the same way; each backbone
lists its tensors (:mod:`srupp.models.backbones`). SRU++ carries an
:class:`~srupp.nn.SRUppState`.

:func:`state_from_dict` reads either this or an :class:`~srupp.nn.SRUppState`
dict: a TensorState dict carries the marker key :data:`KIND_KEY`.

:func:`save_state` and :func:`load_state` keep either kind of state in a
safetensors file (a conversation parked by a server, resumed later in another
process; the carried state of a training checkpoint). The file's metadata
names the state's class (:data:`CLASS_KEY`), so loading gives back the class
that was saved, and a file that holds no state is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from .._files import PathLike, atomic_path
from ..nn.state import SRUppState, check_kept_rows

KIND_KEY = "__kind__.tensor_state"
_DIM_PREFIX = "__batch_dim__."

# The safetensors metadata entry that names the class of a saved state. Metadata
# keys starting with "srupp." are the library's; the caller's own go beside them.
CLASS_KEY = "srupp.state_class"
_RESERVED_PREFIX = "srupp."


@dataclass
class TensorState:
    """Named tensors, with each one's batch dimension (None: not batched)."""

    tensors: Dict[str, Tensor]
    batch_dims: Dict[str, Optional[int]] = field(default_factory=dict)

    def __post_init__(self):
        self.tensors = dict(self.tensors)
        self.batch_dims = {k: self.batch_dims.get(k) for k in self.tensors}
        sizes = {t.shape[d] for k, t in self.tensors.items()
                 if (d := self.batch_dims[k]) is not None}
        if len(sizes) > 1:
            raise ValueError(f"TensorState tensors disagree on the batch size: {sorted(sizes)}")

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def get(self, name: str, default=None):
        return self.tensors.get(name, default)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    @property
    def batch_size(self) -> Optional[int]:
        for k, t in self.tensors.items():
            if self.batch_dims[k] is not None:
                return t.shape[self.batch_dims[k]]
        return None

    def nbytes(self) -> int:
        """Bytes held by all tensors of the state."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    # ------------------------------------------------------------ transforms
    def _map(self, fn) -> "TensorState":
        return TensorState({k: fn(t, self.batch_dims[k]) for k, t in self.tensors.items()},
                           dict(self.batch_dims))

    def detach(self) -> "TensorState":
        """A copy cut from the autograd graph, for truncated backpropagation."""
        return self._map(lambda t, d: t.detach())

    def index_select(self, batch_indices: Tensor) -> "TensorState":
        """Reorder or repeat batch entries (B',) long, e.g. to follow beams."""
        dev = next(iter(self.tensors.values())).device if self.tensors else None
        idx = torch.as_tensor(batch_indices, dtype=torch.long, device=dev)
        return self._map(lambda t, d: t if d is None else t.index_select(d, idx))

    def keep_rows(self, rows: Sequence[int]) -> "TensorState":
        """The state of batch rows ``rows`` (ascending, each once): :meth:`index_select`'s
        (SRUppState moves them within its own buffers; these tensors are copied)."""
        return self.index_select(torch.tensor(check_kept_rows(rows, self.batch_size or 0)))

    @classmethod
    def cat(cls, states: Sequence["TensorState"], *, room: bool = False) -> "TensorState":
        """Several batches as one, in order: the same names and batch dimensions, equal
        shapes but for the batch, and equal values where a tensor is not batched.
        ``room`` is SRUppState.cat's; these tensors are not appended to in place, so
        it changes nothing here."""
        if not states:
            raise ValueError("TensorState.cat needs at least one state")
        first = states[0]
        if any(s.batch_dims != first.batch_dims for s in states):
            raise ValueError("TensorState.cat: the states hold different tensors; join "
                             "states of one model made the same way")
        out = {}
        for k, d in first.batch_dims.items():
            ts = [s.tensors[k] for s in states]
            if d is None:
                if any(not torch.equal(t, ts[0]) for t in ts[1:]):
                    raise ValueError(f"TensorState.cat: the shared tensor {k!r} differs "
                                     f"between the states")
                out[k] = ts[0]
            else:
                out[k] = ts[0] if len(ts) == 1 else torch.cat(ts, d)
        return cls(out, dict(first.batch_dims))

    def put_row(self, row: int, other: "TensorState") -> None:
        """Write ``other`` (batch size 1, the same tensors) over row ``row``, in place (a
        serving engine's freed row); a shared tensor must be equal in both."""
        if other.batch_dims != self.batch_dims:
            raise ValueError("put_row: the states hold different tensors; join states of one "
                             "model made the same way")
        for k, d in self.batch_dims.items():
            mine, theirs = self.tensors[k], other.tensors[k]
            if d is None:
                if not torch.equal(mine, theirs):
                    raise ValueError(f"put_row: the shared tensor {k!r} differs")
                continue
            if theirs.shape[d] != 1 or mine.shape[:d] + mine.shape[d + 1:] \
                    != theirs.shape[:d] + theirs.shape[d + 1:]:
                raise ValueError(f"put_row: {k!r} is {tuple(theirs.shape)}, not one row of "
                                 f"{tuple(mine.shape)}")
            mine.select(d, row).copy_(theirs.select(d, 0))

    def to(self, *args, **kwargs) -> "TensorState":
        """Move to a device. Pass a device only: dtypes are part of the state."""
        return self._map(lambda t, d: t.to(*args, **kwargs))

    # ------------------------------------------------------------ checkpoint
    def to_dict(self) -> Dict[str, Tensor]:
        """A flat ``{name: tensor}`` dict, ready for safetensors or ``torch.save``."""
        out: Dict[str, Tensor] = {KIND_KEY: torch.tensor(1, dtype=torch.long)}
        for k, t in self.tensors.items():
            out[k] = t
            d = self.batch_dims[k]
            out[_DIM_PREFIX + k] = torch.tensor(-1 if d is None else d, dtype=torch.long)
        return out

    @classmethod
    def from_dict(cls, tensors: Dict[str, Tensor]) -> "TensorState":
        """Inverse of :meth:`to_dict`."""
        if KIND_KEY not in tensors:
            raise ValueError(f"TensorState.from_dict: missing marker key {KIND_KEY!r}")
        names = [k for k in tensors if k != KIND_KEY and not k.startswith(_DIM_PREFIX)]
        dims = {}
        for k in names:
            d = tensors.get(_DIM_PREFIX + k)
            if d is None:
                raise ValueError(f"TensorState.from_dict: no batch dimension for {k!r}")
            dims[k] = None if int(d) < 0 else int(d)
        return cls({k: tensors[k] for k in names}, dims)


def state_from_dict(tensors: Dict[str, Tensor]):
    """A TensorState or an SRUppState, whichever wrote ``tensors``."""
    if KIND_KEY in tensors:
        return TensorState.from_dict(tensors)
    return SRUppState.from_dict(tensors)


# ------------------------------------------------------------------ state files
# The classes a state file may hold, by the name its metadata records.
STATE_CLASSES = {"SRUppState": SRUppState, "TensorState": TensorState}


def save_state(state, path: PathLike, metadata: Optional[Dict[str, str]] = None) -> None:
    """Write ``state`` to the safetensors file ``path``, atomically.

    :func:`load_state` gives back the same class with the same tensors
    (values, dtypes, shapes), in this process or another. A kill during the
    write leaves the previous file at ``path``, or none, never a partial one.

    Args:
        state: an :class:`~srupp.nn.SRUppState` or a :class:`TensorState`, as a
            language model's ``forward``, ``step`` or ``initial_state`` returns it.
            The cached keys and values of an SRUppState are not written (they
            are derived from its memory): the first step after loading
            recomputes them.
        path: the file to write; its folder must exist.
        metadata: your own ``{str: str}`` entries (a conversation id, the model
            they belong to...), read back with :func:`load_state_metadata`.
            Keys starting with ``"srupp."`` are reserved.
    """
    name = next((n for n, cls in STATE_CLASSES.items() if isinstance(state, cls)), None)
    if name is None:
        raise TypeError(f"save_state takes an SRUppState or a TensorState (the state a "
                        f"model returns), got {type(state).__name__}")
    metadata = dict(metadata or {})
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"save_state metadata maps str to str (safetensors stores only "
                            f"strings), got {key!r}: {value!r}; convert with str() or "
                            f"json.dumps")
        if key.startswith(_RESERVED_PREFIX):
            raise ValueError(f"save_state metadata key {key!r}: keys starting with "
                             f"{_RESERVED_PREFIX!r} are srupp's own; rename it")
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"cannot save the state to {path}: the folder {path.parent} does "
                         f"not exist; create it first")
    # safetensors wants contiguous CPU tensors that share no memory, but a decoding
    # cache is a view into a larger buffer (srupp.nn.append): write fresh copies.
    tensors = {k: t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
               for k, t in state.to_dict().items()}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={**metadata, CLASS_KEY: name})


def load_state(path: PathLike, device=None):
    """The state :func:`save_state` wrote to ``path``, as the class that was saved.

    Reads only safetensors: loading never executes code from the file.

    Args:
        path: a file written by :func:`save_state`.
        device: where to put the tensors; the CPU by default.
    Returns:
        An :class:`~srupp.nn.SRUppState` or a :class:`TensorState`, ready for the
        model's ``step`` or ``forward``.
    Raises:
        ValueError: ``path`` is missing, is not a state file, or is truncated or corrupt.
    """
    path = Path(path)
    metadata, tensors = _read_state_file(path, with_tensors=True)
    name = metadata[CLASS_KEY]
    try:
        state = STATE_CLASSES[name].from_dict(tensors)
    except (ValueError, RuntimeError) as e:  # the header is sound but the tensors are not
        raise ValueError(f"{path} holds a damaged {name} ({_first_line(e)})") from None
    return state if device is None else state.to(device)


def load_state_metadata(path: PathLike) -> Dict[str, str]:
    """The ``metadata`` given to :func:`save_state` for ``path`` (the tensors are not read)."""
    metadata, _ = _read_state_file(Path(path), with_tensors=False)
    return {k: v for k, v in metadata.items() if not k.startswith(_RESERVED_PREFIX)}


def _read_state_file(path: Path, *, with_tensors: bool
                     ) -> Tuple[Dict[str, str], Optional[Dict[str, Tensor]]]:
    """(metadata, tensors or None) of a state file; a ValueError says what else it is."""
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ValueError(f"cannot load a state from {path}: it {what}; give the file "
                         f"save_state wrote")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            # check the class before reading tensors: a wrong file may be a large one
            name = metadata.get(CLASS_KEY)
            if name is None:
                raise ValueError(f"{path} is a safetensors file but not a saved state (its "
                                 f"metadata names no {CLASS_KEY!r}); write states with "
                                 f"srupp.models.save_state")
            if name not in STATE_CLASSES:
                raise ValueError(f"{path} holds a state of class {name!r}, which this "
                                 f"version of srupp cannot read (it reads "
                                 f"{', '.join(STATE_CLASSES)})")
            # clone: a tensor read from the file may sit at any byte offset, and kernels
            # that take another path for unaligned data would then sum in another order
            # than the uninterrupted run did (resume would not be bit for bit)
            tensors = ({k: f.get_tensor(k).clone() for k in f.keys()} if with_tensors
                       else None)
    except (SafetensorError, OSError, RuntimeError) as e:  # not safetensors, cut short...
        raise ValueError(f"{path} is not a safetensors file, or it is truncated or corrupt "
                         f"({_first_line(e)})") from None
    return metadata, tensors


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]
