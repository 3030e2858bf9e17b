"""Per-dtype tolerances for comparing a fast path with its reference.

Importable from any test file (pytest puts ``tests/`` on ``sys.path``). These
are the defaults for whole layers and models, where both sides compute the
same expressions in a different order (GEMM blocking, fused kernels, SDPA):
* float64: gradcheck territory; only summation order differs.
* float32: a few ulps of O(1) values through a handful of GEMMs and a
  recurrence; 1e-5 relative (2^-23 is 1.2e-7 per rounding).
* bfloat16 (8-bit significand, 2^-8 = 3.9e-3 per rounding) and float16
  (11-bit, 4.9e-4): inputs and outputs are rounded, accumulation is fp32, and
  a layer rounds several times between its GEMMs.
Kernel tests that know their exact error keep tighter tolerances of their own.
"""

import torch

TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
    torch.float16: dict(rtol=4e-3, atol=4e-3),
}


def tol(dtype: torch.dtype) -> dict:
    """``rtol``/``atol`` for ``torch.testing.assert_close`` at ``dtype``."""
    return TOL[dtype]


def half_dtypes(device: torch.device):
    """The reduced precisions worth testing on ``device``: bf16 everywhere, fp16 on CUDA
    (srupp's CPU paths compute fp16 through the reference only)."""
    return (torch.bfloat16, torch.float16) if device.type == "cuda" else (torch.bfloat16,)
