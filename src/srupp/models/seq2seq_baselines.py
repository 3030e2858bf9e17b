"""Translation baselines: RNN encoder–decoders with attention, and a transformer.

Each is a :class:`~srupp.models.seq2seq.Seq2SeqModel` (the same joint
embedding, output layer, loss and decoding interface as the SRU++ model),
registered under task "translate"; build one with
``srupp.models.build_model({"task": "translate", "type": ...})``:

    lstm         bidirectional torch.nn.LSTM encoder, torch.nn.LSTM decoder, attention
    sru          the same with srupp.nn.SRU layers
    transformer  torch.nn.Transformer, pre-LN, GELU, sinusoidal positions

The RNN models (Luong et al., 2015, global attention). The encoder runs
d/2 units per direction, so its states s_j are d wide. The decoder RNN reads
the previous target token (and, with ``input_feeding``, the previous
attentional vector) and gives h_t; attention scores each source position::

    luong     score(h_t, s_j) = h_t · W_a s_j                (multiplicative, "general")
    bahdanau  score(h_t, s_j) = v · tanh(W_q h_t + W_k s_j)  (additive)

then ctx_t = Σ_j softmax(score)_j s_j over the real source positions, and the
attentional vector h̃_t = tanh(W_c [h_t; ctx_t]) goes (after dropout) to the
shared output layer. Both scores use the *current* decoder state h_t as the
query (Bahdanau's additive score in Luong's framework), so the decoder RNN
never waits for attention: without input feeding, teacher forcing runs it over
the whole target in one call. W_a s_j and W_k s_j are computed once per sentence.

Padding (all three models) is at the end of each row (right padding), as the
tokenizer's batches have it; a row must hold at least one real source token
(its eos). Decoders are causal, so target padding, after every real position,
never reaches one: ``tgt_pad`` is only checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from ..nn import SRU
from ..nn.append import append_steps
from .baselines import sinusoids
from .seq2seq import EncoderOutput, Seq2SeqConfig, Seq2SeqModel
from .state import TensorState

ATTENTIONS = ("luong", "bahdanau")


# --------------------------------------------------------------------------- configs

@dataclass
class RNNSeq2SeqConfig(Seq2SeqConfig):
    """What the LSTM and SRU encoder–decoders share. Not built directly: use
    LSTMSeq2SeqConfig or SRUSeq2SeqConfig."""

    attention: str = "luong"              # luong (multiplicative) or bahdanau (additive) score
    # Luong's input feeding: the decoder also reads h̃_{t-1}. Off by default: it makes teacher
    # forcing step token by token, losing the one-call RNN over the whole target.
    input_feeding: bool = False
    # the decoder's initial states from the encoder's final states (tanh of a linear map);
    # False: zeros, and the first query sees no source (attention still does)
    bridge: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be 'luong' or 'bahdanau', got {self.attention!r}")
        if self.d_model % 2:
            raise ValueError(f"d_model must be even: the bidirectional encoder gives each "
                             f"direction d_model/2 units; got {self.d_model}")


@dataclass
class LSTMSeq2SeqConfig(RNNSeq2SeqConfig):
    """torch.nn.LSTM encoder and decoder: the shared fields say everything."""

    type: ClassVar[str] = "lstm"


@dataclass
class SRUSeq2SeqConfig(RNNSeq2SeqConfig):
    """srupp.nn.SRU encoder and decoder."""

    type: ClassVar[str] = "sru"

    highway_bias: float = -2.0            # initial b_r of every SRU layer: start close to the skip


@dataclass
class TransformerSeq2SeqConfig(Seq2SeqConfig):
    """torch.nn.Transformer: pre-LN, GELU, sinusoidal positions (any length)."""

    type: ClassVar[str] = "transformer"

    num_heads: int = 4                    # must divide d_model (256 / 4: heads 64 wide)
    ffn_mult: int = 4                     # the feed-forward sub-layer is ffn_mult·d_model wide
    attn_dropout: float = 0.0             # on attention weights (`dropout` is on residuals)

    _ranges = {"num_heads": ">= 1", "ffn_mult": ">= 1", "attn_dropout": "[0, 1)"}

    def __post_init__(self):
        super().__post_init__()
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide "
                             f"d_model ({self.d_model})")


# --------------------------------------------------------------------------- padding

def check_padding(pad: Optional[Tensor], tokens: Tensor, name: str) -> Optional[Tensor]:
    """``pad`` (B, L) bool, True at padding and only at the end of rows, or None."""
    if pad is None:
        return None
    if not isinstance(pad, Tensor) or pad.dtype != torch.bool or pad.shape != tokens.shape:
        got = f"{pad.dtype} {tuple(pad.shape)}" if isinstance(pad, Tensor) else type(pad).__name__
        raise ValueError(f"{name} must be a bool tensor shaped like its tokens "
                         f"{tuple(tokens.shape)}, True at padding; got {got}")
    if bool((pad[:, :-1] & ~pad[:, 1:]).any()):
        raise ValueError(f"{name} has a real token after padding; pad at the end of each row")
    return pad


def check_source(src: Tensor, src_pad: Optional[Tensor]) -> Optional[Tensor]:
    """The source padding, checked; a row of padding only has nothing to attend to."""
    pad = check_padding(src_pad, src, "src_pad")
    if src.shape[1] == 0 or (pad is not None and bool(pad[:, 0].any())):
        raise ValueError("every source row needs at least one real token (its eos)")
    return pad


# --------------------------------------------------------------------------- RNNs

class RNNSeq2Seq(Seq2SeqModel):
    """The RNN encoder–decoder with attention (see the module doc), for any cell.

    A subclass names the cell's decoder state tensors (``names``, each
    (decoder_layers, B, d)) and supplies :meth:`make_rnn`, :meth:`run_encoder`
    and :meth:`run_decoder`.

    The decoding state is a :class:`TensorState`:
        memory (B, S, d)   the encoder states: attention's values
        keys (B, S, d)     W_a s (luong) or W_k s + b (bahdanau): computed once per sentence
        pad (B, S) bool    the source padding (absent without padding)
        <names> (decoder_layers, B, d)  the decoder RNN's state
        feed (B, d)        h̃ of the previous step (with input_feeding)
    """

    names: ClassVar[Tuple[str, ...]]

    # ------------------------------------------------------- cell-specific
    def make_rnn(self, input_size: int, hidden_size: int, num_layers: int,
                 bidirectional: bool, factory: dict) -> nn.Module:
        raise NotImplementedError

    def run_encoder(self, x: Tensor, pad: Optional[Tensor]) -> Tensor:
        """x (B, S, d), pad (B, S) or None -> states (B, S, d), exact under padding."""
        raise NotImplementedError

    def run_decoder(self, x: Tensor, hx: Tuple[Tensor, ...]) -> Tuple[Tensor, Tuple[Tensor, ...]]:
        """x (B, L, n_in), hx the state tensors -> out (B, L, d) and the new state tensors."""
        raise NotImplementedError

    @property
    def state_dtype(self) -> torch.dtype:
        raise NotImplementedError

    # ------------------------------------------------------------- build
    def build(self, factory: dict) -> None:
        c = self.config
        d = c.d_model
        self.encoder = self.make_rnn(d, d // 2, c.encoder_layers, True, factory)
        self.decoder_rnn = self.make_rnn(2 * d if c.input_feeding else d, d, c.decoder_layers,
                                         False, factory)
        if c.attention == "luong":
            self.attn_key = nn.Linear(d, d, bias=False, **factory)    # W_a
            self.attn_query = self.attn_v = None
        else:
            self.attn_key = nn.Linear(d, d, **factory)                # W_k, b
            self.attn_query = nn.Linear(d, d, bias=False, **factory)  # W_q
            self.attn_v = nn.Linear(d, 1, bias=False, **factory)      # v
        self.combine = nn.Linear(2 * d, d, bias=False, **factory)     # W_c
        self.bridge = (nn.Linear(d, len(self.names) * c.decoder_layers * d, **factory)
                       if c.bridge else None)
        self.out_dropout = nn.Dropout(c.dropout)

    def reset_layers(self) -> None:
        """Each module's PyTorch default (the SRU's own: Xavier); see the subclasses."""
        for m in (self.encoder, self.decoder_rnn, self.attn_key, self.attn_query, self.attn_v,
                  self.combine, self.bridge):
            if m is not None:
                m.reset_parameters()

    # ------------------------------------------------------------ encoder
    def encode(self, src: Tensor, src_pad: Optional[Tensor] = None) -> EncoderOutput:
        pad = check_source(src, src_pad)
        return EncoderOutput(self.run_encoder(self.embed(src), pad), pad)  # (B, S, d)

    def final_states(self, enc: EncoderOutput) -> Tensor:
        """(B, d): the top encoder layer's forward output at each row's last real token and
        backward output at its first, where each direction ends (read from enc.states, so
        EncoderOutput needs nothing more)."""
        states, pad = enc.states, enc.pad
        B, S, d = states.shape
        last = (torch.full((B,), S - 1, device=states.device) if pad is None
                else (~pad).sum(1) - 1)                                   # (B,)
        fwd = states[torch.arange(B, device=states.device), last, :d // 2]  # (B, d/2)
        return torch.cat([fwd, states[:, 0, d // 2:]], -1)                # (B, d)

    # ------------------------------------------------------------ decoder
    def init_decoder(self, enc: EncoderOutput) -> TensorState:
        c = self.config
        B, d = enc.states.shape[0], c.d_model
        if self.bridge is None:
            hx = [enc.states.new_zeros(c.decoder_layers, B, d, dtype=self.state_dtype)
                  for _ in self.names]
        else:
            s = torch.tanh(self.bridge(self.final_states(enc)))          # (B, n·layers·d)
            s = s.view(B, len(self.names), c.decoder_layers, d).permute(1, 2, 0, 3)
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
        context = weights @ values                                            # (B, L, d)
        return torch.tanh(self.combine(torch.cat([h, context], -1)))          # (B, L, d)

    def advance(self, x: Tensor, state: TensorState) -> Tuple[Tensor, TensorState]:
        """Embedded inputs x (B, L, d) (L = 1 with input feeding) -> h̃ (B, L, d), new state."""
        if self.config.input_feeding:
            x = torch.cat([x, state["feed"][:, None].to(x.dtype)], -1)        # (B, 1, 2d)
        out, hx = self.run_decoder(x, tuple(state[n] for n in self.names))    # (B, L, d)
        att = self.attend(out, state)
        new = {**state.tensors, **dict(zip(self.names, hx))}
        if self.config.input_feeding:
            new["feed"] = att[:, -1]
        return att, TensorState(new, dict(state.batch_dims))

    def decode(self, tgt_in: Tensor, enc: EncoderOutput,
               tgt_pad: Optional[Tensor] = None) -> Tensor:
        check_padding(tgt_pad, tgt_in, "tgt_pad")
        state = self.init_decoder(enc)
        x = self.embed(tgt_in)                                                # (B, T, d)
        if not self.config.input_feeding:
            att, _ = self.advance(x, state)
        else:  # h̃_{t-1} is an input at t: one step at a time, as in decoding
            steps = []
            for t in range(x.shape[1]):
                a, state = self.advance(x[:, t:t + 1], state)
                steps.append(a)
            att = torch.cat(steps, 1)
        return self.out_dropout(att)                                          # (B, T, d)

    def decode_step(self, tokens: Tensor, state: TensorState) -> Tuple[Tensor, TensorState]:
        att, state = self.advance(self.embed(tokens[:, None]), state)         # (B, 1, d)
        return self.out_dropout(att[:, 0]), state

    def reorder(self, state: TensorState, index: Tensor) -> TensorState:
        return state.index_select(index)


class LSTMSeq2Seq(RNNSeq2Seq):
    """RNN encoder–decoder with torch.nn.LSTM; packed sequences keep the encoder exact
    under padding (the backward direction starts at each row's last real token)."""

    config_class = LSTMSeq2SeqConfig
    names = ("h", "c")

    def make_rnn(self, input_size, hidden_size, num_layers, bidirectional, factory):
        return nn.LSTM(input_size, hidden_size, num_layers, batch_first=True,
                       bidirectional=bidirectional,
                       dropout=self.config.dropout if num_layers > 1 else 0.0, **factory)

    def reset_layers(self) -> None:
        """PyTorch's U(±1/√h), and a forget-gate bias of 1 (Jozefowicz et al., 2015)."""
        super().reset_layers()
        with torch.no_grad():
            for rnn in (self.encoder, self.decoder_rnn):
                for name, p in rnn.named_parameters():
                    h = p.shape[0] // 4                                       # gates i, f, g, o
                    if name.startswith("bias_ih"):
                        p[h:2 * h].fill_(1.0)
                    elif name.startswith("bias_hh"):
                        p[h:2 * h].fill_(0.0)

    @property
    def state_dtype(self) -> torch.dtype:
        return self.decoder_rnn.weight_hh_l0.dtype

    def run_encoder(self, x, pad):
        if pad is None:
            return self.encoder(x)[0]
        lengths = (~pad).sum(1).cpu()                 # pack_padded_sequence takes CPU lengths
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = pad_packed_sequence(self.encoder(packed)[0], batch_first=True,
                                     total_length=x.shape[1])
        return out                                                            # (B, S, d)

    def run_decoder(self, x, hx):
        out, (h, c) = self.decoder_rnn(x, hx)
        return out, (h, c)


class SRUSeq2Seq(RNNSeq2Seq):
    """RNN encoder–decoder with srupp.nn.SRU; the decoder carries each layer's c, so a
    step never recomputes the prefix."""

    config_class = SRUSeq2SeqConfig
    names = ("c",)

    def make_rnn(self, input_size, hidden_size, num_layers, bidirectional, factory):
        return SRU(input_size, hidden_size, num_layers, dropout=self.config.dropout,
                   bidirectional=bidirectional, highway_bias=self.config.highway_bias,
                   batch_first=True, **factory)

    @property
    def state_dtype(self) -> torch.dtype:
        return self.decoder_rnn.layers[0].state_dtype  # fp32 (fp64 for an fp64 model)

    def run_encoder(self, x, pad):
        return self.encoder(x, mask_pad=pad)[0]      # padded steps hold the state: exact

    def run_decoder(self, x, hx):
        out, c = self.decoder_rnn(x, hx[0])
        return out, (c,)


# --------------------------------------------------------------------------- transformer

class TransformerSeq2Seq(Seq2SeqModel):
    """torch.nn.Transformer (pre-LN, GELU) with sinusoidal positions and KV-cached decoding.

    Inputs are embedding·√d + sinusoid(position), then dropout. Teacher forcing
    runs the torch modules; :meth:`decode_step` runs the same decoder layers
    from their own weights (norm1-3, self_attn, multihead_attn, linear1/2) one
    position at a time, with the prefix's self-attention keys and values
    cached and each layer's cross-attention keys and values computed once per
    sentence in :meth:`init_decoder`.

    The decoding state is a :class:`TensorState`:
        pos ()                  the next target position (shared by the batch)
        mem_k.i, mem_v.i (B, H, S, d/H)   layer i's cross-attention keys and values
        k.i, v.i (B, H, t, d/H)           layer i's self-attention cache (absent before step 1)
        mem_mask (B, 1, 1, S) bool        True at real source positions (absent without padding)
    """

    config_class = TransformerSeq2SeqConfig

    def build(self, factory: dict) -> None:
        c = self.config
        d, ffn = c.d_model, c.ffn_mult * c.d_model
        layer = dict(d_model=d, nhead=c.num_heads, dim_feedforward=ffn, dropout=c.dropout,
                     activation="gelu", batch_first=True, norm_first=True, **factory)
        # pre-LN stacks end in a LayerNorm; nested tensors would only skip padded positions
        encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(**layer), c.encoder_layers,
                                        norm=nn.LayerNorm(d, **factory),
                                        enable_nested_tensor=False)
        decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(**layer), c.decoder_layers,
                                        norm=nn.LayerNorm(d, **factory))
        self.transformer = nn.Transformer(d, c.num_heads, custom_encoder=encoder,
                                          custom_decoder=decoder, batch_first=True,
                                          norm_first=True, **factory)
        for m in self.transformer.modules():
            if isinstance(m, nn.MultiheadAttention):
                m.dropout = c.attn_dropout       # the layers give attention `dropout` otherwise

    def reset_layers(self) -> None:
        """Xavier-uniform matrices (nn.Transformer's own choice), zero biases, unit LayerNorms."""
        for m in self.transformer.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.MultiheadAttention):
                nn.init.xavier_uniform_(m.in_proj_weight)
                nn.init.zeros_(m.in_proj_bias)
            elif isinstance(m, nn.LayerNorm):
                m.reset_parameters()

    def embed_at(self, tokens: Tensor, start: Union[int, Tensor]) -> Tensor:
        """(B, L) ids at positions start.. -> (B, L, d). The √d makes the embedding (variance
        1/d) as large as the sinusoids."""
        d = self.config.d_model
        positions = start + torch.arange(tokens.shape[1], device=tokens.device)  # (L,)
        x = self.embedding(tokens) * math.sqrt(d)
        return self.emb_dropout(x + sinusoids(positions, d).to(x.dtype))

    def encode(self, src: Tensor, src_pad: Optional[Tensor] = None) -> EncoderOutput:
        pad = check_source(src, src_pad)
        states = self.transformer.encoder(self.embed_at(src, 0), src_key_padding_mask=pad)
        return EncoderOutput(states, pad)                                     # (B, S, d)

    def decode(self, tgt_in: Tensor, enc: EncoderOutput,
               tgt_pad: Optional[Tensor] = None) -> Tensor:
        check_padding(tgt_pad, tgt_in, "tgt_pad")
        x = self.embed_at(tgt_in, 0)                                          # (B, T, d)
        causal = nn.Transformer.generate_square_subsequent_mask(
            x.shape[1], device=x.device, dtype=x.dtype)                      # (T, T) 0 / -inf
        return self.transformer.decoder(x, enc.states, tgt_mask=causal, tgt_is_causal=True,
                                        memory_key_padding_mask=enc.pad)      # (B, T, d)

    def heads(self, x: Tensor) -> Tensor:
        """(B, L, d) -> (B, H, L, d/H)."""
        B, L, d = x.shape
        H = self.config.num_heads
        return x.view(B, L, H, d // H).transpose(1, 2)

    def init_decoder(self, enc: EncoderOutput) -> TensorState:
        d = self.config.d_model
        tensors = {"pos": torch.zeros((), dtype=torch.long, device=enc.states.device)}
        for i, layer in enumerate(self.transformer.decoder.layers):
            mha = layer.multihead_attn
            w, b = mha.in_proj_weight, mha.in_proj_bias                     # [q; k; v] rows
            tensors[f"mem_k.{i}"] = self.heads(F.linear(enc.states, w[d:2 * d], b[d:2 * d]))
            tensors[f"mem_v.{i}"] = self.heads(F.linear(enc.states, w[2 * d:], b[2 * d:]))
        if enc.pad is not None:
            tensors["mem_mask"] = ~enc.pad[:, None, None, :]                 # (B, 1, 1, S)
        return TensorState(tensors, {k: None if k == "pos" else 0 for k in tensors})

    def decode_step(self, tokens: Tensor, state: TensorState) -> Tuple[Tensor, TensorState]:
        d = self.config.d_model
        x = self.embed_at(tokens[:, None], state["pos"])                      # (B, 1, d)
        B = x.shape[0]
        new = dict(state.tensors)
        new["pos"] = state["pos"] + 1
        for i, layer in enumerate(self.transformer.decoder.layers):
            # self-attention: this position's key and value join the cached prefix's
            sa = layer.self_attn
            q, k, v = F.linear(layer.norm1(x), sa.in_proj_weight, sa.in_proj_bias).chunk(3, -1)
            new[f"k.{i}"] = k = append_steps(state.get(f"k.{i}"), self.heads(k), dim=2)
            new[f"v.{i}"] = v = append_steps(state.get(f"v.{i}"), self.heads(v), dim=2)
            drop = sa.dropout if self.training else 0.0
            a = F.scaled_dot_product_attention(self.heads(q), k, v, dropout_p=drop)  # sees all
            x = x + layer.dropout1(sa.out_proj(a.transpose(1, 2).reshape(B, 1, d)))
            # cross-attention to the source, its keys and values made in init_decoder
            ca = layer.multihead_attn
            q = F.linear(layer.norm2(x), ca.in_proj_weight[:d], ca.in_proj_bias[:d])
            a = F.scaled_dot_product_attention(self.heads(q), state[f"mem_k.{i}"],
                                               state[f"mem_v.{i}"],
                                               attn_mask=state.get("mem_mask"),
                                               dropout_p=ca.dropout if self.training else 0.0)
            x = x + layer.dropout2(ca.out_proj(a.transpose(1, 2).reshape(B, 1, d)))
            # feed-forward
            y = layer.linear2(layer.dropout(layer.activation(layer.linear1(layer.norm3(x)))))
            x = x + layer.dropout3(y)                                         # (B, 1, d)
        h = self.transformer.decoder.norm(x)[:, 0]                            # (B, d)
        return h, TensorState(new, {k: None if k == "pos" else 0 for k in new})

    def reorder(self, state: TensorState, index: Tensor) -> TensorState:
        return state.index_select(index)
