"""Training, evaluation and comparison of the models of every task (lm, translate, classify).

``build_config`` reads a recipe; ``TASKS`` names the task classes (what
differs between tasks, :mod:`srupp.train.tasks`); ``Trainer`` is the one
training loop. Applying a trained model to new text is :mod:`srupp.inference`'s.

``Trainer`` is imported when first asked for, so that what only reads configs or
finds a task (``srupp generate``'s check of a checkpoint's task) does not import the
training loop.
"""

from .config import RunConfig, build_config
from .lm import evaluate, metric_for
from .registry import TASKS

__all__ = ["TASKS", "RunConfig", "Trainer", "build_config", "evaluate", "metric_for"]


def __getattr__(name):
    if name == "Trainer":
        from .trainer import Trainer

        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
