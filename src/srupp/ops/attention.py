"""Scaled dot-product attention: the dispatcher :func:`attend` and its paths.

Most of this module is the paths that are not PyTorch's SDPA. SRU++ attends in
a small width (d′ = d/4, often one head) over one segment and its memory. For
those shapes PyTorch's fused CPU kernel (``F.scaled_dot_product_attention``'s
flash path) is no faster in bf16 than in fp32, while plain batched matrix
products in bf16 run at about twice the fp32 rate. So the attention is computed
as written in the paper, with the probabilities kept for the backward::

    S = (q · scale) Kᵀ + mask          (B, H, L, S)
    P = softmax(S)                      (B, H, L, S)
    o = P V                             (B, H, L, hd)

    backward:  dV = Pᵀ dO,  dP = dO Vᵀ,  dS = P ⊙ (dP − rowsum(dP ⊙ P)),
               dq = dS K · scale,  dK = dSᵀ q · scale

in two forms:

- causal (:func:`attention_causal_matmul`, fp32 and bf16): the queries go in row
  blocks, each multiplied only against the keys it may see, so the products
  above the diagonal are never computed;
- any other mask (:func:`attention_matmul`, bf16 only): the whole square; in
  fp32 SDPA is as fast and is kept.

The cost is memory: P is kept, B·H·L·S elements (about half that for causal),
so these paths are used only while P fits in :data:`MAX_PROB_BYTES`. In bf16
the precision is that of any bf16 matmul attention (the scores are rounded to
bf16 before the softmax); the tests bound it against fp32.

Decoding asks for one query at a time, where SDPA's CPU kernel pays more in
fixed cost than the work. One query per (batch, head) without a mask or
gradient goes to :func:`attention_one_query`, the C++ extension's one-pass
kernel, in bf16 always and in fp32 with several (batch, head) rows (see
:func:`_one_query_wins`).

:func:`attend` dispatches: the explicit paths above for CPU tensors when there
is no attention dropout, P fits, nothing is tracing the model (``torch.compile``
and export see plain SDPA), and the dtype is fp32 (causal only) or bf16 on a
CPU with bf16 matrix instructions (AVX-512 BF16 or AMX:
:func:`~srupp.ops.settings.cpu_has_native_bf16`; emulated bf16 loses the edge);
SDPA ("sdpa") otherwise. A mask that is causal over memory keys reaches the
blocked path through ``causal_offset``.

When SDPA runs, a causal mask goes to it as an offset where that helps
(:func:`attention_sdpa_causal`): ``is_causal=True`` without memory, and on
CUDA ``causal_lower_right`` with memory, so that the flash and memory-efficient
kernels run without reading a dense mask (flash takes none at all).
:func:`set_attention_backend` (or, for a whole process,
``SRUPP_ATTENTION=auto|sdpa|matmul``) forces one (a forced "matmul" still defers
to SDPA for dropout).

The timings behind these rules are in docs/performance.md ("Attention backends").
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu_kernels
from .settings import CHOICES, accessors, cpu_has_native_bf16, tracing

__all__ = ["attend", "attention_reference", "attention_matmul", "attention_causal_matmul",
           "attention_one_query", "attention_sdpa_causal", "causal_mask",
           "causal_block", "set_attention_backend",
           "get_attention_backend", "use_attention_backend",
           "ATTENTION_BACKENDS", "MAX_PROB_BYTES"]

ATTENTION_BACKENDS = CHOICES["attention"]

# Largest P (B·H·L·S elements) the explicit path keeps for its backward.
MAX_PROB_BYTES = 256 * 2**20

# set_attention_backend("sdpa" | "matmul" | "auto"), get_attention_backend()
# (``SRUPP_ATTENTION`` the first time), use_attention_backend(name): a context manager
set_attention_backend, get_attention_backend, use_attention_backend = accessors("attention")


def attention_reference(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                        is_causal: bool = False, dropout_p: float = 0.0) -> Tensor:
    """``F.scaled_dot_product_attention`` with SRU++'s arguments.

    Args:
        q: (B, H, L, hd).  k, v: (B, H, S, hd).
        attn_mask: bool (B|1, 1|H, L, S) with True = may attend, or additive float; or None.
        is_causal: query i sees keys j <= i (needs L == S and no attn_mask).
    Returns:
        o (B, H, L, hd).
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                          dropout_p=dropout_p)


def causal_mask(L: int, offset: int = 0, device=None) -> Tensor:
    """bool (L, offset + L), True where query i may see key j: j <= offset + i."""
    return torch.ones(L, offset + L, dtype=torch.bool, device=device).tril_(offset)


def attention_sdpa_causal(q: Tensor, k: Tensor, v: Tensor, offset: int = 0,
                          dropout_p: float = 0.0) -> Tensor:
    """SDPA with the causal mask over ``offset`` memory keys, in the form its kernels take.

    Query i sees keys j <= offset + i (S = offset + L keys): the same result as
    SDPA with :func:`causal_mask` as ``attn_mask``. Without memory that is
    ``is_causal=True``. With memory the mask is aligned bottom-right, which
    ``is_causal`` is not (with L != S it aligns top-left); on CUDA
    ``causal_lower_right`` says so without a tensor, and the flash and
    memory-efficient kernels take it. No CPU kernel does (PyTorch would build
    the mask itself), so there the dense mask is passed.

    Args:
        q: (B, H, L, hd).  k, v: (B, H, S, hd) with S = offset + L.
    Returns:
        o (B, H, L, hd).
    """
    L, S = q.shape[-2], k.shape[-2]
    if S != offset + L:
        raise ValueError(f"causal attention with offset {offset} needs S = offset + L = "
                         f"{offset + L} keys, got {S}")
    if offset == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    if q.device.type == "cuda":
        return _sdpa_lower_right(q, k, v, dropout_p)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(L, offset, q.device),
                                          dropout_p=dropout_p)


def _sdpa_lower_right(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Tensor:
    """SDPA with the causal mask aligned bottom-right, as the CUDA kernels take it."""
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[-2],
                                                                                k.shape[-2]),
                                          dropout_p=dropout_p)


def _offset_form(device_type: str, offset: Optional[int], has_mask: bool, traced: bool) -> bool:
    """Whether SDPA gets a causal mask as its offset (:func:`attention_sdpa_causal`)
    rather than as the dense ``attn_mask``.

    Offset 0 is ``is_causal``, on every device. With memory: on CUDA, where a
    dense mask keeps SDPA off its flash kernel and makes the others read it;
    elsewhere a mask already built is passed as it is, and a traced model
    (torch.compile) gets the dense mask too, the form known to compile
    (``causal_lower_right`` picks its kernel in Python, from the tensors).
    """
    if offset is None:
        return False
    if offset == 0 or not has_mask:
        return True
    return device_type == "cuda" and not traced


def _sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
          dropout_p: float, offset: Optional[int]) -> Tensor:
    """SDPA; a causal mask (``offset`` not None) in the form :func:`_offset_form` picks."""
    if _offset_form(q.device.type, offset, attn_mask is not None, tracing()):
        return attention_sdpa_causal(q, k, v, offset, dropout_p)
    return attention_reference(q, k, v, attn_mask, is_causal, dropout_p)


class _MatmulAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor]) -> Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        with torch.autocast(q.device.type, enabled=False):
            # K and V arrive as halves of one [K | V] projection; each product below
            # would copy them to a dense layout again, so do it once.
            k, v = k.contiguous(), v.contiguous()
            s = torch.matmul(q * scale, k.transpose(-2, -1))          # (B, H, L, S)
            if attn_mask is not None:
                if attn_mask.dtype == torch.bool:
                    s.masked_fill_(~attn_mask, float("-inf"))
                else:
                    s.add_(attn_mask.to(s.dtype))
            p = torch.softmax(s, dim=-1)                               # (B, H, L, S)
            o = torch.matmul(p, v)                                     # (B, H, L, hd)
        ctx.save_for_backward(q, k, v, p)
        ctx.scale = scale
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go: Tensor):
        q, k, v, p = ctx.saved_tensors
        go = go.to(v.dtype)
        dv = torch.matmul(p.transpose(-2, -1), go)                     # (B, H, S, hd)
        dp = torch.matmul(go, v.transpose(-2, -1))                     # (B, H, L, S)
        ds = torch.ops.aten._softmax_backward_data(dp, p, -1, p.dtype)
        dq = torch.matmul(ds, k).mul_(ctx.scale)                       # (B, H, L, hd)
        dk = torch.matmul(ds.transpose(-2, -1), q).mul_(ctx.scale)     # (B, H, S, hd)
        return dq, dk, dv, None


def causal_block(dtype: torch.dtype) -> int:
    """Query rows per block of the causal path: 64 for fp32, 128 for 16-bit dtypes.

    Smaller blocks skip more of the masked half but multiply smaller matrices,
    which bf16's faster products feel sooner; both keep a block's scores near
    256 bytes per key. (The sizes were the fastest in ``benchmarks/attention.py
    --blocks 64 32``: docs/performance.md.)
    """
    return max(1, 256 // dtype.itemsize)


def _row_blocks(L: int, block: int):
    return [(r0, min(r0 + block, L)) for r0 in range(0, L, block)]


@functools.lru_cache(maxsize=16)
def _strict_upper(n: int, device: torch.device) -> Tensor:
    """bool (n, n), True above the diagonal: the keys a causal block's rows may not see."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)


class _CausalMatmulAttention(torch.autograd.Function):
    """Causal attention as explicit products, skipping the key blocks it may not see.

    Query i sees keys j <= offset + i (``offset`` memory keys precede the L
    queries' own). Rows are taken in blocks of ``block``: block [r0, r1) only
    multiplies against keys [0, offset + r1), so the products above the diagonal,
    nearly half of them for offset 0, are never computed. Each block keeps its
    own probabilities P_i for the backward, which accumulates dK and dV over the
    blocks (an extra rounding per block in bf16, which tests/ops/test_attention.py
    bounds).
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, offset: int, block: int) -> Tensor:
        B, H, L, hd = q.shape
        S = k.shape[-2]
        scale = 1.0 / math.sqrt(hd)
        with torch.autocast(q.device.type, enabled=False):
            # (B, H, n, hd) -> (B·H, n, hd): views for one head; K and V are halves of
            # one [K | V] projection, made dense once rather than in every product.
            qs = (q * scale).reshape(B * H, L, hd)
            k3 = k.reshape(B * H, S, hd).contiguous()
            v3 = v.reshape(B * H, S, hd).contiguous()
            o = qs.new_empty(B * H, L, hd)
            probs = []
            for r0, r1 in _row_blocks(L, block):
                e = offset + r1                                            # keys seen
                s = torch.bmm(qs[:, r0:r1], k3[:, :e].transpose(1, 2))     # (BH, n, e)
                s[:, :, offset + r0:].masked_fill_(_strict_upper(r1 - r0, s.device),
                                                   float("-inf"))
                p = torch.softmax(s, dim=-1)                               # (BH, n, e)
                o[:, r0:r1] = torch.bmm(p, v3[:, :e])                      # (BH, n, hd)
                probs.append(p)
        ctx.save_for_backward(qs, k3, v3, *probs)
        ctx.shape = (B, H, L, S, hd)
        ctx.offset, ctx.block, ctx.scale = offset, block, scale
        return o.view(B, H, L, hd)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go: Tensor):
        qs, k3, v3, *probs = ctx.saved_tensors
        B, H, L, S, hd = ctx.shape
        go = go.to(v3.dtype).reshape(B * H, L, hd)
        dq = qs.new_empty(B * H, L, hd)
        dk = dv = None
        # Last block first: it sees every key, so its products initialise dK and dV
        # whole; the earlier blocks add into their key prefixes.
        blocks = _row_blocks(L, ctx.block)
        for (r0, r1), p in reversed(list(zip(blocks, probs))):
            e = ctx.offset + r1
            g = go[:, r0:r1]                                               # (BH, n, hd)
            dp = torch.bmm(g, v3[:, :e].transpose(1, 2))                   # (BH, n, e)
            ds = torch.ops.aten._softmax_backward_data(dp, p, -1, p.dtype)
            dq[:, r0:r1] = torch.bmm(ds, k3[:, :e]).mul_(ctx.scale)
            if dk is None:
                dk = torch.bmm(ds.transpose(1, 2), qs[:, r0:r1])    # (BH, S, hd)
                dv = torch.bmm(p.transpose(1, 2), g)                # (BH, S, hd)
            else:
                # (into a dense product first: baddbmm_ into a strided prefix falls
                # back to one matrix product per batch row)
                dk[:, :e].add_(torch.bmm(ds.transpose(1, 2), qs[:, r0:r1]))
                dv[:, :e].add_(torch.bmm(p.transpose(1, 2), g))
        return (dq.view(B, H, L, hd), dk.view(B, H, S, hd), dv.view(B, H, S, hd),
                None, None)


def attention_causal_matmul(q: Tensor, k: Tensor, v: Tensor, offset: int = 0,
                            block: Optional[int] = None) -> Tensor:
    """Causal attention as blocked matrix products (see :class:`_CausalMatmulAttention`).

    Args:
        q: (B, H, L, hd).  k, v: (B, H, S, hd) with S = offset + L.
        offset: keys before the queries' own (memory); query i sees keys j <= offset + i.
        block: query rows per block; None picks :func:`causal_block` of the dtype.
    Returns:
        o (B, H, L, hd): ``attention_reference`` with the causal mask, which for
        offset 0 is ``is_causal=True``.
    """
    if k.shape[-2] != offset + q.shape[-2]:
        raise ValueError(f"causal attention with offset {offset} needs S = offset + L = "
                         f"{offset + q.shape[-2]} keys, got {k.shape[-2]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if block is None:
        block = causal_block(q.dtype)
    if block < 1:
        raise ValueError(f"block must be at least 1, got {block}")
    if q.shape[-2] == 0:  # no queries, no blocks: SDPA returns the empty result
        return F.scaled_dot_product_attention(q, k, v)
    return _CausalMatmulAttention.apply(q, k, v, offset, block)


def attention_matmul(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                     is_causal: bool = False) -> Tensor:
    """Attention as explicit matrix products, keeping P for the backward.

    Same arguments and result as :func:`attention_reference` (no dropout), in
    any floating dtype on any device; the dispatcher uses it for bf16 on CPU. (fp16
    is not sent here: without fp16 matrix hardware it is slower than SDPA.)
    """
    if is_causal and (attn_mask is not None or q.shape[-2] != k.shape[-2]):
        raise ValueError("is_causal needs L == S and no attn_mask")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if is_causal:
        return attention_causal_matmul(q, k, v)
    return _MatmulAttention.apply(q, k, v, attn_mask)


def _needs_grad(*ts: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


_ONE_QUERY_DTYPES = (torch.float32, torch.bfloat16)  # what the extension's kernel takes


def _one_query_wins(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether :func:`attention_one_query` beats SDPA for one query per (batch, head).

    The extension's kernel wins in bf16 at every batch and head count, and in fp32
    with several (batch, head) rows (with one it ties); without the extension the
    plain products lose (docs/performance.md, "Decoding at the memory-bandwidth bound").
    """
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _ONE_QUERY_DTYPES
            and cpu_kernels.function("attend_one_query") is not None):
        return False
    return q.dtype == torch.bfloat16 or q.shape[:-1].numel() > 1


def attention_one_query(q: Tensor, k: Tensor, v: Tensor,
                        attn_mask: Optional[Tensor] = None) -> Tensor:
    """One query per (batch, head), no dropout, no gradient: decoding.

    Same arguments and result as :func:`attention_reference` with L = 1: the
    scores, a softmax in fp32, and P V. Without a mask, on CPU in fp32 or bf16,
    the C++ extension's ``attend_one_query`` does all three in one pass over K
    and one over V, read in place, with fp32 sums. Otherwise (a mask, another
    dtype or device, or no extension) they are plain products. The dispatcher
    sends here the cases where the kernel beats SDPA (:func:`_one_query_wins`).
    """
    hd = q.shape[-1]
    if (attn_mask is None and q.device.type == "cpu" and q.dtype in _ONE_QUERY_DTYPES
            and q.dtype == k.dtype == v.dtype and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1):
        kernel = cpu_kernels.function("attend_one_query")
        if kernel:
            return kernel(q, k, v, 1.0 / math.sqrt(hd))                 # (B, H, 1, hd)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * (1.0 / math.sqrt(hd))  # (B, H, 1, S)
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask)
    return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)         # (B, H, 1, hd)


def attend(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
           is_causal: bool = False, dropout_p: float = 0.0,
           causal_offset: Optional[int] = None) -> Tensor:
    """Scaled dot-product attention on the best backend for these tensors.

    Args:
        q: (B, H, L, hd).  k, v: (B, H, S, hd).
        attn_mask: bool (B|1, 1|H, L, S) with True = may attend, or additive
            float (B|1, 1|H, L, S); or None.
        is_causal: query i sees keys j <= i (L == S, no attn_mask).
        dropout_p: dropout on the attention weights (SDPA handles it).
        causal_offset: a promise that ``attn_mask`` is exactly the causal mask
            over S = causal_offset + L keys (query i sees keys j <= causal_offset + i),
            or, without ``attn_mask``, that mask itself; it lets the explicit path
            skip the masked blocks, and SDPA on CUDA run without a mask tensor.
    Returns:
        o (B, H, L, hd), in q's dtype.
    """
    name = get_attention_backend()
    # the causal offset, if the mask is causal; is_causal with L != S is SDPA's
    # top-left alignment, not a memory offset, so it is left to SDPA
    offset = (0 if q.shape[-2] == k.shape[-2] else None) if is_causal else causal_offset
    if name == "sdpa" or dropout_p > 0.0 or tracing():
        return _sdpa(q, k, v, attn_mask, is_causal, dropout_p, offset)
    if (name == "auto" and q.shape[-2] == 1 and attn_mask is None and not is_causal
            and q.device.type == "cpu" and _one_query_wins(q, k, v)
            and not _needs_grad(q, k, v)):
        return attention_one_query(q, k, v)  # decoding
    if name == "matmul":
        if offset is not None:
            return attention_causal_matmul(q, k, v, offset)
        return attention_matmul(q, k, v, attn_mask, is_causal)
    small = q.shape[:-1].numel() * k.shape[-2] * q.element_size() <= MAX_PROB_BYTES  # P fits
    if q.device.type == "cpu" and small and q.dtype == k.dtype == v.dtype:
        native_bf16 = q.dtype == torch.bfloat16 and cpu_has_native_bf16()
        if offset is not None and (q.dtype == torch.float32 or native_bf16):
            return attention_causal_matmul(q, k, v, offset)
        if native_bf16:
            return _MatmulAttention.apply(q, k, v, attn_mask)
    return _sdpa(q, k, v, attn_mask, is_causal, dropout_p, offset)
