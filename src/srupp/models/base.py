"""What every srupp model shares: the registry, saving and loading.

A model is registered under its config's ``task`` ("lm", "translate",
"classify") and ``type`` ("srupp", "sru", "lstm", ...): the registry maps
task -> type -> (config class, model class). Every model class derives from
:class:`SavedModel`, which enters it in the registry when it is defined and
gives it ``save_pretrained``/``from_pretrained``. A saved ``config.json`` holds
the config's fields, its ``type`` and (for tasks other than "lm") its ``task``,
so :func:`load_model` rebuilds any saved model without being told what it is.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import fields
from pathlib import Path
from typing import Any, ClassVar, Dict, Optional, Tuple, Type, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model as load_weights
from safetensors.torch import save_model
from torch import nn

from .._files import atomic_path, atomic_write_json
from ..errors import UserError

TASKS = ("lm", "translate", "classify")

# task -> model type -> (config class, model class), filled in as model classes are defined
REGISTRY: Dict[str, Dict[str, Tuple[type, Type["SavedModel"]]]] = {t: {} for t in TASKS}


def task_models(task: str) -> Dict[str, Tuple[type, Type["SavedModel"]]]:
    """The registered model types of ``task``: type -> (config class, model class)."""
    if task not in REGISTRY:
        raise ValueError(f"task must be one of {', '.join(TASKS)}; got {task!r}")
    return REGISTRY[task]


def model_class(model_type: str, task: str = "lm") -> Type["SavedModel"]:
    """The model class of ``model_type`` for ``task``."""
    models = task_models(task)
    if model_type not in models:
        raise ValueError(f"type must be one of {', '.join(models)} for task {task}; "
                         f"got {model_type!r}")
    return models[model_type][1]


class SavedModel(nn.Module):
    """A model built from one config dataclass, saved as config.json + model.safetensors.

    A subclass that sets ``config_class`` (a dataclass with ClassVars ``task``
    and ``type``, and a ``to_dict()``) is the model of that task and type.
    """

    config_class: ClassVar[type]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        config_class = cls.__dict__.get("config_class")
        if config_class is not None:
            models = task_models(getattr(config_class, "task", "lm"))
            if config_class.type in models:
                raise TypeError(f"two model classes for type {config_class.type!r}: "
                                f"{models[config_class.type][1].__name__} and {cls.__name__}")
            models[config_class.type] = (config_class, cls)

    def check_config(self, config) -> None:
        """TypeError unless ``config`` is this class's config (call first in __init__)."""
        want = getattr(type(self), "config_class", None)
        if want is None or not isinstance(config, want):
            raise TypeError(f"{type(self).__name__} takes a "
                            f"{want.__name__ if want else 'model type config'}, got "
                            f"{type(config).__name__}; srupp.models.build_model builds the "
                            f"model of any config")

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def num_parameters(self) -> int:
        """Every parameter, embeddings and output included (tied weights counted once)."""
        return sum(p.numel() for p in self.parameters())

    def save_pretrained(self, directory: Union[str, os.PathLike]) -> None:
        """Write ``config.json`` and ``model.safetensors`` into ``directory``.

        Each file is replaced atomically, and both carry the same new save id:
        a save interrupted between the two leaves a pair that
        :meth:`from_pretrained` refuses, never one it loads mixed.
        """
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        save_id = uuid.uuid4().hex
        with atomic_path(d / "model.safetensors") as tmp:
            save_model(self, str(tmp), metadata={"save_id": save_id})
        atomic_write_json(d / "config.json", {**self.config.to_dict(), "save_id": save_id})

    @classmethod
    def from_pretrained(cls, directory: Union[str, os.PathLike], *, device=None) -> "SavedModel":
        """Load a model saved by :meth:`save_pretrained`, in eval mode.

        On a base class the model is of the saved task and type; on a model
        class it is that class, or a ValueError names the saved type.
        Reads only JSON and safetensors: loading never executes code from the files.
        """
        d = Path(directory)
        config, save_id = read_config(d)
        model_cls = model_class(config.type, getattr(config, "task", "lm"))
        if not issubclass(model_cls, cls):
            raise ValueError(f"{d} holds a {config.type} model, which {cls.__name__} cannot "
                             f"load; use {model_cls.__name__}.from_pretrained or "
                             f"srupp.models.load_model")
        model = model_cls(config, device=device)
        weights = d / "model.safetensors"
        try:
            with safe_open(str(weights), "pt") as f:
                weights_id = (f.metadata() or {}).get("save_id")
            if weights_id != save_id:
                raise UserError(f"{d}: config.json and model.safetensors come from different "
                                f"saves (a save was interrupted); save again")
            load_weights(model, str(weights), device=str(device or "cpu"))
        except FileNotFoundError:
            raise UserError(f"{d} has no model.safetensors") from None
        except (SafetensorError, RuntimeError, OSError) as e:
            raise UserError(f"{weights} is truncated or corrupt "
                            f"({str(e).splitlines()[0]})") from None
        return model.eval()  # like a freshly loaded model elsewhere: ready for inference


def config_from_dict(d: Dict[str, Any]):
    """The config of ``d["task"]`` (default lm) and ``d["type"]`` (default srupp).

    The other entries are the config's fields; a config class may read them
    itself with a ``from_dict`` classmethod (language-model configs do, to
    read configs saved before the per-type configs).
    """
    d = dict(d)
    task = d.pop("task", "lm")
    cls = model_class(d.pop("type", "srupp"), task).config_class
    if hasattr(cls, "from_dict"):
        return cls.from_dict(d)
    own = {f.name for f in fields(cls)}
    for key in sorted(set(d) - own):
        raise ValueError(f"unknown config key {key!r}; a {task} {cls.type} config has "
                         f"{', '.join(sorted(own))}")
    return cls(**d)


def build_model(config, device=None, dtype=None) -> SavedModel:
    """A freshly initialised model of ``config``'s task and type; a dict is read by config_from_dict."""
    if isinstance(config, dict):
        config = config_from_dict(config)
    return model_class(config.type, getattr(config, "task", "lm"))(config, device=device,
                                                                    dtype=dtype)


def read_config(directory: Path) -> Tuple[Any, Optional[str]]:
    """The config saved in ``directory`` and its save id (None in saves made before save ids)."""
    path = Path(directory) / "config.json"
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path.parent} has no config.json: not a saved srupp model") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is corrupt ({e})") from None
    if not isinstance(d, dict):
        raise UserError(f"{path} is corrupt (not a JSON object)")
    save_id = d.pop("save_id", None)
    try:
        return config_from_dict(d), save_id
    except (ValueError, TypeError) as e:
        raise UserError(f"{path}: {e}") from None


def load_config(directory: Union[str, os.PathLike]):
    """The config of a model saved by :meth:`SavedModel.save_pretrained` in ``directory``."""
    return read_config(Path(directory))[0]


def load_model(directory: Union[str, os.PathLike], *, device=None) -> SavedModel:
    """A model saved by ``save_pretrained``, of whatever task and type, in eval mode."""
    return SavedModel.from_pretrained(directory, device=device)


def parameter_counts(config) -> Dict[str, int]:
    """The model's parameters: ``params`` in all = ``embedding`` + ``layers`` + ``output``.

    Counted on the meta device, so nothing is allocated; tied output weights
    count once, in the embedding. ``layers`` is a language model's body
    (``body_modules()``), or for other models everything but the embedding
    and the output layer.
    """
    with torch.device("meta"):
        model = build_model(config)
    count = lambda *ms: sum(p.numel() for m in ms for p in m.parameters())  # noqa: E731
    total, emb = model.num_parameters(), count(model.embedding)
    if hasattr(model, "body_modules"):
        layers = count(*model.body_modules())
    else:
        shared = {id(p) for p in model.embedding.parameters()}
        head = model.output if hasattr(model, "output") else model.head  # a classifier's
        layers = total - emb - sum(p.numel() for p in head.parameters() if id(p) not in shared)
    return {"params": total, "embedding": emb, "layers": layers, "output": total - emb - layers}
