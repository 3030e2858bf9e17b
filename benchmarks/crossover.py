"""Where SRU++ pays: a budget × size grid of ``srupp compare`` runs, one figure per corpus.

For each parameter count of --params and each budget of --budgets this runs

    srupp compare --data CORPUS --budget B --params P --models MODELS \
        --out OUT/b{B}-p{P} --no-progress --set train.eval_every=E train.save_every=E

(``compare`` sizes every model to P, trains each for B seconds with its tuned
settings from recipes/compare-tuned.toml, and resumes or skips what an earlier
run finished), then draws OUT/crossover.png: one column per size, validation
against training seconds (top, log axis) and against training tokens (bottom),
one colour per model and one line style per budget. It prints one JSON object:
every cell's final validation metric per model, its winner, and per size the
smallest budget at which the best SRU++ layout beats plain SRU and the
Transformer, with the margin.

The runs are long (the sum of every budget times the models, plus evaluation):
run nothing else beside them. Interrupted, run the same command again.

    .venv/bin/python benchmarks/crossover.py --corpus shakespeare \
        --budgets 120,480,1920 --params 1000000,5000000,20000000
    .venv/bin/python benchmarks/crossover.py --corpus shakespeare --plot-only   # no training
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SRUPP_MODELS = ("srupp", "srupp-attn-every-2", "srupp-attn-last-1")
STYLES = ("-", "--", ":", "-.")
COLOURS = {"srupp": "tab:red", "srupp-attn-every-2": "tab:orange", "srupp-attn-last-1": "tab:pink",
           "sru": "tab:blue", "transformer": "tab:green", "lstm": "tab:purple", "gru": "tab:brown"}


def int_list(text):
    return [int(float(v)) for v in text.split(",") if v.strip()]


def seconds_list(text):
    """Budgets in seconds: whole numbers as ints (a cell's folder is b120, not b120.0)."""
    values = [float(v) for v in text.split(",") if v.strip()]
    return [int(v) if v.is_integer() else v for v in values]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="shakespeare")
    ap.add_argument("--budgets", type=seconds_list, default=[120, 480, 1920], help="seconds")
    ap.add_argument("--params", type=int_list, default=[1_000_000, 5_000_000, 20_000_000])
    ap.add_argument("--models", default="srupp,srupp-attn-last-1,sru,transformer")
    ap.add_argument("--out", default=None, help="default: runs/crossover-CORPUS")
    ap.add_argument("--eval-every", type=int, default=100, help="steps between validations")
    ap.add_argument("--set", nargs="*", default=[], help="more compare --set overrides")
    ap.add_argument("--plot-only", action="store_true", help="draw and summarise, train nothing")
    a = ap.parse_args()
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    a.out = Path(a.out or f"runs/crossover-{a.corpus}")
    return a


def cell_dir(out: Path, budget: float, params: int) -> Path:
    return out / f"b{budget}-p{params}"


def train_cell(a, budget: float, params: int) -> None:
    srupp = Path(sys.executable).parent / "srupp"
    cmd = [str(srupp), "compare", "--data", a.corpus, "--budget", str(budget),
           "--params", str(params), "--models", ",".join(a.models),
           "--out", str(cell_dir(a.out, budget, params)), "--no-progress",
           "--set", f"train.eval_every={a.eval_every}", f"train.save_every={a.eval_every}",
           *a.set]
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def read_model(run: Path):
    """(final metric, [(seconds, tokens, value), ...]) of one model's directory, or None."""
    summary, metrics, settings = (run / n for n in ("summary.json", "metrics.jsonl",
                                                    "compare.json"))
    if not summary.exists():
        return None
    cfg = json.loads(settings.read_text())["config"]["train"]
    per_step = cfg["batch_size"] * cfg["unroll"]
    result = json.loads(summary.read_text())
    metric = next(k for k in ("bpc", "ppl") if f"valid_{k}" in metrics.read_text())
    points = []
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if f"valid_{metric}" in row and "train_seconds" in row:
            points.append((row["train_seconds"], row["step"] * per_step, row[f"valid_{metric}"]))
    return metric, result, points


def collect(a):
    """{params: {budget: {model: (final, points)}}} and the metric's name."""
    grid, metric = {}, "bpc"
    for p in a.params:
        for b in a.budgets:
            for m in a.models:
                got = read_model(cell_dir(a.out, b, p) / m)
                if got is not None:
                    metric, result, points = got
                    final = points[-1][2] if points else None
                    grid.setdefault(p, {}).setdefault(b, {})[m] = (final, points, result)
    return grid, metric


def summarise(a, grid, metric):
    cells, crossings = {}, {}
    for p, by_budget in grid.items():
        for b, models in sorted(by_budget.items()):
            finals = {m: v[0] for m, v in models.items() if v[0] is not None}
            if not finals:
                continue
            srupps = {m: f for m, f in finals.items() if m in SRUPP_MODELS}
            best_srupp = min(srupps, key=srupps.get) if srupps else None
            cell = {"final": {m: round(f, 4) for m, f in finals.items()},
                    "winner": min(finals, key=finals.get), "best_srupp_layout": best_srupp}
            for rival in ("sru", "transformer"):
                if best_srupp and rival in finals:
                    cell[f"best_srupp_minus_{rival}"] = round(srupps[best_srupp] - finals[rival], 4)
            cells[f"p{p}-b{b}"] = cell
            for rival in ("sru", "transformer"):
                key = f"best_srupp_minus_{rival}"
                if key in cell and cell[key] < 0:
                    crossings.setdefault(f"p{p}", {}).setdefault(f"beats_{rival}_from_budget", b)
    return {"corpus": a.corpus, "metric": metric, "cells": cells, "crossings": crossings}


def plot(a, grid, metric):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 - matplotlib.ticker.NullFormatter below

    sizes = sorted(grid)
    if not sizes:
        return None
    fig, axes = plt.subplots(2, len(sizes), figsize=(5 * len(sizes), 8), squeeze=False)
    for col, p in enumerate(sizes):
        top, bottom = axes[0][col], axes[1][col]
        for i, b in enumerate(sorted(grid[p])):
            for m, (final, points, _) in grid[p][b].items():
                if not points:
                    continue
                secs, toks, vals = zip(*points)
                kw = dict(color=COLOURS.get(m), linestyle=STYLES[i % len(STYLES)], marker=".",
                          markersize=3, label=f"{m}, {b} s")
                top.plot(secs, vals, **kw)
                bottom.plot([t / 1e6 for t in toks], vals, **kw)
        top.set_xscale("log")
        top.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # labels would overlap
        top.set_title(f"about {p / 1e6:g}M parameters")
        top.set_xlabel("training seconds")
        bottom.set_xlabel("training tokens (millions)")
        for ax in (top, bottom):
            ax.set_ylabel(f"validation {metric}")
            if metric == "ppl":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        finals = [v[0] for b in grid[p].values() for v in b.values() if v[0] is not None]
        if finals:  # a spike would squash the curves: clip above the worst final value
            lo = min(pt[2] for b in grid[p].values() for v in b.values() for pt in v[1])
            for ax in (top, bottom):
                ax.set_ylim(lo * 0.97, max(finals) * (2.0 if metric == "ppl" else 1.25))
        top.legend(fontsize=7)
    fig.suptitle(f"{a.corpus}: validation {metric} against time and tokens")
    fig.tight_layout()
    path = a.out / "crossover.png"
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    os.replace(tmp, path)
    plt.close(fig)
    return str(path)


def main():
    a = parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if not a.plot_only:
        for b in a.budgets:          # the short budgets first: a partial grid is still a result
            for p in a.params:
                train_cell(a, b, p)
    grid, metric = collect(a)
    out = summarise(a, grid, metric)
    out["figure"] = plot(a, grid, metric)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
