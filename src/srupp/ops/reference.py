"""Plain PyTorch reference of the SRU element-wise recurrence.

This is the oracle every fast kernel is tested against, so it favours being
obviously right over being fast: one Python loop over time, vectorised over
batch and units, with autograd doing the backward pass.

Layout (batch-first, the layout the layers keep their activations in):

    U          (B, L, k, D)  k = 3 or 4 planes: u0, u1, u2[, u3]; any strides
    x          (B, L, D)     skip input, used only when k == 3 (None: no skip)
    weight_c   (2, D)        peepholes [v_f; v_r]
    bias       (2, D)        [b_f; b_r]
    c0         (B, D)        initial state
    mask_pad   (B, L) bool   True marks padding
    dropout_mask (B, D)      variational mask on the highway, shared over time

With ``bidirectional=True`` the units split in two halves of d = D / 2: the
first runs t = 0 .. L-1, the second t = L-1 .. 0.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the recurrence state and accumulators use for inputs of ``dtype``.

    Half precisions are promoted to fp32; fp64 stays fp64 (for gradcheck).
    """
    return torch.promote_types(dtype, torch.float32)


def _scan(
    U: Tensor,
    skip: Optional[Tensor],
    v_f: Tensor,
    v_r: Tensor,
    b_f: Tensor,
    b_r: Tensor,
    c0: Tensor,
    mask_pad: Optional[Tensor],
    dropout_mask: Optional[Tensor],
    reverse: bool,
) -> Tuple[Tensor, Tensor]:
    """One direction. U (B, L, k, d), skip (B, L, d) or None; returns h (B, L, d), c_last (B, d)."""
    L = U.shape[1]
    c = c0
    hs = [None] * L
    # unbind once: indexing U[:, t] inside the loop would make the backward quadratic in L
    # (each select's backward materialises a full-size zero tensor)
    U_t = U.unbind(1)                                   # L × (B, k, d)
    skip_t = None if skip is None else skip.unbind(1)   # L × (B, d)
    for t in (range(L - 1, -1, -1) if reverse else range(L)):
        u0, u1, u2 = U_t[t].unbind(1)[:3]  # (B, d) each
        f = torch.sigmoid(u1 + v_f * c + b_f)
        r = torch.sigmoid(u2 + v_r * c + b_r)
        c_new = f * c + (1 - f) * u0
        if skip is None:
            h = r * c_new
            if dropout_mask is not None:
                h = dropout_mask * h
        else:
            s = skip_t[t]
            gate = r if dropout_mask is None else dropout_mask * r
            h = s + gate * (c_new - s)
        if mask_pad is not None:
            pad = mask_pad[:, t].unsqueeze(-1)  # (B, 1)
            c_new = torch.where(pad, c, c_new)  # padding holds the state
            h = torch.where(pad, torch.zeros_like(h), h)
        c = c_new
        hs[t] = h
    return torch.stack(hs, dim=1), c


def sru_recurrence_reference(
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
) -> Tuple[Tensor, Tensor]:
    """The SRU element-wise recurrence, as a per-timestep loop (the oracle).

    Args:
        U: (B, L, k, D), k = 3 or 4. With k = 4 the skip term is ``U[:, :, 3]``.
        x: (B, L, D) skip input for k = 3, multiplied by ``scale_x``; None means
            no skip term (``has_skip_term=False``). Must be None when k = 4.
        weight_c: (2, D) peephole weights [v_f; v_r].
        bias: (2, D) gate biases [b_f; b_r].
        c0: (B, D) initial state, or None for zeros.
        scale_x: constant multiplying ``x`` in the skip term.
        mask_pad: (B, L) bool, True at padding: the state is held and h is 0.
        dropout_mask: (B, D) variational dropout mask applied to the highway.
        bidirectional: the second half of the units runs backwards in time.

    Returns:
        h: (B, L, D) in U's dtype.
        c_last: (B, D) in the compute dtype (fp32 for half inputs, else U's
            dtype). For bidirectional layers it is [c_fwd(L-1), c_bwd(0)].
    """
    B, L, k, D = U.shape
    if k not in (3, 4):
        raise ValueError(f"U must have k = 3 or 4 planes in dim 2, got shape {tuple(U.shape)}")
    if bidirectional and D % 2:
        raise ValueError(f"bidirectional needs an even number of units D, got {D}")
    if k == 4 and x is not None:
        raise ValueError("with k = 4 the skip term is U[:, :, 3]; pass x=None")
    cdt = compute_dtype(U.dtype)
    Uc = U.to(cdt)
    skip = Uc[:, :, 3] if k == 4 else (None if x is None else x.to(cdt) * scale_x)
    wc, b = weight_c.to(cdt), bias.to(cdt)
    c0 = torch.zeros(B, D, dtype=cdt, device=U.device) if c0 is None else c0.to(cdt)
    mask_pad = None if mask_pad is None else mask_pad.to(torch.bool)
    dm = None if dropout_mask is None else dropout_mask.to(cdt)

    dirs = 2 if bidirectional else 1
    d = D // dirs
    hs, cs = [], []
    for di in range(dirs):
        units = slice(di * d, (di + 1) * d)
        h, c = _scan(
            Uc[..., units],
            None if skip is None else skip[..., units],
            wc[0, units], wc[1, units], b[0, units], b[1, units],
            c0[:, units],
            mask_pad,
            None if dm is None else dm[:, units],
            reverse=di == 1,
        )
        hs.append(h)
        cs.append(c)
    h = hs[0] if dirs == 1 else torch.cat(hs, dim=-1)
    c = cs[0] if dirs == 1 else torch.cat(cs, dim=-1)
    return h.to(U.dtype), c
