"""Recurrent backbones: torch.nn.LSTM and torch.nn.GRU (and, in :mod:`.sru`, plain SRU).

    causal   a stack carrying its state, a :class:`~srupp.models.state.TensorState` of
             (num_layers, B, d) tensors, batch dim 1: h, c (LSTM), h (GRU), c (SRU);
             padded steps hold the state, so a left-padded row ends as if unpadded
    encoder  bidirectional, d/2 units per direction; the real tokens of each row run
             packed, so padding anywhere leaves a row's outputs as if unpadded
    decoder  the attentional decoder of Luong et al. (2015), below

The decoder RNN reads the previous target token (and, with ``input_feeding``,
the previous attentional vector) and gives h_t; attention scores each source
state s_j::

    luong     score(h_t, s_j) = h_t · W_a s_j                (multiplicative, "general")
    bahdanau  score(h_t, s_j) = v · tanh(W_q h_t + W_k s_j)  (additive)

then ctx_t = Σ_j softmax(score)_j s_j over the real source positions, and the
attentional vector is h̃_t = tanh(W_c [h_t; ctx_t]). Both scores query with the
*current* h_t, so without input feeding teacher forcing runs the RNN over the
whole target in one call. W_a s_j and W_k s_j are computed once per sentence.
With ``bridge``, the decoder's initial states are tanh of a linear map of the
encoder's final states (this needs right padding, as the tokenizer's batches have).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from ..state import TensorState
from .base import Backbone, EncoderOutput

ATTENTIONS = ("luong", "bahdanau")


@dataclass
class RNNFields:
    """torch.nn.LSTM and GRU: the shared fields say everything."""

    bidirectional: ClassVar[bool] = True  # the encoder gives each direction d_model/2 units


@dataclass
class AttentionalDecoderFields:
    """How a recurrent decoder reads the source."""

    attention: str = "luong"              # luong (multiplicative) or bahdanau (additive) score
    # Luong's input feeding: the decoder also reads h̃_{t-1}. Off by default: it makes teacher
    # forcing step token by token, losing the one-call RNN over the whole target.
    input_feeding: bool = False
    # the decoder's initial states from the encoder's final states (tanh of a linear map);
    # False: zeros, and the first query sees no source (attention still does)
    bridge: bool = True

    def check(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be 'luong' or 'bahdanau', got {self.attention!r}")


@dataclass
class RNNSeq2SeqFields(AttentionalDecoderFields, RNNFields):
    """An LSTM or GRU encoder–decoder with attention."""


def lstm_forget_gate_bias(rnn: nn.Module) -> None:
    """A forget-gate bias of 1 (Jozefowicz et al., 2015) in every LSTM layer and direction."""
    with torch.no_grad():
        for name, p in rnn.named_parameters():
            h = p.shape[0] // 4                                      # gates i, f, g, o
            if name.startswith("bias_ih"):  # the ih and hh biases add up
                p[h:2 * h].fill_(1.0)
            elif name.startswith("bias_hh"):
                p[h:2 * h].fill_(0.0)


class RNNBackbone(Backbone):
    """A recurrent stack in any role (see the module doc); subclasses name the cell."""

    fields = RNNFields
    task_fields = {"translate": RNNSeq2SeqFields}
    pads_right = True                      # the decoder's bridge reads each row's last real token
    names: ClassVar[Tuple[str, ...]]       # the state's tensors, in the cell's hx order

    def __init__(self, config, *, role: str, device=None, dtype=None):
        super().__init__(config, role=role, device=device, dtype=dtype)
        c, d, n = config, config.d_model, self.num_layers
        if role == "encoder":
            self.rnn = self.make_rnn(d, d // 2, n, bidirectional=True)
            return
        self.rnn = self.make_rnn(2 * d if role == "decoder" and c.input_feeding else d, d, n,
                                 bidirectional=False)
        if role != "decoder":
            return
        factory = self.factory
        if c.attention == "luong":
            self.attn_key = nn.Linear(d, d, bias=False, **factory)    # W_a
            self.attn_query = self.attn_v = None
        else:
            self.attn_key = nn.Linear(d, d, **factory)                # W_k, b
            self.attn_query = nn.Linear(d, d, bias=False, **factory)  # W_q
            self.attn_v = nn.Linear(d, 1, bias=False, **factory)      # v
        self.combine = nn.Linear(2 * d, d, bias=False, **factory)     # W_c
        self.bridge = (nn.Linear(d, len(self.names) * n * d, **factory) if c.bridge else None)

    # ------------------------------------------------------- the cell
    def make_rnn(self, n_in: int, hidden: int, layers: int, *, bidirectional: bool) -> nn.Module:
        return self.cell(n_in, hidden, layers, batch_first=True, bidirectional=bidirectional,
                         dropout=self.config.dropout if layers > 1 else 0.0, **self.factory)

    def run(self, x: Tensor, hx: Optional[Tuple[Tensor, ...]], pad: Optional[Tensor]
            ) -> Tuple[Tensor, Tuple[Tensor, ...]]:
        """x (B, L, n_in), hx the state tensors or None, pad (B, L) or None
        -> (y (B, L, D), new state tensors); exact under padding."""
        if pad is None or not bool(pad.any()):
            y, new = self.rnn(x, None if hx is None else (hx if len(hx) == 2 else hx[0]))
            return y, new if isinstance(new, tuple) else (new,)
        B, L, d = x.shape
        if self.rnn.bidirectional:
            # packing needs each row's real tokens first: a stable sort moves them to the
            # front in order, and the outputs are put back after
            order = torch.argsort(pad.to(torch.uint8), dim=1, stable=True)   # (B, L)
            index = order.unsqueeze(-1).expand(B, L, d)
            lengths = (~pad).sum(dim=1).cpu()                     # pack takes CPU lengths
            packed = pack_padded_sequence(x.gather(1, index), lengths, batch_first=True,
                                          enforce_sorted=False)
            y, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=L)
            y = torch.zeros_like(y).scatter(1, index, y)                     # (B, L, D)
            return y, ()
        # causal: step through time, holding the state at padded steps (slow; generation
        # prefill is the one user)
        hx = hx if hx is not None else tuple(self.initial_state(B)[n] for n in self.names)
        hx, ys = tuple(h.to(x.dtype) for h in hx), []
        for t in range(L):
            y_t, new = self.rnn(x[:, t:t + 1], hx if len(hx) == 2 else hx[0])
            new = new if isinstance(new, tuple) else (new,)
            keep = pad[:, t].view(1, B, 1)
            hx = tuple(torch.where(keep, old, n) for old, n in zip(hx, new))
            ys.append(y_t)
        return torch.cat(ys, 1), hx

    @property
    def state_dtype(self) -> torch.dtype:
        return next(self.rnn.parameters()).dtype

    def reset_parameters(self):
        """PyTorch's U(±1/√h) (the SRU's own: Xavier), an LSTM's forget-gate bias 1."""
        for m in self.children():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        if self.cell is nn.LSTM:
            lstm_forget_gate_bias(self.rnn)

    # ------------------------------------------------------- causal and encoder
    def _state(self, hx: Tuple[Tensor, ...]) -> TensorState:
        return TensorState(dict(zip(self.names, hx)), {n: 1 for n in self.names})

    def initial_state(self, batch_size: int, mem_len: Optional[int] = None) -> TensorState:
        return self._state(tuple(
            torch.zeros(self.num_layers, batch_size, self.config.d_model, dtype=self.state_dtype,
                        device=self.device) for _ in self.names))

    def forward(self, x: Tensor, state=None, mask_pad: Optional[Tensor] = None):
        if self.role == "encoder":
            return self.run(x, None, mask_pad)[0], None
        if self.role == "decoder":
            return self.decode(x, state)
        y, hx = self.run(x, None if state is None else tuple(state[n] for n in self.names),
                         mask_pad)
        return y, self._state(hx)

    # ------------------------------------------------------- the attentional decoder
    def init_decoder(self, enc: EncoderOutput, *, steps: bool = True) -> TensorState:
        """TensorState: memory (B, S, d) the encoder states; keys (B, S, d) W_a s or W_k s + b;
        pad (B, S) (absent without padding); <names> (layers, B, d); feed (B, d) h̃ of the
        previous step (with input_feeding)."""
        c, (B, S, d) = self.config, enc.states.shape
        if self.bridge is None:
            hx = [enc.states.new_zeros(self.num_layers, B, d, dtype=self.state_dtype)
                  for _ in self.names]
        else:
            # the top encoder layer's forward output at each row's last real token, and its
            # backward output at the first: where each direction ends
            last = (torch.full((B,), S - 1, device=enc.states.device) if enc.pad is None
                    else (~enc.pad).sum(1) - 1)                                # (B,)
            fwd = enc.states[torch.arange(B, device=enc.states.device), last, :d // 2]
            final = torch.cat([fwd, enc.states[:, 0, d // 2:]], -1)           # (B, d)
            s = torch.tanh(self.bridge(final))                                 # (B, n·layers·d)
            s = s.view(B, len(self.names), self.num_layers, d).permute(1, 2, 0, 3)
            hx = [s[i].to(self.state_dtype).contiguous() for i in range(len(self.names))]
        tensors = {"memory": enc.states, "keys": self.attn_key(enc.states),
                   **dict(zip(self.names, hx))}
        dims = {"memory": 0, "keys": 0, **{n: 1 for n in self.names}}
        if enc.pad is not None:
            tensors["pad"], dims["pad"] = enc.pad, 0
        if c.input_feeding:
            tensors["feed"], dims["feed"] = enc.states.new_zeros(B, d), 0
        return TensorState(tensors, dims)

    def attend(self, h: Tensor, state: TensorState) -> Tensor:
        """Decoder outputs h (B, L, d) -> attentional vectors h̃ (B, L, d)."""
        keys, values, pad = state["keys"], state["memory"], state.get("pad")
        if self.attn_query is None:
            scores = h @ keys.transpose(1, 2)                                 # (B, L, S)
        else:
            # (B, L, 1, d) + (B, 1, S, d): B·L·S·d floats, the cost of the additive score
            e = torch.tanh(self.attn_query(h)[:, :, None] + keys[:, None])
            scores = self.attn_v(e).squeeze(-1)                               # (B, L, S)
        if pad is not None:
            scores = scores.masked_fill(pad[:, None, :], float("-inf"))
        weights = torch.softmax(scores.float(), dim=-1).to(values.dtype)      # (B, L, S)
        return torch.tanh(self.combine(torch.cat([h, weights @ values], -1)))  # (B, L, d)

    def advance(self, x: Tensor, state: TensorState) -> Tuple[Tensor, TensorState]:
        """x (B, L, d) (L = 1 with input feeding) -> h̃ (B, L, d), new state."""
        if self.config.input_feeding:
            x = torch.cat([x, state["feed"][:, None].to(x.dtype)], -1)        # (B, 1, 2d)
        out, hx = self.run(x, tuple(state[n] for n in self.names), None)      # (B, L, d)
        att = self.attend(out, state)
        new = {**state.tensors, **dict(zip(self.names, hx))}
        if self.config.input_feeding:
            new["feed"] = att[:, -1]
        return att, TensorState(new, dict(state.batch_dims))

    def decode(self, x: Tensor, state: TensorState) -> Tuple[Tensor, TensorState]:
        if not self.config.input_feeding:
            return self.advance(x, state)
        steps = []  # h̃_{t-1} is an input at t: one step at a time, as in decoding
        for t in range(x.shape[1]):
            a, state = self.advance(x[:, t:t + 1], state)
            steps.append(a)
        return torch.cat(steps, 1), state


class LSTMBackbone(RNNBackbone):
    label = "LSTM"
    cell = nn.LSTM
    names = ("h", "c")


class GRUBackbone(RNNBackbone):
    label = "GRU"
    cell = nn.GRU
    names = ("h",)
