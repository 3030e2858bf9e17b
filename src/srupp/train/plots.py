"""The curves a run and a comparison draw (``curves.png``), with matplotlib (``srupp[plots]``).

:func:`run_curves`: one run's training and validation curves against step
(the trainer, at the end of a run). :func:`plot_curves`: several runs'
validation curves against training seconds and tokens (``srupp compare``).
Both read metrics in their units: bits per character (``bpc``), perplexity
(``ppl``, on a log axis), or a metric where higher is better (BLEU, macro-F1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Sequence

from .._extras import require
from .._files import atomic_path
from .lm import LOSS_UNITS


def pyplot(what: str):
    """matplotlib.pyplot, drawing to files (Agg); MissingExtra names ``srupp[plots]``."""
    matplotlib = require("matplotlib", "plots", what)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    plt = pyplot("curves.png")
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=100, format="png")
    finally:
        plt.close(fig)
    return path


def _value_axis(ax, metric: str) -> None:
    if metric == "ppl":  # BLEU and F1 are bounded, and read on a plain scale
        ax.set_yscale("log")
    ax.grid(alpha=0.3)


def run_curves(path: Path, rows: Sequence[Dict[str, Any]], metric: str) -> Path:
    """Write one run's curves from its metrics.jsonl ``rows`` to ``path``.

    A language model (``metric`` bpc or ppl): training and validation loss in
    the metric's unit against step. Otherwise the loss in nats (translation:
    per target token; classification: per text), and the validation
    ``metric`` (BLEU, macro-F1) in a panel beside it.
    """
    plt = pyplot("curves.png")
    value, label = LOSS_UNITS.get(metric, (lambda loss: loss, "loss (nats)"))
    train = [(r["step"], value(r["train_loss"])) for r in rows if "train_loss" in r]
    valid = [(r["step"], value(r["valid_loss"])) for r in rows if "valid_loss" in r]
    scores = [(r["step"], r[f"valid_{metric}"]) for r in rows
              if metric not in LOSS_UNITS and f"valid_{metric}" in r]
    fig, axes = plt.subplots(1, 2 if scores else 1, figsize=(12 if scores else 7, 4.5),
                             squeeze=False)
    ax = axes[0][0]
    if train:
        ax.plot(*zip(*train), label="train", alpha=0.8)
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    _value_axis(ax, metric)
    ax.legend()
    if scores:
        axes[0][1].plot(*zip(*scores), "o-")
        axes[0][1].set_xlabel("step")
        axes[0][1].set_ylabel(f"validation {metric}")
        _value_axis(axes[0][1], metric)
    fig.tight_layout()
    return _save(fig, path)


def plot_curves(path: Path, curves: Dict[str, List[tuple]], metric: str,
                tokens_per_step: Dict[str, float], *, higher_is_better: bool = False) -> None:
    """Validation metric against training seconds (left) and training tokens (right).

    ``curves``: ``{model name: [(seconds, step, value), ...]}``. The right panel
    separates learning per token from speed: a model that is ahead per token
    but behind per second is held back by its throughput. For the sentence
    tasks, whose steps read varying numbers of tokens, ``tokens_per_step`` is
    each model's mean.
    """
    plt = pyplot("srupp compare's curves.png")
    fig, (by_time, by_tokens) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for name, pts in curves.items():
        if pts:
            secs, steps, values = zip(*pts)
            by_time.plot(secs, values, "o-", label=name, markersize=3)
            by_tokens.plot([s * tokens_per_step[name] / 1e6 for s in steps], values, "o-",
                           label=name, markersize=3)
    finals = [pts[-1][2] for pts in curves.values() if pts]
    if finals and not higher_is_better:
        # a loss spike would squash every curve into the bottom of the plot:
        # clip the top a little above the worst final value (the spike's start
        # still shows); perplexity, on a log axis, gets more head-room
        lowest = min(v for pts in curves.values() for _, _, v in pts)
        by_time.set_ylim(lowest * 0.97, (3.0 if metric == "ppl" else 1.6) * max(finals))
    by_time.set_xlabel("training seconds")
    by_tokens.set_xlabel("training tokens (millions)")
    by_time.set_ylabel(f"validation {metric}")
    for ax in (by_time, by_tokens):
        _value_axis(ax, metric)
    by_time.legend()
    fig.tight_layout()
    _save(fig, path)
