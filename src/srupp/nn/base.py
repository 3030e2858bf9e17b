"""What SRU and SRU++ layers share: the gates' parameters and the recurrence.

A layer turns its input x (B, L, n_in) into U (B, L, k·D) with some transform
(a linear map for SRU, an attention sub-layer for SRU++), then runs the
element-wise recurrence of :mod:`srupp.ops` on U. Subclasses supply the
transform; this class owns everything after it.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from ..ops import sru_recurrence
from ._inputs import autocast_dtype, state_dtype
from .linear import Linear


class RecurrentLayerBase(nn.Module):
    """Gate parameters, layer-wise LayerNorm, dropout mask and the recurrence.

    Args are the reference's; see :class:`~srupp.nn.SRUCell` for their meaning.
    ``highway_dropout`` is the rate of the variational mask on the highway.
    """

    def __init__(self, input_size: int, hidden_size: int, *, highway_dropout: float,
                 bidirectional: bool, highway_bias: float, layer_norm: bool,
                 normalize_after: bool, rescale: bool, has_skip_term: bool,
                 weight_c_init: float, device=None, dtype=None):
        super().__init__()
        if input_size <= 0 or hidden_size <= 0:
            raise ValueError(
                f"input_size and hidden_size must be positive, got {input_size} and {hidden_size}")
        if not 0.0 <= highway_dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {highway_dropout}")
        factory = {"device": device, "dtype": dtype}
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.bidirectional = bidirectional
        self.output_size = hidden_size * (2 if bidirectional else 1)  # D
        self.highway_dropout = float(highway_dropout)
        self.highway_bias = float(highway_bias)
        self.has_skip_term = has_skip_term
        self.rescale = rescale
        self.weight_c_init = weight_c_init
        self.normalize_after = normalize_after
        # k = 4 adds a projected skip plane when the raw input can't be added to h.
        self.num_matrices = 4 if (has_skip_term and input_size != self.output_size) else 3
        # Constant, so a Python float: kernels take it as a scalar argument.
        self.scale_x = (math.sqrt(1 + 2 * math.exp(highway_bias))
                        if (rescale and has_skip_term) else 1.0)
        D = self.output_size
        self.weight_c = nn.Parameter(torch.empty(2, D, **factory))  # [v_f; v_r]
        self.bias = nn.Parameter(torch.empty(2, D, **factory))      # [b_f; b_r]
        self.layer_norm: Optional[nn.LayerNorm] = None
        if layer_norm:
            self.layer_norm = nn.LayerNorm(D if normalize_after else input_size, **factory)

    def reset_gate_parameters(self):
        with torch.no_grad():
            self.weight_c.uniform_(-self.weight_c_init, self.weight_c_init)
            self.bias[0].zero_()
            self.bias[1].fill_(self.highway_bias)
        if self.layer_norm is not None:
            self.layer_norm.reset_parameters()

    def pre_norm(self, x: Tensor) -> Tensor:
        """The input U is computed from: x, layer-normed if pre-norm. (B, L, n_in)"""
        if self.layer_norm is not None and not self.normalize_after:
            return self.layer_norm(x)
        return x

    def recur(self, U: Tensor, x: Tensor, c0: Tensor,
              mask_pad: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """Run the recurrence and the post-norm.

        Args:
            U: (B, L, k·D) from the transform, planes laid out [u0 | u1 | u2 | u3].
            x: (B, L, n_in) the raw layer input (the skip term uses it un-normed).
            c0: (B, D) initial state.
            mask_pad: (B, L) bool or None.
        Returns:
            h (B, L, D) and c (B, D).
        """
        B, L, _ = U.shape
        D, k = self.output_size, self.num_matrices
        dropout_mask = None
        if self.training and self.highway_dropout > 0:
            p = self.highway_dropout
            dropout_mask = c0.new_empty(B, D).bernoulli_(1 - p).div_(1 - p)
        skip = x if (k == 3 and self.has_skip_term) else None
        h, c = sru_recurrence(
            U.view(B, L, k, D), skip, self.weight_c, self.bias, c0,
            scale_x=self.scale_x, mask_pad=mask_pad, dropout_mask=dropout_mask,
            bidirectional=self.bidirectional,
        )
        if self.layer_norm is not None and self.normalize_after:
            h = self.layer_norm(h)
        ac = autocast_dtype(h.device.type)
        if ac is not None:
            h = h.to(ac)  # LayerNorm runs in fp32 under autocast; outputs stay in ac dtype
        return h, c

    @property
    def state_dtype(self) -> torch.dtype:
        return state_dtype(self.weight_c.dtype)

    def _gate_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.bidirectional:
            s += ", bidirectional=True"
        if self.highway_dropout:
            s += f", dropout={self.highway_dropout}"
        if self.layer_norm is not None:
            s += f", layer_norm=True, normalize_after={self.normalize_after}"
        if self.rescale:
            s += ", rescale=True"
        if not self.has_skip_term:
            s += ", has_skip_term=False"
        return s


class StackBase(nn.Module):
    """What the SRU and SRU++ stacks share: sizes, the optional input projection, layers."""

    layers: nn.ModuleList

    def _init_stack(self, input_size: int, hidden_size: int, num_layers: int,
                    bidirectional: bool, batch_first: bool, proj_input_to_hidden_first: bool,
                    factory: dict) -> int:
        """Set the common attributes; returns the first layer's input size."""
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.bidirectional = bidirectional
        self.num_directions = 2 if bidirectional else 1
        self.output_size = hidden_size * self.num_directions  # D
        self.batch_first = batch_first
        self.input_to_hidden: Optional[nn.Linear] = None
        if proj_input_to_hidden_first and input_size != self.output_size:
            # one bias-free map n_in -> D, so that every layer has k = 3
            self.input_to_hidden = Linear(input_size, self.output_size, bias=False, **factory)
            nn.init.xavier_uniform_(self.input_to_hidden.weight)
            return self.output_size
        return input_size

    def __getitem__(self, i: int):
        return self.layers[i]

    def reset_parameters(self):
        for layer in self.layers:
            layer.reset_parameters()
        if self.input_to_hidden is not None:
            nn.init.xavier_uniform_(self.input_to_hidden.weight)
