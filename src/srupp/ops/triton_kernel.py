"""Triton GPU kernels for the SRU element-wise recurrence (forward and backward).

Written from ``SRUPP_SPEC.md`` sections 2-3; the oracle is
:func:`srupp.ops.reference.sru_recurrence_reference`, whose argument
conventions these kernels follow exactly:

    U            (B, L, k, D)  k = 3 or 4; any strides
    x            (B, L, D)     skip input (k = 3 only) or None; any strides
    weight_c     (2, D)        [v_f; v_r]
    bias         (2, D)        [b_f; b_r]
    c0           (B, D)        initial state (read as fp32)
    mask_pad     (B, L) bool   True = padding: state held, h = 0, no gradient
    dropout_mask (B, D)        variational highway mask, shared over time

Work split: one program per (batch row, block of ``BLOCK`` units), looping
over time.  With ``bidirectional`` each lane picks its own direction from its
unit index (units >= D/2 run t = L-1 .. 0), so a block may straddle the two
halves.  State and all accumulation are fp32 whatever the input dtype; h and
grad_U are written in U's dtype.

The peephole/bias gradients are reduced deterministically: every program
writes its per-batch-row partial sums into a (B, 4, D) fp32 buffer, which is
then summed over B with torch (no atomics).

This module imports triton at its top; nothing else in :mod:`srupp` imports it
at package import time (the dispatcher imports it lazily, for CUDA tensors).
"""

from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .settings import debug_nan_fill

__all__ = [
    "sru_fwd_triton",
    "sru_bwd_triton",
    "sru_bwd_triton_op",
    "SRURecurrenceTriton",
    "sru_recurrence_triton",
]

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------- #
# kernels
# --------------------------------------------------------------------------- #


@triton.jit
def _sru_fwd_kernel(
    U_ptr, X_ptr, WC_ptr, BIAS_ptr, C0_ptr, MP_ptr, DM_ptr,
    H_ptr, CLAST_ptr, CALL_ptr,
    L, D, d_half, scale_x,
    sUb, sUl, sUk, sUd,
    sXb, sXl, sXd,
    sWr, sWd, sBr, sBd,
    sC0b, sC0d,
    sMb, sMl,
    sDb, sDd,
    sHb, sHl, sHd,
    sCb, sCl, sCd,
    K4: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_DROP: tl.constexpr, BIDIR: tl.constexpr, STORE_C: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    jm = j < D
    j = j.to(tl.int64)

    vf = tl.load(WC_ptr + j * sWd, mask=jm, other=0.0).to(tl.float32)
    vr = tl.load(WC_ptr + sWr + j * sWd, mask=jm, other=0.0).to(tl.float32)
    bf = tl.load(BIAS_ptr + j * sBd, mask=jm, other=0.0).to(tl.float32)
    br = tl.load(BIAS_ptr + sBr + j * sBd, mask=jm, other=0.0).to(tl.float32)
    c = tl.load(C0_ptr + b * sC0b + j * sC0d, mask=jm, other=0.0).to(tl.float32)
    if HAS_DROP:
        m = tl.load(DM_ptr + b * sDb + j * sDd, mask=jm, other=0.0).to(tl.float32)
    if BIDIR:
        rev = j >= d_half

    u_row = U_ptr + b * sUb + j * sUd
    for s in range(0, L):
        if BIDIR:
            t = tl.where(rev, L - 1 - s, s).to(tl.int64)
        else:
            t = (s + tl.zeros((), tl.int64)).to(tl.int64)
        pu = u_row + t * sUl
        u0 = tl.load(pu, mask=jm, other=0.0).to(tl.float32)
        u1 = tl.load(pu + sUk, mask=jm, other=0.0).to(tl.float32)
        u2 = tl.load(pu + 2 * sUk, mask=jm, other=0.0).to(tl.float32)
        f = tl.sigmoid(u1 + vf * c + bf)
        r = tl.sigmoid(u2 + vr * c + br)
        c_new = f * c + (1.0 - f) * u0
        if HAS_SKIP:
            if K4:
                sk = tl.load(pu + 3 * sUk, mask=jm, other=0.0).to(tl.float32)
            else:
                sk = tl.load(X_ptr + b * sXb + t * sXl + j * sXd, mask=jm,
                             other=0.0).to(tl.float32) * scale_x
            if HAS_DROP:
                gate = m * r
            else:
                gate = r
            h = sk + gate * (c_new - sk)
        else:
            h = r * c_new
            if HAS_DROP:
                h = m * h
        if HAS_MASK:
            if BIDIR:
                pad = tl.load(MP_ptr + b * sMb + t * sMl, mask=jm, other=0) != 0
            else:
                pad = tl.load(MP_ptr + b * sMb + t * sMl) != 0
            c_new = tl.where(pad, c, c_new)
            h = tl.where(pad, 0.0, h)
        c = c_new
        tl.store(H_ptr + b * sHb + t * sHl + j * sHd, h.to(H_ptr.dtype.element_ty), mask=jm)
        if STORE_C:
            tl.store(CALL_ptr + b * sCb + t * sCl + j * sCd, c, mask=jm)
    tl.store(CLAST_ptr + b * D + j, c, mask=jm)


@triton.jit
def _sru_bwd_kernel(
    GH_ptr, GCL_ptr, U_ptr, X_ptr, WC_ptr, BIAS_ptr, C0_ptr, CALL_ptr, MP_ptr, DM_ptr,
    GU_ptr, GX_ptr, GC0_ptr, PART_ptr,
    L, D, d_half, scale_x,
    sGb, sGl, sGd,
    sGCb, sGCd,
    sUb, sUl, sUk, sUd,
    sXb, sXl, sXd,
    sWr, sWd, sBr, sBd,
    sC0b, sC0d,
    sCb, sCl, sCd,
    sMb, sMl,
    sDb, sDd,
    sGUb, sGUl, sGUk, sGUd,
    sGXb, sGXl, sGXd,
    K4: tl.constexpr, HAS_SKIP: tl.constexpr, STORE_GX: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_DROP: tl.constexpr, BIDIR: tl.constexpr, HAS_GCL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    jm = j < D
    j = j.to(tl.int64)

    vf = tl.load(WC_ptr + j * sWd, mask=jm, other=0.0).to(tl.float32)
    vr = tl.load(WC_ptr + sWr + j * sWd, mask=jm, other=0.0).to(tl.float32)
    bf = tl.load(BIAS_ptr + j * sBd, mask=jm, other=0.0).to(tl.float32)
    br = tl.load(BIAS_ptr + sBr + j * sBd, mask=jm, other=0.0).to(tl.float32)
    c0 = tl.load(C0_ptr + b * sC0b + j * sC0d, mask=jm, other=0.0).to(tl.float32)
    if HAS_DROP:
        m = tl.load(DM_ptr + b * sDb + j * sDd, mask=jm, other=0.0).to(tl.float32)
    if HAS_GCL:
        carry = tl.load(GCL_ptr + b * sGCb + j * sGCd, mask=jm, other=0.0).to(tl.float32)
    else:
        carry = tl.zeros((BLOCK,), tl.float32)
    if BIDIR:
        rev = j >= d_half

    dvf = tl.zeros((BLOCK,), tl.float32)
    dvr = tl.zeros((BLOCK,), tl.float32)
    dbf = tl.zeros((BLOCK,), tl.float32)
    dbr = tl.zeros((BLOCK,), tl.float32)

    u_row = U_ptr + b * sUb + j * sUd
    gu_row = GU_ptr + b * sGUb + j * sGUd
    c_row = CALL_ptr + b * sCb + j * sCd

    # Backward iteration s visits each lane's forward steps in reverse order:
    # forward lanes t = L-1 .. 0, reversed lanes t = 0 .. L-1.  tp is the step
    # whose state is c_{t-1} in the lane's own direction; at s = L-1 it is c0.
    if BIDIR:
        t0 = tl.where(rev, 0, L - 1).to(tl.int64)
    else:
        t0 = (L - 1 + tl.zeros((), tl.int64)).to(tl.int64)
    c_cur = tl.load(c_row + t0 * sCl, mask=jm, other=0.0).to(tl.float32)
    for s in range(0, L):
        if BIDIR:
            t = tl.where(rev, s, L - 1 - s).to(tl.int64)
            tp = tl.where(rev, t + 1, t - 1)
        else:
            t = (L - 1 - s + tl.zeros((), tl.int64)).to(tl.int64)
            tp = t - 1
        has_prev = s < L - 1
        c_prev = tl.load(c_row + tp * sCl, mask=jm & has_prev, other=0.0).to(tl.float32)
        c_prev = tl.where(has_prev, c_prev, c0)

        pu = u_row + t * sUl
        u0 = tl.load(pu, mask=jm, other=0.0).to(tl.float32)
        u1 = tl.load(pu + sUk, mask=jm, other=0.0).to(tl.float32)
        u2 = tl.load(pu + 2 * sUk, mask=jm, other=0.0).to(tl.float32)
        gh = tl.load(GH_ptr + b * sGb + t * sGl + j * sGd, mask=jm, other=0.0).to(tl.float32)
        f = tl.sigmoid(u1 + vf * c_prev + bf)
        r = tl.sigmoid(u2 + vr * c_prev + br)

        if HAS_DROP:
            gm = gh * m
            mr = m * r
        else:
            gm = gh
            mr = r
        if HAS_SKIP:
            if K4:
                sk = tl.load(pu + 3 * sUk, mask=jm, other=0.0).to(tl.float32)
            else:
                sk = tl.load(X_ptr + b * sXb + t * sXl + j * sXd, mask=jm,
                             other=0.0).to(tl.float32) * scale_x
            diff = c_cur - sk
        else:
            diff = c_cur
        gr = gm * diff * (r * (1.0 - r))
        gc = gm * r + carry
        gf = gc * (c_prev - u0) * (f * (1.0 - f))
        new_carry = gc * f + gf * vf + gr * vr
        du0 = gc * (1.0 - f)
        if HAS_SKIP:
            gs = gh * (1.0 - mr)

        if HAS_MASK:
            if BIDIR:
                pad = tl.load(MP_ptr + b * sMb + t * sMl, mask=jm, other=0) != 0
            else:
                pad = tl.load(MP_ptr + b * sMb + t * sMl) != 0
            # Padding: state held (the carry passes straight through), h = 0.
            carry = tl.where(pad, carry, new_carry)
            du0 = tl.where(pad, 0.0, du0)
            gf = tl.where(pad, 0.0, gf)
            gr = tl.where(pad, 0.0, gr)
            if HAS_SKIP:
                gs = tl.where(pad, 0.0, gs)
        else:
            carry = new_carry

        dvf += gf * c_prev
        dvr += gr * c_prev
        dbf += gf
        dbr += gr

        pg = gu_row + t * sGUl
        gty = GU_ptr.dtype.element_ty
        tl.store(pg, du0.to(gty), mask=jm)
        tl.store(pg + sGUk, gf.to(gty), mask=jm)
        tl.store(pg + 2 * sGUk, gr.to(gty), mask=jm)
        if HAS_SKIP:
            if K4:
                tl.store(pg + 3 * sGUk, gs.to(gty), mask=jm)
            elif STORE_GX:
                tl.store(GX_ptr + b * sGXb + t * sGXl + j * sGXd,
                         (gs * scale_x).to(GX_ptr.dtype.element_ty), mask=jm)
        c_cur = c_prev

    tl.store(GC0_ptr + b * D + j, carry, mask=jm)
    pp = PART_ptr + b * 4 * D + j
    tl.store(pp, dvf, mask=jm)
    tl.store(pp + D, dvr, mask=jm)
    tl.store(pp + 2 * D, dbf, mask=jm)
    tl.store(pp + 3 * D, dbr, mask=jm)


# --------------------------------------------------------------------------- #
# host side
# --------------------------------------------------------------------------- #


def _alloc(shape, dtype, device) -> Tensor:
    if debug_nan_fill():  # SRUPP_DEBUG_NAN_FILL=1
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _launch_config(B: int, D: int, block_size: Optional[int]) -> Tuple[int, int]:
    """(BLOCK, num_warps).  One lane per unit; small blocks keep many programs
    in flight when B * D is small (each program is sequential over time)."""
    if block_size is not None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        return block_size, max(1, min(4, block_size // 32))
    if B * D >= 1 << 16:
        return 64, 2
    return 32, 1


def _check(U: Tensor, x: Optional[Tensor], bidirectional: bool) -> Tuple[int, int, int, int]:
    if U.dim() != 4 or U.shape[2] not in (3, 4):
        raise ValueError(f"U must be (B, L, k, D) with k = 3 or 4, got shape {tuple(U.shape)}")
    B, L, k, D = U.shape
    if U.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"sru triton kernel supports fp32/bf16/fp16 U, got {U.dtype}")
    if k == 4 and x is not None:
        raise ValueError("with k = 4 the skip term is U[:, :, 3]; pass x=None")
    if x is not None and tuple(x.shape) != (B, L, D):
        raise ValueError(f"x must be (B, L, D) = {(B, L, D)}, got {tuple(x.shape)}")
    if bidirectional and D % 2:
        raise ValueError(f"bidirectional needs an even number of units, got D = {D}")
    return B, L, k, D


def _mask_arg(mask_pad: Optional[Tensor], like: Tensor) -> Tensor:
    if mask_pad is None:
        return like  # dummy pointer, never read
    m = mask_pad if mask_pad.dtype == torch.bool else mask_pad != 0
    return m.view(torch.uint8)  # same strides, no copy


def _device_guard(t: Tensor):
    """Launch on the tensors' GPU, not whatever device happens to be current."""
    if t.is_cuda:
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def sru_fwd_triton(
    U: Tensor,
    x: Optional[Tensor],
    weight_c: Tensor,
    bias: Tensor,
    c0: Optional[Tensor],
    mask_pad: Optional[Tensor],
    dropout_mask: Optional[Tensor],
    scale_x: float,
    bidirectional: bool,
    store_c: bool,
    *,
    block_size: Optional[int] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Forward recurrence.  Returns ``(h, c_last, c_all)``.

    h (B, L, D) in U's dtype; c_last (B, D) fp32 ([c_fwd(L-1), c_bwd(0)] when
    bidirectional); c_all (B, L, D) fp32, the state after every step, when
    ``store_c`` (else an empty tensor).
    """
    B, L, k, D = _check(U, x, bidirectional)
    dev = U.device
    if c0 is None:
        c0 = torch.zeros(B, D, dtype=torch.float32, device=dev)
    else:
        c0 = c0.to(torch.float32)
    h = _alloc((B, L, D), U.dtype, dev)
    c_last = _alloc((B, D), torch.float32, dev)
    c_all = _alloc((B, L, D), torch.float32, dev) if store_c else torch.empty(0, device=dev)
    if B == 0 or D == 0:
        return h, c_last, c_all
    if L == 0:
        c_last.copy_(c0)
        return h, c_last, c_all

    has_skip = k == 4 or x is not None
    x_ = x if x is not None else U
    xs = x.stride() if x is not None else (0, 0, 0)
    mp = _mask_arg(mask_pad, U)
    ms = mp.stride() if mask_pad is not None else (0, 0)
    dm = dropout_mask if dropout_mask is not None else U
    ds = dropout_mask.stride() if dropout_mask is not None else (0, 0)
    cs = c_all.stride() if store_c else (0, 0, 0)
    BLOCK, num_warps = _launch_config(B, D, block_size)
    grid = (B, triton.cdiv(D, BLOCK))
    with _device_guard(U):
        _sru_fwd_kernel[grid](
            U, x_, weight_c, bias, c0, mp, dm,
            h, c_last, c_all if store_c else h,
            L, D, D // 2, float(scale_x),
            *U.stride(),
            *xs,
            *weight_c.stride(), *bias.stride(),
            *c0.stride(),
            *ms,
            *ds,
            *h.stride(),
            *cs,
            K4=k == 4, HAS_SKIP=has_skip, HAS_MASK=mask_pad is not None,
            HAS_DROP=dropout_mask is not None, BIDIR=bool(bidirectional), STORE_C=bool(store_c),
            BLOCK=BLOCK, num_warps=num_warps,
        )
    return h, c_last, c_all


def sru_bwd_triton(
    grad_h: Optional[Tensor],
    grad_c_last: Optional[Tensor],
    U: Tensor,
    x: Optional[Tensor],
    weight_c: Tensor,
    bias: Tensor,
    c0: Optional[Tensor],
    c_all: Optional[Tensor],
    mask_pad: Optional[Tensor],
    dropout_mask: Optional[Tensor],
    scale_x: float,
    bidirectional: bool,
    *,
    need_grad_x: bool = True,
    block_size: Optional[int] = None,
) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor, Tensor]:
    """Backward recurrence.

    ``c_all`` is the fp32 (B, L, D) state from :func:`sru_fwd_triton` with
    ``store_c=True``; if it is None or empty the forward is re-run to get it.
    ``grad_h`` / ``grad_c_last`` may be None (zero).

    Returns ``(grad_U, grad_x or None, grad_weight_c, grad_bias, grad_c0)``:
    grad_U (B, L, k, D) in U's dtype, grad_x (B, L, D) in x's dtype (None when
    x is None or ``need_grad_x`` is False), grad_weight_c / grad_bias (2, D) in weight_c's / bias's dtype,
    grad_c0 (B, D) fp32.
    """
    B, L, k, D = _check(U, x, bidirectional)
    dev = U.device
    if c0 is None:
        c0 = torch.zeros(B, D, dtype=torch.float32, device=dev)
    else:
        c0 = c0.to(torch.float32)
    if c_all is None or c_all.numel() == 0:
        _, _, c_all = sru_fwd_triton(U, x, weight_c, bias, c0, mask_pad, dropout_mask,
                                     scale_x, bidirectional, True, block_size=block_size)
    elif c_all.dtype != torch.float32 or tuple(c_all.shape) != (B, L, D):
        raise ValueError("c_all must be the fp32 (B, L, D) state from sru_fwd_triton")

    grad_U = _alloc((B, L, k, D), U.dtype, dev)
    store_gx = x is not None and bool(need_grad_x)
    grad_x = _alloc((B, L, D), x.dtype, dev) if store_gx else None
    grad_c0 = _alloc((B, D), torch.float32, dev)
    partial = _alloc((B, 4, D), torch.float32, dev)
    if B == 0 or D == 0 or L == 0:
        grad_U.zero_()
        if grad_x is not None:
            grad_x.zero_()
        if grad_c_last is None:
            grad_c0.zero_()
        else:
            grad_c0.copy_(grad_c_last)
        partial.zero_()
    else:
        if grad_h is None:
            grad_h = torch.zeros((), dtype=U.dtype, device=dev).expand(B, L, D)
        has_gcl = grad_c_last is not None
        gcl = grad_c_last if has_gcl else c0
        gcs = grad_c_last.stride() if has_gcl else (0, 0)
        has_skip = k == 4 or x is not None
        x_ = x if x is not None else U
        xs = x.stride() if x is not None else (0, 0, 0)
        gx = grad_x if grad_x is not None else grad_U
        gxs = grad_x.stride() if grad_x is not None else (0, 0, 0)
        mp = _mask_arg(mask_pad, U)
        ms = mp.stride() if mask_pad is not None else (0, 0)
        dm = dropout_mask if dropout_mask is not None else U
        ds = dropout_mask.stride() if dropout_mask is not None else (0, 0)
        BLOCK, num_warps = _launch_config(B, D, block_size)
        grid = (B, triton.cdiv(D, BLOCK))
        with _device_guard(U):
            _sru_bwd_kernel[grid](
                grad_h, gcl, U, x_, weight_c, bias, c0, c_all, mp, dm,
                grad_U, gx, grad_c0, partial,
                L, D, D // 2, float(scale_x),
                *grad_h.stride(),
                *gcs,
                *U.stride(),
                *xs,
                *weight_c.stride(), *bias.stride(),
                *c0.stride(),
                *c_all.stride(),
                *ms,
                *ds,
                *grad_U.stride(),
                *gxs,
                K4=k == 4, HAS_SKIP=has_skip, STORE_GX=store_gx, HAS_MASK=mask_pad is not None,
                HAS_DROP=dropout_mask is not None, BIDIR=bool(bidirectional), HAS_GCL=has_gcl,
                BLOCK=BLOCK, num_warps=num_warps,
            )
    # Deterministic reduction over the batch; two separate sums so the two
    # results are fresh tensors that do not alias each other.
    grad_weight_c = partial[:, 0:2].sum(dim=0).to(weight_c.dtype)
    grad_bias = partial[:, 2:4].sum(dim=0).to(bias.dtype)
    return grad_U, grad_x, grad_weight_c, grad_bias, grad_c0


def sru_bwd_triton_op(
    U: Tensor,
    x: Optional[Tensor],
    weight_c: Tensor,
    bias: Tensor,
    c0: Optional[Tensor],
    mask_pad: Optional[Tensor],
    dropout_mask: Optional[Tensor],
    c_all: Tensor,
    grad_h: Tensor,
    grad_c_last: Optional[Tensor],
    scale_x: float,
    bidirectional: bool,
    need_grad_x: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`sru_bwd_triton` in the argument order of the ``srupp::sru_bwd``
    custom op (``srupp.ops.custom_ops``), returning an empty tensor (x's dtype,
    or U's when x is None) instead of None for grad_x, since custom ops can't
    return None."""
    gU, gx, gwc, gb, gc0 = sru_bwd_triton(
        grad_h, None if grad_c_last is None else grad_c_last.to(torch.float32),
        U, x, weight_c, bias, c0, c_all, mask_pad, dropout_mask, scale_x, bidirectional,
        need_grad_x=need_grad_x)
    if gx is None:
        gx = (x if x is not None else U).new_empty((0,))
    return gU, gx, gwc, gb, gc0


class SRURecurrenceTriton(torch.autograd.Function):
    """Autograd wrapper.  ``apply(U, x, weight_c, bias, c0, mask_pad,
    dropout_mask, scale_x, bidirectional, block_size)`` -> (h, c_last)."""

    @staticmethod
    def forward(ctx, U, x, weight_c, bias, c0, mask_pad, dropout_mask, scale_x,
                bidirectional, block_size=None):
        need_grad = any(ctx.needs_input_grad[:5])
        h, c_last, c_all = sru_fwd_triton(U, x, weight_c, bias, c0, mask_pad, dropout_mask,
                                          scale_x, bidirectional, need_grad,
                                          block_size=block_size)
        ctx.save_for_backward(U, x, weight_c, bias, c0, c_all, mask_pad, dropout_mask)
        ctx.scale_x = float(scale_x)
        ctx.bidirectional = bool(bidirectional)
        ctx.block_size = block_size
        return h, c_last

    @staticmethod
    def backward(ctx, grad_h, grad_c_last):
        U, x, weight_c, bias, c0, c_all, mask_pad, dropout_mask = ctx.saved_tensors
        gU, gx, gwc, gb, gc0 = sru_bwd_triton(
            grad_h, None if grad_c_last is None else grad_c_last.to(torch.float32),
            U, x, weight_c, bias, c0, c_all, mask_pad, dropout_mask,
            ctx.scale_x, ctx.bidirectional, need_grad_x=ctx.needs_input_grad[1],
            block_size=ctx.block_size,
        )
        if c0 is not None:
            gc0 = gc0.to(c0.dtype)
        else:
            gc0 = None
        return gU, gx, gwc, gb, gc0, None, None, None, None, None


def sru_recurrence_triton(
    U: Tensor,
    x: Optional[Tensor],
    weight_c: Tensor,
    bias: Tensor,
    c0: Optional[Tensor] = None,
    *,
    scale_x: float = 1.0,
    mask_pad: Optional[Tensor] = None,
    dropout_mask: Optional[Tensor] = None,
    bidirectional: bool = False,
    block_size: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """Same arguments and results as :func:`sru_recurrence_reference`, run by
    the Triton kernels (fp32/bf16/fp16 U; c_last is fp32).  ``block_size``
    (a power of two) overrides the unit-block size, for tests."""
    if mask_pad is not None:
        mask_pad = mask_pad.to(torch.bool)
    return SRURecurrenceTriton.apply(U, x, weight_c, bias, c0, mask_pad, dropout_mask,
                                     scale_x, bidirectional, block_size)
