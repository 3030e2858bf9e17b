"""SRU++ (Lei, 2021): an SRU whose U comes from a small self-attention.

Each layer computes U with an attention sub-layer (:class:`SRUppAttention`),
then runs the SRU recurrence of :mod:`srupp.nn.sru` on it. Batch-first, with
m the memory (the layer's past, pre-normed inputs, from the state)::

    z = W1 [m; x]                  (B, M+L, d′)
    q = z[:, M:]                   (B, L, d′)
    K, V = W2 z                    (B, M+L, d′) each
    o = softmax(q Kᵀ/√(d′/H) + mask) V, per head
    U = W3 dropout(LN(q + α·o))    (B, L, k·D)
    h, c = recurrence(U, x, c0)    (B, L, D), (B, D)

Layers without attention (:class:`SRUppProjectedLinear`) take U = W2 dropout(LN(W1 x)).

One function, :func:`_run_stack`, runs the layers for :meth:`SRUpp.forward`,
:meth:`SRUpp.step` (one token, for decoding) and :meth:`SRUppLayer.forward`.
Decoding at batch 1 is bound by per-call overhead, not arithmetic, so its
L = 1 case is kept cheap: no mask is built when a lone query may see every
key, and under no_grad the keys and values of the memory are cached in the
state (:class:`~srupp.nn.state.KVCache`) and grown in place
(:func:`~srupp.nn.append.append_steps`) instead of being recomputed. On CPU
that one token runs through every layer in one C++ call where it can
(:mod:`srupp.nn.stack_step`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from ..ops import attend
from ..ops.layer_step import layer_step_applies
from .append import append_steps
from .linear import Linear
from .sru import RecurrentLayerBase, StackBase, check_c0, check_input, read_input, write_output
from .stack_step import StepPlan, _fused_step, _keep_last, plan_steps
from .state import KVCache, SRUppState

StateLike = Union[SRUppState, Tensor, None]


# --------------------------------------------------------------------------- attention

@dataclass(frozen=True)
class AttentionMask:
    """A mask ready for the attention backend, built once per stack call.

    mask: None, or bool (B|1, 1, L, S) with True = may attend, or an additive
        float (B|1, 1, L, S). Rows with nothing to attend to are opened up here
        (so softmax stays finite) and zeroed afterwards through ``dead_rows``.
    is_causal: use SDPA's own causal path (only when there is no memory).
    dead_rows: bool (B|1, 1, L, 1), True where a query may attend to nothing.
    causal_offset: set when ``mask`` is exactly the causal mask over M memory keys
        and the L queries' own (query i sees keys j <= M + i); then it is M, and
        the explicit attention path skips the masked blocks instead of reading it.
    """

    mask: Optional[Tensor] = None
    is_causal: bool = False
    dead_rows: Optional[Tensor] = None
    causal_offset: Optional[int] = None


_NO_MASK = AttentionMask()
_CAUSAL = AttentionMask(is_causal=True)


def build_attention_mask(L: int, M: int, *, causal: bool, attn_mask: Optional[Tensor],
                         key_padding: Optional[Tensor], device,
                         queries_padded: bool = True) -> AttentionMask:
    """Combine causality, a user's additive mask and key padding.

    Args:
        L, M: query length and memory length; keys span S = M + L.
        causal: query i (absolute position M + i) sees keys j <= M + i.
        attn_mask: additive float (L, S) or None.
        key_padding: bool (B, S), True at padded keys, or None.
        queries_padded: False promises that the queries' own keys
            (``key_padding[:, M:]``) are not padded: every query then sees at
            least itself, and no row needs the dead-row fix-up.
    """
    S = M + L
    if attn_mask is None and key_padding is None:
        if not causal or L == 1:  # one causal query sees every key: no mask (decoding)
            return _NO_MASK
        if M == 0:
            return _CAUSAL
    allowed = None  # bool (B|1, 1, L, S)
    if causal and L > 1:
        j = torch.arange(S, device=device)
        i = torch.arange(L, device=device)
        allowed = (j.unsqueeze(0) <= (i.unsqueeze(1) + M)).view(1, 1, L, S)
    if key_padding is not None:
        keep = (~key_padding).view(key_padding.shape[0], 1, 1, S)
        allowed = keep if allowed is None else allowed & keep
    if attn_mask is None:
        if key_padding is None:  # causal over memory: every query sees its memory
            return AttentionMask(mask=allowed, causal_offset=M)
        if not queries_padded:
            return AttentionMask(mask=allowed)
        dead = ~allowed.any(dim=-1, keepdim=True)
        return AttentionMask(mask=allowed | dead, dead_rows=dead)
    bias = attn_mask.view(1, 1, L, S)
    if allowed is not None:
        bias = bias.masked_fill(~allowed, float("-inf"))
    dead = torch.isneginf(bias).all(dim=-1, keepdim=True)
    return AttentionMask(mask=bias.masked_fill(dead, 0.0), dead_rows=dead)


def _reset_projections(linears, dropout: nn.Dropout, layer_norm: Optional[nn.LayerNorm]):
    """Xavier-init the linears, the last scaled by √(1 − dropout); reset the LayerNorm."""
    for lin in linears:
        nn.init.xavier_uniform_(lin.weight)
    if dropout.p > 0:
        with torch.no_grad():
            linears[-1].weight.mul_((1 - dropout.p) ** 0.5)
    if layer_norm is not None:
        layer_norm.reset_parameters()


class SRUppAttention(nn.Module):
    """Single- or multi-head attention producing U, with the ReZero-style α.

    Args:
        in_features: n_in.  out_features: k·D.  proj_features: d′.
        num_heads: H, must divide d′.
        dropout: dropout on LN(q + α·o) before W3; W3 starts scaled by √(1 − dropout).
        attn_dropout: dropout on the attention weights.
        layer_norm: LayerNorm(d′) after the residual (post-norm).
    """

    def __init__(self, in_features: int, out_features: int, proj_features: int, *,
                 num_heads: int = 1, dropout: float = 0.0, attn_dropout: float = 0.0,
                 layer_norm: bool = True, device=None, dtype=None):
        super().__init__()
        if proj_features % num_heads != 0:
            raise ValueError(
                f"proj_size ({proj_features}) must be divisible by num_heads ({num_heads})")
        factory = {"device": device, "dtype": dtype}
        self.num_heads = num_heads
        self.attn_dropout = float(attn_dropout)
        self.linear1 = Linear(in_features, proj_features, bias=False, **factory)
        self.linear2 = Linear(proj_features, 2 * proj_features, bias=False, **factory)
        self.linear3 = Linear(proj_features, out_features, bias=False, **factory)
        self.alpha = nn.Parameter(torch.zeros(1, **factory))
        self.layer_norm = nn.LayerNorm(proj_features, **factory) if layer_norm else None
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self):
        _reset_projections((self.linear1, self.linear2, self.linear3), self.dropout,
                           self.layer_norm)
        with torch.no_grad():
            self.alpha.zero_()

    @property
    def kv_weights(self) -> Tuple[Tensor, Tensor]:
        """W1 and W2: the weights that keys and values are computed with."""
        return self.linear1.weight, self.linear2.weight

    def forward(self, x: Tensor, memory: Optional[Tensor], mask: AttentionMask,
                kv_memory: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """Compute U.

        Args:
            x: (B, L, n_in).
            memory: (B, M, n_in) past inputs, or None.
            mask: the stack's attention mask over keys [memory; x].
            kv_memory: (B, M, 2·d′) keys and values already computed from
                ``memory`` with the current weights; saves recomputing them
                when decoding. ``memory`` is then not read.
        Returns:
            U (B, L, k·D), and [K | V] (B, M+L, 2·d′) for the caller to cache.
        """
        B, L, _ = x.shape
        q = self.linear1(x)                                              # (B, L, d′)
        if kv_memory is not None:
            kv = append_steps(kv_memory, self.linear2(q))               # (B, M+L, 2·d′)
        else:
            # W1 maps each position alone, so memory and x are projected apart and
            # joined at width d′: joining the inputs first would copy (B, M+L, n_in).
            z = q if memory is None else torch.cat(
                [self.linear1(memory.to(x.dtype)), q], dim=1)           # (B, S, d′)
            kv = self.linear2(z)                                         # (B, S, 2·d′)
        k, v = kv.chunk(2, dim=-1)                                       # (B, S, d′) each
        H = self.num_heads
        hd = q.shape[-1] // H
        if H == 1:  # (B, S, d′) -> (B, 1, S, d′)
            qh, kh, vh = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
        else:       # (B, S, d′) -> (B, H, S, hd), as views
            qh, kh, vh = (t.view(B, -1, H, hd).transpose(1, 2) for t in (q, k, v))
        attn = mask.mask
        if attn is not None and attn.dtype != torch.bool:
            attn = attn.to(qh.dtype)
        o = attend(qh, kh, vh, attn_mask=attn, is_causal=mask.is_causal,
                   dropout_p=self.attn_dropout if self.training else 0.0,
                   causal_offset=mask.causal_offset)                     # (B, H, L, hd)
        if mask.dead_rows is not None:
            o = o.masked_fill(mask.dead_rows, 0.0)
        o = o.transpose(1, 2).reshape(B, L, H * hd)                      # (B, L, d′)
        y = q + self.alpha * o
        if self.layer_norm is not None:
            y = self.layer_norm(y)
        if self.training:
            y = self.dropout(y)
        return self.linear3(y), kv                                       # (B, L, k·D)


class SRUppProjectedLinear(nn.Module):
    """U = W2 dropout(LN(W1 x)): the SRU++ sub-layer of layers without attention."""

    def __init__(self, in_features: int, out_features: int, proj_features: int, *,
                 dropout: float = 0.0, layer_norm: bool = True, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.linear1 = Linear(in_features, proj_features, bias=False, **factory)
        self.linear2 = Linear(proj_features, out_features, bias=False, **factory)
        self.layer_norm = nn.LayerNorm(proj_features, **factory) if layer_norm else None
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self):
        _reset_projections((self.linear1, self.linear2), self.dropout, self.layer_norm)

    def forward(self, x: Tensor, memory: Optional[Tensor] = None,
                mask: Optional[AttentionMask] = None,
                kv_memory: Optional[Tensor] = None) -> Tuple[Tensor, None]:
        """x (B, L, n_in) -> (U (B, L, k·D), None); memory and mask are ignored."""
        z = self.linear1(x)                                              # (B, L, d′)
        if self.layer_norm is not None:
            z = self.layer_norm(z)
        if self.training:
            z = self.dropout(z)
        return self.linear2(z), None


# --------------------------------------------------------------------------- layers

class SRUppLayer(RecurrentLayerBase):
    """One SRU++ layer: it runs a whole sequence, not a single step.

    The reference package calls this class ``SRUppCell``; ``srupp.nn.SRUppCell``
    is the same class under that name. Stepping token by token is done by
    feeding one-token inputs with the :class:`SRUppState` the last call returned.

    Args:
        input_size: n_in.  hidden_size: d per direction.  proj_size: d′, the attention width.
        dropout: dropout before W3, and the variational highway dropout
            (unless ``highway_dropout`` overrides it; the stack sets that to 0
            in its last layer).
        attn_dropout: dropout on attention weights.
        num_heads: attention heads; must divide proj_size.
        bidirectional, layer_norm, normalize_after, highway_bias, rescale,
        weight_c_init: as in :class:`~srupp.nn.SRU`.
        attn_layer_norm: LayerNorm(d′) inside the attention sub-layer.
        use_attention: False gives the projected linear sub-layer (no attention).
        causal: each position attends only to itself, the past and memory.
        mem_len: past inputs kept in the returned state's memory; None keeps
            all of them, 0 none.
        batch_first, device, dtype: as ``nn.LSTM``.

    Defaults follow the reference's ``SRUpp`` (the reference's SRUppCell
    inherits SRUCell's defaults but is never built on its own).
    """

    def __init__(self, input_size: int, hidden_size: int, proj_size: int, *,
                 dropout: float = 0.0, attn_dropout: float = 0.0, num_heads: int = 1,
                 bidirectional: bool = False, layer_norm: bool = False,
                 normalize_after: bool = False, attn_layer_norm: bool = True,
                 highway_bias: float = -2.0, rescale: bool = False,
                 weight_c_init: float = 1.0, use_attention: bool = True,
                 highway_dropout: Optional[float] = None, causal: bool = False,
                 mem_len: Optional[int] = None, batch_first: bool = False,
                 device=None, dtype=None):
        super().__init__(input_size, hidden_size,
                         highway_dropout=dropout if highway_dropout is None else highway_dropout,
                         bidirectional=bidirectional, highway_bias=highway_bias,
                         layer_norm=layer_norm, normalize_after=normalize_after,
                         rescale=rescale, has_skip_term=True, weight_c_init=weight_c_init,
                         device=device, dtype=dtype)
        _check_stack_options(proj_size, dropout, attn_dropout, num_heads, bidirectional,
                             causal, mem_len)
        factory = {"device": device, "dtype": dtype}
        self.proj_size = proj_size
        self.use_attention = use_attention
        self.causal = causal
        self.mem_len = mem_len
        self.batch_first = batch_first
        out = self.output_size * self.num_matrices
        if use_attention:
            self.transform = SRUppAttention(
                input_size, out, proj_size, num_heads=num_heads, dropout=dropout,
                attn_dropout=attn_dropout, layer_norm=attn_layer_norm, **factory)
        else:
            self.transform = SRUppProjectedLinear(
                input_size, out, proj_size, dropout=dropout, layer_norm=attn_layer_norm,
                **factory)
        self.reset_gate_parameters()

    def reset_parameters(self):
        self.reset_gate_parameters()
        self.transform.reset_parameters()

    def layer_forward(self, x: Tensor, c0: Tensor, mask_pad: Optional[Tensor],
                      memory: Optional[Tensor], attn: AttentionMask,
                      kv_memory: Optional[Tensor] = None
                      ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        """Batch-first core.

        Args:
            x: (B, L, n_in).  c0: (B, D).  mask_pad: (B, L) bool or None.
            memory: (B, M, n_in) past (pre-normed) inputs, or None.
            attn: the stack's mask for keys [memory; x].
            kv_memory: (B, M, 2·d′) cached keys and values of ``memory``, or None.
        Returns:
            h (B, L, D); c (B, D); the (pre-normed) input (B, L, n_in), which
            is what memory holds for the next call; and [K | V] (B, M+L, 2·d′)
            (None without attention).
        """
        xin = self.pre_norm(x).to(x.dtype)
        U, kv = self.transform(xin, memory, attn, kv_memory)            # (B, L, k·D)
        h, c = self.recur(U, x, c0, mask_pad)
        return h, c, xin, kv

    def forward(self, input: Union[Tensor, PackedSequence], state: StateLike = None, *,
                mask_pad: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None):
        """Run the layer. Same contract as :meth:`SRUpp.forward`, with one layer."""
        x, mask, lengths = read_input(self, input, mask_pad)
        h, state = _run_stack(self, [self], None, x, mask, state, attn_mask)
        return write_output(self, h, lengths), state

    def extra_repr(self) -> str:
        s = self._gate_repr() + f", proj_size={self.proj_size}"
        if not self.use_attention:
            s += ", use_attention=False"
        return s + _options_repr(self)


class SRUpp(StackBase):
    """A stack of SRU++ layers with the reference's arguments, plus state and causality.

    Args:
        input_size, hidden_size, proj_size, num_layers: n_in, d per direction, d′, depth.
        dropout: dropout inside each attention sub-layer, and the variational
            highway dropout of every layer but the last.
        attn_dropout, num_heads, bidirectional, layer_norm, normalize_after,
        attn_layer_norm, highway_bias, rescale, weight_c_init: see :class:`SRUppLayer`.
        attention_every_n_layers: layer i has attention when (i + 1) % n == 0.
        attention_last_n_layers: only the last n layers have attention (-1: off).
        proj_input_to_hidden_first: a bias-free linear n_in → D before layer 0.
        causal: build the causal mask (over memory too). Not with bidirectional.
        mem_len: past inputs each layer keeps in the returned state (None: all).
        batch_first, device, dtype: as ``nn.LSTM``.

    Memory deviation from the reference: with ``layer_norm=True`` and
    ``normalize_after=False`` the reference keeps *raw* inputs as memory but
    attends from normalised ones; srupp keeps the normalised inputs, so that
    every chunking of a sequence gives the same result.
    """

    def __init__(self, input_size: int, hidden_size: int, proj_size: int,
                 num_layers: int = 2, *, dropout: float = 0.0, attn_dropout: float = 0.0,
                 num_heads: int = 1, bidirectional: bool = False, layer_norm: bool = False,
                 normalize_after: bool = False, attn_layer_norm: bool = True,
                 highway_bias: float = -2.0, attention_every_n_layers: int = 1,
                 attention_last_n_layers: int = -1, rescale: bool = False,
                 proj_input_to_hidden_first: bool = False, weight_c_init: float = 1.0,
                 causal: bool = False, mem_len: Optional[int] = None,
                 batch_first: bool = False, device=None, dtype=None):
        super().__init__()
        check_attention_layout(num_layers, attention_every_n_layers, attention_last_n_layers)
        _check_stack_options(proj_size, dropout, attn_dropout, num_heads, bidirectional,
                             causal, mem_len)
        factory = {"device": device, "dtype": dtype}
        first_in = self._init_stack(input_size, hidden_size, num_layers, bidirectional,
                                    batch_first, proj_input_to_hidden_first, factory)
        self.proj_size = proj_size
        self.causal = causal
        self.mem_len = mem_len

        self.layers = nn.ModuleList(
            SRUppLayer(first_in if i == 0 else self.output_size, hidden_size, proj_size,
                       dropout=dropout, attn_dropout=attn_dropout, num_heads=num_heads,
                       bidirectional=bidirectional, layer_norm=layer_norm,
                       normalize_after=normalize_after, attn_layer_norm=attn_layer_norm,
                       highway_bias=highway_bias, rescale=rescale, weight_c_init=weight_c_init,
                       use_attention=(num_layers - i <= attention_last_n_layers
                                      if attention_last_n_layers != -1
                                      else (i + 1) % attention_every_n_layers == 0),
                       highway_dropout=dropout if i + 1 < num_layers else 0.0,
                       batch_first=True, **factory)
            for i in range(num_layers))

    def initial_state(self, batch_size: int, *, device=None,
                      mem_len: Optional[int] = None) -> SRUppState:
        """A zero state with empty memory for ``batch_size`` sequences."""
        first = self.layers[0]
        c = torch.zeros(self.num_layers, batch_size, self.output_size,
                        dtype=first.state_dtype, device=device or first.weight_c.device)
        return SRUppState(c=c, mem_len=mem_len)

    def padded_state(self, batch_size: int, window: int, *, device=None, dtype=None
                     ) -> SRUppState:
        """A zero state whose attention memory is ``window`` steps of padding.

        It acts as :meth:`initial_state` (padded steps are never attended to) while
        every state that follows it keeps exactly ``window`` steps of memory: states
        of streams at different points then join into one batch (:meth:`SRUppState.cat`)
        without reshaping, which is how a serving engine batches them. ``dtype`` is the
        memory's (the layers' input dtype; the weights' by default).
        """
        state = self.initial_state(batch_size, device=device, mem_len=window)
        first = self.layers[0]
        dt = dtype or first.weight_c.dtype
        if window == 0:
            return state
        memory = [first.weight_c.new_zeros(batch_size, window, layer.input_size, dtype=dt,
                                           device=state.c.device)
                  if layer.use_attention else None for layer in self.layers]
        if all(m is None for m in memory):
            return state
        mask = torch.ones(batch_size, window, dtype=torch.bool, device=state.c.device)
        return SRUppState(c=state.c, memory=memory, memory_mask_pad=mask, mem_len=window)

    def forward(self, input: Union[Tensor, PackedSequence], state: StateLike = None, *,
                mask_pad: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None
                ) -> Tuple[Union[Tensor, PackedSequence], SRUppState]:
        """Run the stack over a sequence, continuing from ``state``.

        Args:
            input: (L, B, n_in), or (B, L, n_in) with ``batch_first``, or a PackedSequence.
            state: an :class:`SRUppState` from a previous call, a bare c0
                (num_layers, B, D), or None for zeros and no memory.
            mask_pad: bool (L, B) (or (B, L)); True marks padding: those steps
                hold the state, output 0, and are never attended to.
            attn_mask: additive float (L, M + L) over keys [memory; input],
                added to the causal mask when ``causal=True``.

        Returns:
            output: (L, B, D) (or (B, L, D)), in the autocast dtype under autocast.
            state: the new :class:`SRUppState`: c after the last step, memory
                holding the last ``mem_len`` (pre-normed) inputs of each
                attention layer, and their padding mask.
        """
        x, mask, lengths = read_input(self, input, mask_pad)
        h, state = _run_stack(self, self.layers, self.input_to_hidden, x, mask, state, attn_mask)
        return write_output(self, h, lengths), state

    @torch.no_grad()
    def step(self, input: Tensor, state: StateLike = None) -> Tuple[Tensor, SRUppState]:
        """Advance the stack by one token, for decoding: ``forward`` on a one-step input.

        Runs without gradients, through the same code as ``forward`` (whose
        L = 1 case skips the mask building, and reuses the keys and values
        cached in the state).

        Args:
            input: (B, n_in), one token per sequence.
            state: the state of the previous call (None: zeros, no memory).
        Returns:
            h (B, D), and the new :class:`SRUppState` (memory and cached keys
            and values extended by this token, cut to ``mem_len``).
        """
        if self.bidirectional:
            raise ValueError("step() needs a unidirectional stack: a bidirectional layer "
                             "reads the future")
        if not isinstance(input, Tensor) or input.dim() != 2:
            got = tuple(input.shape) if isinstance(input, Tensor) else type(input).__name__
            raise ValueError(f"step() takes input (B, input_size={self.input_size}), got {got}")
        x = input.unsqueeze(1)                                           # (B, 1, n_in)
        h, state = _run_stack(self, self.layers, self.input_to_hidden, x, None, state, None)
        return h.squeeze(1), state                                       # (B, D)

    def decode_plan(self, state: StateLike, n: int, like: Tensor) -> Optional[StepPlan]:
        """n decoding steps from ``state`` planned for one C++ call (:class:`StepPlan`,
        for ``decode_loop``), with inputs like ``like`` (B, n_in); None where that call
        can't run them and :meth:`step` must: see :func:`plan_steps`, and also a
        bidirectional stack, an input map n_in → D, or the step backend "modules"."""
        if self.bidirectional or self.input_to_hidden is not None or not layer_step_applies(like):
            return None
        check_input(like.unsqueeze(1), self.input_size, self.layers[0].weight_c.dtype)
        state, c0 = _incoming_state(state, self.layers, self.layers[0], like.shape[0], like)
        mem_len = self.mem_len if state.mem_len is None else state.mem_len
        return plan_steps(self.layers, like, state, c0, state.memory_length, mem_len, n)

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, {self.proj_size}, "
                f"num_layers={self.num_layers}" + _options_repr(self))


# --------------------------------------------------------------------------- the stack

def check_attention_layout(num_layers: int, every_n: int, last_n: int) -> None:
    """Which layers attend: every n-th (``every_n``) or the last n (``last_n``), not both.

    The one check behind SRUpp's arguments and the configs that pass them on.
    """
    if every_n != 1 and last_n != -1:
        raise ValueError("set attention_every_n_layers or attention_last_n_layers, not both")
    if every_n < 1:
        raise ValueError(f"attention_every_n_layers must be >= 1, got {every_n}")
    if not -1 <= last_n <= num_layers:
        raise ValueError(f"attention_last_n_layers must be -1 (off) or 0..num_layers "
                         f"({num_layers}), got {last_n}")


def _check_stack_options(proj_size, dropout, attn_dropout, num_heads, bidirectional, causal,
                         mem_len):
    if proj_size <= 0:
        raise ValueError(f"proj_size must be positive, got {proj_size}")
    if num_heads < 1 or proj_size % num_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be >= 1 and divide proj_size ({proj_size})")
    for name, p in (("dropout", dropout), ("attn_dropout", attn_dropout)):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {p}")
    if causal and bidirectional:
        raise ValueError("causal=True cannot be combined with bidirectional=True: the backward "
                         "direction reads the future")
    if mem_len is not None and mem_len < 0:
        raise ValueError(f"mem_len must be >= 0 or None, got {mem_len}")


def _options_repr(m) -> str:
    """The extra_repr of the options an SRU++ layer and stack share, when set."""
    s = ", causal=True" if m.causal else ""
    if m.mem_len is not None:
        s += f", mem_len={m.mem_len}"
    return s + (", batch_first=True" if m.batch_first else "")


def _append_keep_last(old: Optional[Tensor], new: Tensor, n: Optional[int]) -> Tensor:
    """The last n steps of [old; new] (batch-first, time in dim 1; all when n is None).

    Copies only steps that are kept: when ``new`` alone has n steps the result is
    a view of it, and otherwise only old's kept tail is appended. (Concatenating
    everything and then cutting copied the whole (B, M + L, n_in) input of every
    attention layer on every training step.)
    """
    L = new.shape[1]
    if old is None or (n is not None and L >= n):
        return _keep_last(new, n)
    return append_steps(_keep_last(old, None if n is None else n - L), new)


def _incoming_state(state: StateLike, layers, first: SRUppLayer, B: int, x: Tensor
                    ) -> Tuple[SRUppState, Tensor]:
    """The state a call starts from, checked against the layers; and its c (num_layers, B, D)."""
    nL, D, sdt = len(layers), first.output_size, first.state_dtype
    if state is None or isinstance(state, Tensor):
        c0 = check_c0(state, nL, B, D, sdt, x)
        return SRUppState(c=c0), c0
    if not isinstance(state, SRUppState):
        raise ValueError(f"state must be an SRUppState, a c0 tensor or None, "
                         f"got {type(state).__name__}")
    if state.num_layers != nL:
        raise ValueError(f"state has {state.num_layers} layers, this module has {nL}")
    c0 = check_c0(state.c, nL, B, D, sdt, x)
    M = state.memory_length
    for i, (m, layer) in enumerate(zip(state.memory, layers)):
        if m is None:
            if M > 0 and layer.use_attention:
                raise ValueError("state.memory must hold an entry for every attention layer")
        elif m.shape[-1] != layer.input_size:
            raise ValueError(f"state.memory[{i}] has {m.shape[-1]} features, layer {i} "
                             f"expects input_size={layer.input_size}")
    return state, c0


def _run_stack(owner: nn.Module, layers: Sequence[SRUppLayer], input_to_hidden: Optional[nn.Module],
               x: Tensor, mask: Optional[Tensor], state: StateLike,
               attn_mask: Optional[Tensor]) -> Tuple[Tensor, SRUppState]:
    """Run SRU++ layers over a sequence, continuing from ``state``.

    Args:
        owner: the module whose ``causal`` and ``mem_len`` apply.
        layers: the :class:`SRUppLayer` layers, first to last.
        input_to_hidden: a map n_in → D before the first layer, or None.
        x: (B, L, n_in).  mask: (B, L) bool padding, or None.
        state: as for :meth:`SRUpp.forward`.  attn_mask: additive float (L, M + L), or None.
    Returns:
        h (B, L, D) and the new :class:`SRUppState`.
    """
    first = layers[0]
    check_input(x, owner.input_size, first.weight_c.dtype)
    B, L, _ = x.shape
    state, c0 = _incoming_state(state, layers, first, B, x)             # c0 (num_layers, B, D)
    M = state.memory_length
    mem_len = owner.mem_len if state.mem_len is None else state.mem_len
    any_attention = any(layer.use_attention for layer in layers)
    if L == 1 and mask is None and attn_mask is None and layer_step_applies(x):
        fused = _fused_step(layers, input_to_hidden, x[:, 0], state, c0, M, mem_len)
        if fused is not None:
            return fused[0].unsqueeze(1), fused[1]

    # ---- the attention mask over keys [memory; x], shared by all layers
    key_padding = None
    if mask is not None or state.memory_mask_pad is not None:
        mem_mask = state.memory_mask_pad
        if mem_mask is None:
            mem_mask = torch.zeros(B, M, dtype=torch.bool, device=x.device)
        cur = mask if mask is not None else torch.zeros(B, L, dtype=torch.bool, device=x.device)
        key_padding = torch.cat([mem_mask.to(x.device), cur], dim=1)    # (B, M + L)
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor) or not attn_mask.is_floating_point() or \
                tuple(attn_mask.shape) != (L, M + L):
            got = (f"{attn_mask.dtype} {tuple(attn_mask.shape)}" if isinstance(attn_mask, Tensor)
                   else type(attn_mask).__name__)
            raise ValueError(f"attn_mask must be an additive float tensor (L, M + L) = "
                             f"({L}, {M + L}), got {got}")
    attn = build_attention_mask(L, M, causal=owner.causal, attn_mask=attn_mask,
                                key_padding=key_padding, device=x.device,
                                queries_padded=mask is not None) if any_attention else _NO_MASK

    # ---- the layers
    if input_to_hidden is not None:
        x = input_to_hidden(x)                                           # (B, L, D)
    keep_memory = any_attention and mem_len != 0
    # Under no_grad (decoding, evaluation) keep K and V of the memory too, so that
    # the next call does not recompute them (only while the same weights hold).
    use_kv_cache = keep_memory and not torch.is_grad_enabled()
    cs, memory, kv_cache = [], [], []
    for i, layer in enumerate(layers):
        mem_i = kv_mem = weights = None
        if layer.use_attention:
            mem_i = state.memory[i]                                      # (B, M, n_in) or None
            if use_kv_cache:
                weights = layer.transform.kv_weights
                cached = state.kv_cache[i]
                if mem_i is not None and cached is not None and cached.valid_for(weights, M):
                    kv_mem = cached.kv                                   # (B, M, 2·d′)
        x, c, xin, kv = layer.layer_forward(x, c0[i], mask, mem_i, attn, kv_mem)
        cs.append(c)                                                     # (B, D)
        keep = keep_memory and layer.use_attention
        memory.append(_append_keep_last(mem_i, xin, mem_len) if keep else None)  # (B, ≤M+L, n_in)
        kv_cache.append(None if weights is None else KVCache.of(_keep_last(kv, mem_len), weights))
    new_mask = _keep_last(key_padding, mem_len) if keep_memory else None
    return x, SRUppState(c=torch.stack(cs), memory=memory, memory_mask_pad=new_mask,
                         mem_len=state.mem_len, kv_cache=kv_cache)
