"""SRU++ (Lei, 2021): an SRU whose U comes from a small self-attention."""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from ._inputs import (check_c0, check_input, merge_masks, normalize_mask_pad, pack_output,
                      unpack_input)
from .append import append_steps
from .attention import AttentionMask, SRUppAttention, SRUppProjectedLinear, build_attention_mask
from .base import RecurrentLayerBase, StackBase
from .state import SRUppState

StateLike = Union[SRUppState, Tensor, None]


class SRUppCell(RecurrentLayerBase):
    """One SRU++ *layer*: it runs a whole sequence, not a single step.

    As in the reference, a "cell" is a full layer. Stepping token by token is
    done by feeding one-token inputs with the :class:`SRUppState` the last call
    returned.

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
        U, kv = self.transform(xin, memory if self.use_attention else None, attn, kv_memory)
        h, c = self.recur(U, x, c0, mask_pad)
        return h, c, xin, kv

    def forward(self, input: Union[Tensor, PackedSequence], state: StateLike = None, *,
                mask_pad: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None):
        """Run the layer. Same contract as :meth:`SRUpp.forward`, with one layer."""
        return _run_stack(self, [self], None, input, state, mask_pad, attn_mask)

    def extra_repr(self) -> str:
        s = self._gate_repr() + f", proj_size={self.proj_size}"
        if not self.use_attention:
            s += ", use_attention=False"
        if self.causal:
            s += ", causal=True"
        if self.mem_len is not None:
            s += f", mem_len={self.mem_len}"
        if self.batch_first:
            s += ", batch_first=True"
        return s


class SRUpp(StackBase):
    """A stack of SRU++ layers with the reference's arguments, plus state and causality.

    Args:
        input_size, hidden_size, proj_size, num_layers: n_in, d per direction, d′, depth.
        dropout: dropout inside each attention sub-layer, and the variational
            highway dropout of every layer but the last.
        attn_dropout, num_heads, bidirectional, layer_norm, normalize_after,
        attn_layer_norm, highway_bias, rescale, weight_c_init: see :class:`SRUppCell`.
        attention_every_n_layers: layer i has attention when (i + 1) % n == 0.
        attention_last_n_layers: only the last n layers have attention (-1: off).
        proj_input_to_hidden_first: a bias-free linear n_in → D before layer 0.
        nn_rnn_compatible_return: accepted for the reference's signature; the
            state is an :class:`SRUppState`, so only False is supported.
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
                 nn_rnn_compatible_return: bool = False,
                 proj_input_to_hidden_first: bool = False, weight_c_init: float = 1.0,
                 causal: bool = False, mem_len: Optional[int] = None,
                 batch_first: bool = False, device=None, dtype=None):
        super().__init__()
        if attention_every_n_layers != 1 and attention_last_n_layers != -1:
            raise ValueError("set attention_every_n_layers or attention_last_n_layers, not both")
        if attention_every_n_layers < 1:
            raise ValueError(
                f"attention_every_n_layers must be >= 1, got {attention_every_n_layers}")
        if nn_rnn_compatible_return:
            raise ValueError("nn_rnn_compatible_return=True is not supported by SRUpp: it returns "
                             "an SRUppState; reshape state.c yourself if you need nn.LSTM's layout")
        _check_stack_options(proj_size, dropout, attn_dropout, num_heads, bidirectional,
                             causal, mem_len)
        factory = {"device": device, "dtype": dtype}
        first_in = self._init_stack(input_size, hidden_size, num_layers, bidirectional,
                                    batch_first, proj_input_to_hidden_first, factory)
        self.proj_size = proj_size
        self.causal = causal
        self.mem_len = mem_len

        def has_attention(i: int) -> bool:
            if attention_last_n_layers != -1:
                return num_layers - i <= attention_last_n_layers
            return (i + 1) % attention_every_n_layers == 0

        self.layers = nn.ModuleList(
            SRUppCell(first_in if i == 0 else self.output_size, hidden_size, proj_size,
                      dropout=dropout, attn_dropout=attn_dropout, num_heads=num_heads,
                      bidirectional=bidirectional, layer_norm=layer_norm,
                      normalize_after=normalize_after, attn_layer_norm=attn_layer_norm,
                      highway_bias=highway_bias, rescale=rescale, weight_c_init=weight_c_init,
                      use_attention=has_attention(i),
                      highway_dropout=dropout if i + 1 < num_layers else 0.0,
                      batch_first=True, **factory)
            for i in range(num_layers))

    def initial_state(self, batch_size: int, *, device=None,
                      mem_len: Optional[int] = None) -> SRUppState:
        """A zero state with empty memory for ``batch_size`` sequences."""
        p = self.layers[0].weight_c
        c = torch.zeros(self.num_layers, batch_size, self.output_size,
                        dtype=self.layers[0].state_dtype, device=device or p.device)
        return SRUppState(c=c, mem_len=mem_len)

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
        return _run_stack(self, list(self.layers), self.input_to_hidden, input, state,
                          mask_pad, attn_mask)

    @torch.no_grad()
    def step(self, input: Tensor, state: Optional[SRUppState] = None
             ) -> Tuple[Tensor, SRUppState]:
        """Advance the stack by one token, for decoding.

        Gives the same result as ``forward`` on a one-step input (no padding,
        no ``attn_mask``), without the general path's mask building and checks:
        decoding at batch 1 is bound by per-call overhead, not arithmetic.
        Runs without gradients; in training mode with dropout it defers to
        ``forward`` (dropout masks make a step differ from the lean path anyway).

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
        if input.dim() != 2 or input.shape[1] != self.input_size:
            raise ValueError(f"step() takes input (B, input_size={self.input_size}), "
                             f"got {tuple(input.shape)}")
        if isinstance(state, Tensor) or (self.training and any(
                layer.highway_dropout > 0 or layer.transform.dropout.p > 0
                for layer in self.layers)):
            out, new = self(input.unsqueeze(0 if not self.batch_first else 1), state)
            return out.squeeze(0 if not self.batch_first else 1), new
        B = input.shape[0]
        if state is None:
            state = self.initial_state(B, device=input.device)
        elif state.num_layers != self.num_layers or state.batch_size != B:
            raise ValueError(f"state holds {state.num_layers} layers x batch {state.batch_size}; "
                             f"this call has {self.num_layers} layers x batch {B}")
        M = state.memory_length
        mem_len = state.mem_len if state.mem_len is not None else self.mem_len
        keep = mem_len != 0 and any(layer.use_attention for layer in self.layers)
        # keys that may be attended: memory (unless padding) and the token itself
        key_mask = None
        if state.memory_mask_pad is not None:
            own = torch.zeros(B, 1, dtype=torch.bool, device=input.device)
            key_pad = torch.cat([state.memory_mask_pad, own], dim=1)        # (B, M + 1)
            key_mask = (~key_pad).view(B, 1, 1, M + 1)
        x = input if self.input_to_hidden is None else self.input_to_hidden(input)
        cs, memory, kv_cache = [], [], []
        for i, layer in enumerate(self.layers):
            xin = layer.pre_norm(x).to(x.dtype)                              # (B, n_in)
            mem_i = state.memory[i] if layer.use_attention else None
            if layer.use_attention:
                t = layer.transform
                cached = state.kv_cache[i]
                kv_mem = None
                if mem_i is not None and M > 0:
                    if (cached is not None and cached[1] == t.cache_key()
                            and cached[0].shape[1] == M):
                        kv_mem = cached[0]                                   # (B, M, 2·d′)
                    else:
                        kv_mem = t.linear2(t.linear1(mem_i.to(xin.dtype)))
                U, kv = t.step(xin, kv_mem, key_mask)                         # (B, k·D)
            else:
                U, kv = layer.transform(xin.unsqueeze(1))[0].squeeze(1), None
            h, c = layer.recur(U.unsqueeze(1), x.unsqueeze(1), state.c[i], None)
            x = h.squeeze(1)                                                 # (B, D)
            cs.append(c)
            if keep and layer.use_attention:
                memory.append(_append_keep_last(mem_i, xin.unsqueeze(1), mem_len))  # (B, ≤M+1, n_in)
                kv_cache.append((_keep_last(kv, mem_len), layer.transform.cache_key()))
            else:
                memory.append(None)
                kv_cache.append(None)
        new_mask = None
        if keep and state.memory_mask_pad is not None:
            new_mask = _keep_last(key_pad, mem_len)
        return x, SRUppState(c=torch.stack(cs), memory=memory, memory_mask_pad=new_mask,
                             mem_len=state.mem_len, kv_cache=kv_cache)

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}, {self.proj_size}, num_layers={self.num_layers}"
        if self.causal:
            s += ", causal=True"
        if self.mem_len is not None:
            s += f", mem_len={self.mem_len}"
        if self.batch_first:
            s += ", batch_first=True"
        return s


# --------------------------------------------------------------------------- helpers

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


def _append_keep_last(old: Optional[Tensor], new: Tensor, n: Optional[int]) -> Tensor:
    """The last n steps of [old; new] (batch-first, time in dim 1; all when n is None).

    Copies only steps that are kept: when ``new`` alone has n steps the result is
    a view of it, and otherwise only old's kept tail is appended. (Concatenating
    everything and then cutting copied the whole (B, M + L, n_in) input of every
    attention layer on every training step.)
    """
    L = new.shape[1]
    if n is not None and L >= n:
        return new[:, L - n:]
    if old is None:
        return new
    if n is not None and old.shape[1] > n - L:
        old = old[:, old.shape[1] - (n - L):]
    return append_steps(old, new)


def _keep_last(t: Optional[Tensor], n: Optional[int]) -> Optional[Tensor]:
    """The last n steps of a batch-first (B, T, ...) tensor; all when n is None."""
    if t is None or n is None or t.shape[1] <= n:
        return t
    return t[:, t.shape[1] - n:]


def _run_stack(owner, layers: List[SRUppCell], input_to_hidden: Optional[nn.Linear],
               input, state: StateLike, mask_pad: Optional[Tensor],
               attn_mask: Optional[Tensor]):
    """The forward pass shared by SRUpp (many layers) and SRUppCell (one)."""
    first = layers[0]
    x, packed_mask, lengths = unpack_input(input, owner.batch_first)
    check_input(x, owner.input_size, first.weight_c.dtype)
    B, L, _ = x.shape
    nL, D = len(layers), first.output_size
    bf = owner.batch_first or lengths is not None
    mask = merge_masks(packed_mask, normalize_mask_pad(mask_pad, B, L, bf, x.device))

    # ---- the incoming state
    sdt = first.state_dtype
    if state is None:
        state = SRUppState(c=x.new_zeros(nL, B, D, dtype=sdt))
    elif isinstance(state, Tensor):
        state = SRUppState(c=check_c0(state, nL, B, D, sdt, x.device.type))
    elif isinstance(state, SRUppState):
        if state.num_layers != nL:
            raise ValueError(f"state has {state.num_layers} layers, this module has {nL}")
        check_c0(state.c, nL, B, D, sdt, x.device.type)
        for i, (m, layer) in enumerate(zip(state.memory, layers)):
            if m is not None and m.shape[-1] != layer.input_size:
                raise ValueError(f"state.memory[{i}] has {m.shape[-1]} features, layer {i} "
                                 f"expects input_size={layer.input_size}")
    else:
        raise ValueError(f"state must be an SRUppState, a c0 tensor or None, "
                         f"got {type(state).__name__}")
    c0 = state.c.to(sdt)
    M = state.memory_length
    mem_len = state.mem_len if state.mem_len is not None else owner.mem_len
    any_attention = any(layer.use_attention for layer in layers)
    if any_attention and M > 0 and any(m is None for m, layer in zip(state.memory, layers)
                                       if layer.use_attention):
        raise ValueError("state.memory must hold an entry for every attention layer")

    # ---- the attention mask, shared by all layers
    key_padding = None
    if mask is not None or state.memory_mask_pad is not None:
        mem_mask = state.memory_mask_pad
        if mem_mask is None:
            mem_mask = torch.zeros(B, M, dtype=torch.bool, device=x.device)
        cur = mask if mask is not None else torch.zeros(B, L, dtype=torch.bool, device=x.device)
        key_padding = torch.cat([mem_mask.to(x.device), cur], dim=1)  # (B, M + L)
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor) or not attn_mask.is_floating_point() or \
                tuple(attn_mask.shape) != (L, M + L):
            got = (f"{attn_mask.dtype} {tuple(attn_mask.shape)}" if isinstance(attn_mask, Tensor)
                   else type(attn_mask).__name__)
            raise ValueError(f"attn_mask must be an additive float tensor (L, M + L) = "
                             f"({L}, {M + L}), got {got}")
    attn = (build_attention_mask(L, M, causal=owner.causal, attn_mask=attn_mask,
                                 key_padding=key_padding, device=x.device)
            if any_attention else AttentionMask())

    # ---- the layers
    if input_to_hidden is not None:
        x = input_to_hidden(x)
    keep_memory = any_attention and mem_len != 0
    # Under no_grad (decoding, evaluation) keep K and V of the memory too, so the
    # next call does not recompute them; they are only reused with the same weights.
    use_kv_cache = keep_memory and not torch.is_grad_enabled()
    cs, memory, kv_cache = [], [], []
    for i, layer in enumerate(layers):
        mem_i = state.memory[i] if layer.use_attention else None
        kv_mem = None
        cached = state.kv_cache[i]
        if (use_kv_cache and cached is not None and mem_i is not None
                and cached[1] == layer.transform.cache_key()
                and cached[0].shape[1] == M):
            kv_mem = cached[0]
        x_i = x
        x, c, xin, kv = layer.layer_forward(x_i, c0[i], mask, mem_i, attn, kv_mem)
        cs.append(c)
        if keep_memory and layer.use_attention:
            memory.append(_append_keep_last(mem_i, xin.to(x_i.dtype), mem_len))  # (B, ≤M+L, n_in)
        else:
            memory.append(None)
        kv_cache.append((_keep_last(kv, mem_len), layer.transform.cache_key())
                        if use_kv_cache and kv is not None else None)
    new_mask = None
    if keep_memory and key_padding is not None:
        new_mask = _keep_last(key_padding, mem_len)
    new_state = SRUppState(c=torch.stack(cs), memory=memory, memory_mask_pad=new_mask,
                           mem_len=state.mem_len, kv_cache=kv_cache)

    if lengths is not None:
        return pack_output(x, lengths), new_state
    return (x if owner.batch_first else x.transpose(0, 1)), new_state
