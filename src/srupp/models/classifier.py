"""The sequence classifier: one label per token sequence, over any backbone's encoder role.

    embedding → dropout → encoder (B, L, d) → pooling (real positions) → dropout → linear (C)

Padding is given by ``mask_pad`` (True at padding), anywhere in a row; the
ids under padding are never read. Every encoder treats a row as the sequence of
its real tokens alone (:mod:`srupp.models.backbones`), so a padded row gets
the logits it would get unpadded.

Shapes: B batch, L length, d model width, C labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import SavedModel, describe, init_embedding
from .config import POOLINGS, ClassifierConfig


# --------------------------------------------------------------------------- pooling

def mean_pool(h: Tensor, pad: Optional[Tensor]) -> Tensor:
    """The mean over real positions: h (B, L, d), pad (B, L) bool or None -> (B, d)."""
    acc = torch.promote_types(h.dtype, torch.float32)  # a long bf16 sum loses digits
    if pad is None:
        return h.mean(dim=1, dtype=acc).to(h.dtype)
    real = ~pad                                                          # (B, L)
    # where(), not a product: a padded value that is inf or nan must not leak in
    total = torch.where(real.unsqueeze(-1), h, 0.0).sum(dim=1, dtype=acc)  # (B, d)
    return (total / real.sum(dim=1, keepdim=True)).to(h.dtype)


def max_pool(h: Tensor, pad: Optional[Tensor]) -> Tensor:
    """The element-wise max over real positions: h (B, L, d) -> (B, d)."""
    if pad is not None:
        h = h.masked_fill(pad.unsqueeze(-1), float("-inf"))              # (B, L, d)
    return h.amax(dim=1)


def attention_pool(h: Tensor, pad: Optional[Tensor], query: Tensor) -> Tensor:
    """Softmax over real positions of h·query, then the weighted mean of h.

    h (B, L, d), pad (B, L) bool or None, query (d,) -> (B, d).
    """
    scores = h @ query                                                   # (B, L)
    if pad is not None:
        scores = scores.masked_fill(pad, float("-inf"))
    weights = torch.softmax(scores, dim=1)                               # (B, L), 0 at padding
    if pad is not None:
        h = torch.where(pad.unsqueeze(-1), 0.0, h)  # 0·inf is nan: clear padding first
    return torch.einsum("bl,bld->bd", weights, h)


class Pooling(nn.Module):
    """One of :data:`POOLINGS`; "attention" owns the learned query.

    The query starts at zero, so attention pooling starts as mean pooling and
    learns where to look.
    """

    def __init__(self, how: str, d: int, *, device=None, dtype=None):
        super().__init__()
        if how not in POOLINGS:
            raise ValueError(f"pooling must be 'mean', 'max' or 'attention', got {how!r}")
        self.how = how
        self.query = (nn.Parameter(torch.zeros(d, device=device, dtype=dtype))
                      if how == "attention" else None)

    def reset_parameters(self):
        if self.query is not None:
            nn.init.zeros_(self.query)

    def forward(self, h: Tensor, pad: Optional[Tensor]) -> Tensor:
        """h (B, L, d), pad (B, L) bool or None -> (B, d)."""
        if self.how == "mean":
            return mean_pool(h, pad)
        if self.how == "max":
            return max_pool(h, pad)
        return attention_pool(h, pad, self.query)

    def extra_repr(self) -> str:
        return self.how


# --------------------------------------------------------------------------- the shared model

@dataclass
class ClassifierOutput:
    """logits (B, C); loss: mean cross-entropy over the batch (None without labels)."""

    logits: Tensor
    loss: Optional[Tensor] = None


class SequenceClassifier(SavedModel):
    """A classifier over any backbone (the config's ``type``) in its encoder role."""

    task = "classify"

    def __init__(self, config: ClassifierConfig, *, device=None, dtype=None):
        super().__init__(config, device=device, dtype=dtype)
        c, factory = config, self.factory
        self.embedding = nn.Embedding(c.vocab_size, c.d_model, **factory)
        self.emb_dropout = nn.Dropout(c.dropout)
        self.encoder = self.make_backbone("encoder")
        self.pooling = Pooling(c.pooling, c.d_model, **factory)
        self.head_dropout = nn.Dropout(c.dropout)
        self.output = nn.Linear(c.d_model, c.num_labels, **factory)
        self.reset_parameters()

    def reset_parameters(self):
        """U(±√(3/d)) embedding, Xavier output with zero bias; then the encoder."""
        init_embedding(self.embedding)
        nn.init.xavier_uniform_(self.output.weight)
        nn.init.zeros_(self.output.bias)  # no class preferred before training
        self.pooling.reset_parameters()
        self.encoder.reset_parameters()

    # ------------------------------------------------------------ shared
    def _check(self, tokens: Tensor, mask_pad: Optional[Tensor], labels: Optional[Tensor]
               ) -> Optional[Tensor]:
        """ValueError for bad inputs; returns the padding mask on tokens' device, None if none."""
        if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(f"tokens must be a (B, L) long tensor of token ids, "
                             f"got {describe(tokens)}")
        B, L = tokens.shape
        if B == 0 or L == 0:
            raise ValueError(f"tokens must hold at least one token per row, got shape {(B, L)}")
        pad = None
        if mask_pad is not None:
            if not isinstance(mask_pad, Tensor) or mask_pad.dtype != torch.bool or \
                    tuple(mask_pad.shape) != (B, L):
                raise ValueError(f"mask_pad must be a bool tensor of the tokens' shape "
                                 f"(B, L) = {(B, L)}, True at padding; got {describe(mask_pad)}")
            pad = mask_pad.to(tokens.device)
        if labels is not None:
            if not isinstance(labels, Tensor) or labels.dtype != torch.long or \
                    tuple(labels.shape) != (B,):
                raise ValueError(f"labels must be a (B,) = {(B,)} long tensor of class ids, "
                                 f"got {describe(labels)}")
            labels = labels.to(tokens.device)
        # The value checks, read back in one transfer (one sync on GPU).
        real_ids = tokens if pad is None else tokens.masked_fill(pad, 0)
        checks = [(real_ids < 0).any() | (real_ids >= self.config.vocab_size).any()]
        if pad is not None:
            checks += [pad.all(dim=1).any(), pad.any()]
        if labels is not None:
            checks.append(((labels < 0) | (labels >= self.config.num_labels)).any())
        bad = torch.stack(checks).tolist()
        if bad[0]:
            raise ValueError(f"tokens hold ids outside [0, vocab_size={self.config.vocab_size}) "
                             f"at real (unpadded) positions")
        if pad is not None:
            if bad[1]:
                row = int(pad.all(dim=1).nonzero()[0])
                raise ValueError(f"row {row} of mask_pad is all padding: every row needs at "
                                 f"least one real token; drop empty rows first")
            if not bad[2]:
                pad = None  # no padding: take the same path as without a mask
        if labels is not None and bad[-1]:
            raise ValueError(f"labels must be class ids in [0, num_labels="
                             f"{self.config.num_labels}), got values from {int(labels.min())} "
                             f"to {int(labels.max())}")
        return pad

    def forward(self, tokens: Tensor, *, mask_pad: Optional[Tensor] = None,
                labels: Optional[Tensor] = None) -> ClassifierOutput:
        """Classify each row of ``tokens``.

        Args:
            tokens: (B, L) long token ids.
            mask_pad: (B, L) bool, True at padding (anywhere in a row), or None;
                every row needs a real token. Ids under padding are not read.
            labels: (B,) long class ids in [0, num_labels), or None.
        Returns:
            :class:`ClassifierOutput`: logits (B, C), and with labels the mean cross-entropy.
        """
        pad = self._check(tokens, mask_pad, labels)
        if pad is not None:
            tokens = tokens.masked_fill(pad, 0)  # any id may sit under padding
        x = self.emb_dropout(self.embedding(tokens))                     # (B, L, d)
        h, _ = self.encoder(x, None, pad)                                # (B, L, d)
        pooled = self.head_dropout(self.pooling(h, pad))                 # (B, d)
        logits = self.output(pooled)                                     # (B, C)
        if labels is None:
            return ClassifierOutput(logits)
        # at least fp32 (half-precision logits lose the loss), fp64 kept for gradcheck
        loss = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)),
                               labels)
        return ClassifierOutput(logits, loss)
