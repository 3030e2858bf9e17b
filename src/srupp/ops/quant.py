"""Weight-only int8 products for decoding: ``y = x @ (scale · Wq)ᵀ (+ b)``.

Decoding one token reads every weight once, so its speed is the memory
bandwidth over the weights' bytes: int8 weights read a quarter of fp32's bytes
and half of bf16's. The activations stay fp32 or bf16; only the weights are
quantized:

* symmetric, one scale per output feature (row of W): ``scale = max|W_row| / 127``,
  ``Wq = round(W / scale)`` in [-127, 127], so ``W ≈ scale · Wq`` with an error of
  at most ``scale / 2`` per weight (:func:`quantize_per_channel`);
* the product sums ``x · Wq`` in fp32 and multiplies by the scale once per
  output (:func:`linear_int8`).

``linear_int8`` dispatches:

* up to :data:`INT8_FEW_ROWS` rows (decoding: batch × 1 token) on CPU, without
  gradient: the C++ extension's ``linear_int8_rows`` kernel. It widens 16 int8
  weights at a time to fp32 in registers and multiplies them into every row
  of x (:func:`linear_int8_rows`). It is called directly, not as a custom op:
  a decoding step makes a dozen such calls of a few microseconds each, and a
  dispatcher round trip would add about as much again. PyTorch's own ``aten._weight_int8pack_mm`` computes the same thing, but reads
  the weights far below the memory bandwidth at these shapes
  (docs/performance.md, "int8 weights");
* everything else (a prompt's prefill, evaluation over long segments, other
  devices): the weight is dequantized to x's dtype and multiplied by
  :func:`srupp.ops.linear`, whose GEMM reuses each weight across many rows;
* under tracing (``torch.export``, ``torch.jit``): :func:`linear_int8_reference`.

The reference, :func:`linear_int8_reference`, dequantizes in fp32 and calls
``F.linear`` in fp32; the kernel sums in another order (fp32 rounding apart)
and rounds its output to x's dtype once.

**int8 activations too** (``w8a8``, :func:`linear_w8a8`): each row of x is
rounded to int8 with its own scale per call (``scale_x = max|x_row| / 127``,
dynamic quantization, as ONNX Runtime's ``quantize_dynamic`` does), and the
product is an exact integer dot product scaled once:
``y = (xq · Wqᵀ) · scale_x · scale (+ bias)``. Integer products let the kernel
use VNNI (``vpdpbusd``: 64 int8 products per instruction) where the CPU has it,
instead of widening each weight to fp32; the price is the activations' rounding
(at most ``scale_x / 2`` per element). Every path computes the same integer
sums, so the kernel (VNNI or its plain loop), the many-rows path and the
reference agree to the last bit of the sums; only the final scaling may round
differently (an FMA).

The weights are for inference only: no gradient flows to them, and asking for
one through x is a ValueError (train the float model, quantize it afterwards).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu_kernels
from .matmul import linear
from .settings import tracing

__all__ = ["quantize_per_channel", "dequantize", "linear_int8", "linear_int8_reference",
           "int8_kernel_applies", "linear_int8_rows", "quantize_rows", "linear_w8a8",
           "linear_w8a8_reference", "linear_w8a8_rows", "w8a8_vnni", "INT8_FEW_ROWS",
           "INT8_MAX", "W8A8_MAX_K"]

#: Wq's range is [-INT8_MAX, INT8_MAX]: symmetric, so -128 is never used.
INT8_MAX = 127

#: Up to this many rows the kernel reads the int8 weights directly (once per 8 rows);
#: beyond it one dequantized copy and a GEMM reuse each weight across all rows.
INT8_FEW_ROWS = 32

#: w8a8 sums K products of at most 255 · 127 in int32 (the VNNI kernel offsets x by 128):
#: beyond this many input features a sum could overflow.
W8A8_MAX_K = 65_536


def _symmetric_rows(t: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Per-row symmetric int8 of t (..., K): ``(q int8, scale fp32 (...), finite (...))``.

    ``scale = max|row| / 127`` in fp32 (1 for a row of zeros), ``q = round(row / scale)``
    (half to even) in [-127, 127]. Rows holding inf or nan come back as zeros with
    ``finite`` False: the callers decide what they mean.
    """
    tf = t.float()
    absmax = tf.abs().amax(dim=-1)                                      # (...)
    finite = torch.isfinite(absmax)
    scale = torch.where(finite & (absmax > 0), absmax / INT8_MAX, torch.ones_like(absmax))
    q = torch.round(tf / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX)
    q = torch.where(finite[..., None], q, torch.zeros_like(q)).to(torch.int8)
    return q, scale, finite


def quantize_per_channel(weight: Tensor) -> Tuple[Tensor, Tensor]:
    """Symmetric int8 quantization with one scale per output feature.

    Args:
        weight: (N, K) floating point.
    Returns:
        ``(qweight, scale)``: qweight (N, K) int8 in [-127, 127] and scale (N,)
        float32, with ``weight ≈ scale[:, None] * qweight``. A row of zeros gets
        scale 1 (and zeros).
    """
    if not isinstance(weight, Tensor) or not weight.is_floating_point() or weight.dim() != 2:
        got = (f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, Tensor)
               else type(weight).__name__)
        raise TypeError(f"quantize_per_channel needs a floating-point weight (N, K), got {got}")
    q, scale, finite = _symmetric_rows(weight.detach())
    if not bool(finite.all()):
        raise ValueError("the weight holds inf or nan, which int8 cannot represent")
    return q, scale


def quantize_rows(x: Tensor) -> Tuple[Tensor, Tensor]:
    """Dynamic int8 of activations, one scale per row (what :func:`linear_w8a8` does to x).

    Args:
        x: (..., K) floating point.
    Returns:
        ``(xq, scale)``: xq (..., K) int8 in [-127, 127] and scale (...) float32 with
        ``x ≈ scale[..., None] * xq``. A row holding inf or nan gets scale nan (and
        zeros), so that the products it enters are nan, as a float product's would be.
    """
    q, scale, finite = _symmetric_rows(x)
    return q, torch.where(finite, scale, torch.full_like(scale, float("nan")))


def dequantize(qweight: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``scale[:, None] * qweight`` (N, K), computed in fp32, returned in ``dtype``."""
    return (qweight.float() * scale.float()[:, None]).to(dtype)


def linear_int8_reference(x: Tensor, qweight: Tensor, scale: Tensor,
                          bias: Optional[Tensor] = None) -> Tensor:
    """The plain meaning of :func:`linear_int8`: dequantize and ``F.linear``, in fp32.

    x (..., K), qweight (N, K) int8, scale (N,), bias (N,) or None -> (..., N) in x's dtype.
    """
    b = None if bias is None else bias.float()
    return F.linear(x.float(), dequantize(qweight, scale), b).to(x.dtype)


def linear_w8a8_reference(x: Tensor, qweight: Tensor, scale: Tensor,
                          bias: Optional[Tensor] = None) -> Tensor:
    """The plain meaning of :func:`linear_w8a8`: round x per row, sum exactly, scale.

    x (..., K), qweight (N, K) int8, scale (N,), bias (N,) or None -> (..., N) in x's
    dtype. The integer sums are taken in float64, exact for K up to 2^38 (each product
    is below 2^14), then rounded to fp32 as an int32 would be.
    """
    xq, sx = quantize_rows(x)                                           # (..., K), (...)
    dots = (xq.double() @ qweight.double().t()).float()                 # (..., N) exact sums
    y = dots * (sx[..., None] * scale.float())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def linear_int8_rows(x: Tensor, qweight: Tensor, scale: Tensor, bias: Optional[Tensor],
                     plain: bool = False) -> Tensor:
    """The extension's kernel: x (M, K) fp32 or bf16, contiguous -> (M, N) in x's dtype.

    ``plain`` takes its portable loop even where its AVX-512 loop is built (the tests
    compare both with the reference).
    """
    kernel = _kernel()
    if not kernel:
        raise RuntimeError(f"the C++ CPU extension is not available "
                           f"({cpu_kernels.build_error()})")
    return kernel(x, qweight, scale, bias, bool(plain))


def linear_w8a8_rows(x: Tensor, qweight: Tensor, scale: Tensor, bias: Optional[Tensor],
                     plain: bool = False) -> Tensor:
    """The extension's w8a8 kernel: x (M, K) fp32 or bf16, contiguous -> (M, N) in x's
    dtype. ``plain`` takes its portable loop even where its VNNI loop is built."""
    kernel = _kernel("linear_w8a8_rows")
    if not kernel:
        raise RuntimeError(f"the C++ CPU extension is not available "
                           f"({cpu_kernels.build_error()})")
    return kernel(x, qweight, scale, bias, bool(plain))


def w8a8_vnni() -> bool:
    """Whether the built extension's w8a8 kernel uses VNNI (else its plain loop)."""
    flag = _kernel("linear_w8a8_rows_vnni")
    return bool(flag and flag())


def _kernel(name: str = "linear_int8_rows"):
    """The extension's function ``name``, or None when it is not built."""
    return cpu_kernels.function(name)


def int8_kernel_applies(x: Tensor) -> bool:
    """Whether :func:`linear_int8` sends x to the C++ kernel: at most
    :data:`INT8_FEW_ROWS` rows of fp32 or bf16 on CPU, and the extension built."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if x.dim() == 0 or x.numel() > INT8_FEW_ROWS * x.shape[-1]:
        return False
    return bool(_kernel())


def _check(x: Tensor, qweight: Tensor, scale: Tensor, bias: Optional[Tensor]) -> None:
    _check_shapes(x, qweight, scale, bias)
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError("int8 weights are for inference: nothing here is differentiable. "
                         "Run under torch.no_grad() (or torch.inference_mode()), or train "
                         "the float model and quantize it afterwards")


def _check_shapes(x: Tensor, qweight: Tensor, scale: Tensor, bias: Optional[Tensor]) -> None:
    if not isinstance(qweight, Tensor) or qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise TypeError(f"qweight must be an int8 tensor (N, K), got "
                        f"{getattr(qweight, 'dtype', type(qweight).__name__)}; make one with "
                        f"srupp.ops.quantize_per_channel")
    N, K = qweight.shape
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() == 0 \
            or x.shape[-1] != K:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x must be a floating-point tensor (..., {K}) for a weight of "
                         f"{K} input features, got {got}")
    if scale.shape != (N,) or (bias is not None and bias.shape != (N,)):
        raise ValueError(f"scale and bias must be ({N},), one value per output feature; got "
                         f"scale {tuple(scale.shape)}"
                         + ("" if bias is None else f" and bias {tuple(bias.shape)}"))


def linear_int8(x: Tensor, qweight: Tensor, scale: Tensor,
                bias: Optional[Tensor] = None) -> Tensor:
    """``x @ (scale · qweight)ᵀ (+ bias)`` on the best path (see the module docstring).

    Args:
        x: (..., K) fp32 or bf16 (other float dtypes take the dequantized path).
        qweight: (N, K) int8.  scale: (N,).  bias: (N,) or None.
    Returns:
        (..., N) in x's dtype.
    """
    _check(x, qweight, scale, bias)
    if tracing():
        return linear_int8_reference(x, qweight, scale, bias)
    if int8_kernel_applies(x):                                          # decoding
        x2 = x.reshape(-1, x.shape[-1]).contiguous()    # (M, K): no copy when x is already
        y = _kernel()(x2, qweight.contiguous(), scale, bias, False)    # (M, N)
        return y.view(*x.shape[:-1], qweight.shape[0])
    w = dequantize(qweight, scale, x.dtype)                             # (N, K)
    return linear(x, w, None if bias is None else bias.to(x.dtype))


def linear_w8a8(x: Tensor, qweight: Tensor, scale: Tensor,
                bias: Optional[Tensor] = None) -> Tensor:
    """``(round(x / scale_x) · qweightᵀ) · scale_x · scale (+ bias)``, x rounded per row.

    Args:
        x: (..., K) fp32 or bf16, K at most :data:`W8A8_MAX_K`.
        qweight: (N, K) int8.  scale: (N,).  bias: (N,) or None.
    Returns:
        (..., N) in x's dtype. Few rows on CPU take the C++ kernel (VNNI where the CPU
        has it); everything else, and tracing, takes :func:`linear_w8a8_reference`,
        which computes the same sums.
    """
    _check(x, qweight, scale, bias)
    if x.shape[-1] > W8A8_MAX_K:
        raise ValueError(f"w8a8 sums at most {W8A8_MAX_K} products per output in int32, "
                         f"got {x.shape[-1]} input features; use int8 (weight-only) for "
                         f"this layer")
    if not tracing() and int8_kernel_applies(x):                        # decoding
        x2 = x.reshape(-1, x.shape[-1]).contiguous()                    # (M, K)
        y = _kernel("linear_w8a8_rows")(x2, qweight.contiguous(), scale, bias, False)
        return y.view(*x.shape[:-1], qweight.shape[0])
    return linear_w8a8_reference(x, qweight, scale, bias)
