"""Run configuration: a TOML recipe plus ``--set key=value`` overrides.

A recipe has one top-level key, ``task`` ("lm", the default, "translate" or
"classify"; ``--set task=translate``), and four tables, ``[model]``,
``[data]``, ``[train]`` and ``[eval]``; every key is optional. Each field
(:mod:`srupp.train.run_config`, the plain dataclasses :func:`build_config` returns)
says why it exists; the ``[model]`` keys are the fields of the config
of the task's ``model.type`` (:mod:`srupp.models`), and a key of another
model type is an error. Some keys apply to some tasks only: the LM's stream
layout (``train.batch_size``, ``train.unroll``), the sentence tasks' columns
and token batches (``data.src``, ``train.max_tokens``, ...).

Every number is checked when read: each section's ``_ranges`` gives its keys'
ranges (the model's are its config's, :mod:`srupp.models.config`), and a float
must be finite (nan, inf and -inf never pass); an error names the key, the
value and the range (:mod:`srupp._ranges`).

:func:`build_config` is where a run's config is made: it applies the task's
defaults (:mod:`srupp.train.registry`) and its checks.
"""

from __future__ import annotations

import difflib
import math
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Union, get_args, get_origin

from ..errors import UserError
from ..models.registry import REGISTRY
from .registry import TASKS, task_named
from .run_config import (COMPILE_MODES, OPTIMIZER_IMPLS, OPTIMIZERS, SECTIONS, TYPES,
                         DataConfig, EvalConfig, RunConfig, TrainConfig, has_fused)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# (the run config's classes and choices, and TASKS, are imported from here too)
__all__ = ["build_config", "drop_other_types_keys", "TASKS", "RunConfig", "DataConfig",
           "TrainConfig", "EvalConfig", "OPTIMIZERS", "OPTIMIZER_IMPLS", "COMPILE_MODES",
           "has_fused"]


def _unknown(key: str) -> UserError:
    known = [f"{s}.{k}" for s in SECTIONS for k in TYPES[s]]
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return UserError(f"unknown config key {key!r}{hint}")


_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _coerce(key: str, value: Any, typ) -> Any:
    """Convert a TOML or command-line value to the field's type.

    Lists (``List[int]``) come as TOML arrays, or on the command line as
    comma-separated values: ``--set model.adaptive_cutoffs=19997,39997,199997``
    (brackets allowed).
    """
    if get_origin(typ) is Union:  # Optional[X]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        typ = next(a for a in get_args(typ) if a is not type(None))
    if get_origin(typ) in (list, List):
        (item,) = get_args(typ) or (Any,)
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("[") and text.endswith("]"):
                text = text[1:-1]
            value = [v.strip() for v in text.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{key} must be a list, e.g. {key}=1,2,3; got {value!r}")
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    try:
        if typ is bool:
            return value if isinstance(value, bool) else _BOOLS[str(value).lower()]
        if typ is int:
            if isinstance(value, (str, float)) and not math.isfinite(float(value)):
                return float(value)  # nan, inf: the section's check names the key's range
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
        if typ in (float, str):
            return typ(value)
    except (TypeError, ValueError, KeyError):
        raise UserError(f"{key} must be {typ.__name__}, got {value!r}") from None
    return value


def _probe_vocab(tree: Dict[str, Dict[str, Any]]) -> int:
    """A vocabulary size to validate the model fields with before any data is read."""
    vocab = tree["data"].get("vocab_size")
    if isinstance(vocab, int) and vocab >= 1:  # else data's own check names data.vocab_size
        return vocab
    cutoffs = tree["model"].get("adaptive_cutoffs")
    if isinstance(cutoffs, list) and cutoffs and all(isinstance(c, int) for c in cutoffs):
        return max(256, max(cutoffs) + 1)
    return 256


def drop_other_types_keys(model: Dict[str, Any], task: str,
                          keep: frozenset = frozenset()) -> None:
    """Drop model keys that do not apply to model.type, except those in ``keep``.

    For a recipe's keys once the type changed (``--set model.type=...``, or
    one of ``srupp compare``'s models): an SRU++ recipe's proj_size means
    nothing to an LSTM. Keys left in ``keep`` (given with ``--set``) are
    errors (config_from_dict's).
    """
    mtype, models = model.get("type", "srupp"), REGISTRY.get(task, {})
    if mtype in models:
        own = {f.name for f in fields(models[mtype][0])} | {"type"}
        for key in set(model) & set(TYPES["model"]) - own - keep:
            del model[key]


def _other_task(run: str, have: str, want: str, source: str, implicit: bool) -> UserError:
    """The error for a saved run of task ``have`` given a recipe or --set of task ``want``."""
    if source.startswith("recipe"):
        asks = (f"{source} is a {TASKS[want].title} recipe (task={want}"
                f"{', as it names no task' if implicit else ''})")
        fix = "resume with the run's own recipe"
    else:
        asks = f"{source} asks for a {TASKS[want].title} run"
        fix = f"drop {source} to resume"
    return UserError(f"{run} is a {TASKS[have].title} run (task={have}); {asks}: "
                     f"{fix}, or train into a new --out")


def build_config(recipe: Optional[Union[str, Path]] = None,
                 overrides: Optional[List[str]] = None,
                 base: Optional[Dict[str, Any]] = None,
                 base_name: str = "the saved run") -> RunConfig:
    """Read a recipe, apply ``key=value`` overrides and validate everything.

    Args:
        recipe: a TOML file, or None for the defaults.
        overrides: strings ``"section.key=value"``, or ``"task=translate"``.
        base: a dict in the shape of :meth:`RunConfig.to_dict` to start from
            (a saved run's config) instead of the defaults.
        base_name: what the messages call ``base`` (the run's directory).

    With ``base``, a recipe (one without a ``task`` key is a language-model
    recipe) or a ``--set task=...`` of another task than the run's is an error
    that names both tasks, before any of their keys is read.
    """
    tree: Dict[str, Dict[str, Any]] = {s: {} for s in SECTIONS}
    task = "lm"
    base_task = None
    asked = None  # (task, where it was asked for, implicit): the recipe's or --set's
    if base:
        base = dict(base)
        if "task" not in base:  # every saved config names its task
            raise UserError(f"{base_name}'s config.json is corrupt (it names no task); "
                            f"the run is damaged")
        task = base_task = base.pop("task")
        for s, vals in base.items():
            if s not in SECTIONS:
                raise _unknown(s)
            tree[s].update(vals)
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise UserError(f"recipe {str(path)!r} not found")
        try:
            data = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"recipe {path} is not valid TOML: {e}") from None
        implicit = "task" not in data
        task = data.pop("task", "lm")  # a recipe that names no task is a language model's
        if not isinstance(task, str):
            raise UserError(f"recipe {path}: task must be a string "
                            f"({', '.join(TASKS)}), got {task!r}")
        asked = (task, f"recipe {path}", implicit)
        for s, vals in data.items():
            if s not in SECTIONS or not isinstance(vals, dict):
                raise UserError(f"recipe {path}: unknown section [{s}]; "
                                f"sections are {sorted(SECTIONS)}")
            tree[s].update(vals)
    set_model_keys = set()
    for item in overrides or []:
        if "=" not in item:
            raise UserError(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        key = key.strip()
        if key == "task":
            task = value.strip()
            asked = (task, f"--set task={task}", False)
            continue
        if key.count(".") != 1 or key.split(".")[0] not in SECTIONS:
            raise _unknown(key)
        s, name = key.split(".")
        tree[s][name] = value
        if s == "model":
            set_model_keys.add(name)
    if "type" in set_model_keys:
        # --set model.type=lstm on an SRU++ recipe: the recipe's SRU++-only keys
        # no longer apply; keys given with --set still must
        drop_other_types_keys(tree["model"], task, keep=frozenset(set_model_keys))
    task_class = task_named(task)  # an unknown task: its error, before any key is read
    if asked is not None and base_task is not None and asked[0] != base_task:
        raise _other_task(base_name, base_task, *asked)
    for s in SECTIONS:
        for name, value in list(tree[s].items()):
            if name not in TYPES[s]:
                raise _unknown(f"{s}.{name}")
            tree[s][name] = _coerce(f"{s}.{name}", value, TYPES[s][name])
    tree["model"].pop("vocab_size", None)  # always taken from the tokenizer
    data = DataConfig(**tree["data"])
    # the task's defaults where the recipe leaves data.* unset
    if data.tokenizer is None:
        data.tokenizer = task_class.default_tokenizer
    if data.subword_type is None:
        data.subword_type = task_class.default_subword_type
    if data.corpus is None:
        data.corpus = task_class.default_corpus  # classify has none: its task asks for --data
    cfg = RunConfig(model=tree["model"], data=data, train=TrainConfig(**tree["train"]),
                    eval=EvalConfig(**tree["eval"]), task=task, task_class=task_class)
    task_class.check_config(cfg)
    data.check()  # the checks that need the resolved tokenizer
    # validate the model fields now; the vocabulary is only known once the tokenizer is
    # built, so vocabulary-dependent checks use data.vocab_size, or else just pass
    cfg.model_config(_probe_vocab(tree))
    return cfg
