"""``srupp compare``: SRU++ against baselines at a matched parameter count and time budget.

Every model is sized to about the same number of parameters (its depth fixed,
its width searched), trained for the same seconds on the same data, evaluated
the same way, and timed generating at batch 1. The results go to
``DIR/results.json``, ``DIR/results.md`` and ``DIR/curves.png``.

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

The default recipes and the tuned learning rates (``compare-tuned-lr.toml``,
with how they were tuned) ship with the package: ``srupp/recipes``, which in
a source checkout is the repository's ``recipes/`` directory.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from .._extras import require
from .._files import atomic_write_json, atomic_write_text
from ..errors import UserError
from ..models import parameter_counts
from .config import RunConfig, build_config
from .evaluate import metric_for

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# name -> (model.type, fixed depth or None for the recipe's, extra model fields)
MODELS: Dict[str, tuple] = {
    "srupp": ("srupp", None, {}),
    "sru": ("sru", 4, {}),
    "lstm": ("lstm", 2, {}),
    "gru": ("gru", 2, {}),
    # no segment memory: each 128-token window stands alone with learned positions
    # (GPT-style). With memory its absolute positions never repeat, and it trained
    # far worse in the 2-minute tuning runs (3.69 against 3.27 bpc; docs/results.md).
    # max_positions covers the training window and the generation test (64 + 256
    # tokens) without spending parameters on positions that are never used.
    "transformer": ("transformer", 4, {"mem_len": 0, "max_positions": 512}),
    "srupp-attn-every-2": ("srupp", None, {"attention_every_n_layers": 2}),
    "srupp-attn-last-1": ("srupp", None, {"attention_last_n_layers": 1}),
}
DEFAULT_MODELS = ["srupp", "sru", "lstm", "gru", "transformer"]
# {corpus: {model name or type: peak learning rate}}, with their provenance
TUNED_LR_FILE = "compare-tuned-lr.toml"
SETTINGS_FILE = "compare.json"  # compare's mark on a model directory it created
WIDTH_STEP = 8
MAX_WIDTH = 8192
TOLERANCE = 0.10
PROMPT_TOKENS = 64
NEW_TOKENS = 256
GENERATION_REPEATS = 3


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


def load_tuned_lr(path: Optional[Path] = None) -> Dict[str, Dict[str, float]]:
    """``{corpus: {model name or type: lr}}`` from the packaged table (or ``path``)."""
    path = Path(path) if path is not None else packaged_recipe(TUNED_LR_FILE)
    try:
        table = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid TOML: {e}") from None
    known = set(MODELS) | {mtype for mtype, _, _ in MODELS.values()}
    for corpus, rates in table.items():
        if not isinstance(rates, dict):
            raise ValueError(f"{path}: [{corpus}] must be a table of model = learning rate")
        for name, lr in rates.items():
            if name not in known:
                raise ValueError(f"{path}: [{corpus}] names unknown model {name!r}; "
                                 f"known: {', '.join(sorted(known))}")
            if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
                raise ValueError(f"{path}: [{corpus}] {name} must be a positive number, got {lr!r}")
    return {c: {n: float(v) for n, v in r.items()} for c, r in table.items()}


def parse_models(spec: Optional[str]) -> List[str]:
    names = [n.strip() for n in (spec or ",".join(DEFAULT_MODELS)).split(",") if n.strip()]
    if not names:
        raise UserError(f"--models is empty; choose from {', '.join(MODELS)}")
    for n in names:
        if n not in MODELS:
            raise UserError(f"unknown model {n!r} in --models; valid ones: {', '.join(MODELS)}")
    if len(set(names)) != len(names):
        raise UserError("--models names a model twice")
    return names


def _heads_for(d: int) -> int:
    """d/64 rounded, moved to the nearest divisor of d (at least 1)."""
    target = max(1, round(d / 64))
    return min((h for h in range(1, d + 1) if d % h == 0), key=lambda h: (abs(h - target), h))


def shape_overrides(name: str, d: int, base: RunConfig) -> Dict[str, Any]:
    """The model fields of ``name`` at width ``d``."""
    mtype, depth, extra = MODELS[name]
    fields: Dict[str, Any] = {"type": mtype, "d_model": d}
    if depth is not None:
        fields["num_layers"] = depth
    if mtype == "transformer":
        fields["num_heads"] = _heads_for(d)
    elif mtype == "srupp":
        fields["proj_size"] = max(1, d // 4)  # d' = d/4, as in the paper
        heads = int(base.model.get("num_heads", 1))
        fields["num_heads"] = heads if fields["proj_size"] % heads == 0 else 1
    fields.update(extra)
    return fields


def split_overrides(overrides: List[str], names: List[str]) -> tuple:
    """Split ``--set`` items into shared ones and ``NAME:key=value`` ones per model.

    Returns ``(shared, {name: [key=value, ...]})``. A prefix that is not one
    of the compared models is an error, so a typo cannot silently apply to none.
    """
    shared: List[str] = []
    per_model: Dict[str, List[str]] = {n: [] for n in names}
    for item in overrides:
        if ":" in item.split("=", 1)[0]:  # NAME:key=value, not a ':' in a value
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
    """``base`` with the model fields replaced, then the model's own overrides."""
    tree = base.to_dict()
    tree["model"] = {**tree["model"], **fields}
    return build_config(None, list(overrides or []), base=tree)


@dataclass
class Sized:
    name: str
    cfg: RunConfig
    params: int


def size_model(name: str, base: RunConfig, vocab: int, target: int,
               overrides: Optional[List[str]] = None) -> Sized:
    """A width whose parameter count is within 10% of ``target``, or UserError.

    Counts grow with width. Multiples of 16 are preferred, then of 8 (the
    closest count among them); only when neither fits (tiny targets) are the
    widths between two multiples of 8 tried one by one. ``overrides`` are
    this model's own ``key=value`` settings (its tuned learning rate, say).
    """
    cache: Dict[int, Optional[Sized]] = {}

    def at(d: int) -> Optional[Sized]:
        if d not in cache:
            try:
                cfg = model_run_config(base, shape_overrides(name, d, base), overrides)
                cache[d] = Sized(name, cfg, parameter_counts(cfg.model_config(vocab))["params"])
            except UserError:
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
    path = run_dir / "metrics.jsonl"
    out = []
    for ln in path.read_text().splitlines() if path.exists() else []:
        try:
            r = json.loads(ln)
        except json.JSONDecodeError:
            continue
        if key in r:
            out.append((float(r["train_seconds"]), int(r.get("step", 0)), float(r[key])))
    return out


def _generation_speed(trainer, repeats: int = GENERATION_REPEATS) -> float:
    """Tokens/s decoding NEW_TOKENS at batch 1 after a PROMPT_TOKENS validation prompt.

    The median of ``repeats`` timed runs after one untimed warm-up: a single
    run of a quarter-second is at the mercy of one scheduler hiccup.
    """
    import statistics

    import torch

    model = trainer.model
    model.eval()
    prompt = trainer.valid_ids[:PROMPT_TOKENS].tolist() or trainer.train_ids[:PROMPT_TOKENS].tolist()
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    speeds = []
    with torch.no_grad():
        for i in range(repeats + 1):
            gen = torch.Generator(device=trainer.device).manual_seed(0)
            sync()
            start = time.perf_counter()
            new = model.generate([prompt], NEW_TOKENS, temperature=1.0, generator=gen)[0]
            sync()
            if i:  # the first run warms caches and allocators
                speeds.append(len(new) / max(time.perf_counter() - start, 1e-9))
    return statistics.median(speeds)


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
    if (run_dir / "summary.json").exists():
        state = "done"
    elif (run_dir / "last.json").exists():
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
    from .trainer import Trainer

    summary_path = run_dir / "summary.json"
    if state == "done":
        print(f"srupp: {sized.name}: finished before with the same settings, skipping "
              f"({summary_path})", file=sys.stderr)
        return json.loads(summary_path.read_text())
    if state == "restart":
        shutil.rmtree(run_dir)  # compare.json shows compare created it; no checkpoint in it
    if state in ("new", "restart"):
        try:
            run_dir.mkdir(parents=True)
        except FileExistsError:
            raise UserError(f"{run_dir} appeared while compare was running; choose another "
                            f"--out") from None
        atomic_write_json(run_dir / SETTINGS_FILE, settings)
    resume = state == "resume"
    print(f"srupp: {sized.name}: {'resuming' if resume else 'training'} "
          f"{sized.params:,} parameters into {run_dir}", file=sys.stderr)
    trainer = Trainer(sized.cfg, run_dir, resume=resume, progress=progress)
    result = trainer.train()
    if result.get("interrupted"):
        raise KeyboardInterrupt
    t = sized.cfg.train
    tokens = trainer.step * t.batch_size * t.unroll * t.grad_accum
    summary = {
        "name": sized.name, "params": trainer.model.num_parameters(),
        "model": sized.cfg.model, "lr": t.lr, "step": trainer.step, "tokens": tokens,
        "train_seconds": result["train_seconds"],
        # valid_ppl always; valid_bpc only for byte and char tokenizers
        **{k: result[k] for k in ("valid_bpc", "valid_ppl") if k in result},
        "tokenizer": trainer.tokenizer.to_dict()["type"],
        "generate_tokens_per_s": _generation_speed(trainer),
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


def write_markdown(path: Path, results: Dict[str, Any]) -> None:
    cols = ["name", "params", "tokens", "tokens_per_s", "train_seconds", "final",
            "time_to_best_baseline", "time_to_transformer_final", "generate_tokens_per_s", "lr"]
    lines = [f"Validation metric: **{results['metric']}** (lower is better); the "
             f"time_to_* columns are the training seconds at which a model's validation "
             f"curve first reached the best baseline's (or the Transformer's) final value.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for m in results["models"]:
        lines.append("| " + " | ".join(_fmt(m[c]) for c in cols) + " |")
    atomic_write_text(path, "\n".join(lines) + "\n")


def plot_curves(path: Path, curves: Dict[str, List[tuple]], metric: str,
                tokens_per_step: Dict[str, int]) -> None:
    """Validation metric against training seconds (left) and training tokens (right).

    The right panel separates learning per token from speed: a model that is
    ahead per token but behind per second is held back by its throughput.
    """
    matplotlib = require("matplotlib", "plots", "srupp compare's curves.png")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_tokens) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for name, pts in curves.items():
        if pts:
            secs, steps, values = zip(*pts)
            by_time.plot(secs, values, "o-", label=name, markersize=3)
            by_tokens.plot([s * tokens_per_step[name] / 1e6 for s in steps], values, "o-",
                           label=name, markersize=3)
    finals = [pts[-1][2] for pts in curves.values() if pts]
    if finals:
        # a loss spike would squash every curve into the bottom of the plot:
        # clip the top a little above the worst final value (the spike's start
        # still shows); perplexity, on a log axis, gets more head-room
        lowest = min(v for pts in curves.values() for _, _, v in pts)
        by_time.set_ylim(lowest * 0.97, (3.0 if metric == "ppl" else 1.6) * max(finals))
    by_time.set_xlabel("training seconds")
    by_tokens.set_xlabel("training tokens (millions)")
    by_time.set_ylabel(f"validation {metric}")
    for ax in (by_time, by_tokens):
        if metric == "ppl":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    by_time.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def compare(data: str, budget: float, params: int, models: Optional[str] = None,
            out: Optional[Path] = None, recipe: Optional[str] = None,
            overrides: Optional[List[str]] = None, progress: bool = True) -> Dict[str, Any]:
    """Run the comparison; returns the results.json content."""
    names = parse_models(models)
    if not budget > 0 or not math.isfinite(budget):
        raise UserError(f"--budget must be > 0 seconds, got {budget}")
    if params <= 0:
        raise UserError(f"--params must be > 0, got {params}")
    require("matplotlib", "plots", "srupp compare's curves.png")  # before hours of training
    recipe_path = Path(recipe) if recipe else default_recipe(data)
    shared, per_model = split_overrides(list(overrides or []), names)
    base = build_config(recipe_path, shared +
                        [f"data.corpus={data}", f"train.max_seconds={budget}"])

    from ..data import build_tokenizer, load_corpus

    corpus = load_corpus(base.data.corpus)
    tokenizer = build_tokenizer(base.data.tokenizer, corpus.train, **base.data.tokenizer_options())
    vocab = tokenizer.vocab_size
    metric = metric_for(tokenizer)
    key = f"valid_{metric}"

    if not any(o.split("=", 1)[0].strip() == "train.lr" for o in shared):
        tuned = load_tuned_lr().get(str(data), {})
        for n in names:
            base_name = n if n in tuned else MODELS[n][0]
            if base_name in tuned and not any(
                    o.split("=", 1)[0].strip() == "train.lr" for o in per_model[n]):
                per_model[n] = [f"train.lr={tuned[base_name]}"] + per_model[n]
    for n in names:  # a bad per-model key fails here, not as "no shape fits"
        model_run_config(base, {}, per_model[n])
    sized = [size_model(n, base, vocab, params, per_model[n]) for n in names]  # every error before training
    out = Path(out) if out else Path("runs") / f"compare-{Path(str(data)).stem}"
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; choose a directory")
    settings = {s.name: run_settings(s, params, shared + per_model[s.name]) for s in sized}
    states = {s.name: plan_run_dir(out / s.name, settings[s.name]) for s in sized}
    out.mkdir(parents=True, exist_ok=True)

    summaries = {s.name: run_one(s, out / s.name, settings[s.name], states[s.name], progress)
                 for s in sized}
    curves = {n: _valid_curve(out / n, key) for n in names}

    baselines = [n for n in names if MODELS[n][0] != "srupp"]
    target = min((summaries[n][key] for n in baselines if summaries[n].get(key) is not None),
                 default=None)
    # the paper's claim: SRU++ reaches the Transformer's final quality in a
    # fraction of its time; compare each model's time to it with the
    # Transformer's own training seconds
    tf_final = summaries["transformer"].get(key) if "transformer" in summaries else None

    def first_time_at(n: str, level: Optional[float]) -> Optional[float]:
        return next((sec for sec, _, v in curves[n] if level is not None and v <= level), None)

    rows = []
    for n in names:
        s = summaries[n]
        rows.append({"name": n, "params": int(s["params"]), "tokens": int(s["tokens"]),
                     "tokens_per_s": s["tokens"] / max(s["train_seconds"], 1e-9),
                     "train_seconds": s["train_seconds"],
                     "final": s.get(key), "time_to_best_baseline": first_time_at(n, target),
                     "time_to_transformer_final": first_time_at(n, tf_final),
                     "generate_tokens_per_s": s["generate_tokens_per_s"],
                     "lr": s.get("lr")})
    results = {"metric": metric, "models": rows}
    atomic_write_json(out / "results.json", results)
    write_markdown(out / "results.md", results)
    tokens_per_step = {s.name: s.cfg.train.batch_size * s.cfg.train.unroll * s.cfg.train.grad_accum
                       for s in sized}
    plot_curves(out / "curves.png", curves, metric, tokens_per_step)
    return results
