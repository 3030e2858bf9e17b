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

The SRU++ model (:class:`Seq2Seq`, type "srupp"): a bidirectional SRU++
encoder (d/2 units per direction, so its output is d wide; exact under
padding: each sentence's output is what it gets alone), and a causal SRU++
decoder over the target embeddings that reads the encoder output in one of
two ways (``cross_attention``):

- ``"memory"``: the encoder output is every decoder attention layer's
  *memory* (:class:`~srupp.nn.SRUppState`: ``memory = [enc] * layers``,
  ``memory_mask_pad`` = the source padding, unbounded ``mem_len``). Each
  layer's one softmax then runs over [source; target prefix]: self- and
  cross-attention share it, and the design adds no parameter. When decoding
  (no_grad), :meth:`Seq2Seq.init_decoder` computes each layer's source keys
  and values once per sentence into the state's K/V cache; each step then
  adds one row to it (and beams copy it by ``reorder``), never recomputing it.
- ``"sublayer"``: after each SRU++ decoder layer, a pre-norm cross-attention
  sub-layer h ← h + Wo·attn(q = Wq LN(h), K = Wk enc, V = Wv enc) of width
  d′ (``proj_size``) and ``num_heads`` heads (:class:`CrossAttention`). The
  SRU++ layers' own attention sees only the target prefix. The layers run one
  at a time, each an :class:`~srupp.nn.SRUppCell` with its own state;
  :meth:`Seq2Seq.init_decoder` computes the sub-layers' K and V once per
  sentence (:class:`CrossAttentionState`).

Shapes: B batch, S source length, T target length, d model width, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._ranges import check_fields
from ..nn import SRUpp, SRUppCell, SRUppState
from ..nn.linear import Linear
from ..nn.state import KVCache
from .base import SavedModel

CROSS_ATTENTION = ("memory", "sublayer")


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

    # each number's range (srupp._ranges; a subclass's table adds to its bases')
    _ranges = {"vocab_size": ">= 1", "d_model": ">= 1", "encoder_layers": ">= 1",
               "decoder_layers": ">= 1", "dropout": "[0, 1)"}

    def __post_init__(self):
        if not self.type:
            raise TypeError("Seq2SeqConfig holds the fields every translation model shares; "
                            "build the config of a model type, or use "
                            "config_from_dict({'task': 'translate', 'type': ...})")
        check_fields(self)  # every number of this type's config, subclasses' included
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
        """Rows ``index`` (B',): a list, or a tensor on any device."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.states.device)
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
        self.output = Linear(c.d_model, c.vocab_size, **factory)
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


# --------------------------------------------------------------------------- SRU++

@dataclass
class SRUppSeq2SeqConfig(Seq2SeqConfig):
    """The SRU++ encoder–decoder: a bidirectional SRU++ encoder, a causal SRU++ decoder."""

    type: ClassVar[str] = "srupp"

    proj_size: Optional[int] = None       # d′: attention width; None: d_model // 4 (paper)
    num_heads: int = 1                    # the paper uses single-head attention
    attn_dropout: float = 0.0             # on attention weights
    highway_bias: float = -2.0            # initial b_r: start close to the skip path
    cross_attention: str = "sublayer"     # "sublayer": a cross-attention per layer (BLEU 25.0
    #                                       against 8.3 in 600 s, docs/results.md); "memory":
    #                                       the source as attention memory (no new parameters)

    _ranges = {"num_heads": ">= 1", "attn_dropout": "[0, 1)"}  # proj_size: below, with its note

    def __post_init__(self):
        super().__post_init__()
        if self.d_model % 2:
            raise ValueError(f"d_model must be even (the bidirectional encoder has d_model/2 "
                             f"units per direction), got {self.d_model}")
        if self.proj_size is not None and self.proj_size < 1:
            raise ValueError(f"proj_size must be >= 1 or None (d_model // 4), "
                             f"got {self.proj_size}")
        if self.num_heads < 1 or self.resolved_proj_size % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be >= 1 and divide "
                             f"proj_size ({self.resolved_proj_size})")
        if self.cross_attention not in CROSS_ATTENTION:
            raise ValueError(f"cross_attention must be 'memory' or 'sublayer', "
                             f"got {self.cross_attention!r}")

    @property
    def resolved_proj_size(self) -> int:
        """d′: proj_size, or d_model // 4 when it is None."""
        return self.proj_size if self.proj_size is not None else max(1, self.d_model // 4)


class CrossAttention(nn.Module):
    """h + dropout(Wo·attn(q = Wq LN(h), K = Wk enc, V = Wv enc)): a decoder layer reads the source.

    Pre-norm on the query side (the encoder output is already the input of
    every layer's keys); width d′ with H heads, like the SRU++ attention, so it
    stays small next to the d-wide layers.
    """

    def __init__(self, d_model: int, proj_size: int, num_heads: int, *, dropout: float,
                 attn_dropout: float, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.num_heads = num_heads
        self.attn_dropout = attn_dropout
        self.layer_norm = nn.LayerNorm(d_model, **factory)
        self.query = Linear(d_model, proj_size, bias=False, **factory)
        self.key_value = Linear(d_model, 2 * proj_size, bias=False, **factory)
        self.out = Linear(proj_size, d_model, bias=False, **factory)
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self):
        for lin in (self.query, self.key_value, self.out):
            nn.init.xavier_uniform_(lin.weight)
        self.layer_norm.reset_parameters()

    def _heads(self, t: Tensor) -> Tensor:
        """(B, L, d′) -> (B, H, L, d′/H)."""
        B, L, _ = t.shape
        return t.view(B, L, self.num_heads, -1).transpose(1, 2)

    def keys_values(self, enc: Tensor) -> Tuple[Tensor, Tensor]:
        """enc (B, S, d) -> K, V (B, H, S, d′/H): once per sentence."""
        k, v = self.key_value(enc).chunk(2, dim=-1)                     # (B, S, d′) each
        return self._heads(k), self._heads(v)

    def forward(self, h: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
        """h (B, L, d); k, v from :meth:`keys_values`; mask from :func:`source_mask`
        -> (B, L, d)."""
        B, L, _ = h.shape
        q = self._heads(self.query(self.layer_norm(h)))                 # (B, H, L, d′/H)
        o = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
            dropout_p=self.attn_dropout if self.training else 0.0)     # (B, H, L, d′/H)
        o = o.transpose(1, 2).reshape(B, L, -1)                         # (B, L, d′)
        return h + self.dropout(self.out(o))


def source_mask(pad: Optional[Tensor]) -> Optional[Tensor]:
    """Source padding (B, S) -> the cross-attention's bool mask (B, 1, 1, S), True = may attend.

    A source that is all padding is opened up so the softmax stays finite; the
    encoder's output there is 0 (SRU++ outputs 0 at padding), so its V is 0 and
    the sub-layer adds nothing.
    """
    if pad is None:
        return None
    keep = ~pad
    keep = keep | pad.all(dim=-1, keepdim=True)                        # (B, S)
    return keep[:, None, None, :]


@dataclass
class CrossAttentionState:
    """The "sublayer" decoder's state.

    layers: one :class:`~srupp.nn.SRUppState` per decoder row (c, and the target
    prefix as memory); keys, values: per layer (N, H, S, d′/H), the source's K
    and V, one entry per source sentence; mask: (N, 1, 1, S) bool or None (see
    :func:`source_mask`); group: decoder rows per source entry. Beam search
    keeps ``group`` = beam rows per sentence, which attend to their sentence's
    K and V as ``group`` queries, so the source is never copied per beam.
    """

    layers: List[SRUppState]
    keys: List[Tensor]
    values: List[Tensor]
    mask: Optional[Tensor]
    group: int = 1

    def index_select(self, index: Tensor) -> "CrossAttentionState":
        """The state of decoder rows ``index`` (B',).

        The source entries follow: when the new rows come in runs of equal
        length that each read one source entry (beams of a sentence), the
        runs become the new group and only the source entries change (none,
        when they stay the same); otherwise every row gets its own entry.
        ``index`` may be a list, or a tensor on any device.
        """
        index = torch.as_tensor(index, dtype=torch.long, device=self.keys[0].device)
        layers = [st.index_select(index) for st in self.layers]
        source = torch.div(index, self.group, rounding_mode="floor")      # (B',)
        group = _run_length(source)
        source = source[::group]                                          # (B' / group,)
        N = self.keys[0].shape[0]
        if source.numel() == N and bool((source == torch.arange(N, device=source.device)).all()):
            return replace(self, layers=layers, group=group)
        pick = lambda t: t.index_select(0, source)  # noqa: E731
        return CrossAttentionState(layers, [pick(k) for k in self.keys],
                                   [pick(v) for v in self.values],
                                   None if self.mask is None else pick(self.mask), group)


def _run_length(source: Tensor) -> int:
    """g when ``source`` (n,) is n / g runs of g equal entries, else 1."""
    n = source.numel()
    if n == 0:
        return 1
    g = int((source == source[0]).long().cumprod(0).sum())             # the first run
    if n % g or not bool((source.view(-1, g) == source.view(-1, g)[:, :1]).all()):
        return 1
    return g


class Seq2Seq(Seq2SeqModel):
    """The SRU++ encoder–decoder (see the module docstring for its two cross-attention designs).

    Encoder: a bidirectional, non-causal SRU++ stack of d/2 units per
    direction. Decoder: a causal SRU++ stack of d units over the target
    embeddings, reading the source through its attention memory ("memory") or
    through a cross-attention sub-layer after each layer ("sublayer").
    """

    config_class = SRUppSeq2SeqConfig

    @property
    def memory_design(self) -> bool:
        return self.config.cross_attention == "memory"

    def build(self, factory: dict) -> None:
        c = self.config
        d, p, n = c.d_model, c.resolved_proj_size, c.decoder_layers
        shared = dict(dropout=c.dropout, attn_dropout=c.attn_dropout, num_heads=c.num_heads,
                      highway_bias=c.highway_bias, batch_first=True, **factory)
        # mem_len=0: the encoder reads each batch whole and keeps nothing for a next call
        self.encoder = SRUpp(d, d // 2, p, c.encoder_layers, bidirectional=True, mem_len=0,
                             **shared)
        if self.memory_design:
            self.decoder = SRUpp(d, d, p, n, causal=True, mem_len=None, **shared)
            self.cross = None
        else:
            # One SRUppCell per layer, each causal with its own state, so that a
            # cross-attention can sit between them; no highway dropout in the last
            # layer, as in the SRUpp stack.
            self.decoder = nn.ModuleList(
                SRUppCell(d, d, p, causal=True, mem_len=None,
                          highway_dropout=c.dropout if i + 1 < n else 0.0, **shared)
                for i in range(n))
            self.cross = nn.ModuleList(
                CrossAttention(d, p, c.num_heads, dropout=c.dropout,
                               attn_dropout=c.attn_dropout, **factory) for _ in range(n))
        self.out_dropout = nn.Dropout(c.dropout)

    def reset_layers(self) -> None:
        self.encoder.reset_parameters()
        if self.memory_design:
            self.decoder.reset_parameters()
        else:
            for module in (*self.decoder, *self.cross):
                module.reset_parameters()

    # ------------------------------------------------------------ encoder
    def encode(self, src: Tensor, src_pad: Optional[Tensor] = None) -> EncoderOutput:
        x = self.embed(src)                                              # (B, S, d)
        h, _ = self.encoder(x, mask_pad=src_pad)                         # (B, S, d)
        return EncoderOutput(h, None if src_pad is None else src_pad.to(torch.bool))

    # ------------------------------------------------------------ decoder
    def _memory_state(self, enc: EncoderOutput, mem_len: Optional[int]) -> SRUppState:
        """The "memory" decoder's state before its first token: zero c, the source as memory."""
        c = self.decoder.initial_state(enc.states.shape[0], device=enc.states.device).c
        memory = [enc.states if layer.use_attention else None for layer in self.decoder.layers]
        return SRUppState(c=c, memory=memory, memory_mask_pad=enc.pad, mem_len=mem_len)

    def _cross_keys_values(self, enc: EncoderOutput) -> Tuple[List[Tensor], List[Tensor]]:
        kvs = [cross.keys_values(enc.states) for cross in self.cross]
        return [k for k, _ in kvs], [v for _, v in kvs]

    def decode(self, tgt_in: Tensor, enc: EncoderOutput,
               tgt_pad: Optional[Tensor] = None) -> Tensor:
        x = self.embed(tgt_in)                                           # (B, T, d)
        if self.memory_design:
            # mem_len=0: attend to the source, but build no memory for a next call
            h, _ = self.decoder(x, self._memory_state(enc, mem_len=0), mask_pad=tgt_pad)
        else:
            keys, values = self._cross_keys_values(enc)
            mask = source_mask(enc.pad)
            h = x
            for layer, cross, k, v in zip(self.decoder, self.cross, keys, values):
                h, _ = layer(h, mask_pad=tgt_pad)                        # (B, T, d)
                h = cross(h, k, v, mask)                                 # (B, T, d)
        return self.out_dropout(h)                                       # (B, T, d)

    def init_decoder(self, enc: EncoderOutput) -> Any:
        """The decoder state before its first token (:class:`~srupp.nn.SRUppState` for
        "memory", :class:`CrossAttentionState` for "sublayer").

        Under no_grad the source's keys and values are computed here, once per
        sentence: into the SRU++ K/V cache for "memory" (the same W2 W1 m the
        attention layer computes from its memory m; the layer checks the cache
        is of its current weights before using it), into the state for "sublayer".
        """
        if self.memory_design:
            state = self._memory_state(enc, mem_len=None)                # unbounded memory
            if not torch.is_grad_enabled():
                for i, (layer, m) in enumerate(zip(self.decoder.layers, state.memory)):
                    if m is not None:
                        t = layer.transform
                        kv = t.linear2(t.linear1(m.to(t.linear1.weight.dtype)))  # (B, S, 2·d′)
                        state.kv_cache[i] = KVCache.of(kv, t.kv_weights)
            return state
        B, device = enc.states.shape[0], enc.states.device
        layers = [SRUppState(c=torch.zeros(1, B, cell.output_size, dtype=cell.state_dtype,
                                           device=device)) for cell in self.decoder]
        keys, values = self._cross_keys_values(enc)
        return CrossAttentionState(layers, keys, values, source_mask(enc.pad))

    def decode_step(self, tokens: Tensor, state: Any) -> Tuple[Tensor, Any]:
        x = self.embed(tokens.unsqueeze(1))                              # (B, 1, d)
        if self.memory_design:
            h, state = self.decoder(x, state)                            # (B, 1, d)
        else:
            h, layers = x, []
            B, d, g = x.shape[0], x.shape[-1], state.group
            for layer, cross, st, k, v in zip(self.decoder, self.cross, state.layers,
                                              state.keys, state.values):
                h, st = layer(h, st)                                     # (B, 1, d)
                # the g rows of one source (its beams) are g queries to its K, V
                h = cross(h.view(B // g, g, d), k, v, state.mask).view(B, 1, d)
                layers.append(st)
            state = replace(state, layers=layers)
        return self.out_dropout(h).squeeze(1), state                     # (B, d)

    def reorder(self, state: Any, index: Tensor) -> Any:
        """Rows ``index`` of every batch-dim tensor: c, memory (source and prefix), its padding
        mask and K/V cache ("memory"); per-layer states, source K, V and mask ("sublayer")."""
        index = torch.as_tensor(index, dtype=torch.long)
        if isinstance(state, SRUppState):
            return state.index_select(index.to(state.c.device))
        return state.index_select(index.to(state.keys[0].device))
