"""The run directory: where a training run keeps its config, tokenizer and checkpoints.

Every reader of a run (the trainer when it resumes, the CLI, inference, the
Hugging Face and ONNX exports) finds its files here, and nowhere else::

    RUN_DIR/
      config.json            the resolved run config
      tokenizer.json         the tokenizer and its vocabulary
      labels.json            classification: the labels, in the model's output order
      ckpt-000500/           a checkpoint folder that stands on its own: model.safetensors,
                             config.json (the model's), tokenizer.json, labels.json,
                             state.safetensors (the carried recurrent state, if any),
                             trainer.pt (optimiser, schedule, RNG, data position)
      last.json, best.json   pointers: {"dir": "ckpt-000500", "step": 500, ...}

The run config, the pointers, the model's config and each checkpoint's
``trainer.pt`` carry ``format_version`` (:mod:`srupp._format`); every reader
checks it (the ones here, :func:`srupp.models.load_model` and the trainer's
:func:`~srupp.train.checkpoint.load_trainer_state`), so a run written by a
srupp that reads it differently is one clear error.

A checkpoint folder is complete before a pointer names it, and pointers are
replaced atomically (:mod:`srupp.train.checkpoint` writes them), so a kill at
any moment leaves the previous checkpoint intact.

This module sits at the bottom of the package: it reads paths and JSON and
imports nothing above :mod:`srupp.errors` and :mod:`srupp._format`; building a model or a tokenizer from
what it finds is for the callers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Union

from ._format import check_format_version, without_format_version
from .errors import UserError

PathLike = Union[str, Path]

POINTERS = ("last", "best")
MODEL_FILE = "model.safetensors"
RUN_CONFIG = "config.json"
MODEL_CONFIG = "config.json"   # in a checkpoint folder: the model's config
TOKENIZER = "tokenizer.json"
LABELS = "labels.json"
TRAINER_STATE = "trainer.pt"
CARRIED_STATE = "state.safetensors"


def read_json(path: PathLike, what: str) -> Any:
    """The JSON in ``path``; a missing or corrupt file is a UserError naming ``what``."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{what} {path} is corrupt ({e})") from None


def is_checkpoint(path: PathLike) -> bool:
    """True when ``path`` is a checkpoint folder (it holds a model)."""
    return (Path(path) / MODEL_FILE).exists()


def read_pointer(ptr: PathLike) -> dict:
    """A pointer file's JSON ({"dir": ..., "step": ...}), its format version checked."""
    saved = read_json(ptr, "checkpoint pointer")
    if not isinstance(saved, dict) or not isinstance(saved.get("dir"), str):
        raise UserError(f"{ptr} is corrupt (expected {{\"dir\": ...}}); the run is damaged")
    check_format_version(saved, ptr)
    return saved


def pointer_path(run_dir: PathLike, pointer: str = "last") -> Path:
    """The file of ``pointer`` ("last" or "best") in ``run_dir``."""
    return Path(run_dir) / f"{pointer}.json"


def has_checkpoint(run_dir: PathLike) -> bool:
    """True when ``run_dir`` holds a run that saved a checkpoint (its last.json exists)."""
    return pointer_path(run_dir, "last").exists()


def pointer_step(run_dir: PathLike, pointer: str = "last") -> Any:
    """The step ``pointer`` names in ``run_dir``, or None without that pointer."""
    ptr = pointer_path(run_dir, pointer)
    return read_pointer(ptr).get("step") if ptr.exists() else None


def referenced_checkpoints(run_dir: PathLike) -> Optional[set]:
    """The checkpoint folders the pointers name; None when a pointer cannot be read
    (a caller deleting folders must then keep them all)."""
    names = set()
    for p in POINTERS:
        ptr = pointer_path(run_dir, p)
        if ptr.exists():
            try:
                names.add(read_pointer(ptr)["dir"])
            except UserError:
                return None
    return names


def resolve_checkpoint(path: PathLike, prefer: str = "best") -> Path:
    """The checkpoint folder of a run directory (``prefer``, else last, else best),
    or ``path`` itself when it is a checkpoint folder."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise UserError(f"{path} is not a run directory or checkpoint folder")
    for p in (prefer, *POINTERS):
        ptr = pointer_path(path, p)
        if ptr.exists():
            d = path / read_pointer(ptr)["dir"]
            if not is_checkpoint(d):
                raise UserError(f"{ptr} names {d.name}, which holds no model; "
                                f"the run is damaged")
            return d
    raise UserError(f"{path} holds no checkpoint (no last.json or best.json, "
                    f"no {MODEL_FILE})")


def read_run_config(run_dir: PathLike) -> dict:
    """A run directory's ``config.json`` (what ``build_config(base=...)`` reads), its format
    version checked and left out."""
    f = Path(run_dir) / RUN_CONFIG
    saved = read_json(f, "run config")
    if not isinstance(saved, dict):
        raise UserError(f"{f} is corrupt (expected a JSON object); the run is damaged")
    check_format_version(saved, f)
    return without_format_version(saved)


def run_config(ckpt: PathLike) -> dict:
    """The run config of the run a checkpoint folder belongs to ({} for a folder on its own)."""
    run_dir = Path(ckpt).parent
    if (run_dir / RUN_CONFIG).exists() and any(pointer_path(run_dir, p).exists()
                                               for p in POINTERS):
        return read_run_config(run_dir)
    return {}


def read_run_files(run_dir: PathLike, names: Iterable[str]) -> Dict[str, Any]:
    """``{name: JSON}`` of files saved beside the run config (a task's tokenizer.json,
    labels.json), for a resumed run."""
    return {name: read_json(Path(run_dir) / name, name.split(".")[0]) for name in names}


def tokenizer_json(ckpt: PathLike) -> dict:
    """The saved tokenizer (its JSON) of a checkpoint folder."""
    return read_json(Path(ckpt) / TOKENIZER, "tokenizer")


def labels_from_json(saved: Any, where: object) -> List[str]:
    """The label list of a ``labels.json`` ({"labels": [...]})."""
    labels = saved.get("labels") if isinstance(saved, dict) else None
    if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
        raise UserError(f"{where} is corrupt (expected {{\"labels\": [...]}}); the run is damaged")
    return labels


def load_labels(ckpt: PathLike) -> List[str]:
    """A classifier's labels, in its output order, from its checkpoint folder."""
    f = Path(ckpt) / LABELS
    return labels_from_json(read_json(f, "labels"), f)
