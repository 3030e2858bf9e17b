"""Element-wise recurrence kernels.

``sru_recurrence`` is the one entry point the layers call. It checks its
arguments once (all backends reject the same bad input with the same
ValueError / TypeError), then dispatches to a backend:

``"reference"``
    :func:`sru_recurrence_reference`, the plain PyTorch loop over time (the
    oracle the fast kernels are tested against; autograd does its backward).
``"cpu"``
    the fused, multithreaded, vectorised C++ kernel (:mod:`srupp.ops.cpu`),
    compiled on first use, for CPU tensors in float32 / bfloat16.
``"triton"``
    Triton kernels for CUDA tensors (``srupp.ops.triton_kernel``, imported lazily).
``"auto"`` (default)
    the fast kernel for the tensors' device when it applies and is available
    (CPU -> "cpu", CUDA -> "triton"), else the reference. float64 inputs (gradcheck)
    and other devices always use the reference. If the C++ build fails, one warning
    is given and the reference is used from then on.

Both fast backends run through the same ``torch.library`` custom ops,
``srupp::sru_fwd`` / ``srupp::sru_bwd`` (:mod:`srupp.ops.custom_ops`), which route
by device and work under ``torch.compile(fullgraph=True)``.

Choose a backend with :func:`set_backend`, temporarily with the :func:`use_backend`
context manager, or for a whole process with ``SRUPP_BACKEND``. A forced "cpu" or "triton"
backend raises if it can't run the given tensors (wrong device, or the kernel is
unavailable), except that float64 inputs still go to the reference.

Around the recurrence, the layers' projections and attention have their own
fast paths with plain references beside them: :mod:`srupp.ops.matmul`
(``linear``: oneDNN for large fp32 CPU products) and :mod:`srupp.ops.sdpa`
(``attention``: explicit bf16 matrix products on CPU for short windows). One
settings object, :func:`backends`, holds the three choices
(:mod:`srupp.ops.settings`).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import cpu
from .custom_ops import sru_bwd, sru_fwd
from .matmul import (get_matmul_backend, linear, linear_onednn, linear_reference,
                     set_matmul_backend, use_matmul_backend)
from .reference import check_args, compute_dtype, sru_recurrence_reference
from .sdpa import (attention, attention_causal_matmul, attention_matmul, attention_reference,
                   get_attention_backend, set_attention_backend, use_attention_backend)
from .settings import CHOICES, Backends, backends, cpu_has_native_bf16

__all__ = [
    "sru_recurrence", "sru_recurrence_reference", "compute_dtype",
    "set_backend", "get_backend", "use_backend", "BACKENDS",
    "linear", "linear_reference", "linear_onednn",
    "set_matmul_backend", "get_matmul_backend", "use_matmul_backend",
    "attention", "attention_reference", "attention_matmul", "attention_causal_matmul",
    "set_attention_backend", "get_attention_backend", "use_attention_backend",
    "backends", "Backends", "cpu_has_native_bf16",
]

BACKENDS = CHOICES["recurrence"]
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)

def set_backend(name: str) -> None:
    """Force a backend: "reference", "cpu", "triton", or "auto" (the default)."""
    backends().recurrence = name


def get_backend() -> str:
    """The recurrence backend (:func:`srupp.ops.backends`; ``SRUPP_BACKEND`` the first time)."""
    return backends().recurrence


def use_backend(name: str):
    """Context manager: run the enclosed code with backend ``name``, then restore the setting."""
    return backends().use("recurrence", name)


@torch.compiler.assume_constant_result
def _cpu_kernel_available() -> bool:
    # Builds the extension on the first call. Under torch.compile this runs once at
    # trace time and its result is baked into the graph.
    return cpu.is_available()


_triton_state: Optional[bool] = None


@torch.compiler.assume_constant_result
def _triton_available() -> bool:
    global _triton_state
    if _triton_state is None:
        try:
            from . import triton_kernel

            _triton_state = all(hasattr(triton_kernel, f)
                                for f in ("sru_fwd_triton", "sru_bwd_triton_op"))
        except Exception:
            _triton_state = False
    return _triton_state


def _select(U, x, weight_c, bias, c0, dropout_mask) -> str:
    """'reference' or 'kernel' (the custom op) for these tensors."""
    name = get_backend()
    if name == "reference":
        return "reference"
    tensors = [t for t in (U, x, weight_c, bias, c0, dropout_mask) if t is not None]
    if not all(t.dtype in _KERNEL_DTYPES for t in tensors):
        return "reference"  # float64 (gradcheck) and anything else exotic
    dev = U.device.type
    if name == "auto":
        if dev == "cpu":
            return "kernel" if _cpu_kernel_available() else "reference"
        if dev == "cuda":
            return "kernel" if _triton_available() else "reference"
        return "reference"
    want = {"cpu": "cpu", "triton": "cuda"}[name]
    if dev != want:
        raise RuntimeError(f"srupp backend {name!r} runs {want} tensors, got {dev} tensors")
    if name == "cpu" and not _cpu_kernel_available():
        raise RuntimeError(f"srupp backend 'cpu' is unavailable: {cpu.build_error()}")
    if name == "triton" and not _triton_available():
        raise RuntimeError("srupp backend 'triton' is unavailable (srupp.ops.triton_kernel "
                           "could not be imported)")
    return "kernel"


def sru_recurrence(U, x, weight_c, bias, c0=None, *, scale_x=1.0, mask_pad=None,
                   dropout_mask=None, bidirectional=False):
    """Run the SRU recurrence on the best available backend.

    Same arguments, shapes and results as :func:`sru_recurrence_reference`:
    U (B, L, k, D), x (B, L, D) or None, weight_c and bias (2, D), c0 (B, D),
    mask_pad (B, L) bool, dropout_mask (B, D); returns h (B, L, D) and c_last (B, D).
    Raises ValueError / TypeError for arguments that don't fit (see
    :func:`~srupp.ops.reference.check_args`), whatever the backend.
    """
    check_args(U, x, weight_c, bias, c0, mask_pad, dropout_mask, bidirectional)
    if _select(U, x, weight_c, bias, c0, dropout_mask) == "reference":
        return sru_recurrence_reference(
            U, x, weight_c, bias, c0, scale_x=scale_x, mask_pad=mask_pad,
            dropout_mask=dropout_mask, bidirectional=bidirectional,
        )
    # Keep per-step state only when a backward can follow.
    store_c = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (U, x, weight_c, bias, c0))
    if mask_pad is not None and mask_pad.dtype != torch.bool:
        mask_pad = mask_pad.to(torch.bool)
    if not store_c and U.device.type == "cpu" and not torch.compiler.is_compiling():
        # Inference in eager mode: call the C++ kernel directly. The custom op's
        # Python dispatch costs ~15 us a call, several times a decoding step's work.
        h, c_last, _ = cpu.load().sru_fwd(U, x, weight_c, bias, c0, mask_pad, dropout_mask,
                                          float(scale_x), bool(bidirectional), False)
        return h, c_last
    h, c_last, _ = sru_fwd(U, x, weight_c, bias, c0, mask_pad, dropout_mask,
                           float(scale_x), bool(bidirectional), store_c)
    return h, c_last


def warm_up(device="cpu") -> None:
    """Build the fast kernel for ``device`` now (compilation is once; callers time what follows)."""
    if torch.device(device).type == "cpu" and get_backend() in ("auto", "cpu"):
        _cpu_kernel_available()
