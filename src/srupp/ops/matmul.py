"""Dense projections ``x @ Wᵀ (+ b)`` with faster CPU paths for training and decoding.

An SRU++ layer is mostly three bias-free linear maps (W1, W2, W3), so in fp32 on
CPU a training step is mostly matrix multiplication. PyTorch sends fp32
CPU matmuls to MKL. oneDNN, which PyTorch already ships and uses for bf16, has
its own fp32 GEMM, reachable through ``torch.ops.mkldnn._linear_pointwise``
(the op inductor's CPU freezing pass lowers linear layers to). For SRU++'s
shapes it is faster than MKL for ``x @ Wᵀ`` and for the input gradient ``g @ W``;
for the weight gradient ``gᵀ @ x`` it is slower (it copies the transposes), so
that one stays on MKL (``benchmarks/gemm.py``; the figures are in
docs/performance.md, "Projections: oneDNN against MKL"). Both are IEEE fp32
GEMMs: results differ only in summation order (about 1e-7 relative).

``linear(x, weight)`` is what the layers call. It dispatches:

``"onednn"``
    the autograd function below: forward and input gradient on oneDNN, weight
    gradient on ``torch.mm``. Taken for fp32 CPU tensors with at least
    :data:`MIN_ROWS` rows, outside autocast, ``torch.compile``, ``torch.export``
    and ``torch.jit`` tracing (those see plain ``F.linear``).
``"aten"``
    :func:`linear_reference`, i.e. ``F.linear``, for everything else.
``"auto"`` (default)
    the few-rows kernel for decoding (below), else "onednn" where it applies
    and oneDNN is available, else "aten".

Decoding multiplies one row (one token per sequence) by each weight. There
BLAS's GEMM reads the weight far below memory bandwidth, so in "auto" up to
:data:`FEW_ROWS` rows (8 in fp32, 2 in bf16) that need no gradient go to the C++ extension's
``linear_rows`` kernel (:func:`linear_few_rows`, fp32 or bf16, sums in fp32).

Force one with :func:`set_matmul_backend`, :func:`use_matmul_backend` or, for a
whole process, ``SRUPP_MATMUL=auto|aten|onednn`` (:mod:`srupp.ops.settings`).
The choice is a rule, not a timing taken at start-up, so a run and its resumed
continuation compute bit for bit the same thing.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu_kernels
from .settings import CHOICES, accessors, tracing

__all__ = ["linear", "linear_reference", "linear_onednn", "onednn_available",
           "linear_few_rows", "few_rows_applies", "linear_route", "FEW_ROWS", "few_rows",
           "batch_invariant",
           "set_matmul_backend", "get_matmul_backend", "use_matmul_backend",
           "MATMUL_BACKENDS", "MIN_ROWS"]

MATMUL_BACKENDS = CHOICES["matmul"]

# Up to this many rows (decoding: batch × 1 token), products without gradient go to
# the extension's few-rows kernel, per dtype: at a few rows BLAS reads the weights far
# below memory bandwidth and the kernel does not; past these counts BLAS's blocked
# GEMM (bf16: oneDNN's dot-product instructions) wins (docs/performance.md).
FEW_ROWS = {torch.float32: 8, torch.bfloat16: 2}

# Set by batch_invariant(): the row count up to which products take the few-rows kernel
# instead of FEW_ROWS (None: FEW_ROWS).
_invariant_rows: Optional[int] = None


def few_rows(dtype: torch.dtype) -> int:
    """The row count up to which products of ``dtype`` take the few-rows kernel:
    :data:`FEW_ROWS`, or what :func:`batch_invariant` sets (0 for other dtypes)."""
    if _invariant_rows is not None:
        return _invariant_rows
    return FEW_ROWS.get(dtype, 0)


@contextlib.contextmanager
def batch_invariant(max_rows: int):
    """Within it, products of up to ``max_rows`` rows take the few-rows kernel, which
    computes every row the same way whatever the number of rows: a row's result is then
    the same alone or in any batch (BLAS's blocking depends on the batch). A serving
    engine decodes under it, so that a stream's tokens do not depend on its neighbours.
    Process-wide (not per thread): enter it from the one thread that runs the model."""
    global _invariant_rows
    before, _invariant_rows = _invariant_rows, int(max_rows)
    try:
        yield
    finally:
        _invariant_rows = before


# Below this many rows (batch × time) oneDNN's per-call overhead outweighs its
# faster inner kernel (docs/performance.md).
MIN_ROWS = 128

# set_matmul_backend("aten" | "onednn" | "auto"), get_matmul_backend() (``SRUPP_MATMUL``
# the first time), use_matmul_backend(name): a context manager
set_matmul_backend, get_matmul_backend, use_matmul_backend = accessors("matmul")


@functools.lru_cache(maxsize=None)
def onednn_available() -> bool:
    """Whether this torch build has oneDNN and its fp32 linear op."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(
            torch.ops.mkldnn, "_linear_pointwise")
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return False


def linear_reference(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weightᵀ``: x (..., K), weight (N, K) -> (..., N). Plain ``F.linear``."""
    return F.linear(x, weight)


def _onednn_mm(a: Tensor, w: Tensor) -> Tensor:
    """a (M, K) @ w (N, K)ᵀ -> (M, N) on oneDNN's fp32 GEMM."""
    return torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])                      # (M, K); copies only if strided
        ctx.save_for_backward(x2 if weight.requires_grad else None,
                              weight if x.requires_grad else None)
        ctx.x_shape = x.shape
        return _onednn_mm(x2, weight).view(*x.shape[:-1], weight.shape[0])  # (..., N)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x2, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])                 # (M, N)
        gx = gw = None
        if ctx.needs_input_grad[0]:
            if torch.is_grad_enabled():  # create_graph: differentiable ops for a double backward
                gx = g2.mm(weight).view(ctx.x_shape)
            else:
                gx = _onednn_mm(g2, weight.t()).view(ctx.x_shape)  # (M, N) @ (N, K)
        if ctx.needs_input_grad[1]:
            gw = g2.t().mm(x2)                                 # (N, M) @ (M, K) on MKL
        return gx, gw


def linear_onednn(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weightᵀ`` through oneDNN (fp32 CPU only): x (..., K), weight (N, K) -> (..., N)."""
    if not onednn_available():
        raise RuntimeError("oneDNN is not available in this torch build "
                           "(torch.backends.mkldnn.is_available() is False)")
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        raise RuntimeError(f"the oneDNN path runs float32 CPU tensors, got x {x.dtype} on "
                           f"{x.device.type} and weight {weight.dtype}")
    return _OneDNNLinear.apply(x, weight)


def _rows_kernel():
    """The extension's linear_rows, or None when it is not built."""
    return cpu_kernels.function("linear_rows")


def few_rows_applies(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> bool:
    """Whether :func:`linear` sends ``x @ weightᵀ (+ bias)`` to the few-rows CPU kernel.

    That is: at most :data:`FEW_ROWS` rows (per dtype) on CPU, fp32 or bf16 with every
    operand of one dtype, nothing that needs a gradient, outside autocast,
    and the C++ extension built.
    """
    dt = x.dtype
    if dt not in FEW_ROWS or x.dim() == 0 or x.numel() > few_rows(dt) * x.shape[-1] \
            or x.device.type != "cpu":
        return False
    if weight.dtype != dt or weight.dim() != 2 or (bias is not None and bias.dtype != dt):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return False
    return not torch.is_autocast_enabled("cpu") and bool(_rows_kernel())


def linear_few_rows(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(x, weight, bias)`` by the extension's few-rows kernel (no autograd).

    x (..., K) with few rows (any count works), weight (N, K), bias (N,) or
    None, all fp32 or all bf16 on CPU -> (..., N). Sums in fp32.
    """
    kernel = _rows_kernel()
    if not kernel:
        raise RuntimeError(f"the C++ CPU extension is not available "
                           f"({cpu_kernels.build_error()})")
    if not weight.is_contiguous() and (weight.stride(-1) != 1
                                       or weight.stride(0) < weight.shape[1]):
        weight = weight.contiguous()  # (rows with any stride are read in place)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    if x.dim() == 2 and x.is_contiguous():
        return kernel(x, weight, bias)
    y = kernel(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """Projection ``x @ weightᵀ (+ bias)`` on the best backend.

    Args:
        x: (..., K).  weight: (N, K).  bias: (N,) or None.
    Returns:
        (..., N), like ``F.linear(x, weight, bias)``.
    """
    route = linear_route(x, weight, bias)
    if route == "rows":                                                 # decoding
        return linear_few_rows(x, weight, bias)
    if route == "onednn":
        if get_matmul_backend() == "onednn":
            return linear_onednn(x, weight)
        return _OneDNNLinear.apply(x, weight)
    return F.linear(x, weight, bias)


def linear_route(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> str:
    """Where :func:`linear` sends ``x @ weightᵀ (+ bias)``: "rows" (the few-rows kernel),
    "onednn" or "aten" (``F.linear``), by the backend setting and the operands."""
    name = get_matmul_backend()
    if name == "aten" or tracing():
        return "aten"
    if name == "auto" and few_rows_applies(x, weight, bias):
        return "rows"
    if bias is not None:
        return "aten"
    applies = (x.device.type == "cpu" and x.dtype == torch.float32
               and weight.dtype == torch.float32 and not torch.is_autocast_enabled("cpu"))
    # (a forced "onednn" that doesn't apply, bf16 / autocast / other devices, takes
    # F.linear: oneDNN or cuBLAS already)
    if name == "onednn" and applies:
        return "onednn"
    if applies and onednn_available() and x.numel() >= MIN_ROWS * x.shape[-1]:
        return "onednn"
    return "aten"
