"""Input normalisation and validation shared by the SRU and SRU++ modules.

Every check raises ``ValueError`` naming what was expected and what was given.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype active for ``device_type``, or None outside autocast."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def state_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """The dtype of c for a module whose parameters are ``param_dtype``: fp32, or fp64."""
    return torch.promote_types(param_dtype, torch.float32)


def unpack_input(input, batch_first: bool):
    """Turn the user's input into a batch-first tensor and a (B, L) padding mask.

    Returns ``(x, mask_pad_from_lengths, lengths)``; the last two are None unless
    the input was a PackedSequence.
    """
    if isinstance(input, PackedSequence):
        x, lengths = pad_packed_sequence(input, batch_first=True)
        steps = torch.arange(x.shape[1], device=lengths.device)
        mask = (steps.unsqueeze(0) >= lengths.unsqueeze(1)).to(x.device)  # (B, L)
        return x, mask, lengths
    if not isinstance(input, Tensor):
        raise ValueError(f"input must be a Tensor or PackedSequence, got {type(input).__name__}")
    if input.dim() != 3:
        layout = "(B, L, input_size)" if batch_first else "(L, B, input_size)"
        raise ValueError(f"input must be 3-D {layout}, got shape {tuple(input.shape)}")
    x = input if batch_first else input.transpose(0, 1)
    return x, None, None


def pack_output(h: Tensor, lengths: Tensor) -> PackedSequence:
    """Inverse of :func:`unpack_input` for a batch-first output."""
    return pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False)


def check_input(x: Tensor, input_size: int, param_dtype: torch.dtype, name: str = "input"):
    """x is batch-first (B, L, n)."""
    if x.shape[-1] != input_size:
        raise ValueError(
            f"{name} has {x.shape[-1]} features in its last dimension, expected input_size={input_size}")
    if x.shape[0] == 0:
        raise ValueError(f"{name} has batch size 0")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if autocast_dtype(x.device.type) is None and x.dtype != param_dtype:
        raise ValueError(
            f"{name} dtype {x.dtype} does not match the module's parameters ({param_dtype}); "
            f"convert the input with .to({param_dtype}) or the module with .to({x.dtype}), "
            f"or run under torch.autocast")


def normalize_mask_pad(mask_pad: Optional[Tensor], B: int, L: int, batch_first: bool,
                       device) -> Optional[Tensor]:
    """Validate a user mask_pad and return it as bool (B, L)."""
    if mask_pad is None:
        return None
    expected = (B, L) if batch_first else (L, B)
    if not isinstance(mask_pad, Tensor) or tuple(mask_pad.shape) != expected:
        got = tuple(mask_pad.shape) if isinstance(mask_pad, Tensor) else type(mask_pad).__name__
        layout = "(B, L)" if batch_first else "(L, B)"
        raise ValueError(f"mask_pad must have shape {layout} = {expected}, got {got}")
    if mask_pad.is_floating_point() or mask_pad.is_complex():
        raise ValueError(
            f"mask_pad must be bool (True marks padding), got {mask_pad.dtype}")
    mask_pad = mask_pad.to(device=device, dtype=torch.bool)
    return mask_pad if batch_first else mask_pad.transpose(0, 1)


def merge_masks(a: Optional[Tensor], b: Optional[Tensor]) -> Optional[Tensor]:
    """Logical or of two optional (B, L) padding masks."""
    if a is None:
        return b
    if b is None:
        return a
    return a | b


def check_c0(c0: Tensor, num_layers: Optional[int], B: int, D: int, dtype: torch.dtype,
             device_type: str) -> Tensor:
    """Validate an initial state; returns it in the state dtype.

    ``num_layers=None`` checks a single layer's (B, D) state.
    """
    expected = (B, D) if num_layers is None else (num_layers, B, D)
    names = "(B, D)" if num_layers is None else "(num_layers, B, D)"
    if not isinstance(c0, Tensor) or tuple(c0.shape) != expected:
        got = tuple(c0.shape) if isinstance(c0, Tensor) else type(c0).__name__
        raise ValueError(f"initial state c0 must have shape {names} = {expected}, got {got}")
    if not c0.is_floating_point():
        raise ValueError(f"initial state c0 must be floating point, got {c0.dtype}")
    if c0.dtype != dtype and autocast_dtype(device_type) is None:
        raise ValueError(
            f"initial state c0 has dtype {c0.dtype}, expected {dtype} "
            f"(the state is kept in fp32, or fp64 for fp64 modules)")
    return c0.to(dtype)
