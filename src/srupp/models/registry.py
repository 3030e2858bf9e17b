"""Every model: task × type -> (config class, head class); building, loading, counting.

A task has one head (:data:`HEADS`); a type is a backbone
(:data:`srupp.models.backbones.BACKBONES`). :data:`REGISTRY` is the live view
task -> type -> (config class, head class) over the backbones that serve each task.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Dict, Tuple, Type, Union

import torch

from .base import SavedModel, read_config
from .classifier import SequenceClassifier
from .config import TASK_NAMES, config_class, config_from_dict, task_types
from .lm import CausalLM
from .seq2seq import EncoderDecoder

HEADS: Dict[str, Type[SavedModel]] = {"lm": CausalLM, "translate": EncoderDecoder,
                                      "classify": SequenceClassifier}


def task_models(task: str) -> Dict[str, Tuple[type, Type[SavedModel]]]:
    """The model types of ``task``: type -> (config class, head class)."""
    return {t: (config_class(task, t), HEADS[task]) for t in task_types(task)}


class _Registry(Mapping):
    """task -> :func:`task_models` (read when asked, so a backbone registered later is in it)."""

    def __getitem__(self, task: str):
        return task_models(task)

    def __iter__(self):
        return iter(TASK_NAMES)

    def __len__(self):
        return len(TASK_NAMES)


REGISTRY = _Registry()


def model_class(model_type: str, task: str = "lm") -> Type[SavedModel]:
    """The head class that builds ``model_type`` for ``task`` (ValueError for an unknown type)."""
    config_class(task, model_type)
    return HEADS[task]


def build_model(config, device=None, dtype=None) -> SavedModel:
    """A freshly initialised model of ``config``'s task and type (a dict: config_from_dict)."""
    if isinstance(config, dict):
        config = config_from_dict(config)
    return HEADS[config.task](config, device=device, dtype=dtype)


def load_config(directory: Union[str, os.PathLike]):
    """The config of a model saved by :meth:`SavedModel.save_pretrained` in ``directory``."""
    return read_config(Path(directory))[0]


def load_model(directory: Union[str, os.PathLike], *, device=None) -> SavedModel:
    """A model saved by ``save_pretrained``, of whatever task and type, in eval mode."""
    return HEADS[load_config(directory).task].from_pretrained(directory, device=device)


def parameter_counts(config) -> Dict[str, int]:
    """The model's parameters: ``params`` in all = ``embedding`` + ``layers`` + ``output``.

    Counted on the meta device, so nothing is allocated; tied output weights
    count once, in the embedding; ``layers`` is everything else (backbones, pooling).
    """
    with torch.device("meta"):
        model = build_model(config)
    count = lambda *ms: sum(p.numel() for m in ms for p in m.parameters())  # noqa: E731
    total, emb = model.num_parameters(), count(model.embedding)
    shared = {id(p) for p in model.embedding.parameters()}
    out = sum(p.numel() for p in model.output.parameters() if id(p) not in shared)
    return {"params": total, "embedding": emb, "layers": total - emb - out, "output": out}
