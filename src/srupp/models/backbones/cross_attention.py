"""The cross-attention sub-layer of a decoder: how a target position reads the source.

One module for every decoder that has the sub-layer: SRU++'s ``"sublayer"``
design (width d′, no biases) and the transformer's decoder blocks (width d,
biases). Its keys and values are computed once per sentence
(:meth:`CrossAttention.keys_values`) and kept in the decoder's state.
"""

from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor, nn

from ...nn.linear import Linear
from ...ops.attention import attention_sdpa


class CrossAttention(nn.Module):
    """h + dropout(Wo·attn(q = Wq LN(h), K = Wk enc, V = Wv enc)), with ``num_heads`` heads.

    Pre-norm on the query side only: the encoder's output, already normalised,
    is every layer's keys. ``width`` is the attention's (SRU++: d′; the
    transformer: d); ``bias``: whether the projections have biases.
    """

    def __init__(self, d_model: int, width: int, num_heads: int, *, bias: bool, dropout: float,
                 attn_dropout: float, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.num_heads = num_heads
        self.attn_dropout = attn_dropout
        self.layer_norm = nn.LayerNorm(d_model, **factory)
        self.query = Linear(d_model, width, bias=bias, **factory)
        self.key_value = Linear(d_model, 2 * width, bias=bias, **factory)
        self.out = Linear(width, d_model, bias=bias, **factory)
        self.dropout = nn.Dropout(dropout)

    def reset_parameters(self, std: Optional[float] = None, out_std: Optional[float] = None):
        """Xavier-uniform weights, or with ``std`` N(0, std²) (N(0, out_std²) for the output
        projection, as a transformer scales its residual branches); zero biases."""
        for lin, s in ((self.query, std), (self.key_value, std), (self.out, out_std)):
            if std is None:
                nn.init.xavier_uniform_(lin.weight)
            else:
                nn.init.normal_(lin.weight, 0.0, s)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        self.layer_norm.reset_parameters()

    def _heads(self, t: Tensor) -> Tensor:
        """(B, L, width) -> (B, H, L, width/H)."""
        B, L, _ = t.shape
        return t.view(B, L, self.num_heads, -1).transpose(1, 2)

    def keys_values(self, enc: Tensor) -> Tuple[Tensor, Tensor]:
        """enc (B, S, d) -> K, V (B, H, S, width/H): once per sentence."""
        k, v = self.key_value(enc).chunk(2, dim=-1)                     # (B, S, width) each
        return self._heads(k), self._heads(v)

    def forward(self, h: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
        """h (B, L, d); k, v from :meth:`keys_values`; mask (B, 1, 1, S) bool, True = may
        attend, or None -> (B, L, d)."""
        B, L, _ = h.shape
        q = self._heads(self.query(self.layer_norm(h)))                 # (B, H, L, width/H)
        # SDPA's numerics, not srupp.ops.attend's: attend would send an unmasked single
        # query to its one-query kernel and CPU bf16 to its matmul path, changing the
        # numerics that the translation tests and results were made with. On CUDA a
        # call SDPA would run on its math kernel takes a fused kernel instead.
        o = attention_sdpa(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
            dropout_p=self.attn_dropout if self.training else 0.0)     # (B, H, L, width/H)
        return h + self.dropout(self.out(o.transpose(1, 2).reshape(B, L, -1)))
