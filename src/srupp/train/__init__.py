"""Training, evaluation and checkpoints for the language model."""

from .config import RunConfig, build_config
from .evaluate import evaluate, metric_for
from .trainer import Trainer

__all__ = ["RunConfig", "Trainer", "build_config", "evaluate", "metric_for"]
