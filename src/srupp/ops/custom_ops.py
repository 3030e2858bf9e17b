"""The recurrence as ``torch.library`` custom ops: ``srupp::sru_fwd`` and ``srupp::sru_bwd``.

Both ops route by device: CPU tensors run the fused C++ kernel of
:mod:`srupp.ops.cpu`, CUDA tensors the Triton kernels of
``srupp.ops.triton_kernel`` (imported lazily, on the first CUDA call). Each op
has a fake (meta) implementation, so ``torch.compile(fullgraph=True)`` can trace
through it, and ``sru_fwd`` has its autograd formula registered: its backward
is ``sru_bwd``.

``sru_fwd(U, x, weight_c, bias, c0, mask_pad, dropout_mask, scale_x, bidirectional, store_c)``
    -> ``(h, c_last, c_all)``: h (B, L, D) in U's dtype, c_last (B, D) fp32, and
    c_all (B, L, D) fp32, the state after every step, which the backward reads.
    With ``store_c=False`` (inference) c_all is an empty tensor and nothing
    per-step is stored; the backward then can't run.

``sru_bwd(U, x, weight_c, bias, c0, mask_pad, dropout_mask, c_all, grad_h, grad_c_last,
scale_x, bidirectional, need_grad_x)``
    -> ``(grad_U, grad_x, grad_weight_c, grad_bias, grad_c0)``. grad_x is empty when x
    is None or ``need_grad_x`` is False; grad_c0 is fp32 (B, D).

The Triton module (``srupp.ops.triton_kernel``) provides the same contract:
``sru_fwd_triton(U, x, weight_c, bias, c0, mask_pad, dropout_mask, scale_x, bidirectional,
store_c) -> (h, c_last, c_all)`` and, in this op's argument order,
``sru_bwd_triton_op(U, x, weight_c, bias, c0, mask_pad, dropout_mask, c_all, grad_h,
grad_c_last, scale_x, bidirectional, need_grad_x) -> (grad_U, grad_x, grad_weight_c,
grad_bias, grad_c0)``, all outputs fresh (non-aliasing) tensors.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import cpu as _cpu

__all__ = ["sru_fwd", "sru_bwd"]


def _cpu_module():
    mod = _cpu.load()
    if mod is None:
        raise RuntimeError(f"srupp: the CPU kernel is unavailable ({_cpu.build_error()})")
    return mod


def _triton_module():
    from . import triton_kernel  # lazy: only CUDA calls need triton

    return triton_kernel


# --------------------------------------------------------------------------- forward

@torch.library.custom_op("srupp::sru_fwd", mutates_args=(), device_types="cpu")
def sru_fwd(U: Tensor, x: Optional[Tensor], weight_c: Tensor, bias: Tensor,
            c0: Optional[Tensor], mask_pad: Optional[Tensor], dropout_mask: Optional[Tensor],
            scale_x: float, bidirectional: bool, store_c: bool) -> Tuple[Tensor, Tensor, Tensor]:
    return tuple(_cpu_module().sru_fwd(U, x, weight_c, bias, c0, mask_pad, dropout_mask,
                                       float(scale_x), bool(bidirectional), bool(store_c)))


@sru_fwd.register_kernel("cuda")
def _sru_fwd_cuda(U, x, weight_c, bias, c0, mask_pad, dropout_mask, scale_x, bidirectional,
                  store_c):
    return tuple(_triton_module().sru_fwd_triton(U, x, weight_c, bias, c0, mask_pad,
                                                 dropout_mask, scale_x, bidirectional, store_c))


@sru_fwd.register_fake
def _sru_fwd_fake(U, x, weight_c, bias, c0, mask_pad, dropout_mask, scale_x, bidirectional,
                  store_c):
    B, L, _, D = U.shape
    h = U.new_empty((B, L, D))
    c_last = U.new_empty((B, D), dtype=torch.float32)
    c_all = U.new_empty((B, L, D) if store_c else (0,), dtype=torch.float32)
    return h, c_last, c_all


# --------------------------------------------------------------------------- backward

@torch.library.custom_op("srupp::sru_bwd", mutates_args=(), device_types="cpu")
def sru_bwd(U: Tensor, x: Optional[Tensor], weight_c: Tensor, bias: Tensor,
            c0: Optional[Tensor], mask_pad: Optional[Tensor], dropout_mask: Optional[Tensor],
            c_all: Tensor, grad_h: Tensor, grad_c_last: Optional[Tensor], scale_x: float,
            bidirectional: bool, need_grad_x: bool
            ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return tuple(_cpu_module().sru_bwd(U, x, weight_c, bias, c0, mask_pad, dropout_mask, c_all,
                                       grad_h, grad_c_last, float(scale_x), bool(bidirectional),
                                       bool(need_grad_x)))


@sru_bwd.register_kernel("cuda")
def _sru_bwd_cuda(U, x, weight_c, bias, c0, mask_pad, dropout_mask, c_all, grad_h,
                  grad_c_last, scale_x, bidirectional, need_grad_x):
    return tuple(_triton_module().sru_bwd_triton_op(U, x, weight_c, bias, c0, mask_pad,
                                                    dropout_mask, c_all, grad_h, grad_c_last,
                                                    scale_x, bidirectional, need_grad_x))


@sru_bwd.register_fake
def _sru_bwd_fake(U, x, weight_c, bias, c0, mask_pad, dropout_mask, c_all, grad_h,
                  grad_c_last, scale_x, bidirectional, need_grad_x):
    B, L, _, D = U.shape
    grad_U = torch.empty_like(U)
    if x is not None and need_grad_x:
        grad_x = torch.empty_like(x)
    else:
        grad_x = (x if x is not None else U).new_empty((0,))
    grad_wc = weight_c.new_empty(weight_c.shape)
    grad_bias = bias.new_empty(bias.shape)
    grad_c0 = U.new_empty((B, D), dtype=torch.float32)
    return grad_U, grad_x, grad_wc, grad_bias, grad_c0


# --------------------------------------------------------------------------- autograd

def _setup_context(ctx, inputs, output):
    U, x, weight_c, bias, c0, mask_pad, dropout_mask, scale_x, bidirectional, store_c = inputs
    _, _, c_all = output
    ctx.save_for_backward(U, x, weight_c, bias, c0, mask_pad, dropout_mask, c_all)
    ctx.scale_x = scale_x
    ctx.bidirectional = bidirectional
    ctx.mark_non_differentiable(c_all)
    # Don't let autograd fill zero gradients for outputs the loss never used:
    # c_all is (B, L, D) fp32 and was zero-filled on every backward (0.8 ms a layer
    # at the layer benchmark's size). _backward handles None itself.
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
        ctx.scale_x, ctx.bidirectional, bool(x is not None and need[1]))
    return (
        grad_U if need[0] else None,
        grad_x if (x is not None and need[1]) else None,
        grad_wc if need[2] else None,
        grad_bias if need[3] else None,
        grad_c0.to(c0.dtype) if (c0 is not None and need[4]) else None,
        None, None, None, None, None,
    )


sru_fwd.register_autograd(_backward, setup_context=_setup_context)
