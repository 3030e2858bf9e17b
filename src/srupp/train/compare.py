"""``srupp compare``: SRU++ against baselines at a matched parameter count and time budget.

Every model is sized to about the same number of parameters (its depth fixed,
its width searched), trained for the same seconds on the same data, evaluated
the same way, and timed at inference. The results go to ``DIR/results.json``,
``DIR/results.md`` and ``DIR/curves.png``.

The task is the recipe's (``task = "lm" | "translate" | "classify"``, or
``--set task=...``); without a recipe it is language modelling with the
packaged default recipes. Per task (its models, summary, speed and columns
are its Task class's, :mod:`srupp.train.tasks`):

    lm         bits per character or perplexity (lower is better); generation
               speed: tokens/s at batch 1
    translate  BLEU (higher is better), chrF; translation speed: sentences/s
               with greedy search and with a beam of 5
    classify   macro-F1 (higher is better), accuracy; texts/s classified

Each model trains into ``DIR/<name>/``. Before its trainer starts, compare
creates that directory and writes ``compare.json`` into it: the settings the
result is made with (the ``--params`` target and the model's whole resolved
run config, which holds ``--budget``, the learning rate and every ``--set``).
Run again, compare skips a finished model (``summary.json``) and resumes an
unfinished one, but only when its settings are the same. Otherwise it refuses
before training anything, naming what differs: old figures are never reported
under new settings, and a result is never thrown away unasked (use another
``--out``, or delete that model's directory to train it again). A directory
without ``compare.json`` is not compare's: it is never touched, and compare
refuses to use it. The one directory compare removes by itself is its own
that never reached a checkpoint (nothing in it can be resumed).

The default recipes and the tuned settings (``compare-tuned.toml``: per
corpus and model, ``train.*`` and ``model.*`` keys such as the learning rate,
with how they were tuned; language modelling only) ship with the package:
``srupp/recipes``, which in a source checkout is the repository's
``recipes/`` directory.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from .._extras import require
from .._files import atomic_write_json, atomic_write_text
from ..errors import UserError
from ..models.backbones import BACKBONES
from ..models.registry import parameter_counts
from ..runs import has_checkpoint, read_json
from .config import RunConfig, build_config, drop_other_types_keys
from .registry import TASKS
from .lm import LMTask
from .lock import LOCK_FILE, locked_run_dir
from .metrics import MetricsLog
from .plots import plot_curves
from .trainer import Trainer

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# The models compare trains for each task: name -> (model.type, fixed depth or
# None for the recipe's, extra model fields); see Task.compare_models
TASK_MODELS: Dict[str, Dict[str, tuple]] = {n: t.compare_models for n, t in TASKS.items()}
MODELS = LMTask.compare_models  # the language models, which the tuned settings name
# [CORPUS.MODEL] tables of config keys (train.lr = ...), with their provenance
TUNED_FILE = "compare-tuned.toml"
# what compare sets for every model itself: the tuned table may not change it
COMPARE_OWNS = {"model.type": "--models sets it", "model.d_model": "--params sizes it",
                "train.max_seconds": "--budget sets it"}
SETTINGS_FILE = "compare.json"  # compare's mark on a model directory it created
SUMMARY_FILE = "summary.json"  # a model's result, written once its training finished
WIDTH_STEP = 8
MAX_WIDTH = 8192
TOLERANCE = 0.10


_extracted = contextlib.ExitStack()  # packaged files copied out of a zip, if ever


def packaged_recipe(name: str) -> Path:
    """The path of a recipe (or table) file shipped in ``srupp/recipes``."""
    res = importlib.resources.files("srupp").joinpath("recipes", name)
    if not res.is_file():
        raise UserError(f"no packaged recipe {name!r}; the srupp installation lacks "
                        f"srupp/recipes/{name} (reinstall srupp)")
    return res if isinstance(res, Path) else _extracted.enter_context(importlib.resources.as_file(res))


def default_recipe(data: str) -> Path:
    """brown-cpu for the Brown corpus, shakespeare-cpu (byte level) for everything else."""
    return packaged_recipe("brown-cpu.toml" if data == "brown" else "shakespeare-cpu.toml")


def load_tuned(path: Optional[Path] = None) -> Dict[str, Dict[str, Dict[str, Any]]]:
    """``{corpus: {model name or type: {"train.lr": 0.02, ...}}}`` from the packaged
    table (or ``path``).

    A table ``[CORPUS.MODEL]`` holds config keys as ``--set`` names them,
    ``train.lr = 2e-2`` (or quoted, ``"train.lr" = 2e-2``). Each key must be
    a ``train.*`` or ``model.*`` field (of that model's type), other than
    those compare sets itself (:data:`COMPARE_OWNS`), and each value must pass
    the checks a ``--set`` of it passes; otherwise ValueError naming the
    file, the table and the key.
    """
    path = Path(path) if path is not None else packaged_recipe(TUNED_FILE)
    try:
        table = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid TOML: {e}") from None
    types = {**{mtype: mtype for mtype, _, _ in MODELS.values()},
             **{name: mtype for name, (mtype, _, _) in MODELS.items()}}
    tuned: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for corpus, models in table.items():
        if not isinstance(models, dict):
            raise ValueError(f"{path}: {corpus} must be tables [{corpus}.MODEL] of config "
                             f"keys, e.g. train.lr = 1e-3")
        for name, settings in models.items():
            where = f"{path}: [{corpus}.{name}]"
            if name not in types:
                raise ValueError(f"{where} names unknown model {name!r}; "
                                 f"known: {', '.join(sorted(types))}")
            if not isinstance(settings, dict):
                raise ValueError(f"{where} must be a table of config keys, e.g. train.lr = 1e-3")
            flat = _dotted(settings)
            for key in flat:
                if key.split(".")[0] not in ("train", "model"):
                    raise ValueError(f"{where}: {key!r} is not a train.* or model.* config key")
                if key in COMPARE_OWNS:
                    raise ValueError(f"{where}: {key} cannot be tuned per model "
                                     f"({COMPARE_OWNS[key]})")
            try:  # unknown keys, types and ranges: as --set checks them, on the model's type
                build_config(None, [f"model.type={types[name]}", *_set_items(flat)])
            except UserError as e:
                raise ValueError(f"{where}: {e}") from None
            tuned.setdefault(corpus, {})[name] = flat
    return tuned


def _dotted(settings: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """TOML's nested tables as config keys: ``{"train": {"lr": x}}`` -> ``{"train.lr": x}``."""
    flat: Dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat.update(_dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _set_value(value: Any) -> str:
    """A TOML value as ``--set`` writes it: true, 0.02, adamw, 0.9,0.95."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(_set_value(v) for v in value)
    return str(value)


def _set_items(settings: Dict[str, Any]) -> List[str]:
    """``{"train.lr": 0.02}`` -> ``["train.lr=0.02"]``."""
    return [f"{key}={_set_value(value)}" for key, value in settings.items()]


def _set_key(item: str) -> str:
    """The key of a ``key=value`` item."""
    return item.split("=", 1)[0].strip()


def parse_models(spec: Optional[str], task: str = "lm") -> List[str]:
    """The ``--models`` names (default: the task's usual set); UserError for one
    that is unknown or does not apply to ``task``."""
    valid = TASKS[task].compare_models
    names = [n.strip() for n in (spec or ",".join(TASKS[task].default_compare_models)).split(",")
             if n.strip()]
    if not names:
        raise UserError(f"--models is empty; choose from {', '.join(valid)}")
    for n in names:
        if n in valid:
            continue
        if any(n in models for models in TASK_MODELS.values()):
            raise UserError(f"model {n!r} does not apply to task {task}; valid ones for "
                            f"{task}: {', '.join(valid)}")
        raise UserError(f"unknown model {n!r} in --models; valid ones for {task}: "
                        f"{', '.join(valid)}")
    if len(set(names)) != len(names):
        raise UserError("--models names a model twice")
    return names


def shape_overrides(name: str, d: int, base: RunConfig) -> Dict[str, Any]:
    """The model fields of ``name`` at width ``d`` for ``base``'s task.

    An odd ``d`` gives a config that a bidirectional encoder (d/2 units per
    direction) refuses; the width search skips such widths.
    """
    task = base.task_class
    mtype, depth, extra = task.compare_models[name]
    fields: Dict[str, Any] = {"type": mtype, "d_model": d}
    if depth is not None:
        fields.update(dict.fromkeys(task.depth_fields, depth))
    fields.update(BACKBONES[mtype].compare_fields(d, base.model))
    fields.update(extra)
    return fields


def _per_model_item(item: str) -> bool:
    """``NAME:key=value`` (a ':' before the '='), not a ':' inside a value."""
    return ":" in item.split("=", 1)[0]


def split_overrides(overrides: List[str], names: List[str]) -> tuple:
    """Split ``--set`` items into shared ones and ``NAME:key=value`` ones per model.

    Returns ``(shared, {name: [key=value, ...]})``. A prefix that is not one
    of the compared models is an error, so a typo cannot silently apply to none.
    """
    shared: List[str] = []
    per_model: Dict[str, List[str]] = {n: [] for n in names}
    for item in overrides:
        if _per_model_item(item):
            name, rest = item.split(":", 1)
            name = name.strip()
            if name not in per_model:
                raise UserError(f"--set {item!r}: {name!r} is not one of the compared models "
                                f"({', '.join(names)})")
            per_model[name].append(rest)
        else:
            shared.append(item)
    return shared, per_model


def model_run_config(base: RunConfig, fields: Dict[str, Any],
                     overrides: Optional[List[str]] = None) -> RunConfig:
    """``base`` with the model fields replaced (the recipe's keys of another type
    dropped), then the model's own overrides."""
    tree = base.to_dict()
    tree["model"] = {**tree["model"], **fields}
    drop_other_types_keys(tree["model"], base.task)
    return build_config(None, list(overrides or []), base=tree)


@dataclass
class Sized:
    name: str
    cfg: RunConfig
    params: int


def size_model(name: str, base: RunConfig, vocab: int, target: int,
               overrides: Optional[List[str]] = None,
               num_labels: Optional[int] = None) -> Sized:
    """A width whose parameter count is within 10% of ``target``, or UserError.

    Counts grow with width. Multiples of 16 are preferred, then of 8 (the
    closest count among them); only when neither fits (tiny targets) are the
    widths between two multiples of 8 tried one by one. ``overrides`` are
    this model's own ``key=value`` settings (its tuned learning rate, say);
    ``num_labels``: a classifier's number of classes.
    """
    cache: Dict[int, Optional[Sized]] = {}

    def at(d: int) -> Optional[Sized]:
        if d not in cache:
            try:
                cfg = model_run_config(base, shape_overrides(name, d, base), overrides)
                cache[d] = Sized(name, cfg,
                                 parameter_counts(cfg.model_config(vocab, num_labels))["params"])
            except ValueError:  # UserError too: a width this model refuses (odd, say)
                cache[d] = None
        return cache[d]

    lo, hi = 0, None  # widest multiple of 8 below target, narrowest above
    for d in range(WIDTH_STEP, MAX_WIDTH + 1, WIDTH_STEP):
        s = at(d)
        if s is None:
            continue
        if s.params <= target:
            lo = d
        elif hi is None:
            hi = d
        if s.params > target * (1 + TOLERANCE):
            break
    # multiples of 16, then of 8, then (sized only if reached) the widths between
    groups = ([s for d, s in cache.items() if d % 16 == 0],
              [s for d, s in cache.items() if d % 8 == 0],
              (at(d) for d in range(max(1, lo + 1), hi if hi is not None else lo + WIDTH_STEP)))
    for group in groups:
        good = [s for s in group if s is not None and abs(s.params - target) <= TOLERANCE * target]
        if good:
            return min(good, key=lambda s: abs(s.params - target))
    raise UserError(f"no shape of {name} reaches {target} parameters within 10%")


def _valid_curve(run_dir: Path, key: str) -> List[tuple]:
    """[(training seconds, step, metric), ...] from a run's metrics.jsonl."""
    return [(float(r["train_seconds"]), int(r.get("step", 0)), float(r[key]))
            for r in MetricsLog(run_dir).rows() if key in r]


def run_settings(sized: Sized, target: int, overrides: List[str]) -> Dict[str, Any]:
    """What ``compare.json`` records: the settings one model's result is made with.

    ``params_target`` and ``config`` (the resolved run config: width, budget,
    learning rate, every override) decide whether a result can be reused;
    ``overrides`` (this model's ``--set`` items) is kept for the reader.
    """
    # as it reads back from the file
    return json.loads(json.dumps({"name": sized.name, "params_target": target,
                                  "overrides": list(overrides), "config": sized.cfg.to_dict()}))


def _differences(old: Dict[str, Any], new: Dict[str, Any], show: int = 4) -> str:
    """``--params 20000 -> 30000; model.d_model 64 -> 80`` (the first ``show`` of them)."""
    def flat(cfg: Any) -> Dict[str, Any]:
        if not isinstance(cfg, dict):
            return {}
        return {f"{s}.{k}": v for s, vals in cfg.items() if isinstance(vals, dict)
                for k, v in vals.items()}

    a, b = flat(old.get("config")), flat(new["config"])
    out = []
    if old.get("params_target") != new["params_target"]:
        out.append(f"--params {old.get('params_target')} -> {new['params_target']}")
    for key in sorted(a.keys() | b.keys()):
        if a.get(key, "unset") != b.get(key, "unset"):
            label = "--budget" if key == "train.max_seconds" else key
            out.append(f"{label} {a.get(key, 'unset')} -> {b.get(key, 'unset')}")
    more = f"; and {len(out) - show} more" if len(out) > show else ""
    return "; ".join(out[:show]) + more


def plan_run_dir(run_dir: Path, settings: Dict[str, Any]) -> str:
    """What to do with one model's directory: "new", "restart", "resume" or "done".

    Raises UserError, before anything is trained, for a directory compare did
    not create (no ``compare.json``) and for a result or checkpoint made with
    other settings.
    """
    if not run_dir.exists():
        return "new"
    marker = run_dir / SETTINGS_FILE
    if not run_dir.is_dir() or not marker.is_file():
        raise UserError(f"{run_dir} exists and was not created by srupp compare (no "
                        f"{SETTINGS_FILE} in it); choose another --out, or move it away")
    try:
        old = json.loads(marker.read_text())
        if not isinstance(old, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{marker} is unreadable ({e}); choose another --out, or delete "
                        f"{run_dir} to train {settings['name']} again") from None
    if (run_dir / SUMMARY_FILE).exists():
        state = "done"
    elif has_checkpoint(run_dir):
        state = "resume"
    else:
        return "restart"  # compare's own, never checkpointed: nothing to keep
    if old.get("params_target") != settings["params_target"] or old.get("config") != settings["config"]:
        what = "result" if state == "done" else "unfinished run"
        raise UserError(f"{run_dir} holds {settings['name']}'s {what} made with other settings "
                        f"({_differences(old, settings)}); choose another --out, or delete "
                        f"{run_dir} to train {settings['name']} again with these")
    return state


def run_one(sized: Sized, run_dir: Path, settings: Dict[str, Any], state: str,
            progress: bool) -> Dict[str, Any]:
    """Train, resume or skip one model as ``state`` (from :func:`plan_run_dir`) says.

    Returns its summary.json content.
    """

    summary_path = run_dir / SUMMARY_FILE
    if state == "new":
        try:
            run_dir.mkdir(parents=True)
        except FileExistsError:
            raise UserError(f"{run_dir} appeared while compare was running; choose another "
                            f"--out") from None
    if state != "done":
        # one writer: another compare or srupp train on this directory refuses, and so
        # does this one while another holds it
        with locked_run_dir(run_dir):
            if state != "new":  # as it is now, not as when planned
                state = plan_run_dir(run_dir, settings)
            if state != "done":
                return _train_one(sized, run_dir, settings, state, progress)
    print(f"srupp: {sized.name}: finished before with the same settings, skipping "
          f"({summary_path})", file=sys.stderr)
    return read_json(summary_path, "compare's summary")


def _train_one(sized: Sized, run_dir: Path, settings: Dict[str, Any], state: str,
               progress: bool) -> Dict[str, Any]:
    """run_one's training, with the directory locked."""
    summary_path = run_dir / SUMMARY_FILE
    if state == "restart":  # compare.json shows compare created it; no checkpoint in it
        for child in run_dir.iterdir():
            if child.name == LOCK_FILE:  # held: stays (see srupp.train.lock)
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    if state in ("new", "restart"):
        atomic_write_json(run_dir / SETTINGS_FILE, settings)
    resume = state == "resume"
    print(f"srupp: {sized.name}: {'resuming' if resume else 'training'} "
          f"{sized.params:,} parameters into {run_dir}", file=sys.stderr)
    trainer = Trainer(sized.cfg, run_dir, resume=resume, progress=progress)
    result = trainer.train()
    if result.get("interrupted"):
        raise KeyboardInterrupt
    summary = {
        "name": sized.name, "params": trainer.model.num_parameters(),
        "model": sized.cfg.model, "lr": sized.cfg.train.lr, "step": trainer.step,
        "train_seconds": result["train_seconds"],
        "tokenizer": trainer.tokenizer.to_dict()["type"],
        **trainer.task.compare_results(result, trainer.step, trainer.tokens_seen),
        **trainer.task.speed(trainer.model, trainer.device, trainer.precision),
    }
    atomic_write_json(summary_path, summary)
    return summary


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


# results.md's and results.json's first columns, for every task; the task's follow
COMMON_COLUMNS = ("name", "params", "tokens", "tokens_per_s", "train_seconds", "final")


def first_time_at(curve: Sequence[tuple], level: Optional[float],
                  higher_is_better: bool = False) -> Optional[float]:
    """The training seconds of the first point of ``curve`` ((seconds, step, value), ...)
    at ``level`` or better (>= when higher is better, else <=); None if none is."""
    if level is None:
        return None
    reached = (lambda v: v >= level) if higher_is_better else (lambda v: v <= level)
    return next((sec for sec, _, v in curve if reached(v)), None)


def best_value(values: Sequence[Optional[float]], higher_is_better: bool = False
               ) -> Optional[float]:
    """The best of ``values`` (None ignored): the highest or the lowest; None if none."""
    known = [v for v in values if v is not None]
    if not known:
        return None
    return max(known) if higher_is_better else min(known)


def write_markdown(path: Path, results: Dict[str, Any], base: Optional[RunConfig] = None) -> None:
    """``results`` as a table under a line that says what the metric is; ``base``
    (the compared run config) names the translation evaluation's settings."""
    metric = results["metric"]
    task = TASKS[results["task"]]
    cols = [*COMMON_COLUMNS, *task.compare_columns, "lr"]
    lines = [task.compare_note(metric, base), "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for m in results["models"]:
        lines.append("| " + " | ".join(_fmt(m.get(c)) for c in cols) + " |")
    atomic_write_text(path, "\n".join(lines) + "\n")


def _task_set(overrides: Sequence[str]) -> Optional[str]:
    """The task a ``--set task=...`` item names (the last one), or None."""
    tasks = [o.split("=", 1)[1].strip() for o in overrides
             if "=" in o and _set_key(o) == "task"]
    return tasks[-1] if tasks else None


def _sizing_data(base: RunConfig) -> tuple:
    """(vocabulary size, number of labels or None, metric) of ``base``'s data.

    The tokenizer is built by the task, as the trainer builds it (``load(None)``):
    a language model's from the training text, translation's joint SentencePiece
    on both columns of the training split, classification's on the training
    texts, with the training labels.
    """
    task = base.task_class(base)
    task.load(None)
    labels = getattr(task, "labels", None)
    return task.tokenizer.vocab_size, None if labels is None else len(labels), task.metric


def compare(data: str, budget: float, params: int, models: Optional[str] = None,
            out: Optional[Path] = None, recipe: Optional[str] = None,
            overrides: Optional[List[str]] = None, progress: bool = True) -> Dict[str, Any]:
    """Run the comparison; returns the results.json content.

    The task is ``recipe``'s (or a ``task=...`` override's). Without a recipe:
    the packaged language-modelling recipe for ``data``, or, when an override
    names another task, the built-in defaults (the LM recipe's model does not
    fit a translation or classification model).
    """
    if not budget > 0 or not math.isfinite(budget):
        raise UserError(f"--budget must be > 0 seconds, got {budget}")
    if params <= 0:
        raise UserError(f"--params must be > 0, got {params}")
    require("matplotlib", "plots", "srupp compare's curves.png")  # before hours of training
    items = list(overrides or [])
    asked = TASKS.get(_task_set([o for o in items if not _per_model_item(o)]) or "lm")
    if recipe:
        recipe_path: Optional[Path] = Path(recipe)
    elif asked is not None and asked.packaged_compare_defaults:
        recipe_path = default_recipe(data)
    else:
        recipe_path = None
    base = build_config(recipe_path, [o for o in items if not _per_model_item(o)] +
                        [f"data.corpus={data}", f"train.max_seconds={budget}"])
    task = base.task_class
    names = parse_models(models, base.task)
    shared, per_model = split_overrides(items, names)

    if task.packaged_compare_defaults:
        # the tuned settings are for language modelling on the corpora named in the table:
        # a model's type's, then its own over them; a key given with --set, shared or
        # this model's, wins over the table
        tuned = load_tuned().get(str(data), {})
        shared_keys = {_set_key(o) for o in shared}
        for n in names:
            settings = {**tuned.get(task.compare_models[n][0], {}), **tuned.get(n, {})}
            given = shared_keys | {_set_key(o) for o in per_model[n]}
            per_model[n] = _set_items({k: v for k, v in settings.items()
                                       if k not in given}) + per_model[n]
    for n in names:  # a bad per-model key fails here, not as "no shape fits"
        model_run_config(base, {}, per_model[n])

    vocab, num_labels, metric = _sizing_data(base)
    key = f"valid_{metric}"
    higher = task.higher_is_better
    sized = [size_model(n, base, vocab, params, per_model[n], num_labels)
             for n in names]  # every error before training
    out = Path(out) if out else Path("runs") / f"compare-{Path(str(data)).stem}"
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; choose a directory")
    settings = {s.name: run_settings(s, params, shared + per_model[s.name]) for s in sized}
    states = {s.name: plan_run_dir(out / s.name, settings[s.name]) for s in sized}
    out.mkdir(parents=True, exist_ok=True)

    summaries = {s.name: run_one(s, out / s.name, settings[s.name], states[s.name], progress)
                 for s in sized}
    curves = {n: _valid_curve(out / n, key) for n in names}

    types = task.compare_models
    target = best_value([summaries[n].get(key) for n in names if types[n][0] != "srupp"],
                        higher)
    # the paper's claim: SRU++ reaches the Transformer's final quality in a
    # fraction of its time; compare each model's time to it with the
    # Transformer's own training seconds
    tf_final = summaries["transformer"].get(key) if "transformer" in summaries else None

    rows = []
    for n in names:
        s = summaries[n]
        row = {"name": n, "params": int(s["params"]), "tokens": int(s["tokens"]),
               "tokens_per_s": s["tokens"] / max(s["train_seconds"], 1e-9),
               "train_seconds": s["train_seconds"], "final": s.get(key),
               "time_to_best_baseline": first_time_at(curves[n], target, higher),
               "time_to_transformer_final": first_time_at(curves[n], tf_final, higher)}
        # the task's columns: its metrics (valid_<name> in the summary) and speeds
        row.update({c: s.get(c, s.get(f"valid_{c}")) for c in task.compare_columns
                    if c not in row})
        row["lr"] = s.get("lr")
        rows.append(row)
    results = {"task": base.task, "metric": metric, "models": rows}
    atomic_write_json(out / "results.json", results)
    write_markdown(out / "results.md", results, base)
    # each model's mean (the sentence tasks' steps read varying numbers of tokens)
    tokens_per_step = {n: summaries[n]["tokens"] / max(summaries[n]["step"], 1) for n in names}
    plot_curves(out / "curves.png", curves, metric, tokens_per_step,
                higher_is_better=higher)
    return results
