"""``nn.Linear`` whose bias-free products go through :func:`srupp.ops.linear`."""

from __future__ import annotations

from torch import Tensor, nn

from ..ops.matmul import linear


class Linear(nn.Linear):
    """``torch.nn.Linear`` (same parameters, state dict and init), with a faster fp32 CPU path.

    Without a bias, ``forward`` calls :func:`srupp.ops.linear`, which sends
    large fp32 CPU products to oneDNN (see :mod:`srupp.ops.matmul`) and
    everything else to ``F.linear``. With a bias it is plain ``nn.Linear``.

    Shapes: input (..., in_features) -> (..., out_features).
    """

    def forward(self, input: Tensor) -> Tensor:
        if self.bias is None:
            return linear(input, self.weight)
        return super().forward(input)
