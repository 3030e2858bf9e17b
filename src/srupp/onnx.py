"""ONNX export of the SRU++ and SRU language models: a prefill graph and a one-token step graph.

Why wrappers instead of exporting the model itself: the layers run fast
kernels ONNX can't express (the recurrence's C++ / Triton custom ops, oneDNN
products, a key/value cache grown in place), the recurrence's reference is a
Python loop that a tracer would unroll to one sequence length, and a decoding
state's memory grows until ``mem_len``. :class:`ForwardGraph` and
:class:`StepGraph` recompute the same model over its own weights with the
SRU++ math reference (:mod:`srupp.nn.reference`, plain torch ops), and keep
the attention memory in a buffer of fixed size, so that the graphs' shapes
vary only in batch (and sequence length).

The two graphs (:func:`export_onnx` writes them, with a JSON description)::

    forward.onnx  tokens (B, L) int64 -> logits (B, L, V), then the state after
                  the last token: ``model(tokens).logits`` and the prefill of
                  ``model.generate``.
    step.onnx     tokens (B,) int64, state -> logits (B, V), next state: one
                  token, as ``model.step`` with an attention window of W tokens.

The state of a model with attention (window W, d = d_model, D = state width)::

    c          (num_layers, B, D) float32  every layer's recurrent state
    lengths    (B,) int64                  how many buffer slots hold a past token (<= W)
    memory_i   (B, W, d) float32           attention layer i's last inputs (after its
                                           pre-norm), oldest first, right-aligned: slot
                                           W-1 holds the latest token; the first
                                           W - lengths slots are unused

A step attends from the new token to the used slots and to itself, then shifts
the buffer left by one slot and writes the token's input into slot W-1 (the
oldest drops out once the buffer is full). That is exactly the memory
``SRUpp.step`` keeps with ``mem_len = W``: the last W inputs, attended to with
the new one. The outputs are named ``new_`` + the state's names, so a caller
feeds each back under its own name. A model without attention (``sru``, or
SRU++ without attention layers) carries ``c`` alone. With W = 0 the buffer
keeps one slot that is never used (a zero-size tensor is awkward in ONNX
runtimes).
"""

from __future__ import annotations

import copy
import logging
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._extras import require
from ._files import atomic_path, atomic_write_json
from .models import CausalLM
from .nn.quant import Int8Linear, check_quantization
from .nn.reference import attention_u, post_norm, pre_norm, projected_u, skip_term, sru_step
from .nn.srupp import SRUppLayer
from .ops.reference import sru_recurrence_reference

# The model types whose step the graphs below rebuild, and why the others are refused.
EXPORTABLE = ("srupp", "sru")
_REFUSED = {
    "lstm": "its body is torch.nn.LSTM, which these graphs do not rebuild",
    "gru": "its body is torch.nn.GRU, which these graphs do not rebuild",
    "transformer": "its key/value cache is not the fixed-size SRU++ window these graphs keep",
}

FORMAT = "srupp-onnx"          # the "format" of the JSON description
FORMAT_VERSION = 1
DESCRIPTION = "srupp-onnx.json"
GRAPH_FILES = {"forward": "forward.onnx", "step": "step.onnx"}


# --------------------------------------------------------------------------- checks

def check_exportable(model: nn.Module) -> None:
    """Raise ValueError, naming the reason, unless ``model`` is an SRU++ or SRU language model
    these graphs rebuild."""
    config = getattr(model, "config", None)
    kind = getattr(config, "type", None)
    if not isinstance(model, CausalLM):
        task = getattr(config, "task", None)
        what = f"a {task} model" if task else f"a {type(model).__name__}"
        raise ValueError(f"ONNX export covers language models (task lm); this is {what}")
    if kind not in EXPORTABLE:
        reason = _REFUSED.get(kind, "no ONNX graphs are written for it")
        raise ValueError(f"ONNX export covers the srupp and sru language models, not "
                         f"model.type={kind}: {reason}")
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        raise ValueError("this model is quantized; export the float model, and quantize "
                         "the graphs with quantize=\"int8\" (srupp export --quantize int8)")
    if config.adaptive_cutoffs is not None:
        raise ValueError("ONNX export does not cover adaptive embeddings and softmax "
                         "(model.adaptive_cutoffs): which cluster a token falls in decides "
                         "the shapes of the computation; export a model with a plain "
                         "embedding and output layer")


def _stack(model: nn.Module) -> nn.Module:
    """The model's SRU or SRU++ stack (:class:`~srupp.nn.SRU` / :class:`~srupp.nn.SRUpp`)."""
    return model.backbone.rnn


def _attends(layer: nn.Module) -> bool:
    return isinstance(layer, SRUppLayer) and layer.use_attention


def resolve_window(model: nn.Module, mem_len: Optional[int] = None) -> int:
    """The step graph's attention window: ``mem_len``, else the model's ``mem_len``.

    0 for a model without attention layers (nothing to remember).
    """
    if not any(_attends(layer) for layer in _stack(model).layers):
        return 0
    window = model.config.mem_len if mem_len is None else mem_len
    if window is None:
        raise ValueError("the model keeps an unbounded attention memory (mem_len=None), but "
                         "the step graph needs a fixed window: give one with mem_len=N "
                         "(srupp export --mem-len N)")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"the attention window (mem_len) must be an integer >= 0, "
                         f"got {window!r}")
    return window


# --------------------------------------------------------------------------- the layers' math
# The math is srupp.nn.reference's (plain torch, no srupp.ops kernels, so a tracer
# sees plain torch ops only); these read a layer's weights and options into it.

def _norm(ln: Optional[nn.LayerNorm]):
    return None if ln is None else (ln.weight, ln.bias, ln.eps)


def _projected_u(layer: nn.Module, xin: Tensor) -> Tensor:
    """U of a layer without attention: SRU's W x (or W2 W1 x), SRU++'s W2 LN(W1 x)."""
    t = layer.transform
    if isinstance(layer, SRUppLayer):
        return projected_u(xin, t.linear1.weight, t.linear2.weight, _norm(t.layer_norm))
    return projected_u(xin, *(m.weight for m in t.modules() if isinstance(m, nn.Linear)))


def _attention_u(layer: nn.Module, q: Tensor, z: Tensor, allowed: Tensor) -> Tensor:
    t = layer.transform
    return attention_u(q, z, allowed, t.linear2.weight, t.linear3.weight, t.alpha,
                       t.num_heads, _norm(t.layer_norm))


def _skip_input(layer: nn.Module, x: Tensor) -> Optional[Tensor]:
    """The raw input x where the skip term is scale_x · x (k = 3), else None."""
    return x if layer.num_matrices == 3 and layer.has_skip_term else None


def _planes(layer: nn.Module, u: Tensor) -> Tensor:
    """(..., k·D) -> (..., k, D)."""
    return u.unflatten(-1, (layer.num_matrices, layer.output_size))


def _recur_step(layer: nn.Module, u: Tensor, x: Tensor, c: Tensor) -> Tuple[Tensor, Tensor]:
    """One step: u (B, k·D), x (B, n_in) the raw input, c (B, D) -> h (B, D), c (B, D)."""
    u = _planes(layer, u)
    return sru_step(u, skip_term(u, _skip_input(layer, x), layer.scale_x), c,
                    layer.weight_c, layer.bias)


def _recur_sequence(layer: nn.Module, U: Tensor, x: Tensor, c0: Tensor) -> Tuple[Tensor, Tensor]:
    """The recurrence over a sequence: U (B, L, k·D), x (B, L, n_in), c0 (B, D) -> h (B, L, D), c.

    While exporting, one ``scan`` over time, which becomes an ONNX Scan that runs
    any length; in eager mode the reference's loop (same steps, no compilation).
    """
    skip_x = _skip_input(layer, x)
    if not torch.compiler.is_compiling():
        return sru_recurrence_reference(_planes(layer, U), skip_x, layer.weight_c, layer.bias,
                                        c0, scale_x=layer.scale_x)
    from torch._higher_order_ops.scan import scan

    def step(c, xs):
        h, c = _recur_step(layer, xs[0], xs[1], c)
        return c, h

    c, h = scan(step, c0, (U, x), dim=1)
    return h, c


# --------------------------------------------------------------------------- the graphs

class _Graph(nn.Module):
    """What both graphs share: the model, the window, and the state's layout."""

    def __init__(self, model: nn.Module, window: Optional[int] = None):
        super().__init__()
        check_exportable(model)
        self.model = model
        self.window = resolve_window(model, window)
        # a buffer of W slots (one, never used, when W = 0)
        self.slots = max(self.window, 1)
        self.attention: List[int] = [i for i, layer in enumerate(_stack(model).layers)
                                     if _attends(layer)]

    @property
    def state_names(self) -> List[str]:
        """The state's tensors, in the order the graphs take and return them."""
        if not self.attention:
            return ["c"]
        return ["c", "lengths", *(f"memory_{i}" for i in self.attention)]

    def _embed(self, tokens: Tensor) -> Tensor:
        x = F.embedding(tokens, self.model.embedding.weight)
        rnn = _stack(self.model)
        if rnn.input_to_hidden is not None:
            x = F.linear(x, rnn.input_to_hidden.weight)
        return x

    def _head(self, h: Tensor) -> Tensor:
        out = self.model.output
        return F.linear(h, out.weight, out.bias)


class ForwardGraph(_Graph):
    """tokens (B, L) -> (logits (B, L, V), c, [lengths, memory_i ...]): the model's
    ``forward`` from a zero state, and the state a step continues from.

    The memory holds the last min(L, W) layer inputs, as ``model.forward`` leaves
    it with ``mem_len = W``; every row has L tokens (no padding).
    """

    def forward(self, tokens: Tensor) -> Tuple[Tensor, ...]:
        B, L = tokens.shape
        x = self._embed(tokens)                                            # (B, L, d)
        pos = torch.arange(L, device=tokens.device)
        causal = (pos.unsqueeze(0) <= pos.unsqueeze(1)).unsqueeze(0)       # (1, L, L)
        cs, memories = [], []
        for layer in _stack(self.model).layers:
            xin = pre_norm(x, _norm(layer.layer_norm), layer.normalize_after)  # (B, L, n_in)
            if _attends(layer):
                z = xin @ layer.transform.linear1.weight.T                 # (B, L, d′)
                U = _attention_u(layer, z, z, causal)
                # the last W inputs, right-aligned in W slots: pad in front, keep the last W
                # (a slice from the end: torch.export on torch 2.11 cannot prove a slice
                # from the symbolic L in range)
                padded = torch.cat([xin.new_zeros(B, self.slots, xin.shape[-1]), xin], dim=1)
                memories.append(padded[:, padded.shape[1] - self.slots:])  # (B, W, n_in)
            else:
                U = _projected_u(layer, xin)
            c0 = x.new_zeros(B, layer.output_size)
            h, c = _recur_sequence(layer, U, x, c0)                        # (B, L, D), (B, D)
            x = post_norm(h, _norm(layer.layer_norm), layer.normalize_after)
            cs.append(c)
        logits = self._head(x)                                             # (B, L, V)
        if not self.attention:
            return logits, torch.stack(cs)
        lengths = torch.ones_like(tokens).sum(dim=1).clamp(max=self.window)  # (B,) = min(L, W)
        return (logits, torch.stack(cs), lengths, *memories)


class StepGraph(_Graph):
    """(tokens (B,), c, [lengths, memories]) -> (logits (B, V), c, [lengths, memory_i ...]).

    ``memories`` is a tuple with one (B, W, d) buffer per attention layer, in layer
    order. Equal to ``model.step`` with an attention window of W.
    """

    def forward(self, tokens: Tensor, c: Tensor, lengths: Optional[Tensor] = None,
                memories: Tuple[Tensor, ...] = ()) -> Tuple[Tensor, ...]:
        x = self._embed(tokens)                                            # (B, d)
        allowed = None
        if self.attention:
            # slots W - lengths .. W - 1 hold past tokens; slot W, the new token, always counts
            slot = torch.arange(self.slots + 1, device=tokens.device)
            first = (self.slots - lengths).unsqueeze(1)                    # (B, 1)
            allowed = (slot.unsqueeze(0) >= first).unsqueeze(1)            # (B, 1, W + 1)
        buffers = iter(memories)
        cs, new_memories = [], []
        for i, layer in enumerate(_stack(self.model).layers):
            xin = pre_norm(x, _norm(layer.layer_norm), layer.normalize_after)  # (B, n_in)
            if _attends(layer):
                buf = next(buffers)                                        # (B, W, n_in)
                w1 = layer.transform.linear1.weight
                q = (xin @ w1.T).unsqueeze(1)                              # (B, 1, d′)
                z = torch.cat([buf @ w1.T, q], dim=1)                      # (B, W + 1, d′)
                u = _attention_u(layer, q, z, allowed).squeeze(1)
                # drop the oldest slot, append this token's input (one slot: just replace it,
                # with no zero-size slice in between)
                new_memories.append(xin.unsqueeze(1) if self.slots == 1 else
                                    torch.cat([buf[:, 1:], xin.unsqueeze(1)], dim=1))
            else:
                u = _projected_u(layer, xin)
            h, c_i = _recur_step(layer, u, x, c[i])                        # (B, D) each
            x = post_norm(h, _norm(layer.layer_norm), layer.normalize_after)
            cs.append(c_i)
        logits = self._head(x)                                             # (B, V)
        if not self.attention:
            return logits, torch.stack(cs)
        lengths = (lengths + 1).clamp(max=self.window)
        return (logits, torch.stack(cs), lengths, *new_memories)


# --------------------------------------------------------------------------- export

def export_onnx(model: nn.Module, out_dir, *, mem_len: Optional[int] = None,
                tokenizer: Optional[Dict[str, Any]] = None,
                quantize: Optional[str] = None) -> Dict[str, Any]:
    """Write ``forward.onnx``, ``step.onnx`` and ``srupp-onnx.json`` into ``out_dir``.

    Args:
        model: an SRU++ or SRU language model (see :func:`check_exportable`).
        out_dir: the folder to write (created if missing; files there are replaced).
        mem_len: the step graph's attention window; None takes the model's ``mem_len``.
        tokenizer: the tokenizer's ``to_dict()``, written as ``tokenizer.json`` so that
            the folder stands on its own (examples/onnx_generate.py reads it).
        quantize: "int8" stores the graphs' weight matrices as int8, one scale per
            output channel (:func:`quantize_graphs`); None keeps them float32.
    Returns:
        The description written to ``srupp-onnx.json``: sizes, window, the state's
        names and shapes, the graphs' file names.
    """
    check_exportable(model)
    window = resolve_window(model, mem_len)
    check_torch_exports()
    require("onnx", "onnx", "ONNX export")
    require("onnxscript", "onnx", "ONNX export")  # torch.onnx's exporter builds graphs with it
    if quantize is not None:
        if check_quantization(quantize) != "int8":
            raise ValueError(f"quantize={quantize!r}: the ONNX graphs take \"int8\", which "
                             f"ONNX Runtime's quantize_dynamic applies (int8 weights, and "
                             f"activations rounded per call, as w8a8 does)")
        require("onnxruntime", "onnx", "ONNX quantization")
    # a private fp32 copy on the CPU, without gradients: exporting never touches the
    # caller's model, and a model on a GPU exports the same graphs (onnxruntime runs
    # them wherever it runs; the example inputs below are CPU tensors)
    model = copy.deepcopy(model).to("cpu", torch.float32).eval().requires_grad_(False)
    forward, step = ForwardGraph(model, window), StepGraph(model, window)
    names = forward.state_names
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    # example inputs: batch 2 and length 3, as sizes 0 and 1 would be taken for constants
    tokens = torch.arange(6).remainder(model.config.vocab_size).view(2, 3)
    with torch.no_grad():
        state = [t.contiguous() for t in forward(tokens)[1:]]
    batch = {0: "batch"}
    _export(forward, (tokens,), out_dir / GRAPH_FILES["forward"],
            inputs=["tokens"], outputs=["logits", *(f"new_{n}" for n in names)],
            dynamic=({0: "batch", 1: "length"},))
    step_args: Tuple[Any, ...] = (tokens[:, -1].contiguous(), state[0])
    step_dynamic: Tuple[Any, ...] = (batch, {1: "batch"})
    if forward.attention:
        step_args += (state[1], tuple(state[2:]))
        step_dynamic += (batch, tuple(batch for _ in state[2:]))
    _export(step, step_args, out_dir / GRAPH_FILES["step"],
            inputs=["tokens", *names], outputs=["logits", *(f"new_{n}" for n in names)],
            dynamic=step_dynamic)

    if quantize is not None:
        quantize_graphs([out_dir / GRAPH_FILES[g] for g in ("forward", "step")])

    c = model.config
    layers = _stack(model).layers
    D = layers[0].output_size
    shapes = {"c": [c.num_layers, "batch", D], "lengths": ["batch"]}
    shapes.update({f"memory_{i}": ["batch", forward.slots, layers[i].input_size]
                   for i in forward.attention})
    description = {
        "format": FORMAT, "version": FORMAT_VERSION, "model_type": c.type,
        "graphs": dict(GRAPH_FILES),
        "vocab_size": c.vocab_size, "d_model": c.d_model, "num_layers": c.num_layers,
        "state_size": D, "window": window, "attention_layers": forward.attention,
        "state": names, "state_shapes": {n: shapes[n] for n in names},
        "state_dtypes": {n: "int64" if n == "lengths" else "float32" for n in names},
        "outputs": "logits",
        "weights": quantize or "float32",
        "tokenizer": "tokenizer.json" if tokenizer is not None else None,
    }
    if tokenizer is not None:
        atomic_write_json(out_dir / "tokenizer.json", tokenizer)
    atomic_write_json(out_dir / DESCRIPTION, description)
    return description


def quantize_graphs(paths: List[Path]) -> None:
    """Store each ONNX graph's weight matrices as int8, in place, with ONNX Runtime's own tool.

    ``onnxruntime.quantization.quantize_dynamic``: the MatMul/Gemm nodes whose
    weight is a constant get int8 weights with one scale per output channel
    (symmetric), and quantize their input per call (dynamic quantization); the
    embedding lookup, the attention over the memory and the recurrence stay
    float32. Inputs and outputs keep their names, shapes and dtypes.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    for path in paths:
        with atomic_path(path) as tmp:
            quantize_dynamic(str(path), str(tmp), per_channel=True,
                             weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul", "Gemm"])


#: The oldest torch whose exporter gives graphs that run any batch and length.
#: torch 2.11's specialises the example's length inside the attention (its
#: forward graph then fails at other lengths in onnxruntime); 2.13 is tested.
MIN_EXPORT_TORCH = "2.13"


def check_torch_exports() -> None:
    """ValueError, naming the fix, when the installed torch exports wrong graphs."""
    version = torch.torch_version.TorchVersion(torch.__version__)
    if version < MIN_EXPORT_TORCH:
        raise ValueError(f"ONNX export needs torch >= {MIN_EXPORT_TORCH}: torch "
                         f"{torch.__version__}'s exporter fixes the sequence length of the "
                         f"graphs; upgrade torch, or export on a machine that has it")


def _export(graph: nn.Module, args: tuple, path: Path, *, inputs: List[str], outputs: List[str],
            dynamic: tuple) -> None:
    """torch.onnx.export (the torch.export-based exporter) of ``graph`` to ``path``."""
    # the exporter's notes on its own internals (prototype features, torchvision ops it
    # skips) are no concern of srupp's users: its warnings and log lines are held back
    log = logging.getLogger("torch.onnx")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(graph, args, dynamo=True, input_names=inputs,
                                        output_names=outputs, dynamic_shapes=dynamic,
                                        optimize=True, verbose=False)
    finally:
        log.setLevel(level)
    with atomic_path(path) as tmp:  # a failed write leaves no half graph
        program.save(str(tmp))  # weights inside the file, unless they pass ONNX's 2 GB limit
