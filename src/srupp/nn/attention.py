"""The sub-layer of SRU++ that computes U from the input.

With attention (``SRUppAttention``)::

    z = W1 [m; x]                  (B, M+L, d′)   m: memory, the layer's past inputs
    q = z[:, M:]                   (B, L, d′)
    K, V = W2 z                    (B, M+L, d′) each
    o = softmax(q Kᵀ/√(d′/H) + mask) V, per head
    U = W3 dropout(LN(q + α·o))    (B, L, k·D)

Without (``SRUppProjectedLinear``): U = W2 dropout(LN(W1 x)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.sdpa import attention as _attention
from .append import append_steps
from .linear import Linear


@dataclass
class AttentionMask:
    """A mask ready for ``F.scaled_dot_product_attention``, built once per stack call.

    mask: None, or bool (B|1, 1, L, S) with True = may attend, or an additive
        float (B|1, 1, L, S). Rows with nothing to attend to are opened up here
        (so softmax stays finite) and zeroed afterwards through ``dead_rows``.
    is_causal: use SDPA's own causal path (only when there is no memory).
    dead_rows: bool (B|1, 1, L, 1), True where a query may attend to nothing.
    causal_offset: set when ``mask`` is exactly the causal mask over M memory keys
        and the L queries' own (query i sees keys j <= M + i); then it is M, and
        the explicit attention path skips the masked blocks instead of reading it.
    """

    mask: Optional[Tensor] = None
    is_causal: bool = False
    dead_rows: Optional[Tensor] = None
    causal_offset: Optional[int] = None


def build_attention_mask(L: int, M: int, *, causal: bool, attn_mask: Optional[Tensor],
                         key_padding: Optional[Tensor], device) -> AttentionMask:
    """Combine causality, a user's additive mask and key padding.

    Args:
        L, M: query length and memory length; keys span S = M + L.
        causal: query i (absolute position M + i) sees keys j <= M + i.
        attn_mask: additive float (L, S) or None.
        key_padding: bool (B, S), True at padded keys, or None.
    """
    S = M + L
    if attn_mask is None and key_padding is None:
        if not causal or L == 1:  # one causal query sees every key: no mask (decoding)
            return AttentionMask()
        if M == 0:
            return AttentionMask(is_causal=True)
    allowed = None  # bool (B|1, 1, L, S)
    if causal:
        j = torch.arange(S, device=device)
        i = torch.arange(L, device=device)
        allowed = (j.unsqueeze(0) <= (i.unsqueeze(1) + M)).view(1, 1, L, S)
    if key_padding is not None:
        keep = (~key_padding).view(key_padding.shape[0], 1, 1, S)
        allowed = keep if allowed is None else allowed & keep
    if attn_mask is None:
        if key_padding is None:  # causal over memory: every query sees its memory
            return AttentionMask(mask=allowed, causal_offset=M)
        dead = ~allowed.any(dim=-1, keepdim=True)
        return AttentionMask(mask=allowed | dead, dead_rows=dead)
    bias = attn_mask.view(1, 1, L, S)
    if allowed is not None:
        bias = bias.masked_fill(~allowed, float("-inf"))
    dead = torch.isneginf(bias).all(dim=-1, keepdim=True)
    return AttentionMask(mask=bias.masked_fill(dead, 0.0), dead_rows=dead)


class SRUppAttention(nn.Module):
    """Single- or multi-head attention producing U, with the ReZero-style α.

    Args:
        in_features: n_in.  out_features: k·D.  proj_features: d′.
        num_heads: H, must divide d′.
        dropout: dropout on LN(q + α·o) before W3; W3 starts scaled by √(1 − dropout).
        attn_dropout: dropout on the attention weights.
        layer_norm: LayerNorm(d′) after the residual (post-norm).
    """

    def __init__(self, in_features: int, out_features: int, proj_features: int, *,
                 num_heads: int = 1, dropout: float = 0.0, attn_dropout: float = 0.0,
                 layer_norm: bool = True, device=None, dtype=None):
        super().__init__()
        if proj_features % num_heads != 0:
            raise ValueError(
                f"proj_size ({proj_features}) must be divisible by num_heads ({num_heads})")
        factory = {"device": device, "dtype": dtype}
        self.num_heads = num_heads
        self.attn_dropout = float(attn_dropout)
        self.linear1 = Linear(in_features, proj_features, bias=False, **factory)
        self.linear2 = Linear(proj_features, 2 * proj_features, bias=False, **factory)
        self.linear3 = Linear(proj_features, out_features, bias=False, **factory)
        self.alpha = nn.Parameter(torch.zeros(1, **factory))
        self.layer_norm = nn.LayerNorm(proj_features, **factory) if layer_norm else None
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self):
        for lin in (self.linear1, self.linear2, self.linear3):
            nn.init.xavier_uniform_(lin.weight)
        with torch.no_grad():
            if self.dropout.p > 0:
                self.linear3.weight.mul_((1 - self.dropout.p) ** 0.5)
            self.alpha.zero_()
        if self.layer_norm is not None:
            self.layer_norm.reset_parameters()

    def cache_key(self) -> tuple:
        """Identifies the weights K and V were computed with (in-place updates bump _version)."""
        w1, w2 = self.linear1.weight, self.linear2.weight
        return (w1.data_ptr(), w1._version, w2.data_ptr(), w2._version)

    def forward(self, x: Tensor, memory: Optional[Tensor], mask: AttentionMask,
                kv_memory: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """Compute U.

        Args:
            x: (B, L, n_in).
            memory: (B, M, n_in) past inputs, or None.
            mask: the stack's attention mask over keys [memory; x].
            kv_memory: (B, M, 2·d′) keys and values already computed from
                ``memory`` with the current weights; saves recomputing them
                when decoding. ``memory`` is then not read.
        Returns:
            U (B, L, k·D), and [K | V] (B, M+L, 2·d′) for the caller to cache.
        """
        B, L, _ = x.shape
        if kv_memory is not None:
            q = self.linear1(x)                                          # (B, L, d′)
            kv = append_steps(kv_memory, self.linear2(q))               # (B, M+L, 2·d′)
        else:
            M = 0 if memory is None else memory.shape[1]
            x_all = x if memory is None else torch.cat([memory.to(x.dtype), x], dim=1)
            z = self.linear1(x_all)                                      # (B, S, d′)
            q = z[:, M:]                                                 # (B, L, d′)
            kv = self.linear2(z)                                         # (B, S, 2·d′)
        k, v = kv.chunk(2, dim=-1)                                       # (B, S, d′) each
        H = self.num_heads
        hd = q.shape[-1] // H
        # (B, S, d′) -> (B, H, S, hd), as views
        qh, kh, vh = (t.unflatten(-1, (H, hd)).transpose(1, 2) for t in (q, k, v))
        attn = mask.mask
        if attn is not None and attn.dtype != torch.bool:
            attn = attn.to(qh.dtype)
        o = _attention(qh, kh, vh, attn_mask=attn, is_causal=mask.is_causal,
                       dropout_p=self.attn_dropout if self.training else 0.0,
                       causal_offset=mask.causal_offset)                 # (B, H, L, hd)
        if mask.dead_rows is not None:
            o = o.masked_fill(mask.dead_rows, 0.0)
        o = o.transpose(1, 2).reshape(B, L, H * hd)                      # (B, L, d′)
        y = q + self.alpha * o
        if self.layer_norm is not None:
            y = self.layer_norm(y)
        return self.linear3(self.dropout(y)), kv


    def step(self, x: Tensor, kv_memory: Optional[Tensor],
             key_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """One query, for decoding: :meth:`forward` with L = 1, minus its generality.

        Args:
            x: (B, n_in) this token's (pre-normed) input.
            kv_memory: (B, M, 2·d′) keys and values of the memory, or None.
            key_mask: bool (B, 1, 1, M + 1), True where a key may be attended
                (the token itself always may), or None for every key.
        Returns:
            U (B, k·D), and [K | V] (B, M + 1, 2·d′) including this token.
        """
        B = x.shape[0]
        q = self.linear1(x)                                              # (B, d′)
        kv = append_steps(kv_memory, self.linear2(q).unsqueeze(1))        # (B, M+1, 2·d′)
        H = self.num_heads
        hd = q.shape[-1] // H
        k, v = kv.chunk(2, dim=-1)                                       # (B, S, d′) each
        qh = q.view(B, H, 1, hd)
        kh, vh = (t.unflatten(-1, (H, hd)).transpose(1, 2) for t in (k, v))  # (B, H, S, hd)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=key_mask)  # (B, H, 1, hd)
        y = q + self.alpha * o.view(B, H * hd)
        if self.layer_norm is not None:
            y = self.layer_norm(y)
        return self.linear3(y), kv


class SRUppProjectedLinear(nn.Module):
    """U = W2 dropout(LN(W1 x)): the SRU++ sub-layer of layers without attention."""

    def __init__(self, in_features: int, out_features: int, proj_features: int, *,
                 dropout: float = 0.0, layer_norm: bool = True, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.linear1 = Linear(in_features, proj_features, bias=False, **factory)
        self.linear2 = Linear(proj_features, out_features, bias=False, **factory)
        self.layer_norm = nn.LayerNorm(proj_features, **factory) if layer_norm else None
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.xavier_uniform_(self.linear1.weight)
        nn.init.xavier_uniform_(self.linear2.weight)
        if self.dropout.p > 0:
            with torch.no_grad():
                self.linear2.weight.mul_((1 - self.dropout.p) ** 0.5)
        if self.layer_norm is not None:
            self.layer_norm.reset_parameters()

    def forward(self, x: Tensor, memory: Optional[Tensor] = None,
                mask: Optional[AttentionMask] = None,
                kv_memory: Optional[Tensor] = None) -> Tuple[Tensor, None]:
        """x (B, L, n_in) -> (U (B, L, k·D), None); memory and mask are ignored."""
        z = self.linear1(x)
        if self.layer_norm is not None:
            z = self.layer_norm(z)
        return self.linear2(self.dropout(z)), None
