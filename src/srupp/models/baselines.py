"""Baseline language models that share the SRU++ model's trainer, checkpoints and generation.

Each is a :class:`~srupp.models.lm.CausalLM`: the same embedding, dropouts and
output head (tied or adaptive), with a different body, selected by
``model.type`` (build them with :func:`srupp.models.build_model`):

    sru          a stack of plain SRU layers (srupp.nn.SRU), no attention
    lstm, gru    torch.nn.LSTM, torch.nn.GRU
    transformer  decoder-only, pre-LN, causal scaled-dot-product attention, GELU MLP

All carry a :class:`~srupp.models.state.TensorState` across segments.

The transformer's memory: with ``mem_len`` > 0 each layer keeps the keys and
values of the last ``mem_len`` positions (Transformer-XL-style, but with
*absolute* positions: the state holds a per-row position counter, so positions
continue across segments and a key keeps the position it was made at; the
default encoding is then sinusoidal, as a learned table would run out). With
``mem_len`` = 0 every segment stands alone and positions restart at 0 (learned
positions by default). Generation keeps an unbounded KV cache unless given a
``mem_len``. Left padding (``mask_pad``) is handled with a key-padding mask and
positions that count only real tokens, so a padded row scores as it would alone.
"""

from __future__ import annotations

import math
from typing import ClassVar, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn import SRU
from ..nn.linear import Linear
from ..nn.append import append_steps
from ..ops import attention
from ..ops.sdpa import attention_sdpa_causal
from .config import GRUConfig, LSTMConfig, SRUConfig, TransformerConfig
from .lm import CausalLM
from .state import TensorState


class SRULanguageModel(CausalLM):
    """embedding → SRU stack (optionally with ``projection_size``) → output."""

    config_class = SRUConfig

    def build_body(self, factory: dict) -> None:
        c = self.config
        self.rnn = SRU(c.d_model, c.d_model, c.num_layers, dropout=c.dropout,
                       projection_size=c.projection_size, highway_bias=c.highway_bias,
                       layer_norm=c.layer_norm, normalize_after=c.normalize_after,
                       batch_first=True, **factory)

    def body(self, x: Tensor, state: Optional[TensorState], mask_pad: Optional[Tensor]):
        c0 = None if state is None else state["c"]
        h, c = self.rnn(x, c0, mask_pad=mask_pad)  # padded steps keep their c
        return h, TensorState({"c": c}, {"c": 1})

    def initial_state(self, batch_size: int, *, mem_len: Optional[int] = None) -> TensorState:
        c = self.config
        return TensorState({"c": torch.zeros(c.num_layers, batch_size, c.d_model,
                                             dtype=self.rnn.layers[0].state_dtype,
                                             device=self.device)}, {"c": 1})


class RNNLanguageModel(CausalLM):
    """embedding → a torch.nn RNN (``cell``) → output: what the LSTM and GRU models share."""

    cell: ClassVar[type]             # torch.nn.LSTM or torch.nn.GRU
    names: ClassVar[Tuple[str, ...]]  # the state's tensors, in the cell's hx order

    def build_body(self, factory: dict) -> None:
        c = self.config
        self.rnn = self.cell(c.d_model, c.d_model, c.num_layers, batch_first=True,
                             dropout=c.dropout if c.num_layers > 1 else 0.0, **factory)

    def reset_body(self) -> None:
        """PyTorch's U(±1/√d), and for an LSTM a forget-gate bias of 1 (Jozefowicz et al.)."""
        super().reset_body()
        if self.cell is nn.LSTM:
            d = self.config.d_model
            with torch.no_grad():
                for k in range(self.config.num_layers):
                    getattr(self.rnn, f"bias_ih_l{k}")[d:2 * d].fill_(1.0)  # gates i, f, g, o
                    getattr(self.rnn, f"bias_hh_l{k}")[d:2 * d].fill_(0.0)

    def _hx(self, state: TensorState):
        hx = tuple(state[n] for n in self.names)
        return hx if len(hx) == 2 else hx[0]

    def _state(self, hx) -> TensorState:
        hx = hx if isinstance(hx, tuple) else (hx,)
        return TensorState(dict(zip(self.names, hx)), {n: 1 for n in self.names})

    def body(self, x: Tensor, state: Optional[TensorState], mask_pad: Optional[Tensor]):
        if mask_pad is None or not bool(mask_pad.any()):
            y, hx = self.rnn(x, None if state is None else self._hx(state))
            return y, self._state(hx)
        # Padding: step through time and hold the state at padded steps (slow; generation
        # prefill is the one user), so a left-padded row ends as if it had no padding.
        B, L, _ = x.shape
        st = state if state is not None else self.initial_state(B)
        hx = tuple(st[n].to(x.dtype) for n in self.names)
        ys = []
        for t in range(L):
            y_t, new = self.rnn(x[:, t:t + 1], hx if len(hx) == 2 else hx[0])
            new = new if isinstance(new, tuple) else (new,)
            pad = mask_pad[:, t].view(1, B, 1)
            hx = tuple(torch.where(pad, old, n) for old, n in zip(hx, new))
            ys.append(y_t)
        return torch.cat(ys, 1), self._state(hx)

    def initial_state(self, batch_size: int, *, mem_len: Optional[int] = None) -> TensorState:
        c, p = self.config, next(self.rnn.parameters())
        return self._state(tuple(torch.zeros(c.num_layers, batch_size, c.d_model, dtype=p.dtype,
                                             device=p.device) for _ in self.names))


class LSTMLanguageModel(RNNLanguageModel):
    config_class = LSTMConfig
    cell = nn.LSTM
    names = ("h", "c")


class GRULanguageModel(RNNLanguageModel):
    config_class = GRUConfig
    cell = nn.GRU
    names = ("h",)


class TransformerBlock(nn.Module):
    """Pre-LN: x + Attn(LN(x)), then x + MLP(LN(x)), attending to cached keys too.

    The projections are srupp's :class:`~srupp.nn.linear.Linear` (``nn.Linear``'s
    parameters), so decoding gets the same few-rows products as SRU++.
    """

    def __init__(self, d: int, num_heads: int, ffn: int, dropout: float, attn_dropout: float,
                 factory: dict):
        super().__init__()
        self.num_heads = num_heads
        self.attn_dropout = attn_dropout
        self.ln1 = nn.LayerNorm(d, **factory)
        self.qkv = Linear(d, 3 * d, **factory)
        self.proj = Linear(d, d, **factory)
        self.ln2 = nn.LayerNorm(d, **factory)
        self.fc1 = Linear(d, ffn, **factory)
        self.fc2 = Linear(ffn, d, **factory)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, k_past: Optional[Tensor], v_past: Optional[Tensor],
                attn_mask: Optional[Tensor], causal_offset: Optional[int] = 0):
        """x (B, L, d); k_past, v_past (B, H, M, hd) or None; attn_mask (B, 1, L, M+L) bool
        (True: may attend), or None: the causal mask over ``causal_offset`` (M)
        past keys (query i sees keys j <= M + i), or with ``causal_offset`` None
        every key (a single decoding query). Returns x and this call's full K, V."""
        B, L, d = x.shape
        H = self.num_heads
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, H, d // H).permute(2, 0, 3, 1, 4)
        if k_past is not None:
            k = append_steps(k_past, k, dim=2)  # no copy of the past when decoding
            v = append_steps(v_past, v, dim=2)
        causal = attn_mask is None and causal_offset is not None
        if L == 1 and not self.training:  # decoding: srupp's dispatcher has a one-query kernel
            # (one query, causal over M past keys, sees them all: no mask)
            a = attention(q, k, v, attn_mask=attn_mask, is_causal=causal and causal_offset == 0)
        elif causal:  # as an offset, not a mask tensor: SDPA's fused kernels take it
            a = attention_sdpa_causal(q, k, v, causal_offset,
                                      dropout_p=self.attn_dropout if self.training else 0.0)
        else:
            a = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask,
                dropout_p=self.attn_dropout if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(B, L, d)))
        x = x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))
        return x, k, v


def sinusoids(positions: Tensor, d: int) -> Tensor:
    """Vaswani et al.'s encoding of (...) long positions -> (..., d) fp64 (exact at large positions)."""
    i = torch.arange(0, d, 2, dtype=torch.float64, device=positions.device)
    angle = positions.to(torch.float64)[..., None] * torch.pow(10000.0, -i / d)
    pe = torch.empty(*positions.shape, d, dtype=torch.float64, device=positions.device)
    pe[..., 0::2] = torch.sin(angle)
    pe[..., 1::2] = torch.cos(angle)[..., :d // 2]
    return pe


class TransformerLanguageModel(CausalLM):
    """A decoder-only pre-LN transformer with optional segment memory (see the module doc)."""

    config_class = TransformerConfig

    def build_body(self, factory: dict) -> None:
        c = self.config
        self.positions = c.resolved_positions
        self.blocks = nn.ModuleList(
            TransformerBlock(c.d_model, c.num_heads, c.ffn_mult * c.d_model, c.dropout,
                             c.attn_dropout, factory) for _ in range(c.num_layers))
        self.ln_f = nn.LayerNorm(c.d_model, **factory)
        self.pos_embedding = (nn.Embedding(c.max_positions, c.d_model, **factory)
                              if self.positions == "learned" else None)

    def reset_body(self) -> None:
        """GPT-2's N(0, 0.02), residual projections scaled by 1/√(2·layers), zero biases.

        Token embeddings (variance 1/d, as in the SRU++ model) are scaled by √d in
        :meth:`body`; learned positions start at variance ½, that of the sinusoids.
        """
        std, res_std = 0.02, 0.02 / math.sqrt(2 * len(self.blocks))
        for b in self.blocks:
            for lin, s in ((b.qkv, std), (b.fc1, std), (b.proj, res_std), (b.fc2, res_std)):
                nn.init.normal_(lin.weight, 0.0, s)
                nn.init.zeros_(lin.bias)
            b.ln1.reset_parameters()
            b.ln2.reset_parameters()
        self.ln_f.reset_parameters()
        if self.pos_embedding is not None:
            nn.init.normal_(self.pos_embedding.weight, 0.0, math.sqrt(0.5))

    def body_modules(self) -> List[nn.Module]:
        extra = [] if self.pos_embedding is None else [self.pos_embedding]
        return [self.blocks, self.ln_f, *extra]

    def initial_state(self, batch_size: int, *, mem_len: Optional[int] = None) -> TensorState:
        """Empty memory that keeps ``mem_len`` positions (the model's when None)."""
        return self.generation_state(batch_size,
                                     self.config.mem_len if mem_len is None else mem_len)

    def generation_state(self, batch_size: int, mem_len: Optional[int] = None) -> TensorState:
        """A KV cache for decoding: unbounded when ``mem_len`` is None."""
        dev = self.device
        return TensorState({"pos": torch.zeros(batch_size, dtype=torch.long, device=dev),
                            "window": torch.tensor(-1 if mem_len is None else mem_len,
                                                   dtype=torch.long, device=dev)},
                           {"pos": 0, "window": None})

    def _position_encoding(self, positions: Tensor, dtype) -> Tensor:
        if self.pos_embedding is None:
            return sinusoids(positions, self.config.d_model).to(dtype)
        n = self.config.max_positions
        if positions.numel() and int(positions.max()) >= n:
            raise ValueError(f"the context reaches position {int(positions.max())}, past "
                             f"max_positions ({n}) of the learned position table")
        return self.pos_embedding(positions)

    def body(self, x: Tensor, state: Optional[TensorState], mask_pad: Optional[Tensor]):
        B, L, d = x.shape
        if state is None:
            state = self.initial_state(B)
        w = int(state["window"])
        window = None if w < 0 else w
        pos0 = state["pos"]                                       # (B,)
        real = (torch.ones(B, L, dtype=torch.long, device=x.device) if mask_pad is None
                else (~mask_pad).long())
        positions = pos0[:, None] + real.cumsum(1) - real          # padding does not count
        x = x * math.sqrt(d) + self._position_encoding(positions, x.dtype)

        M = state["k.0"].shape[2] if "k.0" in state else 0
        past_pad = state.get("key_pad")
        attn_mask, key_pad, causal_offset = None, None, None
        if mask_pad is None and past_pad is None:
            # no padding: causal over the memory, given as its length (no mask tensor, and
            # nothing to read back), or one query after memory, which sees every key
            causal_offset = M if L > 1 or M == 0 else None
        else:
            no_pad = torch.zeros(B, M + L, dtype=torch.bool, device=x.device)
            key_pad = torch.cat([no_pad[:, :M] if past_pad is None else past_pad,
                                 no_pad[:, M:] if mask_pad is None else mask_pad], 1)  # (B, M+L)
            causal = torch.ones(L, M + L, dtype=torch.bool, device=x.device).tril(M)
            allowed = causal[None] & ~key_pad[:, None, :]
            # a padded query sees itself (the diagonal at offset M), so that no row is all
            # -inf (its output is unused)
            attn_mask = (allowed | causal.triu(M)[None])[:, None]  # (B, 1, L, M+L)

        new = {"window": state["window"]}
        keep = window is None or window > 0
        for i, block in enumerate(self.blocks):
            x, k, v = block(x, state.get(f"k.{i}"), state.get(f"v.{i}"), attn_mask, causal_offset)
            if keep:
                new[f"k.{i}"] = k if window is None else k[:, :, -window:]
                new[f"v.{i}"] = v if window is None else v[:, :, -window:]
        if keep:
            new["pos"] = pos0 + real.sum(1)
            if key_pad is not None and bool(key_pad.any()):
                new["key_pad"] = key_pad if window is None else key_pad[:, -window:]
        else:  # no memory: the next segment starts again at position 0
            new["pos"] = torch.zeros_like(pos0)
        dims = {k: (None if k == "window" else 0) for k in new}
        return self.ln_f(x), TensorState(new, dims)
