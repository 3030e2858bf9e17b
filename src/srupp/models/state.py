"""The state the baseline language models carry between calls.

:class:`TensorState` is a named set of tensors, each with the index of its
batch dimension (None for tensors shared by the whole batch), so that the
trainer (``detach()``), beam search (``index_select``) and checkpoints
(``to_dict``/``from_dict``) handle every baseline the same way:

    sru          c (num_layers, B, d)                      batch dim 1
    lstm         h, c (num_layers, B, d)                   batch dim 1
    gru          h (num_layers, B, d)                      batch dim 1
    transformer  k.i, v.i (B, H, M, hd) per layer i        batch dim 0 (absent: empty cache)
                 key_pad (B, M) bool, True at padding      batch dim 0 (with the cache)
                 pos (B,) long, next token's position      batch dim 0
                 window () long, keys kept after a call    shared (-1: unbounded)

:func:`state_from_dict` reads either this or an :class:`~srupp.nn.SRUppState`
dict: a TensorState dict carries the marker key :data:`KIND_KEY`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
from torch import Tensor

KIND_KEY = "__kind__.tensor_state"
_DIM_PREFIX = "__batch_dim__."


@dataclass
class TensorState:
    """Named tensors, with each one's batch dimension (None: not batched)."""

    tensors: Dict[str, Tensor]
    batch_dims: Dict[str, Optional[int]] = field(default_factory=dict)

    def __post_init__(self):
        self.tensors = dict(self.tensors)
        self.batch_dims = {k: self.batch_dims.get(k) for k in self.tensors}
        sizes = {t.shape[d] for k, t in self.tensors.items()
                 if (d := self.batch_dims[k]) is not None}
        if len(sizes) > 1:
            raise ValueError(f"TensorState tensors disagree on the batch size: {sorted(sizes)}")

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def get(self, name: str, default=None):
        return self.tensors.get(name, default)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    @property
    def batch_size(self) -> Optional[int]:
        for k, t in self.tensors.items():
            if self.batch_dims[k] is not None:
                return t.shape[self.batch_dims[k]]
        return None

    def nbytes(self) -> int:
        """Bytes held by all tensors of the state."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    # ------------------------------------------------------------ transforms
    def _map(self, fn) -> "TensorState":
        return TensorState({k: fn(t, self.batch_dims[k]) for k, t in self.tensors.items()},
                           dict(self.batch_dims))

    def detach(self) -> "TensorState":
        """A copy cut from the autograd graph, for truncated backpropagation."""
        return self._map(lambda t, d: t.detach())

    def index_select(self, batch_indices: Tensor) -> "TensorState":
        """Reorder or repeat batch entries (B',) long, e.g. to follow beams."""
        dev = next(iter(self.tensors.values())).device if self.tensors else None
        idx = torch.as_tensor(batch_indices, dtype=torch.long, device=dev)
        return self._map(lambda t, d: t if d is None else t.index_select(d, idx))

    def to(self, *args, **kwargs) -> "TensorState":
        """Move to a device. Pass a device only: dtypes are part of the state."""
        return self._map(lambda t, d: t.to(*args, **kwargs))

    # ------------------------------------------------------------ checkpoint
    def to_dict(self) -> Dict[str, Tensor]:
        """A flat ``{name: tensor}`` dict, ready for safetensors or ``torch.save``."""
        out: Dict[str, Tensor] = {KIND_KEY: torch.tensor(1, dtype=torch.long)}
        for k, t in self.tensors.items():
            out[k] = t
            d = self.batch_dims[k]
            out[_DIM_PREFIX + k] = torch.tensor(-1 if d is None else d, dtype=torch.long)
        return out

    @classmethod
    def from_dict(cls, tensors: Dict[str, Tensor]) -> "TensorState":
        """Inverse of :meth:`to_dict`."""
        if KIND_KEY not in tensors:
            raise ValueError(f"TensorState.from_dict: missing marker key {KIND_KEY!r}")
        names = [k for k in tensors if k != KIND_KEY and not k.startswith(_DIM_PREFIX)]
        dims = {}
        for k in names:
            d = tensors.get(_DIM_PREFIX + k)
            if d is None:
                raise ValueError(f"TensorState.from_dict: no batch dimension for {k!r}")
            dims[k] = None if int(d) < 0 else int(d)
        return cls({k: tensors[k] for k in names}, dims)


def state_from_dict(tensors: Dict[str, Tensor]):
    """A TensorState or an SRUppState, whichever wrote ``tensors``."""
    if KIND_KEY in tensors:
        return TensorState.from_dict(tensors)
    from ..nn import SRUppState

    return SRUppState.from_dict(tensors)
