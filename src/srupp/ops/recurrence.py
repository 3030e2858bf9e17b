"""The recurrence's one dispatcher and its one autograd.

:func:`sru_recurrence` checks its arguments (:func:`~srupp.ops.reference.check_args`),
then picks a kernel in :func:`route`: "reference", "cpu" (the C++ kernel of
:mod:`srupp.ops.cpu_kernels`) or "triton" (:mod:`srupp.ops.triton_kernel`). The fast
kernels run through two ``torch.library`` custom ops, which have fake (meta)
implementations for ``torch.compile(fullgraph=True)``; ``sru_fwd``'s backward is
``sru_bwd``:

``sru_fwd(U, x, weight_c, bias, c0, mask_pad, dropout_mask, scale_x, bidirectional, store_c,
triton=False)``
    -> ``(h, c_last, c_all)``: h (B, L, D) in U's dtype, c_last (B, D) fp32, and
    c_all (B, L, D) fp32, the state after every step, which the backward reads.
    With ``store_c=False`` (inference) c_all is an empty tensor and nothing
    per-step is stored; the backward then can't run.

``sru_bwd(U, x, weight_c, bias, c0, mask_pad, dropout_mask, c_all, grad_h, grad_c_last,
scale_x, bidirectional, need_grad_x, triton=False)``
    -> ``(grad_U, grad_x, grad_weight_c, grad_bias, grad_c0)``. grad_x is empty when x
    is None or ``need_grad_x`` is False; grad_c0 is fp32 (B, D).

``triton`` runs the Triton kernels; CUDA tensors always do. Both kernel modules
provide ``sru_fwd`` and ``sru_bwd`` with exactly these arguments and results
(all outputs fresh tensors), and neither checks its arguments: that is done
once, by :func:`sru_recurrence`. mask_pad reaches them as bool.
"""

from __future__ import annotations

import functools
import os
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import cpu_kernels
from .marks import constant_when_compiled
from .reference import check_args, sru_recurrence_reference
from .settings import CHOICES, RECURRENCE_DTYPES, accessors, backends

__all__ = ["sru_recurrence", "set_backend", "get_backend", "use_backend", "BACKENDS",
           "warm_up", "sru_fwd", "sru_bwd"]

BACKENDS = CHOICES["recurrence"]


# set_backend("reference" | "cpu" | "triton" | "auto"), get_backend() (``SRUPP_BACKEND``
# the first time), use_backend(name): a context manager
set_backend, get_backend, use_backend = accessors("recurrence")


# ----------------------------------------------------------------------------- routing

@constant_when_compiled
def _interpreting() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``): then its kernels run
    on CPU tensors, which is how the tests run them without a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    try:
        from . import triton_kernel  # noqa: F401
    except Exception:  # noqa: BLE001 - no triton, or no driver for it
        return False
    return True


@constant_when_compiled
def _available(kernel: str) -> bool:
    # Builds the C++ extension, or imports triton, on the first call. Under
    # torch.compile this runs once at trace time and its result is baked into the graph.
    return cpu_kernels.is_available() if kernel == "cpu" else _triton_importable()


def route(U: Tensor, x, weight_c, bias, c0, dropout_mask) -> str:
    """The kernel for these (checked) arguments: "reference", "cpu" or "triton".

    "auto" takes the fast kernel for U's device (CPU: "cpu", CUDA: "triton") if it
    computes in the tensors' dtypes and is available, else the reference. A
    forced "cpu" or "triton" raises RuntimeError when it can't run U's device or
    isn't available; "triton" runs CPU tensors under the Triton interpreter. Dtypes
    a kernel lacks (float64) always go to the reference.
    """
    name, dev = backends().recurrence, U.device.type
    forced = name != "auto"
    if not forced:
        name = "cpu" if dev == "cpu" else "triton" if dev == "cuda" else "reference"
    if name == "reference":
        return name
    if any(t is not None and t.dtype not in RECURRENCE_DTYPES[name]
           for t in (U, x, weight_c, bias, c0, dropout_mask)):
        return "reference"
    native = "cpu" if name == "cpu" else "cuda"
    if dev != native and not (name == "triton" and dev == "cpu" and _interpreting()):
        if not forced:
            return "reference"
        hint = " (CPU ones under TRITON_INTERPRET=1)" if name == "triton" else ""
        raise RuntimeError(f"srupp backend {name!r} runs {native} tensors{hint}, "
                           f"got {dev} tensors")
    if not _available(name):
        if not forced:
            return "reference"
        why = (cpu_kernels.build_error() if name == "cpu"
               else "srupp.ops.triton_kernel can't be imported")
        raise RuntimeError(f"srupp backend {name!r} is unavailable: {why}")
    return name


def kernels(U: Tensor, triton: bool):
    """The module whose ``sru_fwd`` / ``sru_bwd`` run U: the Triton kernels for CUDA
    tensors or when ``triton``, else the C++ extension."""
    if triton or U.device.type != "cpu":
        from . import triton_kernel  # lazy: imports triton

        return triton_kernel
    mod = cpu_kernels.load()
    if mod is None:
        raise RuntimeError(f"srupp: the CPU kernel is unavailable ({cpu_kernels.build_error()})")
    return mod


# ----------------------------------------------------------------------------- custom ops

@torch.library.custom_op("srupp::sru_fwd", mutates_args=())
def sru_fwd(U: Tensor, x: Optional[Tensor], weight_c: Tensor, bias: Tensor,
            c0: Optional[Tensor], mask_pad: Optional[Tensor], dropout_mask: Optional[Tensor],
            scale_x: float, bidirectional: bool, store_c: bool, triton: bool = False
            ) -> Tuple[Tensor, Tensor, Tensor]:
    return tuple(kernels(U, triton).sru_fwd(U, x, weight_c, bias, c0, mask_pad, dropout_mask,
                                            float(scale_x), bool(bidirectional), bool(store_c)))


@sru_fwd.register_fake
def _sru_fwd_fake(U, x, weight_c, bias, c0, mask_pad, dropout_mask, scale_x, bidirectional,
                  store_c, triton=False):
    B, L, _, D = U.shape
    return (U.new_empty((B, L, D)), U.new_empty((B, D), dtype=torch.float32),
            U.new_empty((B, L, D) if store_c else (0,), dtype=torch.float32))


@torch.library.custom_op("srupp::sru_bwd", mutates_args=())
def sru_bwd(U: Tensor, x: Optional[Tensor], weight_c: Tensor, bias: Tensor,
            c0: Optional[Tensor], mask_pad: Optional[Tensor], dropout_mask: Optional[Tensor],
            c_all: Tensor, grad_h: Tensor, grad_c_last: Optional[Tensor], scale_x: float,
            bidirectional: bool, need_grad_x: bool, triton: bool = False
            ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return tuple(kernels(U, triton).sru_bwd(U, x, weight_c, bias, c0, mask_pad, dropout_mask,
                                            c_all, grad_h, grad_c_last, float(scale_x),
                                            bool(bidirectional), bool(need_grad_x)))


@sru_bwd.register_fake
def _sru_bwd_fake(U, x, weight_c, bias, c0, mask_pad, dropout_mask, c_all, grad_h,
                  grad_c_last, scale_x, bidirectional, need_grad_x, triton=False):
    if x is not None and need_grad_x:
        grad_x = torch.empty_like(x)
    else:
        grad_x = (x if x is not None else U).new_empty((0,))
    return (torch.empty_like(U), grad_x, weight_c.new_empty(weight_c.shape),
            bias.new_empty(bias.shape), U.new_empty((U.shape[0], U.shape[3]), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    U, x, weight_c, bias, c0, mask_pad, dropout_mask, scale_x, bidirectional, _, triton = inputs
    ctx.save_for_backward(U, x, weight_c, bias, c0, mask_pad, dropout_mask, output[2])
    ctx.scale_x, ctx.bidirectional, ctx.triton = scale_x, bidirectional, triton
    ctx.mark_non_differentiable(output[2])
    # Don't let autograd fill zero gradients for outputs the loss never used:
    # c_all is (B, L, D) fp32 and would be zero-filled on every backward.
    # _backward handles None itself.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_h, grad_c_last, _grad_c_all):
    U, x, weight_c, bias, c0, mask_pad, dropout_mask, c_all = ctx.saved_tensors
    B, L, _, D = U.shape
    if c_all.numel() != B * L * D:
        raise RuntimeError(
            "srupp::sru_fwd ran with store_c=False (inference mode), so it kept no "
            "per-step state and can't be differentiated; call it with store_c=True")
    need = ctx.needs_input_grad
    if grad_h is None:
        grad_h = U.new_zeros((B, L, D))
    grad_U, grad_x, grad_wc, grad_bias, grad_c0 = sru_bwd(
        U, x, weight_c, bias, c0, mask_pad, dropout_mask, c_all, grad_h, grad_c_last,
        ctx.scale_x, ctx.bidirectional, bool(x is not None and need[1]), ctx.triton)
    return (
        grad_U if need[0] else None,
        grad_x if (x is not None and need[1]) else None,
        grad_wc if need[2] else None,
        grad_bias if need[3] else None,
        grad_c0.to(c0.dtype) if (c0 is not None and need[4]) else None,
        None, None, None, None, None, None,
    )


sru_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- entry point

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
    kernel = route(U, x, weight_c, bias, c0, dropout_mask)
    if kernel == "reference":
        return sru_recurrence_reference(U, x, weight_c, bias, c0, scale_x=scale_x,
                                        mask_pad=mask_pad, dropout_mask=dropout_mask,
                                        bidirectional=bidirectional)
    if mask_pad is not None and mask_pad.dtype != torch.bool:
        mask_pad = mask_pad != 0
    args = (U, x, weight_c, bias, c0, mask_pad, dropout_mask, float(scale_x), bool(bidirectional))
    # Keep per-step state only when a backward can follow.
    store_c = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (U, x, weight_c, bias, c0))
    if not store_c and not torch.compiler.is_compiling():
        # Inference in eager mode: call the kernel directly. The custom op's
        # Python dispatch costs several times a decoding step's work.
        h, c_last, _ = kernels(U, kernel == "triton").sru_fwd(*args, False)
    else:
        h, c_last, _ = sru_fwd(*args, store_c, kernel == "triton")
    return h, c_last


def warm_up(device="cpu") -> None:
    """Build the fast kernel for ``device`` now (compilation is once; callers time what follows)."""
    if torch.device(device).type == "cpu" and get_backend() in ("auto", "cpu"):
        _available("cpu")
