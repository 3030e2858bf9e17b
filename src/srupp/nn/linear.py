"""``nn.Linear`` whose bias-free products go through :func:`srupp.ops.linear`."""

from __future__ import annotations

from torch import Tensor, nn

from ..ops.matmul import linear


class Linear(nn.Linear):
    """``torch.nn.Linear`` (same parameters, state dict and init), with a faster fp32 CPU path.

    ``forward`` calls :func:`srupp.ops.linear`, which sends large bias-free
    fp32 CPU products to oneDNN, products of a few rows without gradient
    (decoding) to the extension's few-rows kernel (see :mod:`srupp.ops.matmul`),
    and everything else to ``F.linear``.

    Shapes: input (..., in_features) -> (..., out_features).
    """

    def forward(self, input: Tensor) -> Tensor:
        return linear(input, self.weight, self.bias)
