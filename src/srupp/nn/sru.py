"""Plain SRU (Lei et al., 2018): U is a linear map of the input, no attention."""

from __future__ import annotations

import warnings
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from ._inputs import (check_c0, check_input, merge_masks, normalize_mask_pad, pack_output,
                      unpack_input)
from .base import RecurrentLayerBase, StackBase
from .linear import Linear


class SRUCell(RecurrentLayerBase):
    """One SRU *layer*: it runs a whole sequence, not a single step.

    Unlike ``nn.LSTMCell``, this is a full layer, as in the reference package;
    to continue a sequence, pass the returned state back in as ``c0``.

    U = W x (or W₂ W₁ x with ``projection_size``), bias-free, then the
    element-wise recurrence (see ``SRUPP_SPEC.md``)::

        f_t = σ(u1_t + v_f ⊙ c_{t−1} + b_f)
        r_t = σ(u2_t + v_r ⊙ c_{t−1} + b_r)
        c_t = f_t ⊙ c_{t−1} + (1 − f_t) ⊙ u0_t
        h_t = r_t ⊙ c_t + (1 − r_t) ⊙ s_t,  s_t = scale_x·x_t (k=3) or u3_t (k=4)

    Args:
        input_size: features of the input, n_in.
        hidden_size: units per direction, d. The output has D = d·directions.
        dropout: variational dropout on the highway (one mask per call).
        rnn_dropout: deprecated variational dropout on the input, kept for
            compatibility with the reference.
        bidirectional: run a second direction backwards on its own d units.
        projection_size: if > 0, factorise W as W₂ W₁ through this width.
        highway_bias: initial b_r.
        layer_norm: add a LayerNorm, on the input (pre) or on h (post).
        normalize_after: post-norm if True (the reference's SRUCell default).
        rescale: scale the skip term by √(1 + 2·exp(highway_bias)).
        has_skip_term: include the highway's skip term.
        weight_c_init: v_f and v_r start U(−weight_c_init, weight_c_init).
        batch_first: input and output are (B, L, ·) instead of (L, B, ·).
        device, dtype: factory kwargs for the parameters.

    Shapes:
        input: (L, B, n_in) (or (B, L, n_in) with ``batch_first``) or a PackedSequence.
        c0: (B, D), fp32 (fp64 for an fp64 module); zeros if None.
        mask_pad: bool (L, B) (or (B, L)); True marks padding.
        Returns ``(h, c)``: h like the input with D features, c (B, D).
    """

    def __init__(self, input_size: int, hidden_size: int, *, dropout: float = 0.0,
                 rnn_dropout: float = 0.0, bidirectional: bool = False,
                 projection_size: int = 0, highway_bias: float = 0.0,
                 layer_norm: bool = False, normalize_after: bool = True,
                 rescale: bool = False, has_skip_term: bool = True,
                 weight_c_init: float = 1.0, batch_first: bool = False,
                 device=None, dtype=None):
        super().__init__(input_size, hidden_size, highway_dropout=dropout,
                         bidirectional=bidirectional, highway_bias=highway_bias,
                         layer_norm=layer_norm, normalize_after=normalize_after,
                         rescale=rescale, has_skip_term=has_skip_term,
                         weight_c_init=weight_c_init, device=device, dtype=dtype)
        if rnn_dropout > 0:
            warnings.warn("rnn_dropout is deprecated (as in the reference); use dropout",
                          DeprecationWarning, stacklevel=2)
        if not 0.0 <= rnn_dropout < 1.0:
            raise ValueError(f"rnn_dropout must be in [0, 1), got {rnn_dropout}")
        if projection_size < 0:
            raise ValueError(f"projection_size must be >= 0, got {projection_size}")
        factory = {"device": device, "dtype": dtype}
        self.rnn_dropout = float(rnn_dropout)
        self.projection_size = projection_size
        self.batch_first = batch_first
        out = self.output_size * self.num_matrices
        if projection_size == 0:
            self.transform = Linear(input_size, out, bias=False, **factory)
        else:
            self.transform = nn.Sequential(
                Linear(input_size, projection_size, bias=False, **factory),
                Linear(projection_size, out, bias=False, **factory))
        self.reset_parameters()

    def reset_parameters(self):
        self.reset_gate_parameters()
        for m in self.transform.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)

    def layer_forward(self, x: Tensor, c0: Tensor,
                      mask_pad: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """Batch-first core: x (B, L, n_in), c0 (B, D), mask_pad (B, L) -> h (B, L, D), c (B, D)."""
        xin = self.pre_norm(x)
        if self.training and self.rnn_dropout > 0:
            p = self.rnn_dropout
            keep = xin.new_empty(xin.shape[0], 1, xin.shape[2]).bernoulli_(1 - p).div_(1 - p)
            xin = xin * keep
        return self.recur(self.transform(xin), x, c0, mask_pad)

    def forward(self, input: Union[Tensor, PackedSequence], c0: Optional[Tensor] = None, *,
                mask_pad: Optional[Tensor] = None):
        x, packed_mask, lengths = unpack_input(input, self.batch_first)
        check_input(x, self.input_size, self.weight_c.dtype)
        B, L, _ = x.shape
        bf = self.batch_first or lengths is not None
        mask = merge_masks(packed_mask, normalize_mask_pad(mask_pad, B, L, bf, x.device))
        if c0 is None:
            c0 = x.new_zeros(B, self.output_size, dtype=self.state_dtype)
        else:
            c0 = check_c0(c0, None, B, self.output_size, self.state_dtype, x.device.type)
        h, c = self.layer_forward(x, c0, mask)
        if lengths is not None:
            return pack_output(h, lengths), c
        return (h if self.batch_first else h.transpose(0, 1)), c

    def extra_repr(self) -> str:
        s = self._gate_repr()
        if self.projection_size:
            s += f", projection_size={self.projection_size}"
        if self.batch_first:
            s += ", batch_first=True"
        return s


class SRU(StackBase):
    """A stack of :class:`SRUCell` layers, with the reference's arguments.

    Args:
        input_size, hidden_size, num_layers: as ``nn.LSTM``; hidden_size is per direction.
        dropout: variational highway dropout in every layer but the last.
        projection_size: an int, or one per layer.
        proj_input_to_hidden_first: put a bias-free linear n_in → D before the
            first layer (when they differ), so every layer has k = 3.
        nn_rnn_compatible_return: return c as (num_layers·directions, B, d),
            the layout of ``nn.LSTM``'s states.
        The remaining arguments are those of :class:`SRUCell`, except that
        ``normalize_after`` defaults to False here, as in the reference.

    Shapes:
        input: (L, B, n_in) (or (B, L, n_in) with ``batch_first``) or a PackedSequence.
        c0: (num_layers, B, D) or None.
        mask_pad: bool (L, B) (or (B, L)); True marks padding.
        Returns ``(h, c)``: h (L, B, D) like the input, c (num_layers, B, D).
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 2, *,
                 dropout: float = 0.0, rnn_dropout: float = 0.0,
                 bidirectional: bool = False,
                 projection_size: Union[int, Sequence[int]] = 0,
                 highway_bias: float = 0.0, layer_norm: bool = False,
                 normalize_after: bool = False, has_skip_term: bool = True,
                 rescale: bool = False, nn_rnn_compatible_return: bool = False,
                 proj_input_to_hidden_first: bool = False, weight_c_init: float = 1.0,
                 batch_first: bool = False, device=None, dtype=None):
        super().__init__()
        if not isinstance(projection_size, int) and len(projection_size) != num_layers:
            raise ValueError(f"projection_size has {len(projection_size)} entries, "
                             f"expected one per layer ({num_layers})")
        factory = {"device": device, "dtype": dtype}
        first_in = self._init_stack(input_size, hidden_size, num_layers, bidirectional,
                                    batch_first, proj_input_to_hidden_first, factory)
        self.nn_rnn_compatible_return = nn_rnn_compatible_return
        self.layers = nn.ModuleList(
            SRUCell(first_in if i == 0 else self.output_size, hidden_size,
                    dropout=dropout if i + 1 < num_layers else 0.0,
                    rnn_dropout=rnn_dropout, bidirectional=bidirectional,
                    projection_size=(projection_size if isinstance(projection_size, int)
                                     else projection_size[i]),
                    highway_bias=highway_bias, layer_norm=layer_norm,
                    normalize_after=normalize_after, rescale=rescale,
                    has_skip_term=has_skip_term, weight_c_init=weight_c_init,
                    batch_first=True, **factory)
            for i in range(num_layers))

    def forward(self, input: Union[Tensor, PackedSequence], c0: Optional[Tensor] = None, *,
                mask_pad: Optional[Tensor] = None):
        x, packed_mask, lengths = unpack_input(input, self.batch_first)
        check_input(x, self.input_size, self.layers[0].weight_c.dtype)
        B, L, _ = x.shape
        bf = self.batch_first or lengths is not None
        mask = merge_masks(packed_mask, normalize_mask_pad(mask_pad, B, L, bf, x.device))
        sdt = self.layers[0].state_dtype
        if c0 is None:
            c0 = x.new_zeros(self.num_layers, B, self.output_size, dtype=sdt)
        else:
            c0 = check_c0(c0, self.num_layers, B, self.output_size, sdt, x.device.type)
        if self.input_to_hidden is not None:
            x = self.input_to_hidden(x)
        cs = []
        for i, layer in enumerate(self.layers):
            x, c = layer.layer_forward(x, c0[i], mask)
            cs.append(c)
        c = torch.stack(cs)  # (num_layers, B, D)
        if self.nn_rnn_compatible_return:
            c = (c.view(self.num_layers, B, self.num_directions, self.hidden_size)
                 .transpose(1, 2).reshape(self.num_layers * self.num_directions, B,
                                          self.hidden_size))
        if lengths is not None:
            return pack_output(x, lengths), c
        return (x if self.batch_first else x.transpose(0, 1)), c

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}"
                + (", batch_first=True" if self.batch_first else ""))
