"""The SRU++ layer's math as plain functions, and a paper-like layer built from them.

Lei (2021), "When Attention Meets Fast Recurrence" (the attention that makes U),
and Lei et al. (2018), "Simple Recurrent Units" (the element-wise recurrence).
One layer, with x̃ what U is computed from and m the memory (the layer's
earlier x̃); the shapes are the step functions', which are batch-first, while
:func:`srupp_layer_reference` takes and returns time-major (L, B, ·) tensors,
as the fast layer does::

    x̃ = pre_norm(x)                                      (B, L, n_in)
    U = attention_u(W1 x̃, W1 [m; x̃])  or  projected_u(x̃)  (B, L, k·D)
    h_t, c_t = sru_step(u_t, s_t, c_{t-1})  for t = 0 .. L-1
    output = post_norm(h)                                 (B, L, D)

The functions take tensors (the weights are passed in) and use plain torch
only: no srupp.ops kernels or dispatchers, no SDPA, no F.linear / F.layer_norm.
They favour being obviously right over being fast. Two things are built on them:

- :func:`srupp_layer_reference`, the independent check of the fast layer: tests
  compare :class:`~srupp.nn.SRUppLayer` against it (outputs, final state and all
  gradients; autograd gives every gradient);
- the ONNX graphs (:mod:`srupp.onnx`), which trace them to torch-free graphs.

The recurrence and the LayerNorm are :mod:`srupp.ops.reference`'s (:func:`sru_step` one step,
:func:`skip_term` its s_t, :func:`sru_recurrence_reference` a sequence): the
kernels' oracle, written once, and exported here with the rest of the layer's math.
A LayerNorm is passed as ``norm``: None for none, or ``(weight, bias)`` or
``(weight, bias, eps)``.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ..ops.reference import layer_norm, skip_term, sru_recurrence_reference, sru_step

__all__ = ["layer_norm", "pre_norm", "post_norm", "projected_u", "attention_u", "skip_term",
           "sru_step", "sru_recurrence_reference", "srupp_layer_reference"]

Norm = Optional[tuple]  # a LayerNorm's (weight, bias[, eps]), or None


def pre_norm(x: Tensor, norm: Norm, normalize_after: bool) -> Tensor:
    """x̃, what U is computed from and attention memory holds: LN(x) with a pre-norm, else x."""
    return x if norm is None or normalize_after else layer_norm(x, *norm)


def post_norm(h: Tensor, norm: Norm, normalize_after: bool) -> Tensor:
    """The layer's output: LN(h) with a post-norm (``normalize_after``), else h."""
    return layer_norm(h, *norm) if norm is not None and normalize_after else h


def projected_u(x: Tensor, w1: Tensor, w2: Optional[Tensor] = None, norm: Norm = None) -> Tensor:
    """U of a layer without attention: SRU++'s W2 LN(W1 x) (LN optional), SRU's W x
    (``w2`` None) or W2 W1 x.

    x: (..., n_in).  w1: (d′, n_in).  w2: (k·D, d′).  Returns (..., k·D).
    """
    y = x @ w1.T
    if norm is not None:
        y = layer_norm(y, *norm)
    return y if w2 is None else y @ w2.T


def attention_u(q: Tensor, z: Tensor, allowed: Optional[Tensor], w_kv: Tensor, w_out: Tensor,
                alpha: Tensor, num_heads: int = 1, norm: Norm = None) -> Tensor:
    """U = W3 LN(q + α·softmax(q Kᵀ/√(d′/H)) V), per head, with [K | V] = W2 z.

    Args:
        q: (B, L, d′) the queries, W1 x̃.  z: (B, S, d′) W1 of every key position, [m; x̃].
        allowed: bool (B|1, L, S), True where a query may see a key; None: every key.
            A query that may see no key gets o = 0.
        w_kv: W2 (2·d′, d′).  w_out: W3 (k·D, d′).  alpha: α (1,).
        num_heads: H, dividing d′.  norm: the LayerNorm after the residual, or None.
    Returns:
        U (B, L, k·D).
    """
    B, L, width = q.shape
    hd = width // num_heads                                        # per-head width d′/H
    k, v = (z @ w_kv.T).chunk(2, dim=-1)                           # (B, S, d′) each
    qh, kh, vh = (t.unflatten(-1, (num_heads, hd)).transpose(1, 2)
                  for t in (q, k, v))                              # (B, H, L|S, hd)
    scores = qh @ kh.transpose(-2, -1) / math.sqrt(hd)             # (B, H, L, S)
    if allowed is not None:
        allowed = allowed.unsqueeze(1)                             # (B|1, 1, L, S)
        dead = ~allowed.any(-1, keepdim=True)                      # a query with no key at all
        scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(dead, 0.0)
    p = scores.softmax(dim=-1)                                     # (B, H, L, S)
    if allowed is not None:
        p = p.masked_fill(dead, 0.0)
    o = (p @ vh).transpose(1, 2).reshape(B, L, width)              # (B, L, d′)
    y = q + alpha * o                                              # the residual
    if norm is not None:
        y = layer_norm(y, *norm)
    return y @ w_out.T                                             # (B, L, k·D)


def _norm(P: Dict[str, Tensor], name: str) -> Norm:
    """The LayerNorm ``name`` of a parameter dict, or None."""
    return (P[f"{name}.weight"], P[f"{name}.bias"]) if f"{name}.weight" in P else None


def srupp_layer_reference(
    x: Tensor, P: Dict[str, Tensor], *, num_heads: int = 1, bidirectional: bool = False,
    causal: bool = False, normalize_after: bool = False, scale_x: float = 1.0,
    c0: Optional[Tensor] = None, mask_pad: Optional[Tensor] = None,
    memory: Optional[Tensor] = None, memory_mask_pad: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """One SRU++ layer, time-major, its parameters read from a dict.

    ``P`` is keyed like the fast layer's ``named_parameters()``, so
    ``srupp_layer_reference(x, dict(cell.named_parameters()), ...)`` runs a cell's
    weights. With ``"transform.alpha"`` present the layer attends; without, U is
    the projected linear sub-layer W2 LN(W1 x̃). Dropout is not modelled (rate 0 / eval).

    Args:
        x: (L, B, n_in) the layer's input.  P: parameters by the fast layer's names.
        num_heads: H, dividing d′.
        bidirectional: the second half of the D units runs t = L−1…0.
        causal: query i sees keys j ≤ M + i.  normalize_after: layer-wise LN on h, not on x.
        scale_x: multiplies the skip x_t when k = 3 (√(1 + 2·e^{highway_bias}) with rescale).
        c0: (B, D) initial state (zeros if None).  mask_pad: (L, B) bool, True = padding.
        memory: (M, B, n_in) the layer's (pre-normed) inputs from earlier calls.
        memory_mask_pad: (M, B) bool, True = padded memory key.
    Returns:
        h (L, B, D); c (B, D) after the last step ([c_fwd(L−1), c_bwd(0)] if bidirectional);
        x̃ (L, B, n_in), the pre-normed input, which is the memory of the next call.
    """
    L, B, _ = x.shape
    D = P["weight_c"].shape[1]                                    # units, both directions
    norm = _norm(P, "layer_norm")
    xn = pre_norm(x, norm, normalize_after)                       # (L, B, n_in)
    if "transform.alpha" in P:
        M = 0 if memory is None else memory.shape[0]
        x_all = xn if memory is None else torch.cat([memory, xn], 0)    # [m; x̃] (M+L, B, n_in)
        z = x_all.transpose(0, 1) @ P["transform.linear1.weight"].T     # (B, M+L, d′)
        allowed = torch.ones(B, L, M + L, dtype=torch.bool, device=x.device)
        if causal:
            i = torch.arange(L, device=x.device).view(L, 1)
            j = torch.arange(M + L, device=x.device).view(1, M + L)
            allowed = allowed & (j <= i + M)                      # no peeking at the future
        if mask_pad is not None or memory_mask_pad is not None:
            pads = [torch.zeros(n, B, dtype=torch.bool, device=x.device) if p is None
                    else p.to(x.device)
                    for n, p in ((M, memory_mask_pad), (L, mask_pad))]
            key_pad = torch.cat(pads, 0).T                        # (B, M+L): padded keys
            allowed = allowed & ~key_pad.view(B, 1, M + L)
        U = attention_u(z[:, M:], z, allowed, P["transform.linear2.weight"],
                        P["transform.linear3.weight"], P["transform.alpha"], num_heads,
                        _norm(P, "transform.layer_norm"))         # (B, L, k·D)
    else:
        U = projected_u(xn.transpose(0, 1), P["transform.linear1.weight"],
                        P["transform.linear2.weight"], _norm(P, "transform.layer_norm"))
    U = U.unflatten(-1, (-1, D))                                  # (B, L, k, D)
    h, c = sru_recurrence_reference(
        U, x.transpose(0, 1) if U.shape[2] == 3 else None, P["weight_c"], P["bias"], c0,
        scale_x=scale_x, mask_pad=None if mask_pad is None else mask_pad.T,
        bidirectional=bidirectional)                              # (B, L, D), (B, D)
    return post_norm(h.transpose(0, 1), norm, normalize_after), c, xn
