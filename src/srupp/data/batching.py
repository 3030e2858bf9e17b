"""Batching: token streams for language models, length buckets for pairs and labels.

:class:`StreamBatcher` (language models, Transformer-XL style)
----------------------------------------------------------------

The token stream is cut into ``batch_size * world_size`` equal contiguous
streams (the remainder at the end is dropped). Rank ``r`` owns streams
``r*B .. (r+1)*B - 1``, so ranks never share a token. Batch ``i`` of an epoch
holds, for each of the rank's streams, the tokens at positions
``i*L .. i*L + L - 1`` as inputs and the tokens one further on as targets.
Consecutive batches therefore continue every stream, and a recurrent state
carried from one batch to the next is meaningful.

A stream of ``S`` tokens gives ``S - 1`` (input, target) pairs, so an epoch
has ``ceil((S - 1) / L)`` batches; the last one is shorter than ``L`` when
``L`` does not divide ``S - 1``. It is kept, so every target is trained on
(and evaluated) once per epoch.

Steps are global batch indices counted across epochs: step ``s`` is batch
``s % len(batcher)`` of epoch ``s // len(batcher)``. Every epoch has the same
layout, so the first batch of an epoch starts the streams again from their
beginning: reset the carried state there (``Batch.epoch_start`` /
:meth:`StreamBatcher.is_epoch_start`).

:class:`LengthBatcher` (translation, classification)
----------------------------------------------------
Independent items (sentence pairs, labelled texts) of varying length are
grouped with items of similar length, so that little of a padded batch is
padding; the doc of :class:`LengthBatcher` gives the rule. It hands out
item indices; padding and tensors are the task's business.
"""

from __future__ import annotations

import random
import zlib
from functools import cached_property
from typing import Any, Iterator, NamedTuple, Optional, Sequence

import numpy as np
import torch


__all__ = ["Batch", "StreamBatcher", "LengthBatch", "LengthBatcher"]


class Batch(NamedTuple):
    """One training batch from :meth:`StreamBatcher.iter_from`."""

    inputs: torch.Tensor   #: (B, l) int64, l <= unroll
    targets: torch.Tensor  #: (B, l) int64, inputs shifted by one along each stream
    step: int              #: global step (counting across epochs)
    epoch: int             #: step // len(batcher)
    epoch_start: bool      #: first batch of an epoch: reset the carried state before it


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _int_at_least(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int: TypeError if it is no integer, ValueError if it is
    below ``minimum`` (1: positive, 0: non-negative)."""
    msg = f"{name} must be a {'positive' if minimum else 'non-negative'} integer, got {value!r}"
    if not _is_int(value):
        raise TypeError(msg)
    if value < minimum:
        raise ValueError(msg)
    return int(value)


def _saved_position(state: Any, mine: dict[str, int], other: str, what: str,
                    same: str) -> int:
    """The position of a batcher's saved state, after checking it was saved for ``mine``.

    ``other``: where a state lacking keys may come from; ``what``: what a
    difference is in; ``same``: what a resumed run must keep.
    """
    if not isinstance(state, dict) or "position" not in state:
        raise ValueError("a saved batcher state must be a dict with a 'position'; "
                         "the checkpoint is corrupt")
    missing = [k for k in mine if k not in state]
    if missing:
        raise ValueError(f"the saved batcher state lacks {', '.join(missing)}; the "
                         f"checkpoint is corrupt or from {other}")
    diffs = [f"{k}: saved {state[k]!r}, now {v!r}" for k, v in mine.items() if state[k] != v]
    if diffs:
        raise ValueError(f"cannot resume: the batcher state was saved for different data or "
                         f"{what} ({'; '.join(diffs)}); resume with the same {same}")
    pos = state["position"]
    if not _is_int(pos) or pos < 0:
        raise ValueError(f"the saved batcher position must be a non-negative integer, "
                         f"got {pos!r}; the checkpoint is corrupt")
    return int(pos)


class StreamBatcher:
    """Batches ``(inputs, targets)`` of shape ``(batch_size, <=unroll)`` from a
    1-D token stream, continuing each of ``batch_size`` streams from batch to
    batch (see the module doc).

    * ``iter(batcher)`` / ``for x, y in batcher``: one epoch from its start,
      as ``(inputs, targets)`` tuples (for evaluation; ``position`` untouched).
    * :meth:`iter_from`: endless training iterator of :class:`Batch`, wrapping
      into the next epoch; advances :attr:`position`.
    * :meth:`state_dict` / :meth:`load_state_dict`: save and restore
      :attr:`position` for an exact resume (checked against the data and layout).
    """

    def __init__(self, ids: torch.Tensor, batch_size: int, unroll: int, *,
                 rank: int = 0, world_size: int = 1):
        self.batch_size = _int_at_least("batch_size", batch_size, 1)
        self.unroll = _int_at_least("unroll", unroll, 1)
        self.world_size = _int_at_least("world_size", world_size, 1)
        if not _is_int(rank) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an integer in 0..{self.world_size - 1} "
                             f"(world_size={self.world_size}), got {rank!r}")
        self.rank = int(rank)

        if not isinstance(ids, torch.Tensor):
            arr = np.asarray(ids)
            ids = torch.as_tensor(arr.astype(np.int64) if arr.size == 0 else arr)
        if ids.dim() != 1:
            raise ValueError(f"the token ids must be a 1-D tensor, got shape {tuple(ids.shape)}")
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"the token ids must be integers, got dtype {ids.dtype}")
        self.ids = ids.to(torch.int64)
        self.num_tokens = int(ids.numel())

        num_streams = self.batch_size * self.world_size
        self.stream_len = self.num_tokens // num_streams
        need = num_streams * (self.unroll + 1)
        if self.stream_len < self.unroll + 1:
            raise ValueError(
                f"too little data: {self.num_tokens} tokens, but batch_size={self.batch_size} x "
                f"world_size={self.world_size} streams x (unroll={self.unroll} + 1) needs at "
                f"least {need} tokens for one batch; use a smaller batch_size or unroll, "
                "or more data")
        self.dropped_tokens = self.num_tokens - num_streams * self.stream_len
        streams = self.ids[: num_streams * self.stream_len].view(num_streams, self.stream_len)
        #: This rank's streams, (batch_size, stream_len).
        self.streams = streams[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        self._num_batches = -(-(self.stream_len - 1) // self.unroll)
        #: Global step of the next batch :meth:`iter_from` hands out
        #: (= batches handed out so far, counting across epochs).
        self.position = 0

    # ------------------------------------------------------------------ layout

    def __len__(self) -> int:
        """Batches per epoch."""
        return self._num_batches

    @property
    def epoch(self) -> int:
        """Epoch of the next batch (``position // len(self)``)."""
        return self.position // self._num_batches

    @property
    def tokens_per_epoch(self) -> int:
        """Target tokens this rank sees in one epoch: ``batch_size * (stream_len - 1)``."""
        return self.batch_size * (self.stream_len - 1)

    def is_epoch_start(self, step: int) -> bool:
        """Whether ``step`` is the first batch of an epoch (reset the carried state)."""
        return step % self._num_batches == 0

    def get_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` for global ``step`` (any non-negative int; wraps by epoch)."""
        start = (_int_at_least("step", step, 0) % self._num_batches) * self.unroll
        length = min(self.unroll, self.stream_len - 1 - start)
        return (self.streams[:, start:start + length].contiguous(),
                self.streams[:, start + 1:start + 1 + length].contiguous())

    def __repr__(self) -> str:
        return (f"StreamBatcher(num_tokens={self.num_tokens}, batch_size={self.batch_size}, "
                f"unroll={self.unroll}, rank={self.rank}, world_size={self.world_size}, "
                f"stream_len={self.stream_len}, batches_per_epoch={len(self)}, "
                f"position={self.position})")

    # --------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One epoch, from its first batch, as ``(inputs, targets)``.

        Does not touch :attr:`position`. Start from a fresh state before it.
        """
        return map(self.get_batch, range(self._num_batches))

    def iter_from(self, step: int | None = None) -> Iterator[Batch]:
        """Endless iterator of :class:`Batch` from ``step`` (default: :attr:`position`).

        Wraps into the next epoch with an identical layout; ``Batch.epoch_start``
        is True exactly at steps that are multiples of ``len(self)``. When
        batch ``s`` is handed out, :attr:`position` becomes ``s + 1``, so a
        :meth:`state_dict` taken after processing it resumes at the next batch.
        (Resuming mid-epoch needs the carried state saved too; otherwise the
        caller starts from a fresh state, which is not an exact resume.)
        """
        s = _int_at_least("step", self.position if step is None else step, 0)
        while True:
            inputs, targets = self.get_batch(s)
            self.position = s + 1
            yield Batch(inputs, targets, s, s // self._num_batches, self.is_epoch_start(s))
            s += 1

    # ------------------------------------------------------------------ resume

    @cached_property
    def _data_crc32(self) -> int:
        arr = np.ascontiguousarray(self.ids.detach().cpu().numpy())
        return zlib.crc32(memoryview(arr).cast("B"))

    def _layout(self) -> dict[str, int]:
        return {"num_tokens": self.num_tokens, "batch_size": self.batch_size,
                "unroll": self.unroll, "rank": self.rank, "world_size": self.world_size,
                "data_crc32": self._data_crc32}

    def state_dict(self) -> dict[str, int]:
        """Plain-int dict: ``position`` plus the layout it is valid for."""
        return {"position": self.position, **self._layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :attr:`position`; the data and layout must match the saved ones."""
        self.position = _saved_position(
            state, self._layout(), "an incompatible srupp", "layout",
            "corpus, tokenizer, batch_size, unroll, rank and world_size")


# ----------------------------------------------------------------------------- length batching


class LengthBatch(NamedTuple):
    """One batch from :meth:`LengthBatcher.iter_from`."""

    indices: list[int]  #: item indices, ascending in length (ties in seeded random order)
    epoch: int          #: position // len(batcher)
    epoch_start: bool   #: first batch of an epoch


class LengthBatcher:
    """Batches of items of similar length, at most ``max_tokens`` padded tokens
    each, for seq2seq and classification.

    ``lengths[i]``: item ``i``'s length in tokens (for a pair, whatever the
    task pads to, e.g. the longer side). The batches are made once:

    1. the items are sorted by length; items of equal length are ordered by a
       random permutation drawn from ``random.Random(seed)``, so that the
       batches mix them rather than follow the data's order;
    2. the sorted items are cut, in order, into runs where
       ``len(batch) * max(length in batch) <= max_tokens`` (the padded size)
       and ``len(batch) <= max_batch_size``. A run grows while the next item
       still fits; every batch has at least one item, so an item longer than
       ``max_tokens`` forms a batch of its own.

    The batches themselves stay the same in every epoch; only the order in
    which an epoch visits them changes: epoch ``e`` visits them in the order
    of ``random.Random(seed * 1_000_003 + e).shuffle`` (with ``shuffle``;
    without it, in sorted order). Batch ``p`` since the start of training is
    therefore a function of ``p`` alone, which makes resuming exact and
    trivial (:meth:`iter_from`, :meth:`state_dict`).

    * :meth:`iter_from`: the endless training iterator of
      :class:`LengthBatch`; advances :attr:`position`.
    * :meth:`batches`: one epoch in the fixed sorted order, for evaluation.
    """

    def __init__(self, lengths: Sequence[int], max_tokens: int, *, seed: int = 0,
                 shuffle: bool = True, max_batch_size: Optional[int] = None,
                 content_crc32: int = 0):
        # the caller's checksum of the items themselves (ids, labels): lengths alone
        # would let a resumed run continue silently on other data of the same lengths
        self.content_crc32 = int(content_crc32)
        self.max_tokens = _int_at_least("max_tokens", max_tokens, 1)
        self.max_batch_size = (None if max_batch_size is None
                               else _int_at_least("max_batch_size", max_batch_size, 1))
        if not _is_int(seed):
            raise TypeError(f"seed must be an integer, got {seed!r}")
        self.seed = int(seed)
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be True or False, got {shuffle!r}")
        self.shuffle = shuffle
        if isinstance(lengths, (np.ndarray, torch.Tensor)):
            lengths = lengths.tolist()  # 0-d tensors are no ints: take their values
        self.lengths: list[int] = list(lengths)
        if not self.lengths:
            raise ValueError("lengths is empty: there are no items to batch; check the data")
        for i, n in enumerate(self.lengths):
            if not _is_int(n) or n < 1:
                raise ValueError(f"lengths[{i}] is {n!r}; every item length must be a positive "
                                 "integer (drop empty items first)")
        self.lengths = [int(n) for n in self.lengths]
        self._batches = self._make_batches()
        #: Batches handed out by :meth:`iter_from` since the start of training
        #: (the index of the next one, counting across epochs).
        self.position = 0
        self._epoch_order: tuple[int, list[int]] = (-1, [])

    def _make_batches(self) -> list[list[int]]:
        tiebreak = list(range(len(self.lengths)))
        random.Random(self.seed).shuffle(tiebreak)
        order = sorted(range(len(self.lengths)), key=lambda i: (self.lengths[i], tiebreak[i]))
        cap = self.max_batch_size or len(order)
        batches: list[list[int]] = []
        batch: list[int] = []
        for i in order:
            # Sorted ascending: item i is the longest of the batch it joins.
            if batch and ((len(batch) + 1) * self.lengths[i] > self.max_tokens
                          or len(batch) == cap):
                batches.append(batch)
                batch = []
            batch.append(i)
        batches.append(batch)
        return batches

    # ------------------------------------------------------------------ layout

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self._batches)

    @property
    def epoch(self) -> int:
        """Epoch of the next batch (``position // len(self)``)."""
        return self.position // len(self._batches)

    def batches(self) -> list[list[int]]:
        """One epoch in the fixed order (sorted by length, unshuffled): for evaluation.

        Fresh lists: changing them changes nothing here. Does not touch
        :attr:`position`.
        """
        return [list(b) for b in self._batches]

    def epoch_order(self, epoch: int) -> list[int]:
        """The order in which epoch ``epoch`` visits the batches (indices into :meth:`batches`)."""
        epoch = _int_at_least("epoch", epoch, 0)
        if self._epoch_order[0] != epoch:
            order = list(range(len(self._batches)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def __repr__(self) -> str:
        return (f"LengthBatcher(items={len(self.lengths)}, max_tokens={self.max_tokens}, "
                f"max_batch_size={self.max_batch_size}, seed={self.seed}, "
                f"shuffle={self.shuffle}, batches_per_epoch={len(self)}, "
                f"position={self.position})")

    # --------------------------------------------------------------- iteration

    def iter_from(self, position: Optional[int] = None) -> Iterator[LengthBatch]:
        """Endless iterator of :class:`LengthBatch` from ``position`` (default:
        :attr:`position`), batches counted since the start of training.

        Yields exactly what an uninterrupted iteration from 0 yields from its
        ``position``-th batch on. When batch ``p`` is handed out,
        :attr:`position` becomes ``p + 1``, so a :meth:`state_dict` taken after
        processing it resumes at the next batch.
        """
        p = _int_at_least("position", self.position if position is None else position, 0)
        n = len(self._batches)
        while True:
            epoch, k = divmod(p, n)
            indices = list(self._batches[self.epoch_order(epoch)[k]])
            self.position = p + 1
            yield LengthBatch(indices, epoch, k == 0)
            p += 1

    # ------------------------------------------------------------------ resume

    @cached_property
    def _lengths_crc32(self) -> int:
        return zlib.crc32(np.asarray(self.lengths, dtype=np.int64).tobytes())

    def _layout(self) -> dict[str, int]:
        return {"num_items": len(self.lengths), "lengths_crc32": self._lengths_crc32,
                "content_crc32": self.content_crc32, "max_tokens": self.max_tokens, "max_batch_size": self.max_batch_size or 0,
                "seed": self.seed, "shuffle": int(self.shuffle)}

    def state_dict(self) -> dict[str, int]:
        """Plain-int dict: ``position`` plus the data and settings it is valid for
        (``max_batch_size`` 0: none; ``shuffle`` 0 or 1)."""
        return {"position": self.position, **self._layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :attr:`position`; the data and settings must match the saved ones."""
        self.position = _saved_position(
            state, self._layout(), "another kind of batcher", "settings",
            "data, tokenizer, max_tokens, max_batch_size, seed and shuffle")
