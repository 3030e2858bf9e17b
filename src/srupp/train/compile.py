"""``train.compile=layers``: each repeated layer of the backbone compiled alone.

Regional compilation: ``torch.compile`` over one layer at a time instead of the
whole model. Inside a layer Inductor fuses the small element-wise work (layer
norms, SRU++'s α-residual, dropout, casts) into few kernels, while the SRU
recurrence stays one opaque call of the ``srupp::sru_fwd`` / ``sru_bwd``
custom ops (:mod:`srupp.ops.recurrence`), with no graph break. The layers of
a stack share their code, so Dynamo traces each kind of layer once, not each
layer (the last layer, without highway dropout, and layers without attention
are other kinds; so is an SRU++ layer's first segment, without memory).

What is compiled, by class (:data:`LAYERS`):

- SRU and SRU++ layers (:class:`~srupp.nn.sru.RecurrentLayerBase`): the method
  their stacks call per layer, ``layer_forward``: the pre-norm, the attention
  or projection sub-layer that makes U, the recurrence and the post-norm;
- Transformer blocks (:class:`~srupp.models.backbones.transformer.Block`):
  ``forward``.

LSTM and GRU backbones have none: ``torch.nn.LSTM`` is one cuDNN call.

Only training calls the compiled code (module in training mode, gradients
on): evaluation and decoding run other shapes on each call, without
gradients, and stay eager, so that they never recompile.

With ``cudagraphs`` (``train.compile=layers-cudagraphs``, CUDA only) each
compiled layer also replays as a CUDA graph (``mode="reduce-overhead"``, shapes
fixed: ``dynamic=False``), so its launches cost one call; the trainer marks
each optimiser step's start (``torch.compiler.cudagraph_mark_step_begin``).
A graph's outputs live in memory that its next replay writes again, so every
output but the first (h, used within the step) is copied out of it: the state
a language model carries to the next segment is made of them (SRU++'s memory,
a block's keys and values). Not yet run on a GPU: ``pytest --device cuda
tests/train/test_compile.py`` checks it against eager training.
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import torch
from torch import nn

from ..models.backbones.transformer import Block
from ..nn.sru import RecurrentLayerBase
from ..ops.settings import backends

# The layers "layers" compiles: (class, the method their stack calls once per layer)
LAYERS: Tuple[Tuple[type, str], ...] = ((RecurrentLayerBase, "layer_forward"), (Block, "forward"))


def compile_layers(model: nn.Module, *, cudagraphs: bool = False, **options: Any) -> List[str]:
    """Compile each layer of ``model`` that :data:`LAYERS` names, in place, for training.

    Args:
        model: any srupp model (or module).
        cudagraphs: also replay each layer as a CUDA graph (CUDA tensors only).
        options: more ``torch.compile`` options (``fullgraph=True``, a ``backend``:
            the tests' and benchmarks' checks).
    Returns:
        the names of the compiled modules (``model.named_modules()``'s); empty
        when the model has no such layer (an LSTM or GRU).

    The weights, ``state_dict`` and saving are untouched; the compiled method is
    an attribute of the layer object, so a copy of the model built anew (FSDP's
    whole-weights copy, a loaded checkpoint) is eager.
    """
    if cudagraphs:
        options = {"mode": "reduce-overhead", "dynamic": False, **options}
    # the backend settings are read on the first dispatch; read them now, not while
    # Dynamo traces (whose guard on the unset settings would recompile at once)
    backends()
    names = []
    for name, module in model.named_modules():
        method = next((m for cls, m in LAYERS if isinstance(module, cls)), None)
        if method is not None:
            setattr(module, method, _training_only(module, getattr(module, method),
                                                    cudagraphs, options))
            names.append(name)
    return names


def _training_only(module: nn.Module, eager: Callable, cudagraphs: bool,
                   options: dict) -> Callable:
    """``eager``, compiled, for the calls of training; other calls run ``eager`` itself."""
    compiled = torch.compile(eager, **options)

    def run(*args, **kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return eager(*args, **kwargs)
        out = compiled(*args, **kwargs)
        if cudagraphs:
            # the first output (h) is used within the step; the rest may be kept
            out = (out[0], *(t.clone() if isinstance(t, torch.Tensor) else t for t in out[1:]))
        return out

    run.__wrapped__ = eager  # type: ignore[attr-defined]
    run.compiled = compiled  # type: ignore[attr-defined]
    return run
