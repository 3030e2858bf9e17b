"""Plain SRU (:class:`srupp.nn.SRU`, no attention) in the recurrent backbones' roles (:mod:`.rnn`).

Its state is each layer's c (num_layers, B, d); padded steps hold it natively,
so every role is exact under padding without packing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

import torch
from torch import Tensor

from ...nn import SRU
from .rnn import AttentionalDecoderFields, RNNBackbone


@dataclass
class SRUFields:
    """A stack of plain SRU layers."""

    bidirectional: ClassVar[bool] = True  # the encoder gives each direction d_model/2 units

    projection_size: int = 0              # factorise each layer's W through this width (0: off)
    highway_bias: float = -2.0            # initial b_r: start close to the skip path
    layer_norm: bool = False              # layer-wise LayerNorm
    normalize_after: bool = False         # post-norm when layer_norm

    _ranges = {"projection_size": ">= 0"}


@dataclass
class SRUSeq2SeqFields(AttentionalDecoderFields, SRUFields):
    """An SRU encoder–decoder with attention."""


class SRUBackbone(RNNBackbone):
    label = "SRU"
    cell = SRU
    names = ("c",)
    fields = SRUFields
    task_fields = {"translate": SRUSeq2SeqFields}

    def make_rnn(self, n_in: int, hidden: int, layers: int, *, bidirectional: bool) -> SRU:
        c = self.config
        return SRU(n_in, hidden, layers, dropout=c.dropout, bidirectional=bidirectional,
                   projection_size=c.projection_size, highway_bias=c.highway_bias,
                   layer_norm=c.layer_norm, normalize_after=c.normalize_after,
                   batch_first=True, **self.factory)

    def run(self, x: Tensor, hx: Optional[Tuple[Tensor, ...]], pad: Optional[Tensor]):
        y, c = self.rnn(x, None if hx is None else hx[0], mask_pad=pad)  # padding holds c
        return y, (c,)

    @property
    def state_dtype(self) -> torch.dtype:
        return self.rnn.layers[0].state_dtype  # fp32 (fp64 for an fp64 model)
