"""Appending time steps to a cache without copying what it already holds.

Decoding one token at a time grows every cache (attention memory, keys and
values) by one step per call. ``torch.cat`` copies the whole cache each time,
O(M) per token. :func:`append_steps` instead writes the new steps into spare
room at the end of a larger buffer and returns a view, so a step costs O(1)
amortised (the buffer doubles when full).

It is safe for shared history: a buffer remembers where its last append
ended, and only a view ending exactly there may append in place. Continuing
an older state a second time (sampling two branches from one prefix) sees a
mismatch and copies, so views handed out earlier never change.

Only used when no gradient is recorded (in-place writes would break autograd).

A serving engine, which never reads an older view again, decodes under
:func:`sliding_windows`: a window of memory then slides back to its buffer's
start in place, and buffers hold 1.5× their rows, not 2×.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

_MIN_CAPACITY = 64

# Set by sliding_windows(): a full buffer moves its rows back to its start in place,
# instead of being copied into a new one twice as large.
_sliding = False


@contextlib.contextmanager
def sliding_windows():
    """Within it, the caller promises that only the newest view of each buffer is read
    again (a serving engine keeps one state per stream and drops the one before). A
    full buffer then moves its last rows back to its start in place, and a new buffer
    leaves half its rows spare, not as many as it holds: a window of memory costs 1.5×
    its bytes and no buffer is allocated while it slides, where the default (views handed
    out stay valid forever) holds 2× and allocates a new buffer each time one fills.
    Process-wide: enter it from the thread that runs the model."""
    global _sliding
    before, _sliding = _sliding, True
    try:
        yield
    finally:
        _sliding = before


def _slide(base: Tensor, dim: int, start: int, M: int) -> None:
    """Move steps start .. start+M-1 of ``base`` (along ``dim``) to 0 .. M-1, in place: in
    pieces of at most ``start`` steps, front to back, so that no piece overlaps its target
    and every piece is read before it is written over."""
    done = 0
    while done < M:
        n = min(start, M - done)
        base.narrow(dim, done, n).copy_(base.narrow(dim, start + done, n))
        done += n


def append_steps(old: Optional[Tensor], new: Tensor, dim: int = 1) -> Tensor:
    """``torch.cat([old, new], dim)``, reusing ``old``'s buffer when it can.

    Args:
        old: (..., M, ...) the cache so far, or None.
        new: (..., L, ...) steps to add; same shape as ``old`` except at ``dim``.
        dim: the time dimension.
    Returns:
        (..., M + L, ...), equal to ``torch.cat([old, new], dim)``; a view into
        a buffer with spare room when gradients are off, so the next call can
        append without copying.
    """
    if (torch.compiler.is_compiling() or torch.is_grad_enabled() and (
            new.requires_grad or (old is not None and old.requires_grad))):
        return new if old is None else torch.cat([old.to(new.dtype), new], dim)
    dim = dim % new.dim()
    M, L = (0 if old is None else old.shape[dim]), new.shape[dim]
    base, start = reserve_steps(old, new.shape, new, dim)
    base.narrow(dim, start + M, L).copy_(new)
    return base.narrow(dim, start, M + L)


def reserve_steps(old: Optional[Tensor], steps_shape: Sequence[int], like: Tensor,
                  dim: int = 1, known: Optional[Tuple[Tensor, int]] = None) -> Tuple[Tensor, int]:
    """Room for new steps after ``old``, for a kernel that writes them in place.

    :func:`append_steps` is this plus the copy of the new steps. ``steps_shape``
    is the new steps' shape (L at ``dim``; ``old``'s shape elsewhere) and ``like``
    gives the dtype and device. Returns a buffer and ``start``: along ``dim`` its
    steps start .. start+M-1 hold ``old`` (copied only when its own buffer has no
    room, or ``old`` does not end where that buffer's last append ended), and the
    L steps after them are the caller's to write. The buffer is marked as ending
    at start+M+L. Gradients are not tracked.

    ``known`` = (buffer, start): where ``old`` lies, when the caller knows it is that
    buffer narrowed along ``dim`` from ``start`` (a decoding step that made ``old``
    itself); it spares working that out from strides and offsets (a few µs a call).
    """
    dim = dim % len(steps_shape)
    L = steps_shape[dim]
    if known is not None and old is not None and old.dtype == like.dtype:
        base, start = known
        end, M = getattr(base, "_srupp_append_end", None), old.shape[dim]
        if start + M == end and base.device == like.device:
            if end + L <= base.shape[dim]:
                base._srupp_append_end = end + L
                return base, start
            if _sliding and M + L <= base.shape[dim]:
                return _slid(base, dim, start, M, L)
    if old is not None and old.dtype != like.dtype:
        old = old.to(like.dtype)
    M = 0 if old is None else old.shape[dim]
    if old is not None:
        base = old._base
        end = getattr(base, "_srupp_append_end", None) if base is not None else None
        if end is not None and base.device == like.device:
            start = (old.storage_offset() - base.storage_offset()) // max(old.stride(dim), 1)
            # old is base narrowed along dim only: same strides, and (as no other size
            # of a view can exceed base's) as many elements per step as base
            if (start + M == end and old.stride() == base.stride()
                    and old.numel() * base.shape[dim] == base.numel() * M):
                if end + L <= base.shape[dim]:
                    base._srupp_append_end = end + L
                    return base, start
                if _sliding and M + L <= base.shape[dim]:
                    return _slid(base, dim, start, M, L)
    # a fresh buffer with room to double (sliding: to grow by half)
    shape = list(steps_shape)
    shape[dim] = _capacity(M, L)
    base = like.new_empty(shape)
    if old is not None:
        base.narrow(dim, 0, M).copy_(old)
    base._srupp_append_end = M + L
    return base, 0


def _capacity(M: int, L: int) -> int:
    """Steps of a fresh buffer for M steps and L new ones: room to double (sliding: to
    grow by half)."""
    room = max(L, (M + L) // 2) if _sliding else M + L
    return max(M + L + room, _MIN_CAPACITY)


def cat_with_room(parts: Sequence[Tensor]) -> Tensor:
    """``torch.cat(parts)`` of step buffers (B_i, M, ...) along the batch (dim 0), written
    into a buffer with the room :func:`reserve_steps` leaves after M steps: the next
    append is then in place. (A plain cat has no room: the next append would copy it
    into a new buffer, holding the two at once: a serving engine's batch, twice.)"""
    shape = list(parts[0].shape)
    M = shape[1]
    shape[0] = sum(p.shape[0] for p in parts)
    full = list(shape)
    full[1] = _capacity(M, 0)
    base = parts[0].new_empty(full)
    out, row = base.narrow(1, 0, M), 0
    for p in parts:
        out.narrow(0, row, p.shape[0]).copy_(p)
        row += p.shape[0]
    base._srupp_append_end = M
    return out


def first_rows(steps: Tensor, rows: Sequence[int]) -> Tensor:
    """``steps`` (B, M, ...) with batch rows ``rows`` (ascending) moved to its front, in its
    own buffer, as a (len(rows), M, ...) view that :func:`reserve_steps` appends to in
    place: dropping rows then allocates nothing (where ``index_select`` would copy the
    kept rows into a new buffer while the old one is still held). ``steps``' other rows
    are overwritten."""
    k, M = len(rows), steps.shape[1]
    for i, r in enumerate(rows):
        if i != r:
            steps[i].copy_(steps[r])
    base = steps._base if steps._base is not None else steps
    if M == 0 or base.dim() != steps.dim():
        return steps[:k]
    # a tensor of its own over the buffer's storage, k rows: reserve_steps finds it as the
    # base of the view it returns, with the buffer's end mark
    own = base.new_empty(0).set_(base.untyped_storage(), base.storage_offset(),
                                 (k, *base.shape[1:]), base.stride())
    if hasattr(base, "_srupp_append_end"):
        own._srupp_append_end = base._srupp_append_end
    start = (steps.storage_offset() - base.storage_offset()) // steps.stride(1)
    return own.narrow(1, start, M)


def release_steps(base: Tensor, end: int) -> None:
    """Give back the steps of ``base`` from ``end`` on that :func:`reserve_steps` reserved
    and no one wrote (a decoding loop that ended early): the next reservation then
    appends after ``end`` in place, instead of copying ``old`` to a fresh buffer."""
    if getattr(base, "_srupp_append_end", -1) > end:
        base._srupp_append_end = end


def _slid(base: Tensor, dim: int, start: int, M: int, L: int) -> Tuple[Tensor, int]:
    """reserve_steps' answer after sliding ``base``'s M steps at ``start`` to its start."""
    if start:
        _slide(base, dim, start, M)
    base._srupp_append_end = M + L
    return base, 0
