"""int8 weights for inference: :class:`Int8Linear` and :func:`quantize_linears`.

``quantize_linears(model)`` replaces every ``nn.Linear`` inside ``model`` (srupp's
:class:`~srupp.nn.linear.Linear` included) by an :class:`Int8Linear` holding the
same weight as int8 with one scale per output feature (:mod:`srupp.ops.quant`).
Embedding tables stay as they are: a lookup reads one row per token, not the
whole table. The task heads' ``model.quantize("int8")`` calls it.

Two kinds (:data:`QUANTIZATIONS`):

* ``"int8"``: weight-only; the activations stay fp32 or bf16 (:func:`~srupp.ops.quant.linear_int8`);
* ``"w8a8"``: int8 weights and int8 activations, each row of a layer's input
  rounded with its own scale at every call (dynamic quantization,
  :func:`~srupp.ops.quant.linear_w8a8`): integer dot products, which VNNI
  computes at several times the rate of widened fp32 weights.

A quantized model is for inference: its int8 weights are buffers, not
parameters, and it refuses ``train()`` and gradients with a message that says so.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..ops.quant import W8A8_MAX_K, linear_int8, linear_w8a8, quantize_per_channel

__all__ = ["Int8Linear", "quantize_linears", "QUANTIZATIONS", "check_quantization"]

#: The names ``quantize`` accepts: int8 weights alone, or int8 weights and activations.
QUANTIZATIONS = ("int8", "w8a8")

_INFERENCE_ONLY = ("int8-quantized layers are for inference only: train the float model "
                   "and quantize it afterwards")


def check_quantization(kind) -> str:
    """``kind`` if it is one of :data:`QUANTIZATIONS`, else a ValueError naming them."""
    if kind not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {kind!r}; choose one of {QUANTIZATIONS}")
    return kind


class Int8Linear(nn.Module):
    """``nn.Linear`` for inference with int8 weights: ``y = x @ (scale · weight)ᵀ (+ bias)``.

    Buffers (saved in the state dict): ``weight`` (out_features, in_features)
    int8, ``scale`` (out_features,) float32 and ``bias`` (out_features,) or
    None. ``.to(dtype)`` converts the bias only: the weight stays int8, and the
    scale float32, since the sums are taken in fp32 and scaled once (a bf16
    scale would add its own rounding, and a conversion per call). Inputs of
    fp32 or bf16; the output has the input's dtype.

    ``kind`` (one of :data:`QUANTIZATIONS`, as ``quantize`` names them): "int8"
    (weight-only, the default) computes with the input as it is; "w8a8" rounds each
    row of the input to int8 with its own scale first, and sums integer products.

    Shapes: input (..., in_features) -> (..., out_features).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 kind: str = "int8", device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.kind = check_quantization(kind)
        dtype = dtype or torch.get_default_dtype()
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8,
                                                   device=device))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32,
                                                 device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device)
                             if bias else None)
        self.training = False

    @classmethod
    def from_linear(cls, linear: nn.Linear, kind: str = "int8") -> "Int8Linear":
        """The int8 version of ``linear`` (its weight quantized per output feature)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"Int8Linear.from_linear takes an nn.Linear, got "
                            f"{type(linear).__name__}")
        w = linear.weight
        q, scale = quantize_per_channel(w)
        m = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                kind=kind, device=w.device, dtype=w.dtype)
        m.weight.copy_(q)
        m.scale.copy_(scale)
        if linear.bias is not None:
            m.bias.copy_(linear.bias.detach())
        return m

    def forward(self, input: Tensor) -> Tensor:
        if self.kind == "w8a8":
            return linear_w8a8(input, self.weight, self.scale, self.bias)
        return linear_int8(input, self.weight, self.scale, self.bias)

    def _apply(self, fn, recurse=True):
        scale = self.scale
        super()._apply(fn, recurse)
        # moves go through (device), dtype changes do not: the scale stays float32
        self.scale = scale.to(self.weight.device)
        return self

    def train(self, mode: bool = True) -> "Int8Linear":
        if mode:
            raise ValueError(_INFERENCE_ONLY)
        return super().train(False)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight=int8 per-channel, "
                f"kind={self.kind}")


def quantize_linears(model: nn.Module, kind: str = "int8",
                     skip: Optional[nn.Module] = None) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` inside ``model`` by an :class:`Int8Linear`.

    Args:
        model: any module; it ends in eval mode, with every remaining parameter
            frozen (``requires_grad=False``): the result is for inference.
        kind: "int8" (weights only) or "w8a8" (weights and activations), see
            :data:`QUANTIZATIONS`.
        skip: a submodule to leave as it is (its Linear layers included).
    Returns:
        ``model``. A Linear whose weight is shared with another module (tied
        embeddings) gets its own int8 copy; the other keeps the float weight.
    """
    check_quantization(kind)
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_linears takes an nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.Linear):
        raise TypeError("quantize_linears replaces the Linear layers inside a module; for "
                        "one layer use Int8Linear.from_linear(layer)")
    if kind == "w8a8":
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and m.in_features > W8A8_MAX_K:
                raise ValueError(f"{name or 'the model'} has {m.in_features} input features; "
                                 f"w8a8 sums at most {W8A8_MAX_K} in int32: quantize this "
                                 f"model with \"int8\" (weights only) instead")
    for parent in list(model.modules()):
        if skip is not None and any(parent is m for m in skip.modules()):
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and (skip is None or child is not skip):
                setattr(parent, name, Int8Linear.from_linear(
                    child, kind=kind))
    model.requires_grad_(False)
    return model.eval()
