"""A minimal SRU++ layer written like the paper's equations: the independent check.

Lei (2021), "When Attention Meets Fast Recurrence" (the attention that makes U),
and Lei et al. (2018), "Simple Recurrent Units" (the element-wise recurrence).
Plain torch only: no srupp.ops, no SDPA, no F.linear / F.layer_norm; the
recurrence is a Python loop over time, and autograd gives every gradient.
It favours being obviously right over being fast. Tests compare
:class:`~srupp.nn.SRUppCell` against it (outputs, final state and all gradients).

Parameters are read from a dict keyed like the fast layer's ``named_parameters()``,
so ``srupp_layer_reference(x, dict(cell.named_parameters()), ...)`` runs a cell's
weights. With ``"transform.alpha"`` present the layer attends; without, it is the
projected linear sub-layer U = W2 LN(W1 x). Dropout is not modelled (rate 0 / eval).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor


def _layer_norm(y: Tensor, g: Tensor, b: Tensor, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dim: (y − mean) / √(var + ε) · g + b (biased variance)."""
    mu = y.mean(-1, keepdim=True)
    var = ((y - mu) ** 2).mean(-1, keepdim=True)
    return (y - mu) / torch.sqrt(var + eps) * g + b


def srupp_layer_reference(
    x: Tensor, P: Dict[str, Tensor], *, num_heads: int = 1, bidirectional: bool = False,
    causal: bool = False, normalize_after: bool = False, scale_x: float = 1.0,
    c0: Optional[Tensor] = None, mask_pad: Optional[Tensor] = None,
    memory: Optional[Tensor] = None, memory_mask_pad: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """One SRU++ layer, time-major.

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
    L, B, n_in = x.shape
    D = P["weight_c"].shape[1]                                # units, both directions
    ln = "layer_norm.weight" in P
    xn = _layer_norm(x, P["layer_norm.weight"], P["layer_norm.bias"]) \
        if ln and not normalize_after else x                  # pre-norm (U only; skip uses raw x)

    # ---- U from attention (SRU++), or from the factorised projection W2 W1 x
    if "transform.alpha" in P:
        M = 0 if memory is None else memory.shape[0]
        x_all = xn if memory is None else torch.cat([memory, xn], 0)   # [m; x]  (M+L, B, n_in)
        z = x_all @ P["transform.linear1.weight"].T           # Q = W^q X            (M+L, B, d′)
        q = z[M:]                                             # queries: current steps only
        k, v = (z @ P["transform.linear2.weight"].T).chunk(2, -1)  # K = W^k Q, V = W^v Q
        dh = q.shape[-1] // num_heads                         # per-head width d′/H
        qh, kh, vh = (t.unflatten(-1, (num_heads, dh)) for t in (q, k, v))  # (T, B, H, dh)
        S = torch.einsum("ibhe,jbhe->bhij", qh, kh) / math.sqrt(dh)  # Qᵀ K / √(d′/H)
        allowed = torch.ones(B, 1, L, M + L, dtype=torch.bool, device=x.device)
        if causal:
            i = torch.arange(L, device=x.device).view(L, 1)
            j = torch.arange(M + L, device=x.device).view(1, M + L)
            allowed = allowed & (j <= i + M)                  # no peeking at the future
        if mask_pad is not None or memory_mask_pad is not None:
            pads = [torch.zeros(n, B, dtype=torch.bool, device=x.device) if p is None
                    else p.to(x.device)
                    for n, p in ((M, memory_mask_pad), (L, mask_pad))]
            key_pad = torch.cat(pads, 0).T                    # (B, M+L): padded keys
            allowed = allowed & ~key_pad.view(B, 1, 1, M + L)
        dead = ~allowed.any(-1, keepdim=True)                 # a query with no key at all
        S = S.masked_fill(~allowed, float("-inf")).masked_fill(dead, 0.0)
        A = torch.softmax(S, -1) * allowed                    # softmax(·); dead rows give 0
        o = torch.einsum("bhij,jbhe->ibhe", A, vh).flatten(2)  # Aᵀ = softmax(·) Vᵀ  (L, B, d′)
        y = q + P["transform.alpha"] * o                      # Q + α·A (residual)
        W_o = P["transform.linear3.weight"]
    else:
        y = xn @ P["transform.linear1.weight"].T              # W1 x, no attention
        W_o = P["transform.linear2.weight"]
    if "transform.layer_norm.weight" in P:                    # layernorm(Q + α·A), post-norm
        y = _layer_norm(y, P["transform.layer_norm.weight"], P["transform.layer_norm.bias"])
    U = (y @ W_o.T).unflatten(-1, (-1, D))                    # Uᵀ = W^o (...)      (L, B, k, D)
    k_planes = U.shape[2]
    skip = U[:, :, 3] if k_planes == 4 else scale_x * x       # s_t: u3_t, or scale_x · x_t

    # ---- the element-wise recurrence (SRU), one direction at a time
    v_f, v_r = P["weight_c"]
    b_f, b_r = P["bias"]
    c0 = x.new_zeros(B, D) if c0 is None else c0
    d = D // (2 if bidirectional else 1)
    h = [[None] * L for _ in range(D // d)]
    c_last = []
    for di in range(D // d):
        j = slice(di * d, (di + 1) * d)                       # this direction's units
        c = c0[:, j]
        for t in (range(L) if di == 0 else range(L - 1, -1, -1)):
            u0, u1, u2 = U[t, :, 0, j], U[t, :, 1, j], U[t, :, 2, j]
            f = torch.sigmoid(u1 + v_f[j] * c + b_f[j])       # f_t = σ(u1_t + v_f ⊙ c_{t−1} + b_f)
            r = torch.sigmoid(u2 + v_r[j] * c + b_r[j])       # r_t = σ(u2_t + v_r ⊙ c_{t−1} + b_r)
            c_t = f * c + (1 - f) * u0                        # c_t = f_t ⊙ c_{t−1} + (1−f_t) ⊙ u0_t
            h_t = r * c_t + (1 - r) * skip[t, :, j]           # h_t = r_t ⊙ c_t + (1 − r_t) ⊙ s_t
            if mask_pad is not None:                          # padding: hold c, output 0
                pad = mask_pad[t].view(B, 1)
                c_t, h_t = torch.where(pad, c, c_t), torch.where(pad, 0.0, h_t)
            c, h[di][t] = c_t, h_t
        c_last.append(c)
    h = torch.cat([torch.stack(hd, 0) for hd in h], -1)      # (L, B, D)
    if ln and normalize_after:                                # layer-wise post-norm on h
        h = _layer_norm(h, P["layer_norm.weight"], P["layer_norm.bias"])
    return h, torch.cat(c_last, -1), xn
