"""Text classifiers: one label per token sequence.

Every classifier shares :class:`ClassifierBase`::

    embedding → dropout → encoder (B, L, d) → pooling over real positions → dropout → linear (C)

and differs only in its encoder, chosen by the config's ``type`` (task "classify"):

    srupp        bidirectional SRU++ (srupp.nn.SRUpp): :class:`Classifier`
    sru          bidirectional plain SRU (srupp.nn.SRU)
    lstm         bidirectional torch.nn.LSTM, run on packed sequences
    transformer  torch.nn.TransformerEncoder, pre-LN, GELU, sinusoidal positions

Padding is given by ``mask_pad`` (True at padding), anywhere in a row; the
ids under padding are never read. Every encoder treats a row as the sequence of
its real tokens alone: the SRU stacks hold their state over padded steps and
never attend to them, the LSTM runs only the real tokens (packed), the
transformer masks padded keys and counts positions over real tokens only. So
a padded row gets the logits it would get unpadded.

Shapes: B batch, L length, d model width, C labels.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from .._ranges import check_fields
from ..nn import SRU, SRUpp
from ..nn.srupp import check_attention_layout
from .base import SavedModel
from .baselines import sinusoids

POOLINGS = ("mean", "max", "attention")


# --------------------------------------------------------------------------- configs

@dataclass
class ClassifierConfig:
    """What every classifier shares. Not built directly: use a model type's config."""

    task: ClassVar[str] = "classify"
    type: ClassVar[str] = ""              # set by each model type's config
    bidirectional: ClassVar[bool] = False  # the encoder splits d_model over two directions

    vocab_size: int                       # V: the tokenizer's vocabulary (no sensible default)
    num_labels: int                       # C: the classes; >= 2 (a binary task has 2)
    d_model: int = 256                    # d: embedding and encoder output width
    num_layers: int = 2                   # encoder depth; classification needs little
    dropout: float = 0.1                  # after the embedding, inside the encoder, before the head
    pooling: str = "mean"                 # mean|max|attention over real positions (see pool)

    # each number's range (srupp._ranges; a subclass's table adds to its bases')
    _ranges = {"vocab_size": ">= 1", "d_model": ">= 1", "num_layers": ">= 1",
               "dropout": "[0, 1)"}  # num_labels: below, with its note

    def __post_init__(self):
        if not self.type:
            raise TypeError("ClassifierConfig holds the fields every classifier shares; build "
                            "the config of a model type, or use "
                            "config_from_dict({'task': 'classify', 'type': ...})")
        check_fields(self)  # every number of this type's config, subclasses' included
        if self.num_labels < 2:
            raise ValueError(f"num_labels must be >= 2 (a yes/no task has 2), "
                             f"got {self.num_labels}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be 'mean', 'max' or 'attention', "
                             f"got {self.pooling!r}")
        if self.bidirectional and self.d_model % 2:
            raise ValueError(f"d_model must be even for the bidirectional {self.type} encoder "
                             f"(d_model/2 per direction), got {self.d_model}")

    def to_dict(self) -> dict:
        """The fields, ``task`` and ``type``: what config_from_dict reads back."""
        return {"task": self.task, "type": self.type, **asdict(self)}


@dataclass
class SRUppClassifierConfig(ClassifierConfig):
    """Bidirectional SRU++: SRU layers whose input projection attends to the whole sequence."""

    type: ClassVar[str] = "srupp"
    bidirectional: ClassVar[bool] = True

    proj_size: int = 64                   # d′: attention width; the paper uses d/4
    num_heads: int = 1                    # the paper uses single-head attention
    attn_dropout: float = 0.0             # on attention weights
    highway_bias: float = -2.0            # initial b_r: start close to the skip path
    attention_every_n_layers: int = 1     # attention in layers i with (i+1) % n == 0
    attention_last_n_layers: int = -1     # or only in the last n layers (-1: off)

    _ranges = {"proj_size": ">= 1", "num_heads": ">= 1", "attn_dropout": "[0, 1)"}

    def __post_init__(self):
        super().__post_init__()
        if self.proj_size % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be >= 1 and divide "
                             f"proj_size ({self.proj_size})")
        check_attention_layout(self.num_layers, self.attention_every_n_layers,
                               self.attention_last_n_layers)


@dataclass
class SRUClassifierConfig(ClassifierConfig):
    """Bidirectional plain SRU, without attention."""

    type: ClassVar[str] = "sru"
    bidirectional: ClassVar[bool] = True

    highway_bias: float = -2.0            # initial b_r: start close to the skip path


@dataclass
class LSTMClassifierConfig(ClassifierConfig):
    """Bidirectional torch.nn.LSTM: the shared fields say everything."""

    type: ClassVar[str] = "lstm"
    bidirectional: ClassVar[bool] = True


@dataclass
class TransformerClassifierConfig(ClassifierConfig):
    """A pre-LN transformer encoder (BERT-like, without pre-training)."""

    type: ClassVar[str] = "transformer"

    num_heads: int = 4                    # must divide d_model
    ffn_mult: int = 4                     # the MLP is ffn_mult·d_model wide

    _ranges = {"num_heads": ">= 1", "ffn_mult": ">= 1"}

    def __post_init__(self):
        super().__post_init__()
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be >= 1 and divide "
                             f"d_model ({self.d_model})")


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


def _describe(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__


class ClassifierBase(SavedModel):
    """Embedding, pooling, head and loss shared by every classifier.

    A subclass builds its encoder in :meth:`build`, initialises it in
    :meth:`reset_layers` and runs it in :meth:`encode`.
    ``ClassifierBase.from_pretrained`` loads a saved classifier of any type.
    """

    config_class: ClassVar[type]

    def __init__(self, config: ClassifierConfig, *, device=None, dtype=None):
        super().__init__()
        self.check_config(config)
        self.config = c = config
        factory = {"device": device, "dtype": dtype}
        self.embedding = nn.Embedding(c.vocab_size, c.d_model, **factory)
        self.emb_dropout = nn.Dropout(c.dropout)
        self.build(factory)
        self.pooling = Pooling(c.pooling, c.d_model, **factory)
        self.head_dropout = nn.Dropout(c.dropout)
        self.head = nn.Linear(c.d_model, c.num_labels, **factory)
        self.reset_parameters()

    def reset_parameters(self):
        """U(±√(3/d)) embedding (variance 1/d), Xavier head with zero bias; then the encoder."""
        bound = math.sqrt(3.0 / self.config.d_model)
        nn.init.uniform_(self.embedding.weight, -bound, bound)
        nn.init.xavier_uniform_(self.head.weight)
        nn.init.zeros_(self.head.bias)  # no class preferred before training
        self.pooling.reset_parameters()
        self.reset_layers()

    # ------------------------------------------------- what subclasses supply
    def build(self, factory: dict) -> None:
        """Create the encoder's modules."""
        raise NotImplementedError

    def reset_layers(self) -> None:
        """Initialise the encoder."""
        raise NotImplementedError

    def encode(self, x: Tensor, pad: Optional[Tensor]) -> Tensor:
        """x (B, L, d) embedded tokens, pad (B, L) bool (some padding) or None -> (B, L, d).

        Each row's real positions must come out as for the row without its padding.
        """
        raise NotImplementedError

    # ------------------------------------------------------------ shared
    def _check(self, tokens: Tensor, mask_pad: Optional[Tensor], labels: Optional[Tensor]
               ) -> Optional[Tensor]:
        """ValueError for bad inputs; returns the padding mask on tokens' device, None if none."""
        if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(f"tokens must be a (B, L) long tensor of token ids, "
                             f"got {_describe(tokens)}")
        B, L = tokens.shape
        if B == 0 or L == 0:
            raise ValueError(f"tokens must hold at least one token per row, got shape {(B, L)}")
        pad = None
        if mask_pad is not None:
            if not isinstance(mask_pad, Tensor) or mask_pad.dtype != torch.bool or \
                    tuple(mask_pad.shape) != (B, L):
                raise ValueError(f"mask_pad must be a bool tensor of the tokens' shape "
                                 f"(B, L) = {(B, L)}, True at padding; got {_describe(mask_pad)}")
            pad = mask_pad.to(tokens.device)
        if labels is not None:
            if not isinstance(labels, Tensor) or labels.dtype != torch.long or \
                    tuple(labels.shape) != (B,):
                raise ValueError(f"labels must be a (B,) = {(B,)} long tensor of class ids, "
                                 f"got {_describe(labels)}")
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
        h = self.encode(x, pad)                                          # (B, L, d)
        pooled = self.head_dropout(self.pooling(h, pad))                 # (B, d)
        logits = self.head(pooled)                                       # (B, C)
        if labels is None:
            return ClassifierOutput(logits)
        # at least fp32 (half-precision logits lose the loss), fp64 kept for gradcheck
        loss = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)),
                               labels)
        return ClassifierOutput(logits, loss)


# --------------------------------------------------------------------------- the model types

class Classifier(ClassifierBase):
    """The SRU++ classifier: a bidirectional, non-causal SRU++ encoder, d/2 per direction."""

    config_class = SRUppClassifierConfig

    def build(self, factory: dict) -> None:
        c = self.config
        # mem_len=0: one call sees the whole text, so no state is carried to a next one
        self.encoder = SRUpp(c.d_model, c.d_model // 2, c.proj_size, c.num_layers,
                             dropout=c.dropout, attn_dropout=c.attn_dropout,
                             num_heads=c.num_heads, bidirectional=True,
                             highway_bias=c.highway_bias, causal=False, mem_len=0,
                             attention_every_n_layers=c.attention_every_n_layers,
                             attention_last_n_layers=c.attention_last_n_layers,
                             batch_first=True, **factory)

    def reset_layers(self) -> None:
        self.encoder.reset_parameters()

    def encode(self, x: Tensor, pad: Optional[Tensor]) -> Tensor:
        h, _ = self.encoder(x, mask_pad=pad)  # padded steps hold the state and are not attended
        return h                                                         # (B, L, d)


class SRUClassifier(ClassifierBase):
    """A bidirectional plain SRU encoder, d/2 per direction."""

    config_class = SRUClassifierConfig

    def build(self, factory: dict) -> None:
        c = self.config
        self.encoder = SRU(c.d_model, c.d_model // 2, c.num_layers, dropout=c.dropout,
                           bidirectional=True, highway_bias=c.highway_bias, batch_first=True,
                           **factory)

    def reset_layers(self) -> None:
        self.encoder.reset_parameters()

    def encode(self, x: Tensor, pad: Optional[Tensor]) -> Tensor:
        h, _ = self.encoder(x, mask_pad=pad)  # padded steps hold the state
        return h                                                         # (B, L, d)


class LSTMClassifier(ClassifierBase):
    """A bidirectional torch.nn.LSTM encoder, d/2 per direction, exact under padding."""

    config_class = LSTMClassifierConfig

    def build(self, factory: dict) -> None:
        c = self.config
        self.encoder = nn.LSTM(c.d_model, c.d_model // 2, c.num_layers, batch_first=True,
                               bidirectional=True,
                               dropout=c.dropout if c.num_layers > 1 else 0.0, **factory)

    def reset_layers(self) -> None:
        """PyTorch's U(±1/√h), with forget-gate bias 1 (Jozefowicz et al., 2015)."""
        self.encoder.reset_parameters()
        n = self.encoder.hidden_size
        with torch.no_grad():
            for name, b in self.encoder.named_parameters():
                if name.startswith("bias_ih"):  # gates i, f, g, o; the ih and hh biases add up
                    b[n:2 * n].fill_(1.0)
                elif name.startswith("bias_hh"):
                    b[n:2 * n].zero_()

    def encode(self, x: Tensor, pad: Optional[Tensor]) -> Tensor:
        if pad is None:
            return self.encoder(x)[0]                                    # (B, L, d)
        # Packing needs each row's real tokens first: a stable sort moves them to the
        # front in order (padding may be anywhere), and the outputs are put back after.
        B, L, d = x.shape
        order = torch.argsort(pad.to(torch.uint8), dim=1, stable=True)   # (B, L)
        index = order.unsqueeze(-1).expand(B, L, d)                      # (B, L, d)
        lengths = (~pad).sum(dim=1).cpu()                                # (B,)
        packed = pack_padded_sequence(x.gather(1, index), lengths, batch_first=True,
                                      enforce_sorted=False)
        y, _ = pad_packed_sequence(self.encoder(packed)[0], batch_first=True,
                                   total_length=L)                       # (B, L, d), 0 past length
        return torch.zeros_like(y).scatter(1, index, y)                  # (B, L, d)


class TransformerClassifier(ClassifierBase):
    """A pre-LN transformer encoder (GELU MLP) with sinusoidal positions."""

    config_class = TransformerClassifierConfig

    def build(self, factory: dict) -> None:
        c = self.config
        layer = nn.TransformerEncoderLayer(c.d_model, c.num_heads, c.ffn_mult * c.d_model,
                                           dropout=c.dropout, activation="gelu",
                                           batch_first=True, norm_first=True, **factory)
        # Pre-LN leaves the residual stream un-normalised: the final LayerNorm does it.
        # Nested tensors don't apply to pre-LN layers (torch would warn).
        self.encoder = nn.TransformerEncoder(layer, c.num_layers,
                                             norm=nn.LayerNorm(c.d_model, **factory),
                                             enable_nested_tensor=False)

    def reset_layers(self) -> None:
        """torch's own initialisation, drawn again per layer: TransformerEncoder deep-copies
        one layer, so every layer would otherwise start with the same weights."""
        for layer in self.encoder.layers:
            layer.self_attn._reset_parameters()
            for m in (layer.linear1, layer.linear2, layer.norm1, layer.norm2):
                m.reset_parameters()
        self.encoder.norm.reset_parameters()

    def encode(self, x: Tensor, pad: Optional[Tensor]) -> Tensor:
        B, L, d = x.shape
        if pad is None:
            positions = torch.arange(L, device=x.device).expand(B, L)    # (B, L)
        else:  # count real tokens only, so that a row's positions ignore its padding
            real = (~pad).long()
            positions = real.cumsum(dim=1) - real                        # (B, L)
        # the embedding has variance 1/d: √d brings it to the sinusoids' scale
        x = x * math.sqrt(d) + sinusoids(positions, d).to(x.dtype)       # (B, L, d)
        return self.encoder(x, src_key_padding_mask=pad)                 # (B, L, d)
