"""One SRU++ layer's decoding step as one op: ``srupp::layer_step``.

At one token per sequence a layer is some 30 small operations (the pre-norm,
three few-row products, the cache appends, one query's attention, α, the
LayerNorm, the recurrence, the post-norm); at batch 1 the time between them
was about half of a decoding step (docs/performance.md, "Generation"). This op
runs them all in one C++ call (``layer_step_cpu`` in ``csrc/layer_step.cpp``),
and writes the new token's row of the attention memory and of the key/value
cache in place, into rows the caller has reserved (the buffers and row offsets
are passed, not views of them: a view costs a microsecond or two to make).

The contract, batch-first, one token per sequence (B rows), no gradient::

    x       (B, n_in)      the layer's input
    c       (B, D) fp32    the recurrent state before the token
    w1      (d′, n_in)     W1; w2 (2·d′, d′) with attention, else (k·D, d′); w3 (k·D, d′) or None
    alpha   (1,)           α, with attention
    norm_weight, norm_bias             the layer's LayerNorm: a pre-norm of x, or with
                                       ``normalize_after`` a post-norm of h; or None
    attn_norm_weight, attn_norm_bias   the LayerNorm inside the sub-layer, or None
    weight_c, bias (2, D)  the recurrence's [v_f; v_r] and [b_f; b_r]
    kv      (B, T, 2·d′) a buffer with [K | V] of the M memory positions in rows
            kv_start .. kv_start+M-1 (M = ``cached``); the op writes the token's into
            row kv_start+M and attends over rows kv_start .. kv_start+M
    memory  (B, T′, n_in) or None: the op writes x̃ (the pre-normed x) into row
            memory_start+M
    memory_pad (B, M) bool or None: True at padded memory keys

    returns h (B, D) in x's dtype, and the new c (B, D) fp32

x and the weights are all float32 or all bfloat16. A layer without attention
passes ``w3``, ``alpha``, ``kv`` and ``memory`` as None, and U = W2 LN(W1 x̃).
k = 3 takes the skip term from x (n_in = D), k = 4 from U's fourth plane.
Rounding follows the layer's modules: what they store in the weights' dtype
(x̃, q, K and V, o, α·o, q + α·o, U, h) is rounded to it; sums, norms, the
softmax and the recurrence run in fp32. :func:`layer_step_reference` is the
same contract in plain PyTorch, the op's oracle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import cpu_kernels
from .reference import layer_norm, skip_term, sru_step
from .matmul import FEW_ROWS
from .settings import accessors, tracing

__all__ = ["layer_step", "layer_step_reference", "layer_step_available", "layer_step_applies",
           "stack_step_kernel", "decode_loop_kernel", "stack_step", "stack_step_arguments",
           "decode_loop", "StackArgs",
           "OutputArgs", "QUANT", "OUTPUT_ROUTES", "STACK_STEP_PARAMS", "DECODE_LOOP_PARAMS",
           "set_step_backend", "get_step_backend", "use_step_backend"]

set_step_backend, get_step_backend, use_step_backend = accessors("step")

SCHEMA = ("layer_step(Tensor x, Tensor c, Tensor w1, Tensor w2, Tensor? w3, Tensor? alpha, "
          "Tensor? norm_weight, Tensor? norm_bias, Tensor? attn_norm_weight, "
          "Tensor? attn_norm_bias, Tensor weight_c, Tensor bias, Tensor(a!)? kv, "
          "Tensor(b!)? memory, Tensor? memory_pad, int kv_start, int memory_start, int cached, "
          "float norm_eps, float attn_norm_eps, "
          "float scale_x, int num_heads, bool normalize_after, int few_rows) -> (Tensor, Tensor)")

# The schema is defined here, at import (no compilation): the C++ kernel registers its
# CPU implementation when the extension loads, and the fake kernel below lets
# torch.compile and torch.export trace the op without running it.
_lib = torch.library.Library("srupp", "FRAGMENT")
_lib.define(SCHEMA)


@torch.library.register_fake("srupp::layer_step", lib=_lib)
def _layer_step_fake(x, c, w1, w2, w3, alpha, norm_weight, norm_bias, attn_norm_weight,
                     attn_norm_bias, weight_c, bias, kv, memory, memory_pad, kv_start,
                     memory_start, cached, norm_eps, attn_norm_eps, scale_x, num_heads,
                     normalize_after, few_rows):
    B, D = x.shape[0], weight_c.shape[1]
    return x.new_empty((B, D)), c.new_empty((B, D))


def layer_step_available() -> bool:
    """Whether the C++ op can run (the extension builds; on the first call it is built)."""
    return cpu_kernels.is_available()  # loading the extension registers the kernel


def layer_step_applies(x: Tensor) -> bool:
    """Whether a one-token step of a stack with input ``x`` runs through the op.

    That is: the step backend is "auto" or "fused", no gradient is recorded,
    nothing traces or autocasts, and ``x`` is a float32 or bfloat16 CPU tensor
    with the extension built. A forced "fused" raises where it can't run ``x``.
    """
    name = get_step_backend()
    if name == "modules" or torch.is_grad_enabled() or tracing():
        return False
    ok = (x.device.type == "cpu" and x.dtype in FEW_ROWS
          and not torch.is_autocast_enabled("cpu"))
    if name == "fused" and not (ok and layer_step_available()):
        raise RuntimeError(f"srupp: the fused step runs float32/bfloat16 CPU tensors outside "
                           f"autocast with the C++ extension built; got {x.dtype} on "
                           f"{x.device.type} (extension: {cpu_kernels.build_error() or 'ok'})")
    return ok and layer_step_available()


# ------------------------------------------------------------ the C++ entry points' arguments
# The one place that knows the C++ signatures of stack_step and decode_loop: their enums,
# and the order of their arguments, which callers fill by name (StackArgs, OutputArgs).
# tests/ops/test_layer_step.py reads csrc/ and checks all three against it.

#: ``enum Quant`` of csrc/layer_step.cpp: how a layer's W1, W2, W3 hold their weights
#: (float; int8 weights with float activations; int8 weights and activations; bf16
#: weights with pair-packed copies for the few-rows products, ``pack_pairs_bf16``).
QUANT = {"float": 0, "int8": 1, "w8a8": 2, "pairs": 3}

#: ``enum OutputRoute`` of csrc/decode_loop.cpp: how decode_loop computes the logits
#: (the few-rows kernel, ATen's linear, the int8 or the w8a8 few-rows kernel).
OUTPUT_ROUTES = {"rows": 0, "aten": 1, "int8": 2, "w8a8": 3}

#: ``stack_step_cpu``'s parameters, in order.
STACK_STEP_PARAMS = ("x", "c", "weights", "kv", "memory", "memory_pad", "kv_start",
                     "memory_start", "cached", "first", "kept", "norm_eps", "attn_norm_eps",
                     "scale_x", "num_heads", "normalize_after", "few_rows", "extras", "quant")

#: ``decode_loop_cpu``'s parameters, in order.
DECODE_LOOP_PARAMS = ("logits", "done", "embedding", "out_weight", "out_bias", "out_scale",
                      "out_route", "c", "weights", "kv", "memory", "memory_pad", "kv_start",
                      "memory_start", "cached", "mem_len", "norm_eps", "attn_norm_eps",
                      "scale_x", "num_heads", "normalize_after", "few_rows", "extras", "quant",
                      "n", "final", "temperature", "top_k", "top_p", "generator", "eos_id",
                      "first")


@dataclass
class StackArgs:
    """What ``stack_step`` and ``decode_loop`` read of a stack's layers (L of them) and
    its state, by name; :class:`srupp.nn.stack_step.StepPlan` fills it."""

    c: Tensor                          # (L, B, D) fp32: the recurrent state
    weights: List[Optional[Tensor]]    # 10 per layer: w1, w2, w3, α, norm w, b, attn norm w, b,
    #                                    weight_c, bias (None where the layer has none)
    kv: List[Optional[Tensor]]         # per layer: the [K | V] buffer (B, T, 2·d′), or None
    memory: List[Optional[Tensor]]     # per layer: the memory buffer (B, T′, n_in), or None
    memory_pad: Optional[Tensor]       # (B, M [+ tokens]) bool: True at padded memory
    kv_start: List[int]                # per layer: the first cached row in kv
    memory_start: List[int]            # per layer: the first cached row in memory
    cached: int                        # M, the memory positions cached
    norm_eps: List[float]
    attn_norm_eps: List[float]
    scale_x: List[float]
    num_heads: List[int]
    normalize_after: List[int]         # 0 / 1
    few_rows: int                      # products of up to this many rows: the few-rows kernel
    extras: List[Optional[Tensor]]     # 3 per layer: int8 weights' scales, or (quant "pairs")
    #                                    the bf16 weights' pair-packed copies; else None
    quant: List[int]                   # per layer: a QUANT value


@dataclass
class OutputArgs:
    """How ``decode_loop`` computes the logits: the output layer's weight, bias and (int8)
    scale, and the route (an :data:`OUTPUT_ROUTES` key)."""

    weight: Tensor
    bias: Optional[Tensor]
    scale: Optional[Tensor]
    route: str


def _in_order(params: Tuple[str, ...], named: dict) -> list:
    missing = set(params) - named.keys()
    if missing or len(named) != len(params):
        raise TypeError(f"srupp: the C++ call lacks {sorted(missing)} or has extra arguments "
                        f"{sorted(named.keys() - set(params))}")
    return [named[p] for p in params]


def stack_step_arguments(x: Tensor, stack: StackArgs, *, first: int, kept: int) -> list:
    """``stack_step_cpu``'s arguments, in its order (a benchmark replays one call)."""
    return _in_order(STACK_STEP_PARAMS, {**vars(stack), "x": x, "first": first, "kept": kept})


def stack_step(x: Tensor, stack: StackArgs, *, first: int, kept: int):
    """One token x (B, n_in) through every layer: ``stack_step_cpu``. Returns h (B, D), the
    new c (L, B, D) and each layer's memory and [K | V] after the token (views, or None),
    of which the memory keeps steps ``first`` .. ``first + kept - 1``."""
    return stack_step_kernel()(*stack_step_arguments(x, stack, first=first, kept=kept))


def decode_loop(logits: Tensor, done: Tensor, embedding: Tensor, output: OutputArgs,
                stack: StackArgs, *, mem_len: Optional[int], n: int, final: bool,
                temperature, top_k, top_p, generator, eos_id: Optional[int],
                first: Optional[Tensor] = None):
    """Up to n tokens through ``decode_loop_cpu`` (sampled from ``logits`` (B, V) first; rows
    already ``done`` (B,) bool, and rows that sample ``eos_id``, stop). ``final``: the last
    token is not fed (nothing follows). Sampling: one setting for the batch (``temperature``
    a float, ``top_k``/``top_p`` None or a number, ``generator`` None or one: every row is
    drawn in one call, as :func:`srupp.models.lm.sample` draws a batch), or lists of one
    setting per row (each row drawn alone with its own generator). ``first``: tokens (B,)
    fed before the first sample (``logits`` is then not read). Returns (tokens
    (B, ≤ n), c, logits, memory, kv, shift), as ``csrc/decode_loop.cpp`` documents."""
    per_row = isinstance(temperature, (list, tuple))
    if not per_row:
        temperature, top_k, top_p, generator = [temperature], [top_k], [top_p], [generator]
    named = {**vars(stack), "logits": logits, "done": done, "embedding": embedding,
             "out_weight": output.weight, "out_bias": output.bias, "out_scale": output.scale,
             "out_route": OUTPUT_ROUTES[output.route],
             "mem_len": -1 if mem_len is None else mem_len, "n": n, "final": final,
             "temperature": [float(t) for t in temperature],
             "top_k": [-1 if k is None else int(k) for k in top_k],
             "top_p": [1.0 if p is None else float(p) for p in top_p],
             "generator": list(generator), "eos_id": -1 if eos_id is None else eos_id,
             "first": first}
    return decode_loop_kernel()(*_in_order(DECODE_LOOP_PARAMS, named))


def stack_step_kernel():
    """The C++ ``stack_step``: the op's kernel for every layer of a stack in turn, in one
    call and without the dispatcher (its argument parsing alone costs a few µs per call;
    ``stack_step_cpu`` in ``csrc/layer_step.cpp`` documents the arguments). Eager only:
    under tracing call :func:`layer_step`. None when the extension can't be built."""
    return cpu_kernels.function("stack_step")


def decode_loop_kernel():
    """The C++ ``decode_loop``: up to n tokens of a causal LM over an SRU++ stack, each
    sampled, embedded, stepped through ``stack_step``'s layers and the output layer, with
    no Python between (``decode_loop_cpu`` in ``csrc/decode_loop.cpp`` documents the
    arguments; :meth:`srupp.models.CausalLM.generate` calls it). Eager only."""
    return cpu_kernels.function("decode_loop")


def layer_step(x: Tensor, c: Tensor, w1: Tensor, w2: Tensor, w3: Optional[Tensor],
               alpha: Optional[Tensor], norm_weight: Optional[Tensor],
               norm_bias: Optional[Tensor], attn_norm_weight: Optional[Tensor],
               attn_norm_bias: Optional[Tensor], weight_c: Tensor, bias: Tensor,
               kv: Optional[Tensor], memory: Optional[Tensor], memory_pad: Optional[Tensor],
               kv_start: int, memory_start: int, cached: int, norm_eps: float,
               attn_norm_eps: float, scale_x: float, num_heads: int, normalize_after: bool,
               few_rows: int) -> Tuple[Tensor, Tensor]:
    """The op (see the module doc); the C++ kernel is built on the first call.
    ``few_rows``: products of up to this many rows take the few-rows kernel, larger
    ones ATen's GEMM (:data:`srupp.ops.matmul.FEW_ROWS` has the measured crossover)."""
    if not tracing() and not layer_step_available():
        raise RuntimeError(f"srupp: the C++ CPU extension is unavailable "
                           f"({cpu_kernels.build_error()})")
    return torch.ops.srupp.layer_step(
        x, c, w1, w2, w3, alpha, norm_weight, norm_bias, attn_norm_weight, attn_norm_bias,
        weight_c, bias, kv, memory, memory_pad, kv_start, memory_start, cached, norm_eps,
        attn_norm_eps, scale_x, num_heads, normalize_after, few_rows)


def layer_step_reference(x: Tensor, c: Tensor, w1: Tensor, w2: Tensor, w3: Optional[Tensor],
                         alpha: Optional[Tensor], norm_weight: Optional[Tensor],
                         norm_bias: Optional[Tensor], attn_norm_weight: Optional[Tensor],
                         attn_norm_bias: Optional[Tensor], weight_c: Tensor, bias: Tensor,
                         kv: Optional[Tensor], memory: Optional[Tensor],
                         memory_pad: Optional[Tensor], kv_start: int, memory_start: int,
                         cached: int, norm_eps: float, attn_norm_eps: float, scale_x: float,
                         num_heads: int, normalize_after: bool,
                         few_rows: int = 0) -> Tuple[Tensor, Tensor]:
    """:func:`layer_step` in plain PyTorch (``few_rows`` is unused: it only picks kernels)."""
    dt = x.dtype
    f = torch.float32

    def round_(t: Tensor) -> Tensor:            # what the modules store in the weights' dtype
        return t.to(dt).to(f)

    def norm(t: Tensor, g: Optional[Tensor], b: Optional[Tensor], eps: float) -> Tensor:
        return t if g is None else round_(layer_norm(t, g.to(f), b.to(f), eps))

    B, D = x.shape[0], weight_c.shape[1]
    xf = x.to(f)
    xin = xf if normalize_after else norm(xf, norm_weight, norm_bias, norm_eps)  # (B, n_in)
    if memory is not None:
        memory[:, memory_start + cached] = xin.to(dt)
    q = round_(xin @ w1.to(f).T)                                          # (B, d′)
    if w3 is not None:
        kv[:, kv_start + cached] = (q @ w2.to(f).T).to(dt)                # the new [K | V]
        dp = q.shape[1]
        hd = dp // num_heads
        keys = kv[:, kv_start:kv_start + cached + 1]                      # (B, S, 2·d′)
        k, v = keys.to(f).split(dp, dim=-1)                               # (B, S, d′) each
        qh = q.view(B, num_heads, 1, hd)
        kh, vh = (t.unflatten(-1, (num_heads, hd)).transpose(1, 2) for t in (k, v))  # (B, H, S, hd)
        scores = qh @ kh.transpose(-2, -1) / math.sqrt(hd)                # (B, H, 1, S)
        if memory_pad is not None:
            pad = torch.cat([memory_pad, memory_pad.new_zeros(B, 1)], 1)  # the token is real
            scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        o = round_((scores.softmax(-1) @ vh).reshape(B, dp))              # (B, d′)
        y = round_(q + round_(alpha.to(f) * o))                           # the residual
        U = round_(norm(y, attn_norm_weight, attn_norm_bias, attn_norm_eps) @ w3.to(f).T)
    else:
        U = round_(norm(q, attn_norm_weight, attn_norm_bias, attn_norm_eps) @ w2.to(f).T)
    U = U.view(B, -1, D)                                                  # (B, k, D)
    h, c_new = sru_step(U, skip_term(U, xf, scale_x), c.to(f), weight_c.to(f), bias.to(f))
    h = round_(h)
    if normalize_after:
        h = norm(h, norm_weight, norm_bias, norm_eps)
    return h.to(dt), c_new
