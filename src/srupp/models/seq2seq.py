"""The encoder–decoder (translation) model over any backbone: one in its encoder role, one in
its decoder role.

One joint vocabulary and token embedding (shared by source, target and output
when ``tie_embeddings``), a teacher-forced :meth:`~EncoderDecoder.forward` with
label-smoothed loss, and the decoding interface that greedy and beam search
(:mod:`srupp.models.decoding`) use: :meth:`~EncoderDecoder.encode` once per
sentence, :meth:`~EncoderDecoder.init_decoder` (the decoder backbone computes
what it reads of the source once), then :meth:`~EncoderDecoder.step` token by
token through the state, :meth:`~EncoderDecoder.reorder` to pick beams.

Token conventions (those of srupp's SentencePiece tokenizer): the source is
its pieces then ``eos_id``; the decoder reads ``bos_id`` then the target's
pieces and predicts the pieces then ``eos_id``. Padding is given by masks
(True at padding); the ids under padding are never read. A backbone with
``pads_right`` takes padding only at the end of rows (as the tokenizer's
batches have it), and every source row needs a real token (its eos).

Shapes: B batch, S source length, T target length, d model width, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.linear import Linear
from .backbones import EncoderOutput
from .base import SavedModel, describe, init_embedding
from .config import Seq2SeqConfig


@dataclass
class Seq2SeqOutput:
    """logits (B, T, V); loss: label-smoothed mean over target tokens (None without
    targets); nll: the plain mean negative log-likelihood, for reporting."""

    logits: Tensor
    loss: Optional[Tensor] = None
    nll: Optional[Tensor] = None


def check_padding(pad: Optional[Tensor], tokens: Tensor, name: str) -> Optional[Tensor]:
    """``pad`` (B, L) bool, True at padding and only at the end of rows, or None."""
    if pad is None:
        return None
    if not isinstance(pad, Tensor) or pad.dtype != torch.bool or pad.shape != tokens.shape:
        raise ValueError(f"{name} must be a bool tensor shaped like its tokens "
                         f"{tuple(tokens.shape)}, True at padding; got {describe(pad)}")
    if bool((pad[:, :-1] & ~pad[:, 1:]).any()):
        raise ValueError(f"{name} has a real token after padding; pad at the end of each row")
    return pad


def check_source(src: Tensor, src_pad: Optional[Tensor]) -> Optional[Tensor]:
    """The source padding, checked; a row of padding only has nothing to attend to."""
    pad = check_padding(src_pad, src, "src_pad")
    if src.shape[1] == 0 or (pad is not None and bool(pad[:, 0].any())):
        raise ValueError("every source row needs at least one real token (its eos)")
    return pad


class EncoderDecoder(SavedModel):
    """A translation model over any backbone (the config's ``type``); see the module doc."""

    task = "translate"

    def __init__(self, config: Seq2SeqConfig, *, device=None, dtype=None):
        super().__init__(config, device=device, dtype=dtype)
        c, factory = config, self.factory
        self.embedding = nn.Embedding(c.vocab_size, c.d_model, **factory)
        self.emb_dropout = nn.Dropout(c.dropout)
        self.encoder = self.make_backbone("encoder")
        self.decoder = self.make_backbone("decoder")
        self.out_dropout = nn.Dropout(c.dropout)
        self.output = Linear(c.d_model, c.vocab_size, **factory)
        if c.tie_embeddings:
            self.output.weight = self.embedding.weight
        self.reset_parameters()

    def reset_parameters(self):
        """U(±√(3/d)) embedding (and untied output), zero output bias; then the backbones."""
        init_embedding(self.embedding, self.output)
        self.encoder.reset_parameters()
        self.decoder.reset_parameters()

    def embed(self, tokens: Tensor) -> Tensor:
        """(B, L) ids -> (B, L, d), embedding dropout applied."""
        return self.emb_dropout(self.embedding(tokens))

    def encode(self, src: Tensor, src_pad: Optional[Tensor] = None) -> EncoderOutput:
        """src (B, S) ids, src_pad (B, S) bool or None -> :class:`EncoderOutput`."""
        if self.encoder.pads_right:
            src_pad = check_source(src, src_pad)
        elif src_pad is not None:
            src_pad = src_pad.to(torch.bool)
        h, _ = self.encoder(self.embed(src), None, src_pad)             # (B, S, d)
        return EncoderOutput(h, src_pad)

    def decode(self, tgt_in: Tensor, enc: EncoderOutput,
               tgt_pad: Optional[Tensor] = None) -> Tensor:
        """Teacher forcing: tgt_in (B, T) ids -> h (B, T, d), position t seeing tgt_in[:, :t+1]."""
        if self.decoder.pads_right:
            check_padding(tgt_pad, tgt_in, "tgt_pad")
        state = self.decoder.init_decoder(enc, steps=False)
        h, _ = self.decoder(self.embed(tgt_in), state, tgt_pad)         # (B, T, d)
        return self.out_dropout(h)

    def init_decoder(self, enc: EncoderOutput) -> Any:
        """The decoder state before its first token; what depends on the source is computed once."""
        return self.decoder.init_decoder(enc)

    def decode_step(self, tokens: Tensor, state: Any) -> Tuple[Tensor, Any]:
        """tokens (B,) -> (h (B, d), new state)."""
        h, state = self.decoder.step(self.embed(tokens), state)
        return self.out_dropout(h), state

    def reorder(self, state: Any, index: Tensor) -> Any:
        """The state of rows ``index`` (B',) of ``state``, for beam search."""
        return state.index_select(index)

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
                raise ValueError(f"{name} must be a (B, L) long tensor of token ids, "
                                 f"got {describe(t)}")
        enc = self.encode(src, src_pad)
        h = self.decode(tgt_in, enc, tgt_pad)                    # (B, T, d)
        logits = self.output(h)                                  # (B, T, V)
        if targets is None:
            return Seq2SeqOutput(logits)
        # both losses from one log-softmax (at least fp32): as F.cross_entropy with
        # label_smoothing=ε, loss = (1 − ε)·nll + ε·mean over the vocabulary of −log p
        dtype = torch.promote_types(logits.dtype, torch.float32)
        logp = F.log_softmax(logits.to(dtype), dim=-1).flatten(0, 1)         # (B·T, V)
        tgt = targets.flatten()
        keep = tgt != -100
        n = keep.sum()
        picked = logp.gather(1, tgt.clamp_min(0).unsqueeze(1)).squeeze(1)   # (B·T,)
        nll = -torch.where(keep, picked, 0.0).sum() / n
        loss = nll
        if label_smoothing:
            smooth = -torch.where(keep, logp.mean(dim=-1), 0.0).sum() / n
            loss = (1 - label_smoothing) * nll + label_smoothing * smooth
        return Seq2SeqOutput(logits, loss, nll)

    @torch.no_grad()
    def step(self, tokens: Tensor, state: Any) -> Tuple[Tensor, Any]:
        """One decoder token per row: tokens (B,) -> (log-probabilities (B, V) fp32, state)."""
        h, state = self.decode_step(tokens, state)
        return F.log_softmax(self.output(h).float(), dim=-1), state
