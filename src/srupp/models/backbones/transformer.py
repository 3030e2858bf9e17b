"""The transformer: pre-LN blocks with a KV cache, in every role.

    causal   decoder-only, causal attention over a KV cache ("memory" of ``mem_len``
             positions across segments; generation keeps every position)
    encoder  non-causal attention over the whole sequence, padded keys masked
    decoder  causal self-attention with a KV cache, then a cross-attention sub-layer
             over the source keys and values, computed once per sentence

Inputs are scaled by √d (the embedding has variance 1/d) and get their
positions added (:func:`sinusoids` or a learned table). Positions are
*absolute* and count only real tokens: the state holds a per-row position
counter, so positions continue across segments, a cached key keeps the position
it was made at, and a padded row scores as it would alone. With ``mem_len`` = 0
every segment stands alone and positions restart at 0.

The state is a :class:`~srupp.models.state.TensorState`:
    k.i, v.i (B, H, M, hd)     layer i's cached keys and values (absent: empty cache)
    key_pad (B, M) bool        True at padded cached keys (absent: none)
    pos (B,) long              the next token's position
    window () long             keys kept after a call (-1: every one)
    src_k.i, src_v.i (B, H, S, hd), src_mask (B, 1, 1, S) bool   the decoder's source
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...nn.append import append_steps
from ...nn.linear import Linear
from ...ops import attend
from ...ops.attention import attention_sdpa, attention_sdpa_causal
from ..state import TensorState
from .base import Backbone, EncoderOutput
from .cross_attention import CrossAttention


@dataclass
class TransformerFields:
    """A pre-LN transformer."""

    num_heads: int = 1                    # must divide d_model
    attn_dropout: float = 0.0             # on attention weights (`dropout` is on residuals)
    positions: Optional[str] = None       # learned|sinusoidal; None: learned without memory
    max_positions: int = 2048             # the learned table's length: the longest context
    ffn_mult: int = 4                     # the MLP is ffn_mult·d_model wide

    _ranges = {"num_heads": ">= 1", "attn_dropout": "[0, 1)", "max_positions": ">= 1",
               "ffn_mult": ">= 1"}

    def check(self):
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide "
                             f"d_model ({self.d_model})")
        if self.positions not in (None, "learned", "sinusoidal"):
            raise ValueError(f"positions must be 'learned', 'sinusoidal' or None, "
                             f"got {self.positions!r}")
        if self.positions == "learned" and getattr(self, "mem_len", 0) != 0:
            raise ValueError("positions='learned' needs mem_len=0: with memory, the position "
                             "count runs on across segments past any table; use sinusoidal")

    @property
    def resolved_positions(self) -> str:
        """positions, with None resolved: learned for a language model without memory, else
        sinusoidal (any length)."""
        return self.positions or ("learned" if getattr(self, "mem_len", None) == 0
                                  else "sinusoidal")


@dataclass
class TransformerEncoderFields(TransformerFields):
    """Encoders (classifier, translation) default to more heads."""

    num_heads: int = 4                    # must divide d_model (256 / 4: heads 64 wide)


def sinusoids(positions: Tensor, d: int) -> Tensor:
    """Vaswani et al.'s encoding of (...) long positions -> (..., d) fp64 (exact when large)."""
    i = torch.arange(0, d, 2, dtype=torch.float64, device=positions.device)
    angle = positions.to(torch.float64)[..., None] * torch.pow(10000.0, -i / d)
    pe = torch.empty(*positions.shape, d, dtype=torch.float64, device=positions.device)
    pe[..., 0::2] = torch.sin(angle)
    pe[..., 1::2] = torch.cos(angle)[..., :d // 2]
    return pe


class Block(nn.Module):
    """Pre-LN: x + Attn(LN(x)), [x + CrossAttn(LN(x), source)], x + MLP(LN(x)).

    The projections are srupp's :class:`~srupp.nn.linear.Linear` (``nn.Linear``'s
    parameters), so decoding gets the same few-rows products as SRU++.
    """

    def __init__(self, d: int, num_heads: int, ffn: int, dropout: float, attn_dropout: float,
                 cross: bool, factory: dict):
        super().__init__()
        self.num_heads, self.attn_dropout = num_heads, attn_dropout
        self.ln1 = nn.LayerNorm(d, **factory)
        self.qkv = Linear(d, 3 * d, **factory)
        self.proj = Linear(d, d, **factory)
        # the decoder's: reads the source (K and V in the state, made once per sentence)
        self.cross = (CrossAttention(d, d, num_heads, bias=True, dropout=dropout,
                                     attn_dropout=attn_dropout, **factory) if cross else None)
        self.ln2 = nn.LayerNorm(d, **factory)
        self.fc1 = Linear(d, ffn, **factory)
        self.fc2 = Linear(ffn, d, **factory)
        self.drop = nn.Dropout(dropout)

    def reset_parameters(self, std: Optional[float] = None, res_std: Optional[float] = None):
        """Xavier-uniform weights, or with ``std`` N(0, std²) (N(0, res_std²) for the
        projections back onto the residual stream); zero biases, unit LayerNorms."""
        for lin, s in ((self.qkv, std), (self.fc1, std), (self.proj, res_std), (self.fc2, res_std)):
            if std is None:
                nn.init.xavier_uniform_(lin.weight)
            else:
                nn.init.normal_(lin.weight, 0.0, s)
            nn.init.zeros_(lin.bias)
        if self.cross is not None:
            self.cross.reset_parameters(std, out_std=res_std)
        for m in self.children():
            if isinstance(m, nn.LayerNorm):
                m.reset_parameters()

    def forward(self, x: Tensor, k_past: Optional[Tensor], v_past: Optional[Tensor],
                attn_mask: Optional[Tensor], causal_offset: Optional[int],
                source: Optional[tuple] = None):
        """x (B, L, d); k_past, v_past (B, H, M, hd) or None; attn_mask (B, 1, L, M+L) bool
        (True: may attend), or None: causal over ``causal_offset`` (M) past keys (query i
        sees keys j <= M + i), or with ``causal_offset`` None every key; source (K, V, mask)
        for the cross-attention. Returns x and this call's full K, V."""
        B, L, d = x.shape
        H = self.num_heads
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, H, d // H).permute(2, 0, 3, 1, 4)
        if k_past is not None:
            k = append_steps(k_past, k, dim=2)  # no copy of the past when decoding
            v = append_steps(v_past, v, dim=2)
        p = self.attn_dropout if self.training else 0.0
        causal = attn_mask is None and causal_offset is not None
        if L == 1 and not self.training:  # decoding: srupp's dispatcher has a one-query kernel
            a = attend(q, k, v, attn_mask=attn_mask, is_causal=causal and causal_offset == 0)
        elif causal:  # as an offset, not a mask tensor: SDPA's fused kernels take it
            a = attention_sdpa_causal(q, k, v, causal_offset, dropout_p=p)
        else:  # padded or non-causal: SDPA itself, as the cross-attention (see there why)
            a = attention_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=p)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(B, L, d)))
        if self.cross is not None:
            x = self.cross(x, *source)
        x = x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))
        return x, k, v


class TransformerBackbone(Backbone):
    """A pre-LN transformer in any role (see the module doc)."""

    label = "Transformer"
    fields = TransformerFields
    task_fields = {"translate": TransformerEncoderFields, "classify": TransformerEncoderFields}
    pads_right = True  # a translation batch's padding sits at the end of each row

    def __init__(self, config, *, role: str, device=None, dtype=None):
        super().__init__(config, role=role, device=device, dtype=dtype)
        c = config
        self.positions = c.resolved_positions
        self.blocks = nn.ModuleList(
            Block(c.d_model, c.num_heads, c.ffn_mult * c.d_model, c.dropout, c.attn_dropout,
                  role == "decoder", self.factory) for _ in range(self.num_layers))
        self.ln_f = nn.LayerNorm(c.d_model, **self.factory)
        self.pos_embedding = (nn.Embedding(c.max_positions, c.d_model, **self.factory)
                              if self.positions == "learned" else None)

    @classmethod
    def compare_fields(cls, d_model: int, model: Dict[str, Any]) -> Dict[str, Any]:
        """d/64 heads (GPT-2's head width), moved to the nearest divisor of d (at least 1)."""
        target = max(1, round(d_model / 64))
        heads = min((h for h in range(1, d_model + 1) if d_model % h == 0),
                    key=lambda h: (abs(h - target), h))
        return {"num_heads": heads}

    def reset_parameters(self):
        """By role: the language model (causal) GPT-2's N(0, 0.02), residual projections
        scaled by 1/√(2·layers); the encoder and decoder (classification, translation)
        Xavier-uniform, nn.Transformer's own. Zero biases; learned positions start at
        variance ½, that of the sinusoids.

        Why not GPT-2's for the encoder and decoder: the inputs here are scaled to unit
        variance (GPT-2's embeddings are N(0, 0.02), as small as its weights), so its
        branches start about a hundred times smaller than the embedding they add to, and
        the tied output layer reads the input token back. The encoder–decoder then stayed
        on its unigram plateau at any learning rate (a copy task: loss 2.99 after 300 steps
        against Xavier's 0.40, tests/models/test_seq2seq_baselines.py). The language
        model's results and tuned rates were measured with GPT-2's, so it keeps them."""
        layers = len(self.blocks)
        gpt2 = (0.02, 0.02 / math.sqrt(2 * layers)) if self.role == "causal" else (None, None)
        for b in self.blocks:
            b.reset_parameters(*gpt2)
        self.ln_f.reset_parameters()
        if self.pos_embedding is not None:
            nn.init.normal_(self.pos_embedding.weight, 0.0, math.sqrt(0.5))

    def _embed(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (B, L, d)·√d + the encoding of positions (B, L)."""
        if self.pos_embedding is None:
            return x * math.sqrt(x.shape[-1]) + sinusoids(positions, x.shape[-1]).to(x.dtype)
        n = self.config.max_positions
        if positions.numel() and int(positions.max()) >= n:
            raise ValueError(f"the context reaches position {int(positions.max())}, past "
                             f"max_positions ({n}) of the learned position table")
        return x * math.sqrt(x.shape[-1]) + self.pos_embedding(positions)

    def initial_state(self, batch_size: int, mem_len: Optional[int] = None) -> TensorState:
        """Empty memory that keeps ``mem_len`` positions (the config's when None)."""
        return self.generation_state(batch_size,
                                     self.config.mem_len if mem_len is None else mem_len)

    def generation_state(self, batch_size: int, mem_len: Optional[int] = None) -> TensorState:
        """A KV cache for decoding: unbounded when ``mem_len`` is None."""
        # the window lives on the CPU: every forward reads it as a number, which from
        # a CUDA tensor would make the host wait for the device each call
        dev = self.device
        return TensorState({"pos": torch.zeros(batch_size, dtype=torch.long, device=dev),
                            "window": torch.tensor(-1 if mem_len is None else mem_len,
                                                   dtype=torch.long)},
                           {"pos": 0, "window": None})

    def padded_state(self, batch_size: int, window: int) -> TensorState:
        """A KV cache of ``window`` padded positions: every later state keeps ``window``."""
        state = self.generation_state(batch_size, window)
        if window == 0:
            return state
        tensors, dims = dict(state.tensors), dict(state.batch_dims)
        w = next(self.parameters())
        for i, block in enumerate(self.blocks):
            H = block.num_heads
            kv = w.new_zeros(batch_size, H, window, self.config.d_model // H)
            tensors[f"k.{i}"], tensors[f"v.{i}"] = kv, kv.clone()
            dims[f"k.{i}"] = dims[f"v.{i}"] = 0
        tensors["key_pad"] = torch.ones(batch_size, window, dtype=torch.bool, device=w.device)
        dims["key_pad"] = 0
        return TensorState(tensors, dims)

    def init_decoder(self, enc: EncoderOutput, *, steps: bool = True) -> TensorState:
        state = self.generation_state(enc.states.shape[0], None if steps else 0)
        tensors, dims = dict(state.tensors), dict(state.batch_dims)
        for i, b in enumerate(self.blocks):
            tensors[f"src_k.{i}"], tensors[f"src_v.{i}"] = b.cross.keys_values(enc.states)
        if enc.pad is not None:
            tensors["src_mask"] = ~enc.pad[:, None, None, :]            # (B, 1, 1, S)
        return TensorState(tensors, {k: dims.get(k, 0) for k in tensors})

    def forward(self, x: Tensor, state: Optional[TensorState] = None,
                mask_pad: Optional[Tensor] = None):
        B, L, d = x.shape
        if self.role == "encoder":
            real = (torch.ones(B, L, dtype=torch.long, device=x.device) if mask_pad is None
                    else (~mask_pad).long())
            x = self._embed(x, real.cumsum(1) - real)                   # padding does not count
            mask = None if mask_pad is None else ~mask_pad[:, None, None, :]  # (B, 1, 1, L)
            for block in self.blocks:
                x = block(x, None, None, mask, None)[0]
            return self.ln_f(x), None
        if self.role == "decoder":
            mask_pad = None  # causal: the target's right padding never reaches a real position
        if state is None:
            state = self.initial_state(B)
        w = int(state["window"])
        window = None if w < 0 else w
        pos0 = state["pos"]                                       # (B,)
        real = (torch.ones(B, L, dtype=torch.long, device=x.device) if mask_pad is None
                else (~mask_pad).long())
        x = self._embed(x, pos0[:, None] + real.cumsum(1) - real)  # padding does not count

        M = state["k.0"].shape[2] if "k.0" in state else 0
        past_pad = state.get("key_pad")
        attn_mask, key_pad, causal_offset = None, None, None
        if mask_pad is None and past_pad is None:
            # no padding: causal over the memory, given as its length (no mask tensor), or
            # one query after memory, which sees every key
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

        new = {k: t for k, t in state.tensors.items() if k.startswith("src_")}
        new["window"] = state["window"]
        keep = window is None or window > 0
        for i, block in enumerate(self.blocks):
            source = ((state[f"src_k.{i}"], state[f"src_v.{i}"], state.get("src_mask"))
                      if block.cross is not None else None)
            x, k, v = block(x, state.get(f"k.{i}"), state.get(f"v.{i}"), attn_mask,
                            causal_offset, source)
            if keep:
                new[f"k.{i}"] = k if window is None else k[:, :, -window:]
                new[f"v.{i}"] = v if window is None else v[:, :, -window:]
        if keep:
            new["pos"] = pos0 + real.sum(1)
            # kept once the state had it: states of streams that join one batch hold the
            # same tensors (the serving engine), and an unpadded window is all False
            if key_pad is not None and (past_pad is not None or bool(key_pad.any())):
                new["key_pad"] = key_pad if window is None else key_pad[:, -window:]
        else:  # no memory: the next segment starts again at position 0
            new["pos"] = torch.zeros_like(pos0)
        return self.ln_f(x), TensorState(new, {k: (None if k == "window" else 0) for k in new})
