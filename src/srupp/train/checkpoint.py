"""Checkpoints: written atomically, read without executing code.

The run directory's layout, and every reader of it, are :mod:`srupp.runs`'s;
this module writes checkpoints into it and reads back what only a resumed run
needs: ``trainer.pt`` (optimiser, schedule, RNG, data position; read with
``weights_only=True``), the carried state (``state.safetensors``, the
SRUppState or TensorState written by :func:`srupp.models.save_state`), and
the saved model config that a resumed run's model must match in shape.

A checkpoint folder is complete before a pointer names it, and pointers are
replaced with ``os.replace``, so a kill at any moment leaves the previous
checkpoint intact. Folders no pointer names are removed after each save.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from .._files import atomic_write_json, torch_save, write_error
from .._format import check_format_version, with_format_version
from ..errors import UserError
from ..runs import (CARRIED_STATE, MODEL_CONFIG, TRAINER_STATE, pointer_path, pointer_step,
                    read_json, referenced_checkpoints)


def save_checkpoint(run_dir: Path, step: int, model, carried_state, trainer_state: Dict[str, Any],
                    *, files: Optional[Dict[str, Any]] = None,
                    pointers: Tuple[str, ...] = ("last",), info: Optional[dict] = None) -> Path:
    """Write ``ckpt-<step>`` and point ``pointers`` (e.g. "last", "best") at it.

    ``files``: ``{name: JSON}`` saved beside the model (the tokenizer, a
    classifier's labels), so that the folder stands on its own.

    A folder for ``step`` that a pointer names already holds this run's weights,
    state and data position at ``step``; only its ``trainer.pt`` is replaced
    (atomically), since the trainer's bookkeeping, such as the best validation
    loss, may have changed since (a final evaluation at a step saved before
    it). A folder no pointer names was left by a save that a kill cut short
    before its pointer, maybe by a run resumed since with other settings: it
    is written again.
    """
    from ..models.state import save_state

    name = f"ckpt-{step:06d}"
    final = run_dir / name
    referenced = referenced_checkpoints(run_dir)
    created, pointed = False, []
    try:
        trainer_state = with_format_version(trainer_state)
        if final.exists() and (referenced is None or name in referenced):
            torch_save(trainer_state, final / TRAINER_STATE)
        else:
            tmp = run_dir / f".{name}.tmp"
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
                model.save_pretrained(tmp)
                for file_name, content in (files or {}).items():
                    atomic_write_json(tmp / file_name, content)
                if carried_state is not None:
                    save_state(carried_state, tmp / CARRIED_STATE)
                torch_save(trainer_state, tmp / TRAINER_STATE)
                shutil.rmtree(final, ignore_errors=True)  # a stale folder no pointer names
                os.replace(tmp, final)
                created = True
            finally:
                shutil.rmtree(tmp, ignore_errors=True)  # only left by a save that failed
        for p in pointers:
            atomic_write_json(pointer_path(run_dir, p),
                              with_format_version({"dir": name, "step": step, **(info or {})}))
            pointed.append(p)
    except BaseException as e:
        kept = referenced_checkpoints(run_dir)
        if created and kept is not None and name not in kept:  # no pointer names it yet
            shutil.rmtree(final, ignore_errors=True)
        err = write_error(e, run_dir)
        if err is None:
            raise
        raise _not_saved(err, run_dir, step, pointed) from e
    keep = referenced_checkpoints(run_dir)
    if keep is not None:  # never delete on doubt
        for d in run_dir.glob("ckpt-*"):
            if d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)
        for d in run_dir.glob(".ckpt-*.tmp"):  # saves a kill cut short
            shutil.rmtree(d, ignore_errors=True)
    return final


def _not_saved(err: OSError, run_dir: Path, step: int, pointed: list) -> OSError:
    """``err``, saying what was not saved and where a resumed run continues."""
    last = None
    with contextlib.suppress(OSError, UserError):
        last = pointer_step(run_dir, "last")
    kept = (f"--resume continues from step {last}" if last is not None
            else "no checkpoint was saved before it")
    what = f"checkpoint of step {step} not saved"
    if pointed:  # the folder is complete and named; a later pointer failed
        what = f"step {step} saved, {', '.join(pointed)}.json updated, the rest not"
    return OSError(err.errno, f"{err.strerror or os.strerror(err.errno or 0)} ({what}; {kept})",
                   err.filename, None, err.filename2)


def load_trainer_state(ckpt: Path) -> Dict[str, Any]:
    """What a resumed run needs beyond the weights: ``ckpt``'s ``trainer.pt``."""
    f = Path(ckpt) / TRAINER_STATE
    try:
        state = torch.load(f, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise UserError(f"{ckpt} has no {TRAINER_STATE}; cannot resume from it") from None
    except Exception as e:  # truncated zip, bad pickle opcode...
        raise UserError(f"{f} is truncated or corrupt "
                        f"({str(e).splitlines()[0][:200]})") from None
    if not isinstance(state, dict):
        raise UserError(f"{f} is corrupt (expected a dict); cannot resume from it")
    check_format_version(state, f)
    return state


def load_carried_state(ckpt: Path):
    """The SRUppState or TensorState a checkpoint carries, or None when it has none."""
    from ..models.state import load_state

    f = ckpt / CARRIED_STATE
    if not f.exists():
        return None
    try:
        return load_state(f)
    except ValueError as e:  # its message names the file and what is wrong with it
        raise UserError(str(e)) from None


def _param_shapes(config: Dict[str, Any]) -> Optional[Dict[str, tuple]]:
    """The parameters' shapes of the model ``config`` describes; None for an invalid config."""
    from ..models import build_model

    try:
        with torch.device("meta"):  # shapes without allocating
            model = build_model(dict(config))
    except (ValueError, TypeError):
        return None
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _fmt_value(v: Any) -> str:
    """A config value as ``--set`` takes it."""
    if v is None:
        return "none"
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return str(v).lower() if isinstance(v, bool) else str(v)


def check_same_shape(run_dir: Path, ckpt: Path, model_config) -> None:
    """Refuse a resumed run whose model config would change the saved model's shape.

    Names each model key that does, with the saved value and the new one;
    keys that change no shape (dropout, mem_len, ...) may change on resume.
    """
    path = ckpt / MODEL_CONFIG
    saved = read_json(path, "model config")
    new = model_config.to_dict()
    if not isinstance(saved, dict):
        return  # the loader says what is wrong with it
    check_format_version(saved, path)
    # the new config's fields only: a save holds more (its save id, format version)
    saved = {k: saved[k] for k in new if k in saved}
    changed = [k for k in new if k in saved and new[k] != saved[k]]
    if not changed:
        return
    if "type" in changed:
        culprits = ["type"]  # another model altogether
    else:
        before = _param_shapes(saved)
        if before is None or _param_shapes(new) == before:
            return  # a config the loader refuses (it says why), or the same shapes
        # each key that changes a shape on its own; all changed keys if only together
        culprits = [k for k in changed if _param_shapes({**saved, k: new[k]}) != before]
    which = ", ".join(f"model.{k}={_fmt_value(saved[k])}, not {_fmt_value(new[k])}"
                      for k in (culprits or changed))
    raise UserError(f"{run_dir} was trained with {which}: a resumed run keeps its model's "
                    f"shape; drop the change, or train a new run into another --out")
