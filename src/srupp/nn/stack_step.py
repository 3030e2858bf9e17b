"""An SRU++ stack's decoding steps in one C++ call: the stack runner for one token.

Decoding at batch 1 is bound by per-call overhead, so on CPU under no_grad a
one-token call of :class:`~srupp.nn.SRUpp` runs all its layers in one call of the
``stack_step`` kernel (``srupp::layer_step`` for each layer in turn) instead of
module by module; ``decode_loop`` runs many tokens the same way.

    _layer_plan   what the kernels read from one layer, looked up once (_LayerPlan)
    StepPlan      L steps planned for the kernels: the layers' plans, the rows reserved
                  in each attention layer's memory and [K | V], and the state they leave
    plan_steps    a StepPlan, or None where the kernels can't take the layers or state
    _fused_step   one token through the layers in one ``stack_step`` call (the step
                  backend "fused": what SRUpp.step runs when it can)

:mod:`srupp.nn.srupp` calls these and falls back to its modules on None; this
module reads the layers only through their attributes, so it does not import that one.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..ops import cpu_kernels
from ..ops.layer_step import QUANT, OutputArgs, StackArgs, decode_loop, stack_step
from ..ops.matmul import few_rows, linear_route
from ..ops.quant import int8_kernel_applies
from ..ops.settings import tuning
from .append import append_steps, release_steps, reserve_steps
from .linear import Linear
from .quant import Int8Linear
from .state import KVCache, SRUppState


def _keep_last(t: Optional[Tensor], n: Optional[int]) -> Optional[Tensor]:
    """The last n steps of a batch-first (B, T, ...) tensor; all when n is None.

    The cut to ``mem_len`` that the stack's modules and the fused steps both make.
    """
    if t is None or n is None or t.shape[1] <= n:
        return t
    return t[:, t.shape[1] - n:]


@dataclass(frozen=True)
class _LayerPlan:
    """What ``srupp::layer_step`` reads from one layer, looked up once.

    A module attribute costs about a microsecond to look up, and a layer's fused
    step reads some twenty of them: together more than the op's own overhead. The
    plan keeps them, with the dicts they came from, and stays valid while each
    entry still holds the same object (a swapped Parameter or submodule makes a
    new plan; ``.to()`` and in-place updates keep the objects, and the op reads
    their current data).
    """

    weights: tuple            # w1, w2, w3, α, norm w/b, attention norm w/b, weight_c, bias
    extras: tuple             # w1, w2, w3's scales (int8) or pair-packed copies, else Nones
    quant: int                # how W1, W2, W3 hold their weights: a QUANT value
    # (data_ptr, version) of w1, w2, w3 when extras holds copies of them: a copy is stale
    # once its weight is written in place or given new data, and the plan is made again
    copied: Optional[tuple]
    made_in: torch.dtype      # W1's dtype when the plan was made
    floats: tuple             # the float weights present: they must have x's dtype
    norm_eps: float
    attn_norm_eps: float
    scale_x: float
    num_heads: int
    normalize_after: bool
    use_attention: bool
    sources: tuple            # ((dict, key, object), ...) the lookups the plan holds

    @property
    def kv_weights(self) -> tuple:
        """W1, W2: what the K/V cache is made with."""
        return self.weights[:2]

    def valid(self) -> bool:
        for entries, name, value in self.sources:
            if entries.get(name) is not value:
                return False
        if self.copied is not None:
            return self.copied == _data_keys(self.weights[:3])
        # a float plan made before the model moved to bf16 would miss the packed copies
        return self.weights[0].dtype == self.made_in


_PLANS: "weakref.WeakKeyDictionary[nn.Module, _LayerPlan]" = weakref.WeakKeyDictionary()


_MISSING = object()


class _Lookups:
    """Reads entries of modules' ``_parameters`` / ``_buffers`` / ``_modules`` (or their
    ``__dict__``) and remembers where from."""

    def __init__(self):
        self.sources = []

    def __call__(self, module: nn.Module, kind: str, name: str):
        entries = getattr(module, kind)
        if name in entries:
            value = entries[name]
        elif kind == "_modules" and module.__dict__.get(name, _MISSING) is None:
            value = None  # an optional submodule set to None: a plain attribute
        else:
            raise LookupError(name)
        self.sources.append((entries, name, value))  # valid while .get(name) is value
        return value


def _data_keys(ws) -> tuple:
    """What changes when a weight's data does: its storage and its in-place write count."""
    return tuple(None if w is None else (w.data_ptr(), w._version) for w in ws)


def _packs_pairs(ws) -> bool:
    """Whether a float layer's W1, W2, W3 (None: absent) get pair-packed copies: bf16 on
    a CPU whose few-rows kernels have AVX512-BF16, inputs of even width, and
    ``tuning().pair_packed``."""
    ws = [w for w in ws if w is not None]
    if not tuning().pair_packed or any(w.dtype != torch.bfloat16 or w.device.type != "cpu"
                                       or w.dim() != 2 or w.shape[1] % 2 for w in ws):
        return False
    native = cpu_kernels.function("linear_rows_bf16_native")
    return bool(native and native())


def _pack_pairs(w: Tensor) -> Tensor:
    """W (O, I) bf16 as csrc/matmul_few_rows.cpp's pair-packed tiles (T, I/2, 48, 2)."""
    with torch.no_grad():
        return cpu_kernels.function("pack_pairs_bf16")(w.detach())


def _projection(get: "_Lookups", t: nn.Module, name: str):
    """(weight, scale or None, quant) of the projection ``t.<name>``: a float Linear's
    weight Parameter, or an :class:`Int8Linear`'s int8 weight and scale buffers. A
    LookupError for anything else (an Int8Linear with a bias, say)."""
    m = get(t, "_modules", name)
    if isinstance(m, Int8Linear):
        if get(m, "_buffers", "bias") is not None:
            raise LookupError("bias")
        # the plan holds the kind too: it is a plain attribute, so record where it came from
        kind = get(m, "__dict__", "kind")
        return get(m, "_buffers", "weight"), get(m, "_buffers", "scale"), QUANT[kind]
    if get(m, "_parameters", "bias") is not None:  # the op's projections have no bias
        raise LookupError("bias")
    return get(m, "_parameters", "weight"), None, QUANT["float"]


def _layer_plan(layer: nn.Module) -> Optional[_LayerPlan]:
    """The :class:`_LayerPlan` of an SRUppLayer, made again when what it was read from changed;
    None when a projection is neither a plain Linear nor an Int8Linear, or the three
    don't hold their weights the same way."""
    plan = _PLANS.get(layer)
    if plan is not None and plan.valid():
        return plan
    get = _Lookups()
    attention = layer.use_attention
    try:
        t, ln = get(layer, "_modules", "transform"), get(layer, "_modules", "layer_norm")
        tln = get(t, "_modules", "layer_norm")
        projections = [_projection(get, t, n)
                       for n in ("linear1", "linear2", "linear3")[:3 if attention else 2]]
        alpha = get(t, "_parameters", "alpha") if attention else None
        norms = [None if m is None else get(m, "_parameters", n)
                 for m in (ln, tln) for n in ("weight", "bias")]
        gates = get(layer, "_parameters", "weight_c"), get(layer, "_parameters", "bias")
    except LookupError:
        return None
    if len({quant for _, _, quant in projections}) != 1:
        return None
    w1, w2, w3 = [p[0] for p in projections] + [None] * (3 - len(projections))
    extras = tuple(p[1] for p in projections) + (None,) * (3 - len(projections))
    quant = projections[0][2]
    weights = (w1, w2, w3, alpha, *norms, *gates)
    floats = (alpha, *norms, *gates) + (() if quant else (w1, w2, w3))
    copied = None
    if quant == QUANT["float"] and _packs_pairs((w1, w2, w3)):
        extras = tuple(None if w is None else _pack_pairs(w) for w in (w1, w2, w3))
        quant, copied = QUANT["pairs"], _data_keys((w1, w2, w3))
    plan = _PLANS[layer] = _LayerPlan(
        weights=weights, extras=extras, quant=quant, copied=copied, made_in=w1.dtype,
        floats=tuple(w for w in floats if w is not None),
        norm_eps=1e-5 if ln is None else ln.eps, attn_norm_eps=1e-5 if tln is None else tln.eps,
        scale_x=layer.scale_x, num_heads=t.num_heads if attention else 1,
        normalize_after=layer.normalize_after, use_attention=attention,
        sources=tuple(get.sources))
    return plan


def _token_rows(state: SRUppState, i: int, plan: _LayerPlan, M: int, B: int, like: Tensor,
                L: int = 1) -> Tuple[Tensor, int, Tensor, int]:
    """Layer i's memory and [K | V] buffers with L rows reserved for the tokens after the
    M cached steps: (memory, memory_start, kv, kv_start), as :func:`reserve_steps` gives."""
    old_mem = old_kv = known_mem = known_kv = None
    if M:
        old_mem, old_kv = state.memory[i], state.kv_cache[i].kv
        # where the last fused step left them, if this state is its own and unedited
        last = state._rows[i] if state._rows is not None else None
        if last is not None and last[0][0] is old_mem and last[1][0] is old_kv:
            known_mem, known_kv = last[0][1:], last[1][1:]
    n_in, width = plan.weights[0].shape[1], plan.weights[1].shape[0]    # W1 (d′, n_in), W2 (2·d′, d′)
    mem, mem_start = reserve_steps(old_mem, (B, L, n_in), like, known=known_mem)
    kv, kv_start = reserve_steps(old_kv, (B, L, width), like, known=known_kv)
    return mem, mem_start, kv, kv_start


class StepPlan:
    """L decoding steps of a stack, planned for the C++ kernels (``stack_step``, one token;
    ``decode_loop``, many): the layers' plans, and rows reserved for L tokens in each
    attention layer's memory and [K | V] buffers. :meth:`stack_args` is what both kernels
    take; :meth:`state_after` is the state they leave; :meth:`decode` runs ``decode_loop``.

    Made by :func:`plan_steps`, which returns None where the kernels can't take the
    layers or the state.
    """

    def __init__(self, plans, state: SRUppState, c0: Tensor, M: int, mem_len: Optional[int],
                 B: int, L: int, like: Tensor):
        self.plans, self.state, self.c0, self.M, self.mem_len, self.L = plans, state, c0, M, mem_len, L
        self.dtype = like.dtype
        self.keep_memory = mem_len != 0 and any(p.use_attention for p in plans)
        bufs = []                       # per layer: (memory, memory_start, kv, kv_start)
        for i, plan in enumerate(plans):
            if not plan.use_attention:
                bufs.append((None, 0, None, 0))
            elif self.keep_memory:
                bufs.append(_token_rows(state, i, plan, M, B, like, L))
            else:                       # no memory: each token attends over itself only
                bufs.append((None, 0, like.new_empty(B, 1, plan.weights[1].shape[0]), 0))
        self.mems, self.mem_starts, self.kvs, self.kv_starts = (list(t) for t in zip(*bufs))
        self.mem_mask = state.memory_mask_pad if M > 0 else None        # (B, M) or None
        if self.mem_mask is not None and L > 1:  # then L zeros: the tokens' own rows
            self.mem_mask = append_steps(self.mem_mask, self.mem_mask.new_zeros(B, L))

    def stack_args(self) -> StackArgs:
        """The layers, their buffers and the state as ``stack_step`` and ``decode_loop`` read them."""
        plans = self.plans
        return StackArgs(
            c=self.c0, weights=[w for p in plans for w in p.weights], kv=self.kvs,
            memory=self.mems, memory_pad=self.mem_mask, kv_start=self.kv_starts,
            memory_start=self.mem_starts, cached=self.M,
            norm_eps=[p.norm_eps for p in plans], attn_norm_eps=[p.attn_norm_eps for p in plans],
            scale_x=[p.scale_x for p in plans], num_heads=[p.num_heads for p in plans],
            normalize_after=[int(p.normalize_after) for p in plans],
            few_rows=few_rows(self.dtype), extras=[e for p in plans for e in p.extras],
            quant=[p.quant for p in plans])

    def decode(self, logits: Tensor, done: Tensor, embedding: Tensor, output: OutputArgs, *,
               final: bool, temperature, top_k, top_p, generator, eos_id: Optional[int],
               first: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Optional[SRUppState]]:
        """Up to L tokens in one C++ call (``decode_loop``): each sampled from the logits
        before it, embedded and stepped through the layers and ``output``. Rows ``done``
        (B,) bool, and rows that sample ``eos_id``, stop (``done`` is updated). Sampling:
        one setting for the batch, or lists of one per row
        (:func:`srupp.ops.layer_step.decode_loop`).

        Returns (tokens (B, t ≤ L), the logits after the last token fed, the state after
        the tokens fed). Every token is fed but the last when the call ends early (every
        row done) or with ``final`` (nothing reads what would follow it).

        ``first``: tokens (B,) fed before the first sample, in place of ``logits`` (then
        not read): the step before the loop, in the same call. It needs ``final`` (the L
        rows reserved hold ``first`` and the L - 1 tokens fed after it)."""
        if first is not None and not final:
            raise ValueError("first: feeding tokens before the loop needs final=True")
        tokens, c, logits, memory, kvs, shift = decode_loop(
            logits, done, embedding, output, self.stack_args(), mem_len=self.mem_len, n=self.L,
            final=final, temperature=temperature, top_k=top_k, top_p=top_p,
            generator=generator, eos_id=eos_id, first=first)            # tokens (B, ≤ L)
        t = tokens.shape[1]
        ended = (final and t == self.L) or (eos_id is not None and bool(done.all()))
        fed = t - ended + (first is not None)
        return tokens, logits, self.state_after(c, memory, kvs, shift, fed)

    def state_after(self, c: Tensor, memory: list, new_kvs: list, shift: int,
                    fed: Optional[int] = None) -> SRUppState:
        """The state after the first ``fed`` of the L tokens (all by default): c (layers, B,
        D); the kernel's views of each attention layer's memory and [K | V] (None for other
        layers), whose first row is ``shift`` rows past where the cached ones started."""
        state, M = self.state, self.M
        fed = self.L if fed is None else fed
        if fed == 0:
            return state
        kv_cache, rows = [], []
        for i, (plan, new_mem, new_kv) in enumerate(zip(self.plans, memory, new_kvs)):
            if new_mem is None:
                kv_cache.append(None)
                rows.append(None)
                continue
            # a cache valid for these very weights (checked before) keeps its record of them
            kv_cache.append(state.kv_cache[i].with_kv(new_kv) if M
                            else KVCache.of(new_kv, plan.kv_weights))
            rows.append(((new_mem, self.mems[i], self.mem_starts[i] + shift),
                         (new_kv, self.kvs[i], self.kv_starts[i] + shift)))
            if fed < self.L:  # the rows reserved for the tokens not fed are free again
                for view, base, start in rows[-1]:
                    release_steps(base, start + view.shape[1])
        new_mask = None
        if self.keep_memory and self.mem_mask is not None:
            mask = self.mem_mask
            if self.L == 1:
                mask = append_steps(mask, mask.new_zeros(mask.shape[0], 1))
            elif fed < self.L:  # the tokens' own rows: only those fed
                mask = mask[:, :M + fed]
            new_mask = _keep_last(mask, self.mem_len)                   # (B, ≤ M + fed)
        return SRUppState._from_step(c, memory, new_mask, state.mem_len, kv_cache, tuple(rows))


def plan_steps(layers: Sequence[nn.Module], x: Tensor, state: SRUppState, c0: Tensor, M: int,
               mem_len: Optional[int], L: int = 1) -> Optional[StepPlan]:
    """:class:`StepPlan` for L tokens into the layers, x (B, n_in) like their input; None,
    with nothing reserved, where the kernels can't take the layers or the state: training
    mode, float weights not of x's dtype, a state that is not fp32, or an attention
    layer's memory without keys and values cached under the current weights."""
    plans = [_layer_plan(layer) for layer in layers]
    if None in plans:
        return None
    keep_memory = mem_len != 0 and any(p.use_attention for p in plans)
    dt = x.dtype
    if c0.dtype != torch.float32 or (M > 0 and not keep_memory):
        return None
    for i, (layer, plan) in enumerate(zip(layers, plans)):
        if layer.training:
            return None
        for w in plan.floats:
            if w.dtype != dt:
                return None
        if plan.use_attention and M > 0:
            mem, cached = state.memory[i], state.kv_cache[i]
            if mem is None or mem.dtype != dt or cached is None \
                    or not cached.valid_for(plan.kv_weights, M):
                return None
    return StepPlan(plans, state, c0.contiguous(), M, mem_len, x.shape[0], L, x)


def _fused_step(layers: Sequence[nn.Module], input_to_hidden: Optional[nn.Module], x: Tensor,
                state: SRUppState, c0: Tensor, M: int, mem_len: Optional[int]
                ) -> Optional[Tuple[Tensor, SRUppState]]:
    """One token, x (B, n_in), through the layers in one C++ call: ``stack_step``, the
    ``srupp::layer_step`` kernel for each layer in turn.

    The same result and state as the modules' path of :func:`srupp.nn.srupp._run_stack` (the
    memory and the K/V cache grow in place, into the rows :func:`reserve_steps`
    sets aside; the new state records where, for the next step). None, with
    nothing run, where :func:`plan_steps` says the op can't take the layers or the
    state.
    """
    plan = plan_steps(layers, x, state, c0, M, mem_len)
    if plan is None:
        return None
    if input_to_hidden is not None:
        x = input_to_hidden(x)                                           # (B, D)
    # the memory after this token keeps its last `kept` steps (all when mem_len is None)
    kept = M + 1 if mem_len is None else min(M + 1, mem_len)
    first = M + 1 - kept
    # (layer_step_applies ran: the extension is built)
    h, c, memory, new_kvs = stack_step(x.contiguous(), plan.stack_args(), first=first,
                                       kept=kept)     # (B, D), (layers, B, D), views or None
    return h, plan.state_after(c, memory, new_kvs, first)



def output_args(output: nn.Module, like: Tensor) -> Optional[OutputArgs]:
    """How ``output`` computes logits for rows like ``like`` (B, d), as its forward would, for
    ``decode_loop``; None for what the loop doesn't compute the same way (oneDNN's GEMM, an
    int8 layer at too many rows, any other module)."""
    if isinstance(output, Int8Linear):
        if type(output) is not Int8Linear or not int8_kernel_applies(like):
            return None
        return OutputArgs(output.weight.contiguous(), output.bias, output.scale, output.kind)
    if type(output) not in (Linear, nn.Linear):
        return None
    weight, bias = output.weight, output.bias
    route = linear_route(like, weight, bias) if type(output) is Linear else "aten"
    if route == "onednn" or weight.dtype != like.dtype:
        return None
    if route == "rows":  # as linear_few_rows passes them
        if not weight.is_contiguous():
            weight = weight.contiguous()
        if bias is not None and not bias.is_contiguous():
            bias = bias.contiguous()
    return OutputArgs(weight, bias, None, route)
