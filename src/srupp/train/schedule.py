"""The learning-rate schedule and its length, fitted to a time budget.

A run trains for ``train.max_steps`` optimiser steps, or, with a time budget
(``train.max_seconds``), for as many as the budget holds: the step count is
unknown until steps are timed. :class:`StepSchedule` times them:

- calibration: after :data:`CALIBRATION_SKIP` untimed steps (allocator and
  caches warming up), ``train.calibration_steps`` timed ones; their median
  fixes ``total_steps`` so that the cosine ends when the budget does;
- re-fits at the fractions :data:`REFIT_AT` of the budget (or of the fitted
  steps, whichever comes first), each from the mean step time since the
  previous fit: the calibration's few early steps can run slower or faster
  than the rest, and a run's speed can change midway;
- extension: a resumed run whose budget was raised fits the rest of the new
  budget from the saved step on.

Its :meth:`~StepSchedule.state_dict` is saved in the checkpoint's
``trainer.pt`` (at its top level), so a resumed run continues the same schedule.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

if TYPE_CHECKING:
    from .config import TrainConfig

CALIBRATION_SKIP = 5  # untimed warm-up steps before the calibration window
REFIT_AT = (0.25, 0.5, 0.75, 0.9)  # fractions of the budget at which the length is fitted again
FILL = 0.97  # the share of the remaining time a fit plans steps for (evaluation, jitter)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float,
              schedule: str = "cosine") -> float:
    """Linear warm-up over ``warmup`` steps, then the decay.

    cosine: to ``min_ratio`` at ``total``; inverse_sqrt: √(warmup / step),
    which needs no end (at least ``min_ratio``).
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "inverse_sqrt":
        return max(min_ratio, math.sqrt(max(1, warmup) / (step + 1)))
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class StepSchedule:
    """How many optimiser steps a run takes, and the learning-rate factor of each.

    Args:
        train: the run's training settings (budget, warm-up, decay).

    Attributes:
        total_steps: the steps the schedule ends at (fitted under a time budget).
        calibrated: whether ``total_steps`` is known (always, without a time budget).
        refitted: how many of the :data:`REFIT_AT` re-fits are done.
        calibrated_at: (step, training seconds) of the last fit.
    """

    def __init__(self, train: "TrainConfig"):
        self.train = train
        timed = train.max_seconds is not None
        self.total_steps = train.max_steps
        self.calibrated = not timed
        self.refitted = 0 if timed else len(REFIT_AT)
        self.calibrated_at: Tuple[int, float] = (0, 0.0)
        self._step_times: List[float] = []  # this session's calibration window (not saved)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        return {"total_steps": self.total_steps, "calibrated": self.calibrated,
                "refitted": self.refitted, "calibrated_at": list(self.calibrated_at)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.total_steps = int(state["total_steps"])
        self.calibrated = bool(state["calibrated"])
        self.refitted = int(state["refitted"])
        step, seconds = state["calibrated_at"]
        self.calibrated_at = (int(step), float(seconds))

    # ----------------------------------------------------------------- budget
    @property
    def budget(self) -> Dict[str, Any]:
        """The step and time budget (saved with each checkpoint)."""
        return {"max_steps": self.train.max_steps, "max_seconds": self.train.max_seconds}

    def budget_raised(self, saved: Dict[str, Any]) -> bool:
        """Whether this budget is larger than ``saved``: more steps, or more time."""
        t = self.train
        more_time = saved["max_seconds"] is not None and (
            t.max_seconds is None or t.max_seconds > saved["max_seconds"])
        return t.max_steps > saved["max_steps"] or more_time

    def extend(self, step: int, seconds: float) -> None:
        """Fit the loaded schedule to a raised budget, from ``step`` and ``seconds`` on."""
        t = self.train
        if t.max_seconds is None:
            self.total_steps, self.calibrated = t.max_steps, True
            self.refitted, self.calibrated_at = len(REFIT_AT), (step, seconds)
            return
        if not self.calibrated:  # calibration goes on as in a new run
            self.total_steps, self.refitted = t.max_steps, 0
            return
        step0, seconds0 = self.calibrated_at
        per_step = ((seconds - seconds0) / (step - step0) if step > step0
                    else seconds / max(step, 1))
        fits = step + int(FILL * (t.max_seconds - seconds) / max(per_step, 1e-9))
        self.total_steps = max(step + 1, min(t.max_steps, fits))
        # the re-fits at fractions of the new budget that are still ahead
        self.refitted = sum(seconds >= f * t.max_seconds for f in REFIT_AT)
        self.calibrated_at = (step, seconds)

    # ------------------------------------------------------------- the rate
    def warmup_steps(self) -> int:
        """train.warmup_steps, or warmup_fraction of the schedule once it is fitted."""
        t = self.train
        if t.warmup_fraction is None:
            return t.warmup_steps
        if not self.calibrated:  # the length is not known yet: warm up as for max_steps
            return max(1, round(t.warmup_fraction * t.max_steps))
        return max(1, round(t.warmup_fraction * self.total_steps))

    def lr_factor(self, step: int) -> float:
        """The learning rate of ``step``, as a share of ``train.lr`` (for LambdaLR)."""
        t = self.train
        return lr_factor(step, self.warmup_steps(), self.total_steps, t.min_lr_ratio,
                         t.schedule)

    # ---------------------------------------------------------------- fitting
    def start(self) -> None:
        """A training session begins: calibration (if still due) times its own steps."""
        self._step_times = []

    def calibrate(self, step: int, seconds: float, step_seconds: float) -> bool:
        """Time one step of calibration; True when it fixed ``total_steps``."""
        self._step_times.append(step_seconds)
        if len(self._step_times) < CALIBRATION_SKIP + self.train.calibration_steps:
            return False
        window = sorted(self._step_times[CALIBRATION_SKIP:])
        self._fit(step, seconds, window[len(window) // 2])
        self.calibrated = True
        self.calibrated_at = (step, seconds)
        return True

    def refit_due(self, step: int, seconds: float) -> bool:
        """Whether the length is to be fitted again now (:data:`REFIT_AT`)."""
        t = self.train
        return (self.refitted < len(REFIT_AT)
                and step - self.calibrated_at[0] >= t.calibration_steps
                # at a fraction of the budget, or of the steps when they run
                # faster than fitted (else the schedule could end first)
                and (seconds >= REFIT_AT[self.refitted] * t.max_seconds
                     or step >= REFIT_AT[self.refitted] * self.total_steps))

    def refit(self, step: int, seconds: float) -> None:
        """Fit the length again from the mean step time since the last fit."""
        step0, seconds0 = self.calibrated_at
        if step > step0:
            self._fit(step, seconds, (seconds - seconds0) / (step - step0))
        self.calibrated_at = (step, seconds)
        self.refitted += 1

    def _fit(self, step: int, seconds: float, per_step: float) -> None:
        t = self.train
        fits = step + int(FILL * (t.max_seconds - seconds) / max(per_step, 1e-9))
        self.total_steps = max(step + 1, min(t.max_steps, fits))
