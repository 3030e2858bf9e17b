"""Training, evaluation and comparison of the models of every task (lm, translate, classify).

``build_config`` reads a recipe; ``TASKS`` names the task classes (what
differs between tasks, :mod:`srupp.train.tasks`); ``Trainer`` is the one
training loop. Applying a trained model to new text is :mod:`srupp.inference`'s.
"""

from .config import TASKS, RunConfig, build_config
from .lm import evaluate, metric_for
from .trainer import Trainer

__all__ = ["TASKS", "RunConfig", "Trainer", "build_config", "evaluate", "metric_for"]
