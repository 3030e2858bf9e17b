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

Work split: one program per (batch row, block of units: :func:`_launch_config`),
looping over time.  With ``bidirectional`` each lane picks its own direction
from its unit index (units >= D/2 run t = L-1 .. 0), so a block may straddle the
two halves.  State and all accumulation are fp32 whatever the input dtype; h
and grad_U are written in U's dtype.

How a program walks time is a launch configuration (:class:`LaunchConfig`: units and
warps a program, Triton's software pipelining, explicit blocks of time steps; the
comment above the kernels says how each works); all of them compute the same
results to the last bit. :data:`SWEEP_CONFIGS` lists those a GPU should time before
one becomes the default. The settings object ``srupp.ops.settings.tuning()`` holds the
launch's knobs (``triton_block``, ``triton_warps``, ``triton_stages``, ``triton_steps``;
all None by default: the size picks the block, no pipelining, no blocks of steps), and
:func:`use_launch_config` sets all four for a ``with`` block.

The peephole/bias gradients are reduced deterministically: every program
writes its per-batch-row partial sums into a (B, 4, D) fp32 buffer, which is
then summed over B with torch (no atomics).

Triton compiles a variant of a kernel per combination of constexprs and pointer
dtypes; the host functions decide which (:func:`_launch_config`,
:func:`_fwd_constexprs`, :func:`_bwd_constexprs`, and :func:`_param_dtype` /
:func:`_x_dtype`, which keep the dtype combinations to those the layers produce).
:mod:`srupp.ops.triton_compile` lists every variant from those functions and
compiles them ahead of time for real GPUs, without one.

This module imports triton at its top; nothing in :mod:`srupp` imports it at
package import time (the dispatcher imports it lazily, when it routes to Triton).
Importing it compiles nothing.  Under the Triton interpreter (``TRITON_INTERPRET=1``)
the kernels run on CPU tensors.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .settings import debug_nan_fill, tuning

__all__ = ["sru_fwd", "sru_bwd", "use_launch_config", "LaunchConfig", "SWEEP_CONFIGS",
           "Launch"]


# --------------------------------------------------------------------------- #
# kernels
# --------------------------------------------------------------------------- #


# Both kernels walk time in one of two ways, chosen by the STEPS constexpr:
#
# * STEPS None, the plain loop: each iteration loads one step's inputs and updates the
#   state with them.  No load can move above the previous step's stores (the compiler
#   can't know that outputs and inputs never overlap), so every step waits for a DRAM
#   round trip.
# * STEPS = K, explicit blocks of K steps: each iteration issues the loads of K steps
#   (in the PTX) before the first of their K dependent updates, so that a program
#   waits for about one round trip per block rather than per step.  (ptxas then moves
#   most of a block's loads down among the first updates, a few instructions ahead of
#   their use: the compiled kernels' SASS shows how many it leaves in flight,
#   triton_compile.loop_loads().)  The L % K steps left over run the plain loop.
#
# STAGES = S software-pipelines the loop (the plain one or the one over blocks) with
# Triton's pipeliner (tl.range): the loads of the next S-1 iterations are copied ahead
# asynchronously into shared memory (cp.async, which moves 4 bytes or more a thread:
# fp32, or 2 units a thread in half precision; smaller loads stay as they are).
#
# Every variant does the same arithmetic on the same values in the same order (in
# _fwd_update / _bwd_update): only where the loads sit differs, so all variants agree
# to the last bit.


@triton.jit
def _lane_step(s, L, rev, BIDIR: tl.constexpr):
    """The time step each lane is at in its s-th forward step: s, or L-1-s on the
    reversed half of a bidirectional layer."""
    if BIDIR:
        t = tl.where(rev, L - 1 - s, s).to(tl.int64)
    else:
        t = (s + tl.zeros((), tl.int64)).to(tl.int64)
    return t


@triton.jit
def _lanes(WC_ptr, BIAS_ptr, C0_ptr, DM_ptr, D, d_half, sWr, sWd, sBr, sBd, sC0b, sC0d,
           sDb, sDd, HAS_DROP: tl.constexpr, BLOCK: tl.constexpr):
    """This program's lanes and what each holds for the whole walk: its batch row b, its
    units j (int64), the masks of the units that exist (j < D) and of those in the backward
    direction (used only when BIDIR); then, in fp32, v_f, v_r, b_f, b_r, c0 and the
    dropout mask (without dropout a placeholder, never used)."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    jm = j < D
    j = j.to(tl.int64)
    vf = tl.load(WC_ptr + j * sWd, mask=jm, other=0.0).to(tl.float32)
    vr = tl.load(WC_ptr + sWr + j * sWd, mask=jm, other=0.0).to(tl.float32)
    bf = tl.load(BIAS_ptr + j * sBd, mask=jm, other=0.0).to(tl.float32)
    br = tl.load(BIAS_ptr + sBr + j * sBd, mask=jm, other=0.0).to(tl.float32)
    c0 = tl.load(C0_ptr + b * sC0b + j * sC0d, mask=jm, other=0.0).to(tl.float32)
    m = vf
    if HAS_DROP:
        m = tl.load(DM_ptr + b * sDb + j * sDd, mask=jm, other=0.0).to(tl.float32)
    return b, j, jm, j >= d_half, vf, vr, bf, br, c0, m


@triton.jit
def _load_step(t, u_row, x_row, m_row, jm, sUl, sUk, sXl, sMl,
               K4: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_MASK: tl.constexpr,
               BIDIR: tl.constexpr):
    """Step t's inputs as stored (converted when used): u0, u1, u2, the skip input (u3
    or x) and the padding byte (the last two are placeholders, never used, without a
    skip term / a mask)."""
    pu = u_row + t * sUl
    u0 = tl.load(pu, mask=jm, other=0.0)
    u1 = tl.load(pu + sUk, mask=jm, other=0.0)
    u2 = tl.load(pu + 2 * sUk, mask=jm, other=0.0)
    sk = u0
    if HAS_SKIP:
        if K4:
            sk = tl.load(pu + 3 * sUk, mask=jm, other=0.0)
        else:
            sk = tl.load(x_row + t * sXl, mask=jm, other=0.0)
    pad = u0
    if HAS_MASK:
        if BIDIR:  # the two halves are at different steps
            pad = tl.load(m_row + t * sMl, mask=jm, other=0)
        else:
            pad = tl.load(m_row + t * sMl)
    return u0, u1, u2, sk, pad


@triton.jit
def _fwd_load_block(s0, L, rev, u_row, x_row, m_row, jm, sUl, sUk, sXl, sMl,
                    K4: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_MASK: tl.constexpr,
                    BIDIR: tl.constexpr, STEPS: tl.constexpr):
    """The inputs of forward steps s0 .. s0+STEPS-1 as stored, one tuple a step."""
    block = ()
    for i in tl.static_range(STEPS):
        block = block + (_load_step(_lane_step(s0 + i, L, rev, BIDIR), u_row, x_row, m_row,
                                    jm, sUl, sUk, sXl, sMl, K4, HAS_SKIP, HAS_MASK, BIDIR),)
    return block


@triton.jit
def _fwd_update(c, t, u0, u1, u2, sk, pad, vf, vr, bf, br, m, scale_x, h_row, c_row, jm,
                sHl, sCl, K4: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_MASK: tl.constexpr,
                HAS_DROP: tl.constexpr, STORE_C: tl.constexpr):
    """One forward step from state c on step t's raw inputs: stores h_t (and c_t),
    returns c_t."""
    u0 = u0.to(tl.float32)
    f = tl.sigmoid(u1.to(tl.float32) + vf * c + bf)
    r = tl.sigmoid(u2.to(tl.float32) + vr * c + br)
    c_new = f * c + (1.0 - f) * u0
    if HAS_SKIP:
        sk = sk.to(tl.float32)
        if not K4:
            sk = sk * scale_x
        gate = r
        if HAS_DROP:
            gate = m * r
        h = sk + gate * (c_new - sk)
    else:
        h = r * c_new
        if HAS_DROP:
            h = m * h
    if HAS_MASK:
        pad = pad != 0
        c_new = tl.where(pad, c, c_new)
        h = tl.where(pad, 0.0, h)
    tl.store(h_row + t * sHl, h.to(h_row.dtype.element_ty), mask=jm)
    if STORE_C:
        tl.store(c_row + t * sCl, c_new, mask=jm)
    return c_new


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
    BLOCK: tl.constexpr, STAGES: tl.constexpr, STEPS: tl.constexpr,
):
    b, j, jm, rev, vf, vr, bf, br, c, m = _lanes(
        WC_ptr, BIAS_ptr, C0_ptr, DM_ptr, D, d_half, sWr, sWd, sBr, sBd, sC0b, sC0d, sDb, sDd,
        HAS_DROP, BLOCK)

    u_row = U_ptr + b * sUb + j * sUd
    x_row = X_ptr + b * sXb + j * sXd
    m_row = MP_ptr + b * sMb
    h_row = H_ptr + b * sHb + j * sHd
    c_row = CALL_ptr + b * sCb + j * sCd
    s_tail = 0
    if STEPS is not None:
        s_tail = L // STEPS * STEPS
        for s0 in tl.range(0, s_tail, STEPS, num_stages=STAGES):
            block = _fwd_load_block(s0, L, rev, u_row, x_row, m_row, jm, sUl, sUk, sXl, sMl,
                                    K4, HAS_SKIP, HAS_MASK, BIDIR, STEPS)
            for i in tl.static_range(STEPS):
                u0, u1, u2, sk, pad = block[i]
                c = _fwd_update(c, _lane_step(s0 + i, L, rev, BIDIR), u0, u1, u2, sk, pad,
                                vf, vr, bf, br, m, scale_x, h_row, c_row, jm, sHl, sCl,
                                K4, HAS_SKIP, HAS_MASK, HAS_DROP, STORE_C)
    for s in tl.range(s_tail, L, num_stages=STAGES if STEPS is None else None):
        t = _lane_step(s, L, rev, BIDIR)
        u0, u1, u2, sk, pad = _load_step(t, u_row, x_row, m_row, jm, sUl, sUk, sXl, sMl,
                                         K4, HAS_SKIP, HAS_MASK, BIDIR)
        c = _fwd_update(c, t, u0, u1, u2, sk, pad, vf, vr, bf, br, m, scale_x, h_row, c_row,
                        jm, sHl, sCl, K4, HAS_SKIP, HAS_MASK, HAS_DROP, STORE_C)
    tl.store(CLAST_ptr + b * D + j, c, mask=jm)


@triton.jit
def _bwd_load_step(s, L, rev, c_row, g_row, u_row, x_row, m_row, jm, sCl, sGl, sUl, sUk,
                   sXl, sMl, K4: tl.constexpr, HAS_SKIP: tl.constexpr,
                   HAS_MASK: tl.constexpr, BIDIR: tl.constexpr):
    """The inputs (as stored) of the backward's s-th step, which visits each lane's forward
    steps in reverse (forward lanes t = L-1-s, reversed lanes t = s): c_{t-1} in the
    lane's own direction (unused, and not loaded, at s = L-1, where it is c0), grad_h_t
    and step t's forward inputs."""
    t = _lane_step(L - 1 - s, L, rev, BIDIR)
    if BIDIR:
        tp = tl.where(rev, t + 1, t - 1)
    else:
        tp = t - 1
    c_prev = tl.load(c_row + tp * sCl, mask=jm & (s < L - 1), other=0.0)
    gh = tl.load(g_row + t * sGl, mask=jm, other=0.0)
    u0, u1, u2, sk, pad = _load_step(t, u_row, x_row, m_row, jm, sUl, sUk, sXl, sMl,
                                     K4, HAS_SKIP, HAS_MASK, BIDIR)
    return c_prev, gh, u0, u1, u2, sk, pad


@triton.jit
def _bwd_load_block(s0, L, rev, c_row, g_row, u_row, x_row, m_row, jm, sCl, sGl, sUl, sUk,
                    sXl, sMl, K4: tl.constexpr, HAS_SKIP: tl.constexpr,
                    HAS_MASK: tl.constexpr, BIDIR: tl.constexpr, STEPS: tl.constexpr):
    """The inputs of backward steps s0 .. s0+STEPS-1 as stored, one tuple a step."""
    block = ()
    for i in tl.static_range(STEPS):
        block = block + (_bwd_load_step(s0 + i, L, rev, c_row, g_row,
                                        u_row, x_row, m_row, jm, sCl, sGl, sUl, sUk, sXl,
                                        sMl, K4, HAS_SKIP, HAS_MASK, BIDIR),)
    return block


@triton.jit
def _bwd_update(carry, c_cur, s, L, rev, c0, c_prev, gh, u0, u1, u2, sk, pad,
                vf, vr, bf, br, m, scale_x, gu_row, gx_row, jm, sGUl, sGUk, sGXl,
                K4: tl.constexpr, HAS_SKIP: tl.constexpr, STORE_GX: tl.constexpr,
                HAS_MASK: tl.constexpr, HAS_DROP: tl.constexpr, BIDIR: tl.constexpr):
    """The backward's s-th step on its raw inputs, c_cur being c_t: stores grad_U_t (and
    grad_x_t); returns the new carry (the loss's gradient by c_{t-1}), c_{t-1}, and
    the step's gradients by the gate pre-activations, gf and gr."""
    t = _lane_step(L - 1 - s, L, rev, BIDIR)
    c_prev = tl.where(s < L - 1, c_prev.to(tl.float32), c0)
    u0 = u0.to(tl.float32)
    gh = gh.to(tl.float32)
    f = tl.sigmoid(u1.to(tl.float32) + vf * c_prev + bf)
    r = tl.sigmoid(u2.to(tl.float32) + vr * c_prev + br)
    gm, mr = gh, r
    if HAS_DROP:
        gm = gh * m
        mr = m * r
    if HAS_SKIP:
        sk = sk.to(tl.float32)
        if not K4:
            sk = sk * scale_x
        diff = c_cur - sk
    else:
        diff = c_cur
    gr = gm * diff * (r * (1.0 - r))
    gc = gm * r + carry
    gf = gc * (c_prev - u0) * (f * (1.0 - f))
    new_carry = gc * f + gf * vf + gr * vr
    du0 = gc * (1.0 - f)
    gs = gh * (1.0 - mr)  # (used only with a skip term)
    if HAS_MASK:
        # Padding: state held (the carry passes straight through), h = 0.
        pad = pad != 0
        new_carry = tl.where(pad, carry, new_carry)
        du0 = tl.where(pad, 0.0, du0)
        gf = tl.where(pad, 0.0, gf)
        gr = tl.where(pad, 0.0, gr)
        gs = tl.where(pad, 0.0, gs)
    pg = gu_row + t * sGUl
    gty = gu_row.dtype.element_ty
    tl.store(pg, du0.to(gty), mask=jm)
    tl.store(pg + sGUk, gf.to(gty), mask=jm)
    tl.store(pg + 2 * sGUk, gr.to(gty), mask=jm)
    if HAS_SKIP:
        if K4:
            tl.store(pg + 3 * sGUk, gs.to(gty), mask=jm)
        elif STORE_GX:
            tl.store(gx_row + t * sGXl, (gs * scale_x).to(gx_row.dtype.element_ty), mask=jm)
    return new_carry, c_prev, gf, gr


@triton.jit
def _add_param_grads(dvf, dvr, dbf, dbr, gf, gr, c_prev):
    """The peephole and bias gradients with one more step's terms: gf and gr are the step's
    gradients by the gate pre-activations, c_prev its c_{t-1}."""
    return dvf + gf * c_prev, dvr + gr * c_prev, dbf + gf, dbr + gr


@triton.jit
def _store_param_grads(row, D, jm, dvf, dvr, dbf, dbr):
    """A batch row's partial sums of the four (D,) gradients, at row + 0, D, 2D, 3D (the
    host sums them over the batch: no atomics, the same result every run)."""
    tl.store(row, dvf, mask=jm)
    tl.store(row + D, dvr, mask=jm)
    tl.store(row + 2 * D, dbf, mask=jm)
    tl.store(row + 3 * D, dbr, mask=jm)


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
    BLOCK: tl.constexpr, STAGES: tl.constexpr, STEPS: tl.constexpr,
):
    b, j, jm, rev, vf, vr, bf, br, c0, m = _lanes(
        WC_ptr, BIAS_ptr, C0_ptr, DM_ptr, D, d_half, sWr, sWd, sBr, sBd, sC0b, sC0d, sDb, sDd,
        HAS_DROP, BLOCK)
    if HAS_GCL:
        carry = tl.load(GCL_ptr + b * sGCb + j * sGCd, mask=jm, other=0.0).to(tl.float32)
    else:
        carry = tl.zeros((BLOCK,), tl.float32)

    dvf = tl.zeros((BLOCK,), tl.float32)
    dvr = tl.zeros((BLOCK,), tl.float32)
    dbf = tl.zeros((BLOCK,), tl.float32)
    dbr = tl.zeros((BLOCK,), tl.float32)

    u_row = U_ptr + b * sUb + j * sUd
    x_row = X_ptr + b * sXb + j * sXd
    m_row = MP_ptr + b * sMb
    g_row = GH_ptr + b * sGb + j * sGd
    c_row = CALL_ptr + b * sCb + j * sCd
    gu_row = GU_ptr + b * sGUb + j * sGUd
    gx_row = GX_ptr + b * sGXb + j * sGXd

    # c_t of the step at hand: the state stored at each lane's last step first, then
    # each step's c_{t-1}
    c_cur = tl.load(c_row + _lane_step(L - 1, L, rev, BIDIR) * sCl, mask=jm,
                    other=0.0).to(tl.float32)
    s_tail = 0
    if STEPS is not None:
        s_tail = L // STEPS * STEPS
        for s0 in tl.range(0, s_tail, STEPS, num_stages=STAGES):
            block = _bwd_load_block(s0, L, rev, c_row, g_row, u_row, x_row, m_row, jm, sCl,
                                    sGl, sUl, sUk, sXl, sMl, K4, HAS_SKIP, HAS_MASK, BIDIR,
                                    STEPS)
            for i in tl.static_range(STEPS):
                c_prev, gh, u0, u1, u2, sk, pad = block[i]
                carry, c_cur, gf, gr = _bwd_update(
                    carry, c_cur, s0 + i, L, rev, c0, c_prev, gh, u0, u1, u2, sk, pad, vf, vr,
                    bf, br, m, scale_x, gu_row, gx_row, jm, sGUl, sGUk, sGXl,
                    K4, HAS_SKIP, STORE_GX, HAS_MASK, HAS_DROP, BIDIR)
                # (c_cur is now this step's c_{t-1})
                dvf, dvr, dbf, dbr = _add_param_grads(dvf, dvr, dbf, dbr, gf, gr, c_cur)
    for s in tl.range(s_tail, L, num_stages=STAGES if STEPS is None else None):
        c_prev, gh, u0, u1, u2, sk, pad = _bwd_load_step(s, L, rev, c_row, g_row, u_row, x_row,
                                                         m_row, jm, sCl, sGl, sUl, sUk, sXl,
                                                         sMl, K4, HAS_SKIP, HAS_MASK, BIDIR)
        carry, c_cur, gf, gr = _bwd_update(
            carry, c_cur, s, L, rev, c0, c_prev, gh, u0, u1, u2, sk, pad, vf, vr, bf, br, m,
            scale_x, gu_row, gx_row, jm, sGUl, sGUk, sGXl,
            K4, HAS_SKIP, STORE_GX, HAS_MASK, HAS_DROP, BIDIR)
        dvf, dvr, dbf, dbr = _add_param_grads(dvf, dvr, dbf, dbr, gf, gr, c_cur)

    tl.store(GC0_ptr + b * D + j, carry, mask=jm)
    _store_param_grads(PART_ptr + b * 4 * D + j, D, jm, dvf, dvr, dbf, dbr)


# --------------------------------------------------------------------------- #
# host side
# --------------------------------------------------------------------------- #

class LaunchConfig(NamedTuple):
    """How the kernels are launched: ``block`` units per program (a power of two, one
    lane each), ``num_warps`` warps per program, ``stages`` (software pipelining of the
    time loop, ``tuning().triton_stages``; None: off) and ``steps`` (explicit blocks of K
    time steps, ``tuning().triton_steps``; None: off)."""
    block: int
    num_warps: int
    stages: Optional[int] = None
    steps: Optional[int] = None

    @property
    def name(self) -> str:
        """e.g. ``64/2w``, ``128/4w/4s`` (4 pipeline stages), ``128/4w/k8`` (blocks of 8
        steps)."""
        return (f"{self.block}/{self.num_warps}w"
                + (f"/{self.stages}s" if self.stages is not None else "")
                + (f"/k{self.steps}" if self.steps is not None else ""))


def _config(config) -> LaunchConfig:
    """``config`` (a LaunchConfig or a tuple (block, num_warps[, stages[, steps]])) as a
    checked LaunchConfig."""
    if not isinstance(config, LaunchConfig):
        if not isinstance(config, (tuple, list)) or not 2 <= len(config) <= 4:
            raise TypeError(f"config must be a LaunchConfig or a tuple (block, num_warps"
                            f"[, stages[, steps]]), got {config!r}")
        config = LaunchConfig(*config)
    block, warps, stages, steps = config
    for what, v in (("block", block), ("num_warps", warps)):
        if not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"config: {what} must be a power of two, got {v!r}")
    for what, v in (("stages", stages), ("steps", steps)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"config: {what} must be None (off) or a positive integer, "
                             f"got {v!r}")
    return config


#: The launch configurations: (least B * D, BLOCK, num_warps), largest first.  One
#: lane per unit; small blocks keep many programs in flight when B * D is small
#: (each program is sequential over time).
_LAUNCH_CONFIGS = ((1 << 16, 64, 2), (0, 32, 1))


def use_launch_config(config):
    """Launch every call inside with ``config`` (a LaunchConfig or a tuple, as ``config=``
    takes), whatever the shape: how benchmarks/gpu_check.py trains a whole model on one
    of SWEEP_CONFIGS. Sets the four ``triton_*`` fields of ``tuning()`` for the ``with``
    block, then restores them."""
    block, num_warps, stages, steps = _config(config)
    return tuning().use(triton_block=block, triton_warps=num_warps, triton_stages=stages,
                        triton_steps=steps)


def _launch_config(B: int, D: int) -> LaunchConfig:
    """The launch configuration for a (B, ·, ·, D) problem, from the ``triton_*`` fields of
    ``tuning()``: the block and warps set there, else by size (:data:`_LAUNCH_CONFIGS`;
    a block set alone takes block // 32 warps, 1 to 4), and the stages and steps."""
    t = tuning()
    if t.triton_block is not None:
        block, num_warps = t.triton_block, max(1, min(4, t.triton_block // 32))
    else:
        block, num_warps = next((block, warps) for least, block, warps in _LAUNCH_CONFIGS
                                if B * D >= least)  # (the last takes every size)
    if t.triton_warps is not None:
        num_warps = t.triton_warps
    return LaunchConfig(block, num_warps, t.triton_stages, t.triton_steps)


#: The launch configurations a GPU should time (benchmarks/gpu_check.py) before one of
#: them becomes the default: ``sru_fwd(..., config=c)`` / ``sru_bwd(..., config=c)``
#: for each.  All compute the same results, to the last bit; all compile for sm_80 and
#: sm_90 without spilling (tests/ops/test_triton_compile.py).  In groups:
#: the plain loop at the two defaults and at 128 / 256 lanes a program (is the shape
#: of a program what matters?); Triton's pipelining of the step loop (asynchronous
#: copies 3 or 7 steps ahead; 128/2w has two units a thread, so that bf16 loads
#: are 4 bytes and copied asynchronously too); explicit blocks of 4, 8 and 12 steps
#: (one round trip per block); blocks of 8 pipelined one block ahead (fp32 at 128/4w,
#: fp32 and bf16 at 256/4w).  Blocks of 16 steps spill in the backward (bidirectional,
#: with padding and dropout), 255 registers on both archs.
SWEEP_CONFIGS: Tuple[LaunchConfig, ...] = (
    LaunchConfig(32, 1), LaunchConfig(64, 2), LaunchConfig(128, 4), LaunchConfig(256, 8),
    LaunchConfig(64, 2, stages=4), LaunchConfig(64, 2, stages=8),
    LaunchConfig(128, 2, stages=8),
    LaunchConfig(32, 1, steps=8), LaunchConfig(128, 4, steps=4), LaunchConfig(128, 4, steps=8),
    LaunchConfig(256, 8, steps=8), LaunchConfig(128, 4, steps=12),
    LaunchConfig(128, 4, stages=2, steps=8), LaunchConfig(256, 4, stages=2, steps=8),
)


# What the kernels read each input in.  Triton compiles one variant of a kernel per
# combination of pointer dtypes, so the host keeps those combinations to the ones the
# layers produce and reads anything else through an exact up-cast to fp32; that keeps
# the set of variants small enough to compile ahead of time (triton_compile.specializations()).

def _param_dtype(u: torch.dtype, weight_c: torch.dtype, bias: torch.dtype) -> torch.dtype:
    """weight_c's and bias's dtype as the kernels read them.  The layers pass either
    U's dtype (a half-precision module) or fp32 (an fp32 module, U fp32 or, under
    autocast, half); other mixes, which only direct callers make, are read as fp32
    (two (2, D) copies)."""
    if weight_c == bias and weight_c in (torch.float32, u):
        return weight_c
    return torch.float32


def _x_dtype(u: torch.dtype, x: torch.dtype) -> torch.dtype:
    """The skip input's dtype as the kernels read it: U's, or fp32 (under autocast the
    first layer's input stays fp32 while U is half); any other (a bf16 input under
    fp16 autocast) is read as fp32."""
    return x if x in (torch.float32, u) else torch.float32


# The dropout mask is read as fp32: the layers draw it in the state dtype, fp32.
_DROPOUT_DTYPE = torch.float32


def _fwd_constexprs(k: int, has_x: bool, has_mask: bool, has_drop: bool,
                    bidirectional: bool, store_c: bool) -> Dict[str, bool]:
    return dict(K4=k == 4, HAS_SKIP=k == 4 or has_x, HAS_MASK=has_mask, HAS_DROP=has_drop,
                BIDIR=bool(bidirectional), STORE_C=bool(store_c))


def _bwd_constexprs(k: int, has_x: bool, need_grad_x: bool, has_mask: bool, has_drop: bool,
                    bidirectional: bool, has_grad_c_last: bool) -> Dict[str, bool]:
    return dict(K4=k == 4, HAS_SKIP=k == 4 or has_x, STORE_GX=has_x and bool(need_grad_x),
                HAS_MASK=has_mask, HAS_DROP=has_drop, BIDIR=bool(bidirectional),
                HAS_GCL=has_grad_c_last)


class Launch(NamedTuple):
    """One kernel launch as the host functions make it."""
    kernel: Any                  # _sru_fwd_kernel or _sru_bwd_kernel
    grid: Tuple[int, int]
    args: tuple                  # the runtime arguments, in the kernel's order
    constexprs: Dict[str, Any]   # K4, HAS_SKIP, ..., BLOCK
    num_warps: int


def _run(launch: Launch) -> None:
    # args[0] (U or grad_h) is on the GPU to run on, which need not be the current one
    with torch.cuda.device_of(launch.args[0]):
        launch.kernel[launch.grid](*launch.args, **launch.constexprs,
                                   num_warps=launch.num_warps)


def _alloc(shape, dtype, device) -> Tensor:
    if debug_nan_fill():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


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


def _as(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    # (a no-op .to() still costs a dispatch, and decoding calls the kernel per token)
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _read_as(U: Tensor, x: Optional[Tensor], weight_c: Tensor, bias: Tensor,
             dropout_mask: Optional[Tensor]):
    """x, weight_c, bias and dropout_mask in the dtypes the kernels read them in
    (the tensors themselves, in the layers' combinations)."""
    p = _param_dtype(U.dtype, weight_c.dtype, bias.dtype)
    if x is not None:
        x = _as(x, _x_dtype(U.dtype, x.dtype))
    return x, _as(weight_c, p), _as(bias, p), _as(dropout_mask, _DROPOUT_DTYPE)


def _fwd_setup(U, x, weight_c, bias, c0, mask_pad, dropout_mask, scale_x, bidirectional,
               store_c, config):
    """The forward's outputs ``(h, c_last, c_all)`` and the launch that fills them
    (None when there is nothing to compute; the outputs are then final)."""
    B, L, k, D = U.shape
    dev = U.device
    c0 = _c0(c0, B, D, dev)
    h = _alloc((B, L, D), U.dtype, dev)
    c_last = _alloc((B, D), torch.float32, dev)
    c_all = _alloc((B, L, D), torch.float32, dev) if store_c else torch.empty(0, device=dev)
    if B == 0 or D == 0 or L == 0:
        c_last.copy_(c0)  # (a no-op when B or D is 0)
        return (h, c_last, c_all), None

    x, weight_c, bias, dropout_mask = _read_as(U, x, weight_c, bias, dropout_mask)
    x_, xs = _optional(x, U, 3)
    mp, ms = _optional(mask_pad, U, 2)
    dm, ds = _optional(dropout_mask, U, 2)
    BLOCK, num_warps, stages, steps = config
    launch = Launch(
        _sru_fwd_kernel, (B, triton.cdiv(D, BLOCK)),
        (U, x_, weight_c, bias, c0, mp, dm,
         h, c_last, c_all if store_c else h,
         L, D, D // 2, float(scale_x),
         *U.stride(), *xs, *weight_c.stride(), *bias.stride(), *c0.stride(), *ms, *ds,
         *h.stride(), *(c_all.stride() if store_c else (0, 0, 0))),
        dict(_fwd_constexprs(k, x is not None, mask_pad is not None, dropout_mask is not None,
                             bidirectional, store_c), BLOCK=BLOCK, STAGES=stages, STEPS=steps),
        num_warps)
    return (h, c_last, c_all), launch


def _bwd_setup(U, x, weight_c, bias, c0, mask_pad, dropout_mask, c_all, grad_h, grad_c_last,
               scale_x, bidirectional, need_grad_x, config):
    """The backward's buffers ``(grad_U, grad_x, grad_c0, partial)`` and the launch that
    fills them (None when there is nothing to compute; the buffers are then final).
    grad_x is in the dtype the kernel reads x in."""
    B, L, k, D = U.shape
    dev = U.device
    c0 = _c0(c0, B, D, dev)
    x_in = x
    x, weight_c, bias, dropout_mask = _read_as(U, x, weight_c, bias, dropout_mask)
    grad_U = _alloc((B, L, k, D), U.dtype, dev)
    store_gx = x is not None and bool(need_grad_x)
    grad_x = (_alloc((B, L, D), x.dtype, dev) if store_gx
              else (x_in if x_in is not None else U).new_empty((0,)))
    grad_c0 = _alloc((B, D), torch.float32, dev)
    partial = _alloc((B, 4, D), torch.float32, dev)
    if B == 0 or D == 0 or L == 0:  # (grad_U and grad_x have no elements then)
        grad_c0.copy_(torch.zeros(()) if grad_c_last is None else grad_c_last)
        partial.zero_()
        return (grad_U, grad_x, grad_c0, partial), None

    # autograd hands over grad_h in h's dtype, U's (the cast is for direct callers)
    grad_h = _as(grad_h, U.dtype)
    gcl, gcs = _optional(None if grad_c_last is None else grad_c_last.to(torch.float32),
                         c0, 2)
    x_, xs = _optional(x, U, 3)
    gx, gxs = _optional(grad_x if store_gx else None, grad_U, 3)
    mp, ms = _optional(mask_pad, U, 2)
    dm, ds = _optional(dropout_mask, U, 2)
    BLOCK, num_warps, stages, steps = config
    launch = Launch(
        _sru_bwd_kernel, (B, triton.cdiv(D, BLOCK)),
        (grad_h, gcl, U, x_, weight_c, bias, c0, c_all, mp, dm,
         grad_U, gx, grad_c0, partial,
         L, D, D // 2, float(scale_x),
         *grad_h.stride(), *gcs, *U.stride(), *xs,
         *weight_c.stride(), *bias.stride(), *c0.stride(), *c_all.stride(),
         *ms, *ds, *grad_U.stride(), *gxs),
        dict(_bwd_constexprs(k, x is not None, need_grad_x, mask_pad is not None,
                             dropout_mask is not None, bidirectional, grad_c_last is not None),
             BLOCK=BLOCK, STAGES=stages, STEPS=steps),
        num_warps)
    return (grad_U, grad_x, grad_c0, partial), launch


def sru_fwd(U: Tensor, x: Optional[Tensor], weight_c: Tensor, bias: Tensor,
            c0: Optional[Tensor], mask_pad: Optional[Tensor], dropout_mask: Optional[Tensor],
            scale_x: float, bidirectional: bool, store_c: bool,
            config: Optional[Sequence] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Forward recurrence.  Returns ``(h, c_last, c_all)``.

    h (B, L, D) in U's dtype; c_last (B, D) fp32 ([c_fwd(L-1), c_bwd(0)] when
    bidirectional); c_all (B, L, D) fp32, the state after every step, when
    ``store_c`` (else an empty tensor). ``config``: a :class:`LaunchConfig` (or a tuple
    ``(block, num_warps[, stages[, steps]])``) instead of :func:`_launch_config`'s
    (benchmarks compare them: :data:`SWEEP_CONFIGS`); every configuration computes
    the same results.
    """
    B, _, _, D = U.shape
    config = _launch_config(B, D) if config is None else _config(config)
    outputs, launch = _fwd_setup(U, x, weight_c, bias, c0, mask_pad, dropout_mask, scale_x,
                                 bidirectional, store_c, config)
    if launch is not None:
        _run(launch)
    return outputs


def sru_bwd(U: Tensor, x: Optional[Tensor], weight_c: Tensor, bias: Tensor,
            c0: Optional[Tensor], mask_pad: Optional[Tensor], dropout_mask: Optional[Tensor],
            c_all: Tensor, grad_h: Tensor, grad_c_last: Optional[Tensor], scale_x: float,
            bidirectional: bool, need_grad_x: bool,
            config: Optional[Sequence] = None
            ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward recurrence, from ``c_all``, the fp32 (B, L, D) state that
    :func:`sru_fwd` stored (``store_c=True``).

    Returns ``(grad_U, grad_x, grad_weight_c, grad_bias, grad_c0)``: grad_U
    (B, L, k, D) in U's dtype, grad_x (B, L, D) in x's dtype (an empty tensor when x
    is None or ``need_grad_x`` is False), grad_weight_c / grad_bias (2, D) in
    weight_c's / bias's dtype, grad_c0 (B, D) fp32. ``config`` as :func:`sru_fwd`'s.
    """
    B, _, _, D = U.shape
    config = _launch_config(B, D) if config is None else _config(config)
    (grad_U, grad_x, grad_c0, partial), launch = _bwd_setup(
        U, x, weight_c, bias, c0, mask_pad, dropout_mask, c_all, grad_h, grad_c_last, scale_x,
        bidirectional, need_grad_x, config)
    if launch is not None:
        _run(launch)
    if x is not None:
        grad_x = _as(grad_x, x.dtype)  # (a no-op unless x was read as fp32)
    # Deterministic reduction over the batch; two separate sums so the two
    # results are fresh tensors that do not alias each other.
    grad_weight_c = partial[:, 0:2].sum(dim=0).to(weight_c.dtype)
    grad_bias = partial[:, 2:4].sum(dim=0).to(bias.dtype)
    return grad_U, grad_x, grad_weight_c, grad_bias, grad_c0
