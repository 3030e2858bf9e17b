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
    mask_pad   (B, L) bool   True marks padding (integer: nonzero marks it)
    dropout_mask (B, D)      variational mask on the highway, shared over time

With ``bidirectional=True`` the units split in two halves of d = D / 2: the
first runs t = 0 .. L-1, the second t = L-1 .. 0.

The equations, per unit and step, are the SRU recurrence (Lei et al., "Simple
Recurrent Units for Highly Parallelizable Recurrence", EMNLP 2018, section 2;
SRU++, Lei, EMNLP 2021, keeps it), with s_t the skip term (``scale_x · x_t``, or
``u3_t`` when k = 4) and m the dropout mask (1 without one):

    f_t = σ(u1_t + v_f ⊙ c_{t-1} + b_f)
    r_t = σ(u2_t + v_r ⊙ c_{t-1} + b_r)
    c_t = f_t ⊙ c_{t-1} + (1 − f_t) ⊙ u0_t
    h_t = s_t + m ⊙ r_t ⊙ (c_t − s_t)       (h_t = m ⊙ r_t ⊙ c_t without a skip term)

At padding (``mask_pad`` True) c_t = c_{t-1} and h_t = 0.

:func:`sru_step` is one step of these equations; the SRU++ layer's reference
(:mod:`srupp.nn.reference`) and the ONNX graphs (:mod:`srupp.onnx`) step with it too.
:func:`check_args` is the contract every backend shares: :func:`srupp.ops.sru_recurrence`
and :func:`sru_recurrence_reference` call it before anything runs.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


# sru_recurrence's arguments after U: their shapes, and which may be None
_SHAPES = {"x": "(B, L, D)", "weight_c": "(2, D)", "bias": "(2, D)", "c0": "(B, D)",
           "mask_pad": "(B, L)", "dropout_mask": "(B, D)"}
_OPTIONAL = frozenset(("x", "c0", "mask_pad", "dropout_mask"))


def check_args(U, x, weight_c, bias, c0, mask_pad, dropout_mask, bidirectional) -> None:
    """Raise unless the arguments fit the recurrence: TypeError for a wrong type or
    dtype, ValueError for a wrong shape or device, naming the argument.

    U (B, L, k, D) with k = 3 or 4; x (B, L, D) or None (None when k = 4);
    weight_c and bias (2, D); c0 (B, D) or None; mask_pad (B, L) or None;
    dropout_mask (B, D) or None. U, x, weight_c, bias, c0 and dropout_mask are
    floating point; mask_pad is bool, or integer with nonzero meaning padding.
    All on U's device. Bidirectional needs an even D.

    Shapes can't tell (B, L) from (L, B) when B == L: a time-major mask_pad of a
    square batch passes, and is read as batch-major.
    """
    if not isinstance(U, Tensor):
        raise TypeError(f"U must be a Tensor, got {type(U).__name__}")
    if U.dim() != 4 or U.shape[2] not in (3, 4):
        raise ValueError(f"U must have shape (B, L, k, D) with k = 3 or 4, got {tuple(U.shape)}")
    if not U.dtype.is_floating_point:
        raise TypeError(f"U must be floating point, got {U.dtype}")
    B, L, k, D = U.shape
    if k == 4 and x is not None:
        raise ValueError("with k = 4 the skip term is U[:, :, 3]; pass x=None")
    if bidirectional and D % 2:
        raise ValueError(f"bidirectional needs an even number of units D, got D = {D}")
    device = U.device
    for name, t, shape in zip(_SHAPES, (x, weight_c, bias, c0, mask_pad, dropout_mask),
                              ((B, L, D), (2, D), (2, D), (B, D), (B, L), (B, D))):
        if t is None and name in _OPTIONAL:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.shape != shape:
            raise ValueError(f"{name} must have shape {_SHAPES[name]} = {shape}, "
                             f"got {tuple(t.shape)}")
        if name != "mask_pad":
            if not t.dtype.is_floating_point:
                raise TypeError(f"{name} must be floating point, got {t.dtype}")
        elif t.dtype.is_floating_point or t.dtype.is_complex:
            raise TypeError(f"mask_pad must be bool (True marks padding) or integer, "
                            f"got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but U is on {device}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the recurrence state and accumulators use for inputs of ``dtype``.

    Half precisions are promoted to fp32; fp64 stays fp64 (for gradcheck).
    """
    return torch.promote_types(dtype, torch.float32)


def layer_norm(y: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dim: (y − mean) / √(var + ε) · g + b (biased variance)."""
    mu = y.mean(-1, keepdim=True)
    var = ((y - mu) ** 2).mean(-1, keepdim=True)
    return (y - mu) / torch.sqrt(var + eps) * weight + bias


def skip_term(u: Tensor, x: Optional[Tensor], scale_x: float = 1.0) -> Optional[Tensor]:
    """s, the highway's skip term: u3 with k = 4 planes, else ``scale_x · x`` (None: no skip).

    u: (..., k, D).  x: (..., D), the layer's raw input (not pre-normed), or None.
    """
    if u.shape[-2] == 4:
        return u[..., 3, :]
    return None if x is None else x * scale_x


def sru_step(u: Tensor, skip: Optional[Tensor], c: Tensor, weight_c: Tensor, bias: Tensor,
             dropout_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """One step of the recurrence (the equations above), for every row and unit at once.

    Args:
        u: (..., k, d) this step's planes u0, u1, u2[, u3] (u3 is read through ``skip``).
        skip: (..., d) the skip term s_t (``scale_x · x_t``, or ``u3_t``), or None for none.
        c: (..., d) the state c_{t-1}.
        weight_c, bias: (2, d) [v_f; v_r] and [b_f; b_r].
        dropout_mask: (..., d) or None.
    Returns:
        h_t and c_t, (..., d) each.
    """
    u0, u1, u2 = u.unbind(-2)[:3]
    f = torch.sigmoid(u1 + weight_c[0] * c + bias[0])
    r = torch.sigmoid(u2 + weight_c[1] * c + bias[1])
    c = f * c + (1 - f) * u0
    if skip is None:
        h = r * c
        return (h if dropout_mask is None else dropout_mask * h), c
    gate = r if dropout_mask is None else dropout_mask * r
    return skip + gate * (c - skip), c


def _scan(U: Tensor, skip: Optional[Tensor], weight_c: Tensor, bias: Tensor, c0: Tensor,
          mask_pad: Optional[Tensor], dropout_mask: Optional[Tensor],
          reverse: bool) -> Tuple[Tensor, Tensor]:
    """One direction. U (B, L, k, d), skip (B, L, d) or None; returns h (B, L, d), c_last (B, d)."""
    L = U.shape[1]
    c = c0
    hs = [None] * L
    # unbind once: indexing U[:, t] inside the loop would make the backward quadratic in L
    # (each select's backward materialises a full-size zero tensor)
    U_t = U.unbind(1)                                   # L × (B, k, d)
    skip_t = None if skip is None else skip.unbind(1)   # L × (B, d)
    for t in (range(L - 1, -1, -1) if reverse else range(L)):
        h, c_new = sru_step(U_t[t], None if skip is None else skip_t[t], c, weight_c, bias,
                            dropout_mask)
        if mask_pad is not None:
            pad = mask_pad[:, t].unsqueeze(-1)  # (B, 1)
            c_new = torch.where(pad, c, c_new)  # padding holds the state
            h = torch.where(pad, torch.zeros_like(h), h)
        c = c_new
        hs[t] = h
    return torch.stack(hs, dim=1), c


def sru_recurrence_reference(U: Tensor, x: Optional[Tensor], weight_c: Tensor, bias: Tensor,
                             c0: Optional[Tensor] = None, *, scale_x: float = 1.0,
                             mask_pad: Optional[Tensor] = None,
                             dropout_mask: Optional[Tensor] = None,
                             bidirectional: bool = False) -> Tuple[Tensor, Tensor]:
    """The SRU element-wise recurrence, as a per-timestep loop (the oracle).

    Args:
        U: (B, L, k, D), k = 3 or 4. With k = 4 the skip term is ``U[:, :, 3]``.
        x: (B, L, D) skip input for k = 3, multiplied by ``scale_x``; None means
            no skip term (``has_skip_term=False``). Must be None when k = 4.
        weight_c: (2, D) peephole weights [v_f; v_r].
        bias: (2, D) gate biases [b_f; b_r].
        c0: (B, D) initial state, or None for zeros.
        scale_x: constant multiplying ``x`` in the skip term.
        mask_pad: (B, L) bool (or integer, nonzero = padding), True at padding: the
            state is held and h is 0.
        dropout_mask: (B, D) variational dropout mask applied to the highway.
        bidirectional: the second half of the units runs backwards in time.

    Returns:
        h: (B, L, D) in U's dtype.
        c_last: (B, D) in the compute dtype (fp32 for half inputs, else U's
            dtype). For bidirectional layers it is [c_fwd(L-1), c_bwd(0)].
    """
    check_args(U, x, weight_c, bias, c0, mask_pad, dropout_mask, bidirectional)
    B, L, k, D = U.shape
    cdt = compute_dtype(U.dtype)
    Uc = U.to(cdt)
    skip = skip_term(Uc, None if x is None else x.to(cdt), scale_x)
    wc, b = weight_c.to(cdt), bias.to(cdt)
    c0 = torch.zeros(B, D, dtype=cdt, device=U.device) if c0 is None else c0.to(cdt)
    mask_pad = None if mask_pad is None else mask_pad.to(torch.bool)
    dm = None if dropout_mask is None else dropout_mask.to(cdt)

    dirs = 2 if bidirectional else 1
    d = D // dirs
    hs, cs = [], []
    for di in range(dirs):
        units = slice(di * d, (di + 1) * d)
        h, c = _scan(Uc[..., units], None if skip is None else skip[..., units],
                     wc[:, units], b[:, units], c0[:, units], mask_pad,
                     None if dm is None else dm[:, units], reverse=di == 1)
        hs.append(h)
        cs.append(c)
    h = hs[0] if dirs == 1 else torch.cat(hs, dim=-1)
    c = cs[0] if dirs == 1 else torch.cat(cs, dim=-1)
    return h.to(U.dtype), c
