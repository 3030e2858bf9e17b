"""Triton kernels for the SRU element-wise recurrence (forward and backward).

The equations are those of :mod:`srupp.ops.reference` (the SRU paper's, Lei et
al. 2018, section 2), and so are the argument conventions:

    U            (B, L, k, D)  k = 3 or 4; any strides
    x            (B, L, D)     skip input (k = 3 only) or None; any strides
    weight_c     (2, D)        [v_f; v_r]
    bias         (2, D)        [b_f; b_r]
    c0           (B, D)        initial state (read as fp32)
    mask_pad     (B, L) bool   True = padding: state held, h = 0, no gradient
    dropout_mask (B, D)        variational highway mask, shared over time

:func:`sru_fwd` and :func:`sru_bwd` take the arguments of the ``srupp::sru_fwd``
/ ``srupp::sru_bwd`` custom ops (:mod:`srupp.ops.recurrence`), which call them;
they don't check them (:func:`srupp.ops.sru_recurrence` does).

Work split: one program per (batch row, block of :data:`BLOCK_SIZE` units),
looping over time.  With ``bidirectional`` each lane picks its own direction
from its unit index (units >= D/2 run t = L-1 .. 0), so a block may straddle the
two halves.  State and all accumulation are fp32 whatever the input dtype; h
and grad_U are written in U's dtype.

The peephole/bias gradients are reduced deterministically: every program
writes its per-batch-row partial sums into a (B, 4, D) fp32 buffer, which is
then summed over B with torch (no atomics).

This module imports triton at its top; nothing in :mod:`srupp` imports it at
package import time (the dispatcher imports it lazily, when it routes to Triton).
Under the Triton interpreter (``TRITON_INTERPRET=1``) the kernels run on CPU
tensors.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .settings import debug_nan_fill

__all__ = ["sru_fwd", "sru_bwd", "BLOCK_SIZE"]

#: Units per program (a power of two); None picks by size. The tests set small
#: blocks, so that D is not a multiple of the block and blocks straddle directions.
BLOCK_SIZE: Optional[int] = None


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
            gate = r
            if HAS_DROP:
                gate = m * r
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

        gm, mr = gh, r
        if HAS_DROP:
            gm = gh * m
            mr = m * r
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
    if debug_nan_fill():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _launch_config(B: int, D: int) -> Tuple[int, int]:
    """(BLOCK, num_warps).  One lane per unit; small blocks keep many programs
    in flight when B * D is small (each program is sequential over time)."""
    if BLOCK_SIZE is not None:
        return BLOCK_SIZE, max(1, min(4, BLOCK_SIZE // 32))
    if B * D >= 1 << 16:
        return 64, 2
    return 32, 1


def _optional(t: Optional[Tensor], like: Tensor, dims: int):
    """(pointer, strides) for an optional tensor: a dummy pointer and zero strides
    for None (the kernel never reads it then). bool tensors go as uint8."""
    if t is None:
        return like, (0,) * dims
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)  # same strides, no copy
    return t, t.stride()


def _c0(c0: Optional[Tensor], B: int, D: int, device) -> Tensor:
    if c0 is None:
        return torch.zeros(B, D, dtype=torch.float32, device=device)
    return c0.to(torch.float32)


def sru_fwd(U: Tensor, x: Optional[Tensor], weight_c: Tensor, bias: Tensor,
            c0: Optional[Tensor], mask_pad: Optional[Tensor], dropout_mask: Optional[Tensor],
            scale_x: float, bidirectional: bool, store_c: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """Forward recurrence.  Returns ``(h, c_last, c_all)``.

    h (B, L, D) in U's dtype; c_last (B, D) fp32 ([c_fwd(L-1), c_bwd(0)] when
    bidirectional); c_all (B, L, D) fp32, the state after every step, when
    ``store_c`` (else an empty tensor).
    """
    B, L, k, D = U.shape
    dev = U.device
    c0 = _c0(c0, B, D, dev)
    h = _alloc((B, L, D), U.dtype, dev)
    c_last = _alloc((B, D), torch.float32, dev)
    c_all = _alloc((B, L, D), torch.float32, dev) if store_c else torch.empty(0, device=dev)
    if B == 0 or D == 0 or L == 0:
        c_last.copy_(c0)  # (a no-op when B or D is 0)
        return h, c_last, c_all

    x_, xs = _optional(x, U, 3)
    mp, ms = _optional(mask_pad, U, 2)
    dm, ds = _optional(dropout_mask, U, 2)
    BLOCK, num_warps = _launch_config(B, D)
    with torch.cuda.device_of(U):  # U's GPU, not the current one
        _sru_fwd_kernel[(B, triton.cdiv(D, BLOCK))](
            U, x_, weight_c, bias, c0, mp, dm,
            h, c_last, c_all if store_c else h,
            L, D, D // 2, float(scale_x),
            *U.stride(), *xs, *weight_c.stride(), *bias.stride(), *c0.stride(), *ms, *ds,
            *h.stride(), *(c_all.stride() if store_c else (0, 0, 0)),
            K4=k == 4, HAS_SKIP=k == 4 or x is not None, HAS_MASK=mask_pad is not None,
            HAS_DROP=dropout_mask is not None, BIDIR=bool(bidirectional), STORE_C=bool(store_c),
            BLOCK=BLOCK, num_warps=num_warps,
        )
    return h, c_last, c_all


def sru_bwd(U: Tensor, x: Optional[Tensor], weight_c: Tensor, bias: Tensor,
            c0: Optional[Tensor], mask_pad: Optional[Tensor], dropout_mask: Optional[Tensor],
            c_all: Tensor, grad_h: Tensor, grad_c_last: Optional[Tensor], scale_x: float,
            bidirectional: bool, need_grad_x: bool
            ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward recurrence, from ``c_all``, the fp32 (B, L, D) state that
    :func:`sru_fwd` stored (``store_c=True``).

    Returns ``(grad_U, grad_x, grad_weight_c, grad_bias, grad_c0)``: grad_U
    (B, L, k, D) in U's dtype, grad_x (B, L, D) in x's dtype (an empty tensor when x
    is None or ``need_grad_x`` is False), grad_weight_c / grad_bias (2, D) in
    weight_c's / bias's dtype, grad_c0 (B, D) fp32.
    """
    B, L, k, D = U.shape
    dev = U.device
    c0 = _c0(c0, B, D, dev)
    grad_U = _alloc((B, L, k, D), U.dtype, dev)
    store_gx = x is not None and bool(need_grad_x)
    grad_x = (_alloc((B, L, D), x.dtype, dev) if store_gx
              else (x if x is not None else U).new_empty((0,)))
    grad_c0 = _alloc((B, D), torch.float32, dev)
    partial = _alloc((B, 4, D), torch.float32, dev)
    if B == 0 or D == 0 or L == 0:  # (grad_U and grad_x have no elements then)
        grad_c0.copy_(torch.zeros(()) if grad_c_last is None else grad_c_last)
        partial.zero_()
    else:
        gcl, gcs = _optional(None if grad_c_last is None else grad_c_last.to(torch.float32),
                             c0, 2)
        x_, xs = _optional(x, U, 3)
        gx, gxs = _optional(grad_x if store_gx else None, grad_U, 3)
        mp, ms = _optional(mask_pad, U, 2)
        dm, ds = _optional(dropout_mask, U, 2)
        BLOCK, num_warps = _launch_config(B, D)
        with torch.cuda.device_of(U):
            _sru_bwd_kernel[(B, triton.cdiv(D, BLOCK))](
                grad_h, gcl, U, x_, weight_c, bias, c0, c_all, mp, dm,
                grad_U, gx, grad_c0, partial,
                L, D, D // 2, float(scale_x),
                *grad_h.stride(), *gcs, *U.stride(), *xs,
                *weight_c.stride(), *bias.stride(), *c0.stride(), *c_all.stride(),
                *ms, *ds, *grad_U.stride(), *gxs,
                K4=k == 4, HAS_SKIP=k == 4 or x is not None, STORE_GX=store_gx,
                HAS_MASK=mask_pad is not None, HAS_DROP=dropout_mask is not None,
                BIDIR=bool(bidirectional), HAS_GCL=grad_c_last is not None,
                BLOCK=BLOCK, num_warps=num_warps,
            )
    # Deterministic reduction over the batch; two separate sums so the two
    # results are fresh tensors that do not alias each other.
    grad_weight_c = partial[:, 0:2].sum(dim=0).to(weight_c.dtype)
    grad_bias = partial[:, 2:4].sum(dim=0).to(bias.dtype)
    return grad_U, grad_x, grad_weight_c, grad_bias, grad_c0
