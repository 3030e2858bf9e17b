"""SRU++: SRU layers whose input projection attends (:mod:`srupp.nn.srupp`).

    causal   a causal SRU++ stack carrying an :class:`~srupp.nn.SRUppState` (memory of
             ``mem_len`` positions)
    encoder  a bidirectional, non-causal stack, d/2 units per direction; exact under
             padding (padded steps hold the state and are never attended to)
    decoder  a causal stack over the target that reads the source in one of two ways
             (``cross_attention``):

- ``"memory"``: the encoder output is every attention layer's *memory*
  (``memory_mask_pad`` = the source padding, unbounded ``mem_len``): each
  layer's one softmax runs over [source; target prefix], so self- and
  cross-attention share it and the design adds no parameter. When decoding
  (no_grad), :meth:`SRUppBackbone.init_decoder` computes each layer's source
  keys and values once per sentence into the state's K/V cache.
- ``"sublayer"``: after each SRU++ layer (an :class:`~srupp.nn.SRUppLayer` with
  its own state), a pre-norm cross-attention sub-layer
  h ← h + Wo·attn(q = Wq LN(h), K = Wk enc, V = Wv enc) of width d′ and
  ``num_heads`` heads (:class:`~.cross_attention.CrossAttention`); its K and V are computed once
  per sentence (:class:`CrossAttentionState`).

Shapes: B batch, L length, S source length, d model width, d′ attention width.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Dict, List, Optional

import torch
from torch import Tensor, nn

from ...nn import SRUpp, SRUppLayer, SRUppState
from ...nn.srupp import check_attention_layout
from ...nn.state import KVCache
from .base import Backbone, EncoderOutput
from .cross_attention import CrossAttention

CROSS_ATTENTION = ("memory", "sublayer")


@dataclass
class SRUppFields:
    """What every SRU++ model reads."""

    bidirectional: ClassVar[bool] = True  # the encoder gives each direction d_model/2 units

    proj_size: int = 64                   # d′: attention width; the paper uses d/4
    num_heads: int = 1                    # the paper uses single-head attention
    attn_dropout: float = 0.0             # on attention weights
    highway_bias: float = -2.0            # initial b_r: start close to the skip path
    layer_norm: bool = False              # layer-wise LayerNorm (the paper: only inside attention)
    normalize_after: bool = False         # post-norm when layer_norm

    _ranges = {"proj_size": ">= 1", "num_heads": ">= 1", "attn_dropout": "[0, 1)"}

    @property
    def resolved_proj_size(self) -> int:
        return self.proj_size

    def check(self):
        if self.resolved_proj_size % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide "
                             f"proj_size ({self.resolved_proj_size})")


@dataclass
class SRUppStackFields(SRUppFields):
    """A single SRU++ stack (language model, classifier) chooses its attention layers."""

    attention_every_n_layers: int = 1     # attention in layers i with (i+1) % n == 0
    attention_last_n_layers: int = -1     # or only in the last n layers (-1: off)

    def check(self):
        check_attention_layout(self.num_layers, self.attention_every_n_layers,
                               self.attention_last_n_layers)


@dataclass
class SRUppSeq2SeqFields(SRUppFields):
    """The encoder–decoder: attention in every layer, and how the decoder reads the source."""

    proj_size: Optional[int] = None       # d′; None: d_model // 4 (the paper's ratio)
    cross_attention: str = "sublayer"     # "sublayer": a cross-attention per decoder layer
    #                                       (learns much faster); "memory": the source as
    #                                       attention memory (no new parameters)

    _ranges = {"proj_size": ""}           # checked below, with its note on None

    @property
    def resolved_proj_size(self) -> int:
        return self.proj_size if self.proj_size is not None else max(1, self.d_model // 4)

    def check(self):
        if self.proj_size is not None and self.proj_size < 1:
            raise ValueError(f"proj_size must be >= 1 or None (d_model // 4), "
                             f"got {self.proj_size}")
        if self.cross_attention not in CROSS_ATTENTION:
            raise ValueError(f"cross_attention must be 'memory' or 'sublayer', "
                             f"got {self.cross_attention!r}")


def source_mask(pad: Optional[Tensor]) -> Optional[Tensor]:
    """Source padding (B, S) -> the cross-attention's bool mask (B, 1, 1, S), True = may attend.

    A source that is all padding is opened up so the softmax stays finite; the
    encoder's output there is 0 (SRU++ outputs 0 at padding), so its V is 0.
    """
    if pad is None:
        return None
    keep = ~pad | pad.all(dim=-1, keepdim=True)                         # (B, S)
    return keep[:, None, None, :]


@dataclass
class CrossAttentionState:
    """The "sublayer" decoder's state.

    layers: one :class:`~srupp.nn.SRUppState` per decoder layer (c, and the target
    prefix as memory); keys, values: per layer (N, H, S, d′/H), the source's K
    and V, one entry per source sentence; mask: (N, 1, 1, S) bool or None;
    group: decoder rows per source entry. Beam search keeps ``group`` = beam
    rows per sentence, which attend to their sentence's K and V as ``group``
    queries, so the source is never copied per beam.
    """

    layers: List[SRUppState]
    keys: List[Tensor]
    values: List[Tensor]
    mask: Optional[Tensor]
    group: int = 1

    def index_select(self, index: Tensor) -> "CrossAttentionState":
        """The state of decoder rows ``index`` (B',): a list, or a tensor on any device.

        When the new rows come in runs of equal length that each read one
        source entry (beams of a sentence), the runs become the new group and
        only the source entries change; otherwise every row gets its own entry.
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


class SRUppBackbone(Backbone):
    """SRU++ in any role (see the module doc)."""

    label = "SRUpp"
    fields = SRUppStackFields
    task_fields = {"translate": SRUppSeq2SeqFields}

    def __init__(self, config, *, role: str, device=None, dtype=None):
        super().__init__(config, role=role, device=device, dtype=dtype)
        c, d, n = config, config.d_model, self.num_layers
        p = c.resolved_proj_size
        shared = dict(dropout=c.dropout, attn_dropout=c.attn_dropout, num_heads=c.num_heads,
                      highway_bias=c.highway_bias, layer_norm=c.layer_norm,
                      normalize_after=c.normalize_after, batch_first=True, **self.factory)
        layout = dict(attention_every_n_layers=getattr(c, "attention_every_n_layers", 1),
                      attention_last_n_layers=getattr(c, "attention_last_n_layers", -1))
        self.cross = None
        if role == "causal":
            self.rnn = SRUpp(d, d, p, n, causal=True, mem_len=c.mem_len, **layout, **shared)
        elif role == "encoder":
            # mem_len=0: one call reads the whole sequence and keeps nothing for a next one
            self.rnn = SRUpp(d, d // 2, p, n, bidirectional=True, mem_len=0, **layout, **shared)
        elif c.cross_attention == "memory":
            self.rnn = SRUpp(d, d, p, n, causal=True, mem_len=None, **shared)
        else:
            # one cell per layer, each with its own state, so that a cross-attention sits
            # between them; no highway dropout in the last layer, as in the SRUpp stack
            self.rnn = nn.ModuleList(
                SRUppLayer(d, d, p, causal=True, mem_len=None,
                           highway_dropout=c.dropout if i + 1 < n else 0.0, **shared)
                for i in range(n))
            self.cross = nn.ModuleList(self._cross_attention(d, p) for _ in range(n))

    def _cross_attention(self, d: int, width: int) -> CrossAttention:
        """A "sublayer" cross-attention, initialised as soon as made."""
        c = self.config
        cross = CrossAttention(d, width, c.num_heads, bias=False, dropout=c.dropout,
                               attn_dropout=c.attn_dropout, **self.factory)
        cross.reset_parameters()
        return cross

    @classmethod
    def compare_fields(cls, d_model: int, model: Dict[str, Any]) -> Dict[str, Any]:
        """d′ = d/4, as in the paper; the recipe's heads when they divide d′, else one."""
        proj_size = max(1, d_model // 4)
        heads = int(model.get("num_heads", 1))
        return {"proj_size": proj_size, "num_heads": heads if proj_size % heads == 0 else 1}

    def reset_parameters(self):
        modules = [self.rnn] if self.cross is None else [*self.rnn, *self.cross]
        for m in modules:
            m.reset_parameters()

    def forward(self, x: Tensor, state=None, mask_pad: Optional[Tensor] = None):
        if self.role == "encoder":
            return self.rnn(x, mask_pad=mask_pad)[0], None
        if self.cross is None:
            return self.rnn(x, state, mask_pad=mask_pad)
        B, L, d = x.shape
        g, h, layers = state.group, x, []
        for layer, cross, st, k, v in zip(self.rnn, self.cross, state.layers, state.keys,
                                          state.values):
            h, st = layer(h, st, mask_pad=mask_pad)                      # (B, L, d)
            # the g rows of one source (its beams) are g queries to its K, V
            h = cross(h.view(B // g, g * L, d), k, v, state.mask).view(B, L, d)
            layers.append(st)
        return h, replace(state, layers=layers)

    def step(self, x: Tensor, state):
        if self.role == "causal" and not self.training:
            return self.rnn.step(x, state)
        return super().step(x, state)

    def decode_plan(self, state, n: int, like: Tensor):
        if self.role == "causal" and self.cross is None and not self.training:
            return self.rnn.decode_plan(state, n, like)
        return None

    def initial_state(self, batch_size: int, mem_len: Optional[int] = None) -> SRUppState:
        return self.rnn.initial_state(batch_size, device=self.device, mem_len=mem_len)

    def padded_state(self, batch_size: int, window: int) -> SRUppState:
        return self.rnn.padded_state(batch_size, window, device=self.device)

    def init_decoder(self, enc: EncoderOutput, *, steps: bool = True):
        """:class:`~srupp.nn.SRUppState` ("memory") or :class:`CrossAttentionState` ("sublayer").

        For steps under no_grad, "memory" puts each layer's source keys and
        values (the W2 W1 m its attention computes from memory m) into the
        K/V cache; the layer checks the cache is of its current weights.
        """
        B, device = enc.states.shape[0], enc.states.device
        if self.cross is None:
            c = self.rnn.initial_state(B, device=device).c
            memory = [enc.states if layer.use_attention else None for layer in self.rnn.layers]
            # steps=False: attend to the source, but build no memory for a next call
            state = SRUppState(c=c, memory=memory, memory_mask_pad=enc.pad,
                               mem_len=None if steps else 0)
            if steps and not torch.is_grad_enabled():
                for i, (layer, m) in enumerate(zip(self.rnn.layers, memory)):
                    if m is not None:
                        t = layer.transform
                        kv = t.linear2(t.linear1(m.to(layer.weight_c.dtype)))  # (B, S, 2·d′)
                        state.kv_cache[i] = KVCache.of(kv, t.kv_weights)
            return state
        layers = [SRUppState(c=torch.zeros(1, B, cell.output_size, dtype=cell.state_dtype,
                                           device=device)) for cell in self.rnn]
        kvs = [cross.keys_values(enc.states) for cross in self.cross]
        return CrossAttentionState(layers, [k for k, _ in kvs], [v for _, v in kvs],
                                   source_mask(enc.pad))
