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

On CUDA, :func:`cuda_sdpa_backend` says which kernel PyTorch's SDPA would run
for a head dim, dtype, mask form and compute capability ("cudnn", "flash",
"efficient" or "math"), by PyTorch's documented constraints. Where that is the
math fallback (it materialises the scores, in fp32 for 16-bit inputs), srupp
takes a fused kernel instead (:func:`cuda_attention_route`): the head dim is
zero-padded to the memory-efficient kernel's alignment (q·k and P·V are
unchanged; the padded output columns are dropped), and 16-bit inputs on GPUs
without a fused kernel for them take the explicit bf16 products. SRU++'s
single-head d′ = 768 (enwik8, WikiText-103) is past flash's 256 and runs on the
memory-efficient kernel; :func:`attention_calls` lists a config's attention
calls and the backend of each.

The timings behind these rules are in docs/performance.md ("Attention backends").
"""

from __future__ import annotations

import functools
import math
from typing import Any, List, Mapping, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu_kernels
from .marks import constant_when_compiled
from .settings import CHOICES, accessors, cpu_has_native_bf16, tracing

__all__ = ["attend", "attention_reference", "attention_matmul", "attention_causal_matmul",
           "attention_one_query", "attention_sdpa_causal", "causal_mask",
           "causal_block", "set_attention_backend",
           "get_attention_backend", "use_attention_backend",
           "ATTENTION_BACKENDS", "MAX_PROB_BYTES",
           "cuda_sdpa_backend", "cuda_attention_route", "attention_sdpa", "attention_calls",
           "attention_backend_for", "AttentionCall", "SDPA_MASKS", "CUDNN_OF_TORCH_2_11"]

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
                          dropout_p: float = 0.0, scale: Optional[float] = None) -> Tensor:
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
        scale: of the scores; None is 1/√hd.
    Returns:
        o (B, H, L, hd).
    """
    L, S = q.shape[-2], k.shape[-2]
    if S != offset + L:
        raise ValueError(f"causal attention with offset {offset} needs S = offset + L = "
                         f"{offset + L} keys, got {S}")
    if offset == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                              scale=scale)
    if q.device.type == "cuda":
        return _sdpa_lower_right(q, k, v, dropout_p, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(L, offset, q.device),
                                          dropout_p=dropout_p, scale=scale)


def _sdpa_lower_right(q: Tensor, k: Tensor, v: Tensor, dropout_p: float,
                      scale: Optional[float] = None) -> Tensor:
    """SDPA with the causal mask aligned bottom-right, as the CUDA kernels take it."""
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[-2],
                                                                                k.shape[-2]),
                                          dropout_p=dropout_p, scale=scale)


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
    """SDPA; a causal mask (``offset`` not None) in the form :func:`_offset_form` picks.

    On CUDA the call takes :func:`cuda_attention_route`'s way round the math fallback."""
    as_offset = _offset_form(q.device.type, offset, attn_mask is not None, tracing())
    if q.device.type == "cuda":
        return _sdpa_cuda(q, k, v, attn_mask, is_causal, dropout_p, offset, as_offset)
    return _sdpa_call(q, k, v, attn_mask, is_causal, dropout_p, offset if as_offset else None)


def attention_sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                   is_causal: bool = False, dropout_p: float = 0.0) -> Tensor:
    """``F.scaled_dot_product_attention`` itself, except that on CUDA a call SDPA would
    run on its math kernel takes :func:`cuda_attention_route`'s fused way instead.

    For callers that want SDPA's numerics on every device rather than :func:`attend`'s
    CPU paths (a decoder's cross-attention). Arguments and result as
    :func:`attention_reference`.
    """
    return _sdpa(q, k, v, attn_mask, is_causal, dropout_p, None)


def _sdpa_call(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
               dropout_p: float, offset: Optional[int], scale: Optional[float] = None) -> Tensor:
    """One SDPA call: the causal offset form when ``offset`` is given, else the arguments."""
    if offset is not None:
        return attention_sdpa_causal(q, k, v, offset, dropout_p, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                          dropout_p=dropout_p, scale=scale)


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


# ------------------------------------------------------------------ CUDA: which SDPA kernel runs

SDPA_MASKS = ("none", "causal", "causal_lower_right", "dense")

# cuDNN 9.17.1, which torch 2.11's CUDA 13 wheels load (pytorch/pytorch#173216, "fail-safe
# target for 2.11"); the H200 runs of docs/gpu.json used torch 2.11.0+cu130.
CUDNN_OF_TORCH_2_11 = 91701

# What the rule below relies on. PyTorch's SDPA on CUDA tries its backends in a priority
# order and takes the first whose checks pass (select_sdp_backend, can_use_*_attention and
# their check_* gates in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, read in the
# 2.11 line and on main in 2026; restated here, not copied):
#
# - order: flash, efficient, math, cudnn (aten/src/ATen/Context.h's sdp_priority_order;
#   cuDNN after math is never reached), except that
#   cuDNN goes first on sm90/sm100/sm103 when the loaded cuDNN is newer than 9.15
#   (check_prefer_cudnn_attention; pytorch/pytorch#162073; torch 2.11's cuDNN is the first
#   to pass, huggingface/transformers#48163).
# - flash (check_head_dim_size_flash, check_flash_attention_hardware_support,
#   check_dtypes_low_precision, check_for_attn_mask, check_flash_causal_non_square_seqlens,
#   check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120): fp16/bf16,
#   sm80-sm121, equal q/k/v head dims of at most 256 (any size: PyTorch pads it to a
#   multiple of 8 for the kernel), no attn_mask, is_causal only with L == S; in training
#   on sm86-sm89 and sm120-sm121 only head dims <= 192, or > 224 without dropout.
# - memory-efficient, CUTLASS (check_mem_efficient_hardware_support,
#   check_head_dim_size_mem_efficient, minimum_gemm_alignment): sm50-sm121; fp16/fp32, and
#   bf16 from sm80; any head dim that is a multiple of the GEMM alignment: 8 for 16-bit
#   and 4 for fp32 from sm80, 8 for 16-bit and 1 for fp32 on sm70-sm75, 1 before. It takes
#   attn_mask (dense bool or additive), dropout, the backward, and both causal alignments
#   (is_causal is top-left; causal_lower_right reaches it as custom_mask_type 2). It is the
#   only fused kernel past head dim 256 (huggingface/transformers#45636: 320 on sm90).
# - cuDNN (check_cudnn_tensor_shapes, check_cudnn_hardware_support,
#   check_cudnn_d256_bprop_head_dim, check_cudnn_dropout): fp16/bf16, sm80-sm121, head
#   dim a multiple of 8 and at most 128; on sm90 with cuDNN >= 9.10 at most 256 in the
#   2.11 line (the code of early 2026). Newer torch (pytorch/pytorch#185553, mid 2026: cuDNN
#   > 9.22 with cudnn-frontend 1.24) allows 256 on sm90/sm10x but trains only <= 128 or 256, and
#   takes dropout only in steps of 1/16; cuDNN 9.11-9.13 take no dropout. Here cuDNN
#   > 9.22 stands for that newer torch.
# - causal_lower_right (torch/nn/attention/bias.py, CausalBias._dispatch): with L != S it
#   asks flash, then the memory-efficient kernel, directly (cuDNN is never asked); if
#   neither takes the call it materialises the mask and calls SDPA with it (as "dense").
#
# What "math" costs: it materialises the (L, S) scores and, for 16-bit inputs, computes
# them in fp32 (torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp is off by default).


def _half(dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16)


def _in_sm(cap: Tuple[int, int], lo: Tuple[int, int], hi: Tuple[int, int]) -> bool:
    return lo <= cap <= hi


def _flash_admits(hd: int, dtype: torch.dtype, dense_mask: bool, dropout: bool,
                  cap: Tuple[int, int]) -> bool:
    if dense_mask or not _half(dtype) or hd > 256 or not _in_sm(cap, (8, 0), (12, 1)):
        return False
    if _in_sm(cap, (8, 6), (8, 9)) or _in_sm(cap, (12, 0), (12, 1)):  # its backward's limits
        return hd <= 192 or (hd > 224 and not dropout)
    return True


def _efficient_alignment(dtype: torch.dtype, cap: Tuple[int, int]) -> int:
    """The head-dim multiple the memory-efficient kernel needs: 16 bytes of elements where
    its GEMMs use tensor cores (16-bit from sm70, fp32 from sm80), else 1."""
    tensor_cores = cap[0] >= 8 or (cap[0] == 7 and _half(dtype))
    return max(1, 16 // dtype.itemsize) if tensor_cores else 1


def _efficient_admits(hd: int, dtype: torch.dtype, cap: Tuple[int, int]) -> bool:
    if not _in_sm(cap, (5, 0), (12, 1)):
        return False
    if dtype not in (torch.float16, torch.float32) and not (dtype == torch.bfloat16
                                                            and cap[0] >= 8):
        return False
    return hd % _efficient_alignment(dtype, cap) == 0


def _cudnn_admits(hd: int, dtype: torch.dtype, dropout: Union[bool, float],
                  cap: Tuple[int, int], cudnn: Optional[int]) -> bool:
    if not cudnn or cudnn < 90000 or not _half(dtype) or not _in_sm(cap, (8, 0), (12, 1)):
        return False
    if dropout and 91100 < cudnn < 91400:
        return False
    if hd % 8:
        return False
    if cudnn > 92200:  # the newer checks (see above)
        if dropout and (isinstance(dropout, bool) or dropout * 16 != math.floor(dropout * 16)):
            return False  # True: a probability not known to be on cuDNN's 1/16 grid
        d256 = (cap == (9, 0) or cap[0] == 10) and not (cap == (10, 7) and cudnn <= 92500)
        return hd <= 128 or (d256 and hd == 256)
    return hd <= (256 if cap == (9, 0) and cudnn >= 91000 else 128)


def _cudnn_first(cap: Tuple[int, int], cudnn: Optional[int]) -> bool:
    return bool(cudnn) and cudnn > 91500 and cap[0] in (9, 10) and cap[1] in (0, 3)


def _check_rule_args(head_dim, dtype, mask, capability) -> Tuple[int, int]:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (torch.bfloat16, ...), got {dtype!r}")
    if mask not in SDPA_MASKS:
        raise ValueError(f"mask must be one of {SDPA_MASKS}, got {mask!r}")
    try:
        major, minor = (int(c) for c in capability)
    except (TypeError, ValueError):
        raise ValueError(f"capability must be (major, minor), such as (9, 0), "
                         f"got {capability!r}") from None
    return major, minor


def cuda_sdpa_backend(head_dim: int, dtype: torch.dtype, mask: str, dropout: bool = False,
                      capability: tuple = (9, 0), *,
                      cudnn_version: Optional[int] = CUDNN_OF_TORCH_2_11) -> str:
    """The kernel PyTorch's SDPA runs on CUDA for these arguments, in training.

    A pure function of its arguments, by PyTorch's documented constraints (the
    comment above it says which, and where they come from); the default
    ``cudnn_version`` is torch 2.11's, the project's GPU. Tensors are taken as
    SRU++ makes them: q, k and v of one dtype and head dim, 4-D, last stride 1,
    none empty; no ``sdpa_kernel`` restriction and no deterministic mode.

    Args:
        head_dim: hd, q's, k's and v's last dim.
        dtype: of q, k and v (under autocast, the autocast dtype).
        mask: "none"; "causal" (``is_causal`` with L == S); "causal_lower_right"
            (causal over memory keys, as :func:`attention_sdpa_causal` passes it on
            CUDA); "dense" (an ``attn_mask`` tensor).
        dropout: whether attention dropout is on, or its probability (cuDNN on
            newer torch takes only multiples of 1/16; True counts as off that grid).
        capability: the GPU's compute capability, (major, minor).
        cudnn_version: ``torch.backends.cudnn.version()``, or None without cuDNN.
    Returns:
        "cudnn", "flash", "efficient" or "math".
    """
    cap = _check_rule_args(head_dim, dtype, mask, capability)
    if mask == "causal_lower_right":
        if _flash_admits(head_dim, dtype, False, bool(dropout), cap):
            return "flash"
        if _efficient_admits(head_dim, dtype, cap):
            return "efficient"
        mask = "dense"  # CausalBias materialises the mask and calls SDPA with it
    dense = mask == "dense"
    if _cudnn_first(cap, cudnn_version) and _cudnn_admits(head_dim, dtype, dropout, cap,
                                                          cudnn_version):
        return "cudnn"
    if _flash_admits(head_dim, dtype, dense, bool(dropout), cap):
        return "flash"
    if _efficient_admits(head_dim, dtype, cap):
        return "efficient"
    return "math"


def cuda_attention_route(head_dim: int, dtype: torch.dtype, mask: str,
                         dropout: Union[bool, float] = False, capability: tuple = (9, 0), *,
                         cudnn_version: Optional[int] = CUDNN_OF_TORCH_2_11) -> Tuple[str, int]:
    """What srupp runs on CUDA instead of the math fallback: (backend, head dim run at).

    Where :func:`cuda_sdpa_backend` is a fused kernel, that kernel at ``head_dim``.
    Where it is "math", the head dim zero-padded to the memory-efficient kernel's
    alignment when a fused kernel then takes the call (exact: the padded columns
    add nothing to q·k, and give output columns that are dropped); else, for
    16-bit inputs without dropout, "matmul": the explicit products in that dtype
    (:func:`attention_matmul`, :func:`attention_causal_matmul`), used while P
    fits in :data:`MAX_PROB_BYTES`; else "math".
    """
    rule = dict(cudnn_version=cudnn_version)
    name = cuda_sdpa_backend(head_dim, dtype, mask, dropout, capability, **rule)
    if name != "math":
        return name, head_dim
    step = _efficient_alignment(dtype, tuple(int(c) for c in capability))
    padded = -(-head_dim // step) * step
    if padded != head_dim:
        name = cuda_sdpa_backend(padded, dtype, mask, dropout, capability, **rule)
        if name != "math":
            return name, padded
    if _half(dtype) and not dropout:
        return "matmul", head_dim
    return "math", head_dim


_DEVICE_FACTS: dict = {}


@constant_when_compiled
def _cuda_facts(index: int) -> Tuple[Tuple[int, int], Optional[int]]:
    """(compute capability, cuDNN version) of CUDA device ``index``, looked up once."""
    if index not in _DEVICE_FACTS:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        _DEVICE_FACTS[index] = (tuple(torch.cuda.get_device_capability(index)), cudnn)
    return _DEVICE_FACTS[index]


def _sdpa_cuda(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
               dropout_p: float, offset: Optional[int], as_offset: bool) -> Tensor:
    """SDPA on CUDA, on the way :func:`cuda_attention_route` picks."""
    run_offset = offset if as_offset else None
    hd = q.shape[-1]
    if not (q.dtype == k.dtype == v.dtype and k.shape[-1] == v.shape[-1] == hd):
        return _sdpa_call(q, k, v, attn_mask, is_causal, dropout_p, run_offset)
    square = q.shape[-2] == k.shape[-2]
    if run_offset is not None:
        mask = "causal" if run_offset == 0 else "causal_lower_right"
    elif is_causal and square and attn_mask is None:
        mask = "causal"
    elif attn_mask is not None or is_causal:
        mask = "dense"  # (is_causal with L != S, top-left: flash refuses it, as a mask)
    else:
        mask = "none"
    cap, cudnn = _cuda_facts(q.device.index or 0)
    name, run_hd = cuda_attention_route(hd, q.dtype, mask, dropout_p, cap, cudnn_version=cudnn)
    if run_hd != hd:
        pad = (0, run_hd - hd)
        o = _sdpa_call(F.pad(q, pad), F.pad(k, pad), F.pad(v, pad), attn_mask, is_causal,
                       dropout_p, run_offset, scale=1.0 / math.sqrt(hd))   # (B, H, L, run_hd)
        return o[..., :hd]
    small = q.shape[:-1].numel() * k.shape[-2] * q.element_size() <= MAX_PROB_BYTES  # P fits
    if name == "matmul" and small and not tracing():
        if offset is not None:
            return attention_causal_matmul(q, k, v, offset)
        if not is_causal:
            return _MatmulAttention.apply(q, k, v, attn_mask)
        if square and attn_mask is None:
            return attention_causal_matmul(q, k, v)
    return _sdpa_call(q, k, v, attn_mask, is_causal, dropout_p, run_offset)


# --------------------------------------------------------------------------- a config's calls

class AttentionCall(NamedTuple):
    """One kind of attention call a model makes in training, and what runs it on CUDA."""

    name: str          # which attention, e.g. "self-attention over memory"
    head_dim: int
    mask: str          # one of SDPA_MASKS
    dropout: float
    routed: bool       # through srupp's attend (and its route), or SDPA itself
    pytorch: str       # what SDPA alone runs: cuda_sdpa_backend
    backend: str       # what runs: cuda_attention_route's backend when routed
    run_head_dim: int  # the head dim it runs at (padded where the route pads)


_PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _field(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def attention_calls(config: Any, precision: Union[str, torch.dtype] = "bf16",
                    capability: tuple = (9, 0), *,
                    cudnn_version: Optional[int] = CUDNN_OF_TORCH_2_11) -> List[AttentionCall]:
    """The attention calls an SRU++ model makes in training, and the backend of each on CUDA.

    Args:
        config: an SRU++ model config (``RunConfig.model_config(...)``, or
            ``srupp.models.config_from_dict``), or a mapping of its fields; read:
            task, type, resolved_proj_size (or proj_size), num_heads, attn_dropout,
            mem_len (language models), cross_attention (translation).
        precision: "fp32", "bf16", "fp16" (the recipe's ``train.precision``) or a dtype.
        capability, cudnn_version: as :func:`cuda_sdpa_backend`.
    Returns:
        The calls, the one that carries training first: a language model's over its
        memory (the first segment has none), the padded self-attention otherwise.
    """
    dtype = _PRECISIONS.get(precision, precision)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"precision must be one of {tuple(_PRECISIONS)} or a torch.dtype, "
                         f"got {precision!r}")
    task, kind = _field(config, "task", "lm"), _field(config, "type", "srupp")
    if kind != "srupp":
        raise ValueError(f"attention_calls maps SRU++ models (type 'srupp'), got type {kind!r}")
    width = _field(config, "resolved_proj_size") or _field(config, "proj_size")
    heads = _field(config, "num_heads", 1)
    if not isinstance(width, int) or not isinstance(heads, int) or heads < 1 or width % heads:
        raise ValueError(f"the config needs proj_size (d') divisible by num_heads; got "
                         f"proj_size={width!r}, num_heads={heads!r}")
    hd, p = width // heads, float(_field(config, "attn_dropout", 0.0) or 0.0)
    if task == "lm":
        wanted = [("self-attention, first segment", "causal", True)]
        if _field(config, "mem_len") != 0:
            wanted.insert(0, ("self-attention over memory", "causal_lower_right", True))
    elif task == "classify":
        wanted = [("self-attention, padded keys", "dense", True)]
    elif task == "translate":
        wanted = [("encoder self-attention, padded keys", "dense", True),
                  ("decoder self-attention, causal and padded", "dense", True)]
        if _field(config, "cross_attention", "sublayer") == "sublayer":
            wanted.append(("cross-attention sub-layer, padded source", "dense", True))
    else:
        raise ValueError(f"task must be lm, classify or translate, got {task!r}")
    calls = []
    rule = dict(cudnn_version=cudnn_version)
    for name, mask, routed in wanted:
        pytorch = cuda_sdpa_backend(hd, dtype, mask, p, capability, **rule)
        backend, run_hd = (cuda_attention_route(hd, dtype, mask, p, capability, **rule)
                           if routed else (pytorch, hd))
        calls.append(AttentionCall(name, hd, mask, p, routed, pytorch, backend, run_hd))
    return calls


def attention_backend_for(config: Any, precision: Union[str, torch.dtype] = "bf16",
                          capability: tuple = (9, 0), *,
                          cudnn_version: Optional[int] = CUDNN_OF_TORCH_2_11) -> str:
    """The backend of the attention call that carries an SRU++ model's training on CUDA
    (the first of :func:`attention_calls`): "cudnn", "flash", "efficient", "matmul" or
    "math"."""
    return attention_calls(config, precision, capability, cudnn_version=cudnn_version)[0].backend
