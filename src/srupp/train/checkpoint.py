"""Checkpoints: written atomically, read without executing code.

A run directory holds one folder per saved step plus two pointer files::

    RUN_DIR/
      config.json            the resolved run config
      tokenizer.json         the tokenizer and its vocabulary
      labels.json            classification: the labels, in the model's output order
      ckpt-000500/           model.safetensors, config.json (model), tokenizer.json, labels.json,
                             state.safetensors (the carried SRUppState or TensorState, written
                             by srupp.models.save_state), trainer.pt
                             (optimiser, scheduler, RNG, data position; read with
                             weights_only=True): a folder that stands on its own
      last.json, best.json   {"dir": "ckpt-000500", "step": 500, ...}

A checkpoint folder is complete before a pointer names it, and pointers are
replaced with ``os.replace``, so a kill at any moment leaves the previous
checkpoint intact. Folders no pointer names are removed after each save.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from .._files import atomic_write_json, torch_save, write_error
from ..errors import UserError


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{what} {path} is corrupt ({e})") from None


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
    referenced = _referenced(run_dir)
    created, pointed = False, []
    try:
        if final.exists() and (referenced is None or name in referenced):
            torch_save(trainer_state, final / "trainer.pt")
        else:
            tmp = run_dir / f".{name}.tmp"
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
                model.save_pretrained(tmp)
                for file_name, content in (files or {}).items():
                    atomic_write_json(tmp / file_name, content)
                if carried_state is not None:
                    save_state(carried_state, tmp / "state.safetensors")
                torch_save(trainer_state, tmp / "trainer.pt")
                shutil.rmtree(final, ignore_errors=True)  # a stale folder no pointer names
                os.replace(tmp, final)
                created = True
            finally:
                shutil.rmtree(tmp, ignore_errors=True)  # only left by a save that failed
        for p in pointers:
            atomic_write_json(run_dir / f"{p}.json", {"dir": name, "step": step, **(info or {})})
            pointed.append(p)
    except BaseException as e:
        kept = _referenced(run_dir)
        if created and kept is not None and name not in kept:  # no pointer names it yet
            shutil.rmtree(final, ignore_errors=True)
        err = write_error(e, run_dir)
        if err is None:
            raise
        raise _not_saved(err, run_dir, step, pointed) from e
    keep = _referenced(run_dir)
    if keep is not None:  # never delete on doubt
        for d in run_dir.glob("ckpt-*"):
            if d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)
        for d in run_dir.glob(".ckpt-*.tmp"):  # saves a kill cut short
            shutil.rmtree(d, ignore_errors=True)
    return final


def _not_saved(err: OSError, run_dir: Path, step: int, pointed: list) -> OSError:
    """``err``, saying what was not saved and where a resumed run continues."""
    try:
        last = json.loads((run_dir / "last.json").read_text())["step"]
        kept = f"--resume continues from step {last}"
    except (OSError, ValueError, KeyError, TypeError):
        kept = "no checkpoint was saved before it"
    what = f"checkpoint of step {step} not saved"
    if pointed:  # the folder is complete and named; a later pointer failed
        what = f"step {step} saved, {', '.join(pointed)}.json updated, the rest not"
    return OSError(err.errno, f"{err.strerror or os.strerror(err.errno or 0)} ({what}; {kept})",
                   err.filename, None, err.filename2)


def _referenced(run_dir: Path) -> Optional[set]:
    """The folders "last" and "best" name; None when a pointer cannot be read."""
    names = set()
    for p in ("last", "best"):
        ptr = run_dir / f"{p}.json"
        if ptr.exists():
            try:
                names.add(json.loads(ptr.read_text())["dir"])
            except (json.JSONDecodeError, KeyError, TypeError):
                return None
    return names


def resolve_checkpoint(path: Path, prefer: str = "best") -> Path:
    """A checkpoint folder from a run directory (its best, else last) or a folder itself."""
    path = Path(path)
    if (path / "model.safetensors").exists():
        return path
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist")
    for p in (prefer, "last", "best"):
        ptr = path / f"{p}.json"
        if ptr.exists():
            d = path / read_json(ptr, "checkpoint pointer")["dir"]
            if not d.exists():
                raise UserError(f"{ptr} names {d.name}, which is missing; the run is damaged")
            return d
    raise UserError(f"{path} holds no checkpoint (no last.json or best.json, no model.safetensors)")


def load_trainer_state(ckpt: Path) -> Dict[str, Any]:
    try:
        return torch.load(ckpt / "trainer.pt", weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise UserError(f"{ckpt} has no trainer.pt; cannot resume from it") from None
    except Exception as e:  # truncated zip, bad pickle opcode...
        raise UserError(f"{ckpt / 'trainer.pt'} is truncated or corrupt "
                        f"({str(e).splitlines()[0][:200]})") from None


def load_carried_state(ckpt: Path):
    """The SRUppState or TensorState a checkpoint carries, or None when it has none."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    from ..models.state import CLASS_KEY, load_state, state_from_dict

    f = ckpt / "state.safetensors"
    if not f.exists():
        return None
    try:
        with safe_open(str(f), framework="pt") as h:
            names_its_class = CLASS_KEY in (h.metadata() or {})
        if not names_its_class:  # saved before state files named their class: the keys tell
            return state_from_dict(load_file(str(f)))
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{f} is truncated or corrupt ({str(e).splitlines()[0]})") from None
    try:
        return load_state(f)
    except ValueError as e:  # its message names the file and what is wrong with it
        raise UserError(str(e)) from None


def load_run(path, *, device="cpu", prefer: str = "best"):
    """Everything inference needs from a run directory or a checkpoint folder.

    Returns ``(run_config_dict, tokenizer, model, checkpoint_dir)``; the model is in eval mode.
    """
    from ..data import tokenizer_from_dict
    from ..models import load_model

    ckpt = resolve_checkpoint(Path(path), prefer=prefer)
    tok_file = ckpt / "tokenizer.json"
    if not tok_file.exists():  # older layout: the run directory's copy
        tok_file = ckpt.parent / "tokenizer.json"
    tokenizer = tokenizer_from_dict(read_json(tok_file, "tokenizer"))
    run_cfg_file = ckpt.parent / "config.json"
    run_cfg = read_json(run_cfg_file, "run config") if (
        run_cfg_file.exists() and (ckpt.parent / "last.json").exists()) else {}
    model = load_model(ckpt, device=device)
    if model.config.vocab_size != tokenizer.vocab_size:
        raise UserError(f"{ckpt}: the model's vocabulary ({model.config.vocab_size}) does not "
                        f"match its tokenizer ({tokenizer.vocab_size}); the run is damaged")
    return run_cfg, tokenizer, model, ckpt


def load_labels(ckpt: Path) -> list:
    """A classifier's labels, in its output order, from its checkpoint folder (or the run's)."""
    f = Path(ckpt) / "labels.json"
    if not f.exists():
        f = Path(ckpt).parent / "labels.json"
    return labels_from_json(read_json(f, "labels"), f)


def labels_from_json(saved: Any, where) -> list:
    """The label list of a ``labels.json`` ({"labels": [...]})."""
    labels = saved.get("labels") if isinstance(saved, dict) else None
    if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
        raise UserError(f"{where} is corrupt (expected {{\"labels\": [...]}}); the run is damaged")
    return labels
