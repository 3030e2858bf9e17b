"""Scaled dot-product attention, with a faster bf16 CPU path for short windows.

SRU++ attends in a small width (d′ = d/4, often one head) over one segment and
its memory. For those shapes PyTorch's fused CPU kernel
(``F.scaled_dot_product_attention``'s flash path) is no faster in bf16 than in
fp32, while plain batched matrix products in bf16 run at 2× the fp32 rate. So
for bf16 CPU inputs the attention is computed as written in the paper,
with the probabilities kept for the backward::

    S = (q · scale) Kᵀ + mask          (B, H, L, S)
    P = softmax(S)                      (B, H, L, S)
    o = P V                             (B, H, L, hd)

    backward:  dV = Pᵀ dO,  dP = dO Vᵀ,  dS = P ⊙ (dP − rowsum(dP ⊙ P)),
               dq = dS K · scale,  dK = dSᵀ q · scale

Measured here with ``benchmarks/attention.py --L 256 --d 128`` (B=16, L=S=256,
d′=128, causal, forward + backward): 8.6 ms against 17.7 ms for the fused kernel
in bf16; in fp32 the fused kernel is as fast (17.6 against 19.5 ms), so fp32
stays on it. The cost is memory: P is kept, B·H·L·S
elements, so the path is used only while P fits in :data:`MAX_PROB_BYTES`.
Precision is that of any bf16 matmul attention (the scores are rounded to bf16
before the softmax); the tests bound it against fp32.

``attention`` dispatches: the explicit path above ("matmul") when the inputs are
bf16 CPU tensors on a CPU with bf16 matrix instructions (AVX-512 BF16 or AMX,
see :func:`native_bf16_matmul`), there is no attention dropout, P fits, and nothing is
tracing the model (``torch.compile``/export see plain SDPA); SDPA ("sdpa")
otherwise. ``SRUPP_ATTENTION=auto|sdpa|matmul`` or :func:`set_attention_backend`
forces one (a forced "matmul" still defers to SDPA for dropout).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ._setting import BackendSetting, tracing

__all__ = ["attention", "attention_reference", "attention_matmul", "set_attention_backend",
           "get_attention_backend", "use_attention_backend", "native_bf16_matmul",
           "ATTENTION_BACKENDS", "MAX_PROB_BYTES"]

ATTENTION_BACKENDS = ("auto", "sdpa", "matmul")

# Largest P (B·H·L·S elements) the explicit path keeps for its backward.
MAX_PROB_BYTES = 256 * 2**20

_setting = BackendSetting("attention", "SRUPP_ATTENTION", ATTENTION_BACKENDS)


def set_attention_backend(name: str) -> None:
    """Force the attention backend: "sdpa", "matmul", or "auto" (the default)."""
    _setting.set(name)


def get_attention_backend() -> str:
    """The setting (reading ``SRUPP_ATTENTION`` the first time)."""
    return _setting.get()


def use_attention_backend(name: str):
    """Context manager: run the enclosed code with attention backend ``name``, then restore."""
    return _setting.use(name)


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


class _MatmulAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                is_causal: bool) -> Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        with torch.autocast(q.device.type, enabled=False):
            # K and V arrive as halves of one [K | V] projection; each product below
            # would copy them to a dense layout again, so do it once (measured ~5%).
            k, v = k.contiguous(), v.contiguous()
            s = torch.matmul(q * scale, k.transpose(-2, -1))          # (B, H, L, S)
            L, S = s.shape[-2:]
            if is_causal:
                s.masked_fill_(torch.ones(L, S, dtype=torch.bool, device=s.device).triu_(1),
                               float("-inf"))
            elif attn_mask is not None:
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
        return dq, dk, dv, None, None


def attention_matmul(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                     is_causal: bool = False) -> Tensor:
    """Attention as explicit matrix products, keeping P for the backward.

    Same arguments and result as :func:`attention_reference` (no dropout), in
    any floating dtype on any device; the dispatcher uses it for bf16 on CPU. (fp16
    is not sent here: without fp16 matrix hardware it measured slower than SDPA
    on this CPU, 282 against 190 ms forward and backward for B=16, L=256,
    d′=128; ``benchmarks/attention.py --L 256 --d 128 --dtypes fp16``.)
    """
    if is_causal and (attn_mask is not None or q.shape[-2] != k.shape[-2]):
        raise ValueError("is_causal needs L == S and no attn_mask")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    return _MatmulAttention.apply(q, k, v, attn_mask, is_causal)


_native_bf16: Optional[bool] = None


def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX-512 BF16 or AMX).

    Without it, bf16 products are emulated and the explicit path loses its edge,
    so the dispatcher keeps SDPA.
    """
    global _native_bf16
    if _native_bf16 is None:
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        try:
            _native_bf16 = any(getattr(torch.cpu, p, lambda: False)() for p in probes)
        except Exception:  # noqa: BLE001 - unknown means "no"
            _native_bf16 = False
    return _native_bf16


def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
              is_causal: bool = False, dropout_p: float = 0.0) -> Tensor:
    """Scaled dot-product attention on the best backend for these tensors.

    Args:
        q: (B, H, L, hd).  k, v: (B, H, S, hd).
        attn_mask: bool (B|1, 1|H, L, S) with True = may attend, or additive
            float (B|1, 1|H, L, S); or None.
        is_causal: query i sees keys j <= i (L == S, no attn_mask).
        dropout_p: dropout on the attention weights (SDPA handles it).
    Returns:
        o (B, H, L, hd), in q's dtype.
    """
    name = get_attention_backend()
    if name == "sdpa" or dropout_p > 0.0 or tracing():
        return attention_reference(q, k, v, attn_mask, is_causal, dropout_p)
    if name == "matmul":
        return attention_matmul(q, k, v, attn_mask, is_causal)
    B, H, L, _ = q.shape
    small = B * H * L * k.shape[-2] * q.element_size() <= MAX_PROB_BYTES
    if (q.device.type == "cpu" and q.dtype == torch.bfloat16 and small
            and q.dtype == k.dtype == v.dtype and native_bf16_matmul()):
        return _MatmulAttention.apply(q, k, v, attn_mask, is_causal)
    return attention_reference(q, k, v, attn_mask, is_causal, dropout_p)
