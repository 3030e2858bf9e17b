"""Plain SRU (Lei et al., 2018), and what every SRU and SRU++ layer shares.

A layer turns its input x (B, L, n_in) into U (B, L, k·D) with a *transform*
(a linear map here; an attention sub-layer in :mod:`srupp.nn.srupp`), then
runs the element-wise recurrence of §2 of the paper on U's k planes
[u0 | u1 | u2 | u3] (:func:`srupp.ops.sru_recurrence`; the plain PyTorch loop
it is tested against is :func:`srupp.ops.sru_recurrence_reference`)::

    f_t = σ(u1_t + v_f ⊙ c_{t−1} + b_f)
    r_t = σ(u2_t + v_r ⊙ c_{t−1} + b_r)
    c_t = f_t ⊙ c_{t−1} + (1 − f_t) ⊙ u0_t
    h_t = r_t ⊙ c_t + (1 − r_t) ⊙ s_t,  s_t = scale_x·x_t (k = 3) or u3_t (k = 4)

:class:`RecurrentLayerBase` owns the gates' parameters (v, b), the layer-wise
LayerNorm and the highway dropout; :class:`StackBase` the sizes and optional
input projection of a stack. Layers work batch-first; the stacks' ``forward``
turns the user's layout (time-major, batch-first or packed) into (B, L, n_in)
and back with :func:`read_input` and :func:`write_output`.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from ..ops import sru_recurrence
from .linear import Linear

# --------------------------------------------------------------------------- inputs
# Every check raises ValueError naming what was expected and what was given.


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype active for ``device_type``, or None outside autocast."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def check_input(x: Tensor, input_size: int, param_dtype: torch.dtype):
    """x is batch-first (B, L, n_in)."""
    if x.shape[-1] != input_size:
        raise ValueError(
            f"input has {x.shape[-1]} features in its last dimension, expected "
            f"input_size={input_size}")
    if x.shape[0] == 0:
        raise ValueError("input has batch size 0")
    if not x.is_floating_point():
        raise ValueError(f"input must be a floating-point tensor, got {x.dtype}")
    if x.dtype != param_dtype and autocast_dtype(x.device.type) is None:
        raise ValueError(
            f"input dtype {x.dtype} does not match the module's parameters ({param_dtype}); "
            f"convert the input with .to({param_dtype}) or the module with .to({x.dtype}), "
            f"or run under torch.autocast")


def read_input(module: nn.Module, input: Union[Tensor, PackedSequence],
               mask_pad: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """The user's input as x (B, L, n) and a bool (B, L) padding mask (or None).

    ``module`` gives the layout (``batch_first``). Returns ``(x, mask, lengths)``;
    lengths is None unless the input was a PackedSequence (see :func:`write_output`).
    x is not checked here: see :func:`check_input`.
    """
    lengths = None
    batch_first = module.batch_first
    if isinstance(input, PackedSequence):
        x, lengths = pad_packed_sequence(input, batch_first=True)
        batch_first = True  # a user mask_pad then comes batch-first too
    elif not isinstance(input, Tensor):
        raise ValueError(f"input must be a Tensor or PackedSequence, got {type(input).__name__}")
    elif input.dim() != 3:
        layout = "(B, L, input_size)" if batch_first else "(L, B, input_size)"
        raise ValueError(f"input must be 3-D {layout}, got shape {tuple(input.shape)}")
    else:
        x = input if batch_first else input.transpose(0, 1)
    B, L, _ = x.shape
    mask = None
    if mask_pad is not None:
        expected = (B, L) if batch_first else (L, B)
        if not isinstance(mask_pad, Tensor) or tuple(mask_pad.shape) != expected:
            got = tuple(mask_pad.shape) if isinstance(mask_pad, Tensor) else type(mask_pad).__name__
            layout = "(B, L)" if batch_first else "(L, B)"
            raise ValueError(f"mask_pad must have shape {layout} = {expected}, got {got}")
        if mask_pad.is_floating_point() or mask_pad.is_complex():
            raise ValueError(f"mask_pad must be bool (True marks padding), got {mask_pad.dtype}")
        mask = mask_pad.to(device=x.device, dtype=torch.bool)
        mask = mask if batch_first else mask.transpose(0, 1)
    if lengths is not None:
        steps = torch.arange(L, device=lengths.device)
        packed = (steps.unsqueeze(0) >= lengths.unsqueeze(1)).to(x.device)  # (B, L)
        mask = packed if mask is None else mask | packed
    return x, mask, lengths


def write_output(module: nn.Module, h: Tensor, lengths: Optional[Tensor]):
    """h (B, L, D) in the layout :func:`read_input` was given."""
    if lengths is not None:
        return pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False)
    return h if module.batch_first else h.transpose(0, 1)


def check_c0(c0: Optional[Tensor], num_layers: Optional[int], B: int, D: int,
             dtype: torch.dtype, x: Tensor) -> Tensor:
    """Validate an initial state; returns it in the state dtype (zeros if c0 is None).

    ``num_layers=None`` checks a single layer's (B, D) state. x is the input.
    """
    expected = (B, D) if num_layers is None else (num_layers, B, D)
    if c0 is None:
        return x.new_zeros(expected, dtype=dtype)
    names = "(B, D)" if num_layers is None else "(num_layers, B, D)"
    if not isinstance(c0, Tensor) or tuple(c0.shape) != expected:
        got = tuple(c0.shape) if isinstance(c0, Tensor) else type(c0).__name__
        raise ValueError(f"initial state c0 must have shape {names} = {expected} "
                         f"(batch {B}), got {got}")
    if not c0.is_floating_point():
        raise ValueError(f"initial state c0 must be floating point, got {c0.dtype}")
    if c0.dtype != dtype and autocast_dtype(x.device.type) is None:
        raise ValueError(
            f"initial state c0 has dtype {c0.dtype}, expected {dtype} "
            f"(the state is kept in fp32, or fp64 for fp64 modules)")
    return c0.to(dtype)


# --------------------------------------------------------------------------- shared bases

class RecurrentLayerBase(nn.Module):
    """Gate parameters, layer-wise LayerNorm, dropout mask and the recurrence.

    Args are the reference's; see :class:`SRUCell` for their meaning.
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
            dropout_mask = c0.new_empty(B, D).bernoulli_(1 - p).div_(1 - p)  # (B, D)
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
        """The dtype of c: fp32, or fp64 for an fp64 module."""
        return torch.promote_types(self.weight_c.dtype, torch.float32)

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


# --------------------------------------------------------------------------- SRU

class SRUCell(RecurrentLayerBase):
    """One SRU *layer*: it runs a whole sequence, not a single step.

    Unlike ``nn.LSTMCell``, this is a full layer, as in the reference package;
    to continue a sequence, pass the returned state back in as ``c0``.
    U = W x (or W₂ W₁ x with ``projection_size``), bias-free, then the
    recurrence of the module docstring.

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
            xin = xin * keep                                       # one mask per sequence
        return self.recur(self.transform(xin), x, c0, mask_pad)

    def forward(self, input: Union[Tensor, PackedSequence], c0: Optional[Tensor] = None, *,
                mask_pad: Optional[Tensor] = None):
        x, mask, lengths = read_input(self, input, mask_pad)
        check_input(x, self.input_size, self.weight_c.dtype)
        B, D = x.shape[0], self.output_size
        c0 = check_c0(c0, None, B, D, self.state_dtype, x)
        h, c = self.layer_forward(x, c0, mask)
        return write_output(self, h, lengths), c

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
        first = self.layers[0]
        x, mask, lengths = read_input(self, input, mask_pad)
        check_input(x, self.input_size, first.weight_c.dtype)
        B, nL, D = x.shape[0], self.num_layers, self.output_size
        c0 = check_c0(c0, nL, B, D, first.state_dtype, x)
        if self.input_to_hidden is not None:
            x = self.input_to_hidden(x)                                # (B, L, D)
        cs = []
        for i, layer in enumerate(self.layers):
            x, c = layer.layer_forward(x, c0[i], mask)                 # (B, L, D), (B, D)
            cs.append(c)
        c = torch.stack(cs)                                            # (num_layers, B, D)
        if self.nn_rnn_compatible_return:
            c = (c.view(nL, B, self.num_directions, self.hidden_size)
                 .transpose(1, 2).reshape(nL * self.num_directions, B, self.hidden_size))
        return write_output(self, x, lengths), c

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}"
                + (", batch_first=True" if self.batch_first else ""))
