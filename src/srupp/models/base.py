"""What every model shares: saving and loading as config.json + model.safetensors.

A saved ``config.json`` holds the config's fields, its ``task`` and ``type``
and the ``format_version`` (:mod:`srupp._format`), so a model is rebuilt
without being told what it is (:func:`srupp.models.load_model`).
"""

from __future__ import annotations

import math
import os
import uuid
from pathlib import Path
from typing import Any, ClassVar, Optional, Tuple, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from .._files import atomic_path, atomic_write_json
from .._format import check_format_version, with_format_version
from ..errors import UserError
from ..runs import MODEL_CONFIG, MODEL_FILE, read_json
from ..nn.quant import Int8Linear, check_quantization, quantize_linears
from .backbones import BACKBONES, Backbone
from .config import config_from_dict


class SavedModel(nn.Module):
    """A task head over a backbone, built from one config and saved as config.json +
    model.safetensors. A subclass sets ``task`` and takes that task's configs.
    """

    task: ClassVar[str]

    def __init__(self, config, *, device=None, dtype=None):
        super().__init__()
        if getattr(config, "task", None) != self.task or not getattr(config, "type", ""):
            raise TypeError(f"{type(self).__name__} takes a {self.task} model config, got "
                            f"{type(config).__name__}; srupp.models.build_model builds the "
                            f"model of any config")
        self.config = config
        self.factory = {"device": device, "dtype": dtype}

    def make_backbone(self, role: str) -> Backbone:
        """A new backbone of the config's type in ``role``."""
        return BACKBONES[self.config.type](self.config, role=role, **self.factory)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def num_parameters(self) -> int:
        """Every parameter, embeddings and output included (tied weights counted once);
        the int8 weights and biases of a quantized model count as parameters too."""
        int8 = sum(m.weight.numel() + (0 if m.bias is None else m.bias.numel())
                   for m in self.modules() if isinstance(m, Int8Linear))
        return sum(p.numel() for p in self.parameters()) + int8

    @property
    def quantized(self) -> bool:
        """Whether :meth:`quantize` has converted this model."""
        return any(isinstance(m, Int8Linear) for m in self.modules())

    def quantize(self, kind: str = "int8") -> "SavedModel":
        """Convert this model in place to int8 weights for inference; returns it.

        Every linear layer (the backbone's projections, the output layer) keeps
        its weight as int8 with one scale per output feature. With "int8" it
        computes in the dtype of its input (fp32 or bf16); with "w8a8" it rounds
        each row of its input to int8 too, per call, and sums integer products
        (faster where the CPU has VNNI): :mod:`srupp.nn.quant`. Embedding
        lookups, layer norms, the recurrence and an adaptive softmax keep their
        float weights. The model ends in eval mode with its remaining parameters
        frozen; training it, or saving it, is refused: quantize after loading.

        Args:
            kind: "int8" or "w8a8" (:data:`srupp.nn.quant.QUANTIZATIONS`).
        """
        check_quantization(kind)
        if self.quantized:
            raise ValueError("this model is already quantized")
        return quantize_linears(self, kind, skip=getattr(self, "embedding", None))

    def save_pretrained(self, directory: Union[str, os.PathLike]) -> None:
        """Write ``config.json`` and ``model.safetensors`` into ``directory``.

        Each file is replaced atomically, and both carry the same new save id:
        a save interrupted between the two leaves a pair that
        :meth:`from_pretrained` refuses, never one it loads mixed.
        """
        if self.quantized:
            raise ValueError("a quantized model is not saved: save the float model, and "
                             "quantize it after loading")
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        save_id = uuid.uuid4().hex
        with atomic_path(d / MODEL_FILE) as tmp:
            save_weights(self, tmp, metadata={"save_id": save_id})
        atomic_write_json(d / MODEL_CONFIG,
                          with_format_version({**self.config.to_dict(), "save_id": save_id}))

    @classmethod
    def from_pretrained(cls, directory: Union[str, os.PathLike], *, device=None) -> "SavedModel":
        """Load a model saved by :meth:`save_pretrained`, in eval mode.

        The saved config must be of this head's task (a ValueError names the
        saved one; :func:`srupp.models.load_model` loads any). Reads only JSON
        and safetensors: loading never executes code from the files.
        """
        d = Path(directory)
        config, save_id = read_config(d)
        if config.task != cls.task:
            raise ValueError(f"{d} holds a {config.task} model, which {cls.__name__} cannot "
                             f"load; use srupp.models.load_model")
        model = cls(config, device=device)
        weights = d / MODEL_FILE
        try:
            with safe_open(str(weights), "pt") as f:
                weights_id = (f.metadata() or {}).get("save_id")
            if weights_id is None or weights_id != save_id:
                raise UserError(f"{d}: config.json and model.safetensors come from different "
                                f"saves (a save was interrupted); save again")
            load_weights(model, str(weights), device=str(device or "cpu"))
        except FileNotFoundError:
            raise UserError(f"{d} has no {MODEL_FILE}") from None
        except (SafetensorError, RuntimeError, OSError) as e:
            raise UserError(f"{weights} is truncated or corrupt "
                            f"({str(e).splitlines()[0]})") from None
        return model.eval()  # like a freshly loaded model elsewhere: ready for inference


def _same_tensor_key(t: torch.Tensor):
    """Equal for two names of one tensor (tied weights), different for anything else
    (empty tensors, whose data pointers may all be 0, are never tied)."""
    if t.numel() == 0:
        return id(t)
    return t.device, t.data_ptr(), tuple(t.shape), t.stride()


def _covers_its_storage(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def save_weights(model: nn.Module, path: Union[str, os.PathLike],
                 metadata: Optional[dict] = None) -> None:
    """Write ``model``'s state dict to a safetensors file.

    Tied weights (two names, one tensor) are written once, under the first name
    in sorted order; the others are recorded in the metadata as
    ``{dropped: kept}`` (safetensors' own ``save_model`` does the same, so files
    of either load alike). A tensor that is a view into a larger buffer is
    written as a copy: on CUDA, cuDNN keeps an LSTM's or GRU's weights as views
    into one flat buffer, which ``save_model`` refuses.
    """
    state = model.state_dict()
    kept, out, metadata = {}, {}, dict(metadata or {})
    for name in sorted(state):
        t = state[name]
        key = _same_tensor_key(t)
        if key in kept:
            metadata.setdefault(name, kept[key])
            continue
        kept[key] = name
        out[name] = t if _covers_its_storage(t) else t.clone(memory_format=torch.contiguous_format)
    save_file(out, str(path), metadata=metadata)


def load_weights(model: nn.Module, path: Union[str, os.PathLike], device="cpu") -> None:
    """Load a file written by :func:`save_weights` into ``model``, in place.

    Copies into the model's own tensors, so tied weights stay tied and cuDNN's
    flat buffer stays flat. Raises RuntimeError if the file's names are not the
    model's (a tied name may be absent from the file: it is loaded through the
    name it is tied to).
    """
    weights = load_file(str(path), device=str(device))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    state = model.state_dict()
    loaded = {_same_tensor_key(state[n]) for n in weights if n in state}
    missing = [n for n in missing if _same_tensor_key(state[n]) not in loaded]
    if missing or unexpected:
        raise RuntimeError(f"the weights do not fit {type(model).__name__}: missing "
                           f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")


def describe(t) -> str:
    """What a wrong argument is, for error messages: its dtype and shape, or its type."""
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def init_embedding(embedding: nn.Module, output: Optional[nn.Linear] = None) -> None:
    """U(±√(3/d)) (variance 1/d, the reference's enwik8 init) for the embedding and an untied
    output layer, whose bias starts at zero."""
    bound = math.sqrt(3.0 / embedding.weight.shape[1])
    nn.init.uniform_(embedding.weight, -bound, bound)
    if output is not None:
        if output.weight is not embedding.weight:
            nn.init.uniform_(output.weight, -bound, bound)
        nn.init.zeros_(output.bias)


def read_config(directory: Path) -> Tuple[Any, Optional[str]]:
    """The config saved in ``directory`` and its save id (which its weights must carry)."""
    path = Path(directory) / MODEL_CONFIG
    if not path.exists():
        raise UserError(f"{path.parent} has no {MODEL_CONFIG}: not a saved srupp model")
    d = read_json(path, "model config")
    if not isinstance(d, dict):
        raise UserError(f"{path} is corrupt (not a JSON object)")
    check_format_version(d, path)
    d.pop("format_version")
    save_id = d.pop("save_id", None)  # a pair of files without one is refused below
    try:
        return config_from_dict(d), save_id
    except (ValueError, TypeError) as e:
        raise UserError(f"{path}: {e}") from None
