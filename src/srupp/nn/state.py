"""The state an SRU++ stack carries between calls.

One object serves both Transformer-XL-style segment training (carry the state
across segments, ``detach()`` it between optimiser steps) and token-by-token
decoding (feed one token at a time, ``index_select`` it for beam search).

Layouts are fixed, whatever the layer's ``batch_first`` (as for the hidden
state of ``nn.LSTM``):

    c                (num_layers, B, D)  recurrent state, fp32 (fp64 for fp64 models)
    memory[i]        (B, M, n_in_i)      layer i's past inputs (after its pre-norm,
                                         if any), or None for layers without
                                         attention; dtype of the layer input
    memory_mask_pad  (B, M) bool         True marks padding in memory, or None
                                         when memory holds no padding
    kv_cache[i]      KVCache or None     keys and values computed from memory[i]
                                         under no_grad, with the weights that
                                         made them (see :class:`KVCache`)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from .append import cat_with_room, first_rows


def check_kept_rows(rows: Sequence[int], batch_size: int) -> List[int]:
    """``rows`` for a state's ``keep_rows`` as ints: ascending, each once, in the batch
    (else a ValueError)."""
    rows = [int(r) for r in rows]
    if rows != sorted(set(rows)) or (rows and not 0 <= rows[0] <= rows[-1] < batch_size):
        raise ValueError(f"keep_rows: rows must be ascending, each once, in "
                         f"[0, {batch_size}); got {rows}")
    return rows


@dataclass(frozen=True)
class KVCache:
    """Keys and values of one attention layer's memory, tied to the weights that made them.

    ``kv`` is [K | V] = W2 W1 m (B, M, 2·d′). It may stand in for recomputing
    them only while :meth:`valid_for` holds: the very same weight tensor
    objects (held by weak reference, so a cache never keeps a model alive),
    with the same ``_version`` (no in-place update since: optimiser steps,
    ``load_state_dict``) and the same ``data_ptr()`` (no ``.data =``, ``.to()``).
    A new tensor that lands at a freed weight's address is a different object.
    (Writes through ``weight.data`` bypass the version counter: call
    :meth:`SRUppState.drop_kv_cache` after those.)
    """

    kv: Tensor
    _weights: tuple = field(repr=False)  # ((weakref, _version, data_ptr), ...)

    @classmethod
    def of(cls, kv: Tensor, weights: Sequence[Tensor]) -> "KVCache":
        return cls(kv, tuple([(weakref.ref(w), w._version, w.data_ptr()) for w in weights]))

    def valid_for(self, weights: Sequence[Tensor], M: int) -> bool:
        """Whether ``kv`` holds M steps made by exactly these, unchanged, weights."""
        if self.kv.shape[1] != M:
            return False
        for (ref, version, ptr), w in zip(self._weights, weights):
            if ref() is not w or w._version != version or w.data_ptr() != ptr:
                return False
        return True

    def with_kv(self, kv: Tensor) -> "KVCache":
        """Other keys and values made by the same weights (this cache's record of them)."""
        return KVCache(kv, self._weights)

    def map(self, fn: Callable[[Tensor], Tensor]) -> "KVCache":
        """The same cache with ``fn`` applied to ``kv`` (same weights)."""
        return replace(self, kv=fn(self.kv))


@dataclass
class SRUppState:
    """Recurrent state and attention memory of an :class:`~srupp.nn.SRUpp` stack.

    Args:
        c: (num_layers, B, D) recurrent state of every layer.
        memory: one entry per layer, (B, M, n_in_i) or None. All entries that
            are not None share the same M.
        memory_mask_pad: (B, M) bool, True at padded memory positions; None
            means no memory position is padding.
        mem_len: how many past positions each layer keeps after the next call.
            None defers to the layer's ``mem_len``.
        kv_cache: one :class:`KVCache` (or None) per layer, filled in by the
            layers under no_grad (a decoding speed-up that gives the same
            results); derived data, so not checkpointed.
    """

    c: Tensor
    memory: List[Optional[Tensor]] = field(default_factory=list)
    memory_mask_pad: Optional[Tensor] = None
    mem_len: Optional[int] = None
    kv_cache: List[Optional[KVCache]] = field(default_factory=list, repr=False)
    # Where the fused decoding step left each layer's memory and [K | V] in their
    # buffers: ((memory view, buffer, start), (kv view, buffer, start)) or None per
    # layer, so the next step finds its rows without working them out. Derived
    # data: not an argument, not copied by replace(), checked by identity on use.
    _rows: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def _from_step(cls, c: Tensor, memory: list, memory_mask_pad: Optional[Tensor],
                   mem_len: Optional[int], kv_cache: list, rows: tuple) -> "SRUppState":
        """The state a fused decoding step built: consistent by construction, so not
        checked again (the checks cost a few µs of a step of about 300)."""
        state = cls.__new__(cls)
        state.c, state.memory, state.memory_mask_pad = c, memory, memory_mask_pad
        state.mem_len, state.kv_cache, state._rows = mem_len, kv_cache, rows
        return state

    def __post_init__(self):
        if not isinstance(self.c, Tensor) or self.c.dim() != 3:
            shape = tuple(self.c.shape) if isinstance(self.c, Tensor) else type(self.c).__name__
            raise ValueError(f"SRUppState.c must be a (num_layers, B, D) tensor, got {shape}")
        self.memory = list(self.memory) or [None] * self.c.shape[0]
        if len(self.kv_cache) != len(self.memory):
            self.kv_cache = [None] * len(self.memory)
        if len(self.memory) != self.c.shape[0]:
            raise ValueError(
                f"SRUppState.memory has {len(self.memory)} entries but c has "
                f"{self.c.shape[0]} layers; give one entry (or None) per layer")
        B = self.c.shape[1]
        lengths = set()
        for i, m in enumerate(self.memory):
            if m is None:
                continue
            if m.dim() != 3 or m.shape[0] != B:
                raise ValueError(
                    f"SRUppState.memory[{i}] must be (B={B}, M, n_in), got {tuple(m.shape)}")
            lengths.add(m.shape[1])
        if len(lengths) > 1:
            raise ValueError(f"SRUppState.memory entries disagree on length M: {sorted(lengths)}")
        mp = self.memory_mask_pad
        if mp is not None:
            M = lengths.pop() if lengths else None
            if mp.dtype != torch.bool or mp.dim() != 2 or mp.shape[0] != B or (
                    M is not None and mp.shape[1] != M):
                raise ValueError(
                    f"SRUppState.memory_mask_pad must be bool (B={B}, M={M}), "
                    f"got {mp.dtype} {tuple(mp.shape)}")
        if self.mem_len is not None and self.mem_len < 0:
            raise ValueError(f"SRUppState.mem_len must be >= 0 or None, got {self.mem_len}")

    # ------------------------------------------------------------------ sizes
    @property
    def num_layers(self) -> int:
        return self.c.shape[0]

    @property
    def batch_size(self) -> int:
        return self.c.shape[1]

    @property
    def memory_length(self) -> int:
        """M, the number of past positions held in memory (0 when none)."""
        return next((m.shape[1] for m in self.memory if m is not None), 0)

    def nbytes(self) -> int:
        """Bytes held by all tensors of the state."""
        tensors = [self.c, self.memory_mask_pad, *self.memory,
                   *(kv.kv for kv in self.kv_cache if kv is not None)]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    # ------------------------------------------------------------ transforms
    def _map(self, f) -> "SRUppState":
        """Apply f(t, batch_dim) to every tensor."""
        opt = lambda t, dim: None if t is None else f(t, dim)  # noqa: E731
        return replace(
            self,
            c=f(self.c, 1),
            memory=[opt(m, 0) for m in self.memory],
            memory_mask_pad=opt(self.memory_mask_pad, 0),
            kv_cache=[None if kv is None else kv.map(lambda t: f(t, 0)) for kv in self.kv_cache],
        )

    def drop_kv_cache(self) -> "SRUppState":
        """The same state without cached keys and values (the next call recomputes them)."""
        return replace(self, kv_cache=[None] * len(self.memory))

    def detach(self) -> "SRUppState":
        """A copy cut from the autograd graph, for truncated backpropagation."""
        return self._map(lambda t, dim: t.detach())

    def index_select(self, batch_indices: Tensor) -> "SRUppState":
        """Reorder or repeat batch entries, e.g. to follow beams.

        Args:
            batch_indices: (B',) long indices into the batch.
        """
        idx = torch.as_tensor(batch_indices, dtype=torch.long, device=self.c.device)
        return self._map(lambda t, dim: t.index_select(dim, idx))

    def keep_rows(self, rows: Sequence[int]) -> "SRUppState":
        """The state of batch rows ``rows`` (ascending, each once), moved to the front of this
        state's own memory and key/value buffers in place (:func:`srupp.nn.append.first_rows`):
        a serving engine drops finished streams without allocating a second batch. This
        state is spent: its buffers' other rows are overwritten."""
        rows = check_kept_rows(rows, self.batch_size)
        idx = torch.tensor(rows, dtype=torch.long, device=self.c.device)
        front = lambda t: first_rows(t, rows)  # noqa: E731
        return replace(
            self, c=self.c.index_select(1, idx),
            memory=[None if m is None else front(m) for m in self.memory],
            memory_mask_pad=None if self.memory_mask_pad is None
            else self.memory_mask_pad.index_select(0, idx),
            kv_cache=[None if kv is None else kv.map(front) for kv in self.kv_cache])

    @classmethod
    def cat(cls, states: Sequence["SRUppState"], *, room: bool = False) -> "SRUppState":
        """The states of several batches as one batch, in order (the inverse of
        :meth:`index_select` on disjoint rows): their memories must have one length M
        (left-pad with ``memory_mask_pad`` to make them so) and one ``mem_len``.

        The cached keys and values are kept where every state has them, made by the
        same weights (a serving engine joins streams without recomputing them).
        ``room``: the memories and keys and values go into buffers with room for the
        steps decoding appends next (:func:`srupp.nn.append.cat_with_room`), not into
        new ones that the next step would copy again.
        """
        join = cat_with_room if room else torch.cat
        if not states:
            raise ValueError("SRUppState.cat needs at least one state")
        if len(states) == 1 and not room:
            return states[0]
        first = states[0]
        if len({s.memory_length for s in states}) > 1 or len({s.mem_len for s in states}) > 1:
            raise ValueError(f"SRUppState.cat: the states disagree on memory length "
                             f"{sorted({s.memory_length for s in states})} or mem_len; "
                             f"left-pad their memories to one length first")
        B = [s.batch_size for s in states]
        masks = None
        if any(s.memory_mask_pad is not None for s in states) and first.memory_length:
            masks = torch.cat([s.memory_mask_pad if s.memory_mask_pad is not None else
                               torch.zeros(b, first.memory_length, dtype=torch.bool,
                                           device=first.c.device)
                               for s, b in zip(states, B)])
        memory, kv_cache = [], []
        for i in range(first.num_layers):
            ms = [s.memory[i] for s in states]
            memory.append(None if ms[0] is None else join(ms))
            kvs = [s.kv_cache[i] for s in states]
            same = all(kv is not None and kv._weights == kvs[0]._weights for kv in kvs)
            kv_cache.append(kvs[0].with_kv(join([kv.kv for kv in kvs])) if same else None)
        return cls(c=torch.cat([s.c for s in states], 1), memory=memory,
                   memory_mask_pad=masks, mem_len=first.mem_len, kv_cache=kv_cache)

    def put_row(self, row: int, other: "SRUppState") -> None:
        """Write ``other`` (batch size 1) over row ``row`` of this state, in place: a serving
        engine hands a freed row to a new stream without copying the others. The memories
        must have one length; cached keys and values are written where both states have
        them for the same weights (else a ValueError: the row would disagree with its cache).
        """
        if other.batch_size != 1 or other.num_layers != self.num_layers \
                or other.memory_length != self.memory_length:
            raise ValueError(f"put_row takes a state of batch size 1 with {self.num_layers} "
                             f"layers and memory length {self.memory_length}, got batch "
                             f"{other.batch_size}, {other.num_layers} layers, memory length "
                             f"{other.memory_length}")
        for mine, theirs in zip(self.kv_cache, other.kv_cache):
            if mine is not None and (theirs is None or theirs._weights != mine._weights):
                raise ValueError("put_row: the state's keys and values are cached and the "
                                 "new row's are not (or were made by other weights)")
        self.c[:, row].copy_(other.c[:, 0])
        for mine, theirs in zip(self.memory, other.memory):
            if mine is not None:
                mine[row].copy_(theirs[0])
        M = self.memory_length
        if M:
            pad = other.memory_mask_pad
            if self.memory_mask_pad is None and pad is not None and bool(pad.any()):
                self.memory_mask_pad = torch.zeros(self.batch_size, M, dtype=torch.bool,
                                                   device=self.c.device)
            if self.memory_mask_pad is not None:
                self.memory_mask_pad[row].copy_(pad[0] if pad is not None else False)
        for mine, theirs in zip(self.kv_cache, other.kv_cache):
            if mine is not None:
                mine.kv[row].copy_(theirs.kv[0])

    def to(self, *args, **kwargs) -> "SRUppState":
        """Move to a device. Dtypes are kept (c stays fp32), so pass a device only."""
        return self._map(lambda t, dim: t.to(*args, **kwargs))

    # ------------------------------------------------------------ checkpoint
    def to_dict(self) -> Dict[str, Tensor]:
        """A flat ``{name: tensor}`` dict, ready for safetensors or ``torch.save``."""
        out: Dict[str, Tensor] = {"c": self.c}
        for i, m in enumerate(self.memory):
            if m is not None:
                out[f"memory.{i}"] = m
        if self.memory_mask_pad is not None:
            out["memory_mask_pad"] = self.memory_mask_pad
        if self.mem_len is not None:
            out["mem_len"] = torch.tensor(self.mem_len, dtype=torch.long)
        return out

    @classmethod
    def from_dict(cls, tensors: Dict[str, Tensor]) -> "SRUppState":
        """Inverse of :meth:`to_dict`."""
        if "c" not in tensors:
            raise ValueError("SRUppState.from_dict: missing key 'c'")
        known = {"c", "memory_mask_pad", "mem_len"}
        unknown = [k for k in tensors if k not in known and not k.startswith("memory.")]
        if unknown:
            raise ValueError(f"SRUppState.from_dict: unknown keys {unknown}")
        c = tensors["c"]
        memory = [tensors.get(f"memory.{i}") for i in range(c.shape[0])]
        mem_len = tensors.get("mem_len")
        return cls(c=c, memory=memory, memory_mask_pad=tensors.get("memory_mask_pad"),
                   mem_len=None if mem_len is None else int(mem_len))
