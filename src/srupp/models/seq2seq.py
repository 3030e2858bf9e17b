"""Translation models: an encoder over the source, a decoder that attends to it.

Every translation model shares :class:`Seq2SeqModel`: one joint vocabulary,
a token embedding (shared by source, target and output when
``tie_embeddings``), a teacher-forced :meth:`~Seq2SeqModel.forward` with
label-smoothed loss, and the decoding interface that greedy and beam search
(:mod:`srupp.models.decoding`) use: :meth:`~Seq2SeqModel.encode` once per
sentence, :meth:`~Seq2SeqModel.init_decoder`, then :meth:`~Seq2SeqModel.step`
token by token through the state, :meth:`~Seq2SeqModel.reorder` to pick beams.

Token conventions (those of srupp's SentencePiece tokenizer): the source is
its pieces then ``eos_id``; the decoder reads ``bos_id`` then the target's
pieces and predicts the pieces then ``eos_id``. Padding is given by masks
(True at padding); the ids under padding are never read.

Shapes: B batch, S source length, T target length, d model width, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import SavedModel


@dataclass
class Seq2SeqConfig:
    """What every translation model shares. Not built directly: use a model type's config."""

    task: ClassVar[str] = "translate"
    type: ClassVar[str] = ""              # set by each model type's config

    vocab_size: int = 8000                # V: one joint source/target vocabulary
    d_model: int = 256                    # d: embedding, hidden and output width
    encoder_layers: int = 4               # depth of the encoder
    decoder_layers: int = 4               # depth of the decoder
    dropout: float = 0.1                  # inside the layers and after the embedding
    tie_embeddings: bool = True           # one matrix for source, target and output (joint BPE)
    bos_id: int = 1                       # the decoder's first input (the tokenizer's <eos>)
    eos_id: int = 1                       # ends a target

    def __post_init__(self):
        if not self.type:
            raise TypeError("Seq2SeqConfig holds the fields every translation model shares; "
                            "build the config of a model type, or use "
                            "config_from_dict({'task': 'translate', 'type': ...})")
        for name in ("vocab_size", "d_model", "encoder_layers", "decoder_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        for name in ("bos_id", "eos_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ValueError(f"{name} must be a token id below vocab_size "
                                 f"({self.vocab_size}), got {getattr(self, name)}")

    def to_dict(self) -> dict:
        """The fields, ``task`` and ``type``: what config_from_dict reads back."""
        return {"task": self.task, "type": self.type, **asdict(self)}


@dataclass
class EncoderOutput:
    """states (B, S, d): the encoder's output; pad (B, S) bool, True at padding, or None."""

    states: Tensor
    pad: Optional[Tensor]

    def index_select(self, index: Tensor) -> "EncoderOutput":
        return EncoderOutput(self.states.index_select(0, index),
                             None if self.pad is None else self.pad.index_select(0, index))


@dataclass
class Seq2SeqOutput:
    """logits (B, T, V); loss: label-smoothed mean over target tokens (None without
    targets); nll: the plain mean negative log-likelihood, for reporting."""

    logits: Tensor
    loss: Optional[Tensor] = None
    nll: Optional[Tensor] = None


class Seq2SeqModel(SavedModel):
    """Embedding, output and loss shared by every translation model.

    A subclass builds its encoder and decoder in :meth:`build`, initialises
    them in :meth:`reset_layers` and supplies :meth:`encode`, :meth:`decode`
    (teacher forcing), :meth:`init_decoder`, :meth:`decode_step` and
    :meth:`reorder`.
    """

    config_class: ClassVar[type]

    def __init__(self, config: Seq2SeqConfig, *, device=None, dtype=None):
        super().__init__()
        self.check_config(config)
        self.config = c = config
        factory = {"device": device, "dtype": dtype}
        self.embedding = nn.Embedding(c.vocab_size, c.d_model, **factory)
        self.emb_dropout = nn.Dropout(c.dropout)
        self.build(factory)
        self.output = nn.Linear(c.d_model, c.vocab_size, **factory)
        if c.tie_embeddings:
            self.output.weight = self.embedding.weight
        self.reset_parameters()

    def reset_parameters(self):
        """U(±√(3/d)) for the embedding (and untied output), zero output bias; then the layers."""
        bound = math.sqrt(3.0 / self.config.d_model)
        nn.init.uniform_(self.embedding.weight, -bound, bound)
        if not self.config.tie_embeddings:
            nn.init.uniform_(self.output.weight, -bound, bound)
        nn.init.zeros_(self.output.bias)
        self.reset_layers()

    # ------------------------------------------------- what subclasses supply
    def build(self, factory: dict) -> None:
        raise NotImplementedError

    def reset_layers(self) -> None:
        raise NotImplementedError

    def encode(self, src: Tensor, src_pad: Optional[Tensor] = None) -> EncoderOutput:
        """src (B, S) ids, src_pad (B, S) bool or None -> :class:`EncoderOutput`."""
        raise NotImplementedError

    def decode(self, tgt_in: Tensor, enc: EncoderOutput,
               tgt_pad: Optional[Tensor] = None) -> Tensor:
        """Teacher forcing: tgt_in (B, T) ids -> h (B, T, d), position t seeing tgt_in[:, :t+1]."""
        raise NotImplementedError

    def init_decoder(self, enc: EncoderOutput) -> Any:
        """The decoder state before its first token; computes what depends on the source once."""
        raise NotImplementedError

    def decode_step(self, tokens: Tensor, state: Any) -> Tuple[Tensor, Any]:
        """tokens (B,) -> (h (B, d), new state)."""
        raise NotImplementedError

    def reorder(self, state: Any, index: Tensor) -> Any:
        """The state of rows ``index`` (B',) of ``state``, for beam search."""
        raise NotImplementedError

    # ------------------------------------------------------------ shared
    def embed(self, tokens: Tensor) -> Tensor:
        """(B, L) ids -> (B, L, d), embedding dropout applied."""
        return self.emb_dropout(self.embedding(tokens))

    def forward(self, src: Tensor, tgt_in: Tensor, *, src_pad: Optional[Tensor] = None,
                tgt_pad: Optional[Tensor] = None, targets: Optional[Tensor] = None,
                label_smoothing: float = 0.0) -> Seq2SeqOutput:
        """Score target prefixes with teacher forcing.

        Args:
            src: (B, S) source ids.  tgt_in: (B, T) decoder inputs (bos_id, pieces).
            src_pad, tgt_pad: (B, S), (B, T) bool, True at padding, or None.
            targets: (B, T) next-token ids, -100 where ignored (padding).
            label_smoothing: ε of the smoothed loss.
        """
        for name, t in (("src", src), ("tgt_in", tgt_in)):
            if not isinstance(t, Tensor) or t.dim() != 2 or t.dtype != torch.long:
                got = (f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor)
                       else type(t).__name__)
                raise ValueError(f"{name} must be a (B, L) long tensor of token ids, got {got}")
        enc = self.encode(src, src_pad)
        h = self.decode(tgt_in, enc, tgt_pad)                    # (B, T, d)
        logits = self.output(h)                                  # (B, T, V)
        if targets is None:
            return Seq2SeqOutput(logits)
        flat, tgt = logits.float().flatten(0, 1), targets.flatten()
        loss = F.cross_entropy(flat, tgt, ignore_index=-100, label_smoothing=label_smoothing)
        nll = loss if label_smoothing == 0 else F.cross_entropy(flat.detach(), tgt,
                                                                ignore_index=-100)
        return Seq2SeqOutput(logits, loss, nll)

    @torch.no_grad()
    def step(self, tokens: Tensor, state: Any) -> Tuple[Tensor, Any]:
        """One decoder token per row: tokens (B,) -> (log-probabilities (B, V) fp32, state)."""
        h, state = self.decode_step(tokens, state)
        return F.log_softmax(self.output(h).float(), dim=-1), state
