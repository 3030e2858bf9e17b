"""A run's metrics: ``metrics.jsonl``, and with ``train.tensorboard`` TensorBoard's event files.

``RUN_DIR/metrics.jsonl`` holds one JSON object per line: the training loss
of each logging interval, each validation's results, with their step. With
``train.tensorboard = true`` the same scalars go to ``RUN_DIR/tensorboard/``
(``tensorboard --logdir RUN_DIR/tensorboard``), through
``torch.utils.tensorboard`` (the ``srupp[tensorboard]`` extra).

A resumed run keeps the lines its checkpoint counted and drops the rest
(:meth:`MetricsLog.truncate`); TensorBoard hides the dropped steps' events
(``purge_step``).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from .._files import atomic_write_text, write_error
from ..errors import UserError

TENSORBOARD_DIR = "tensorboard"


def summary_writer_class():
    """torch.utils.tensorboard's SummaryWriter; a UserError names the extra without it."""
    from .._extras import MissingExtra, require

    try:
        require("tensorboard", "tensorboard", "train.tensorboard")
    except MissingExtra as e:
        raise UserError(str(e)) from None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter


class MetricsLog:
    """Rank 0's record of a run's metrics.

    Args:
        run_dir: the run directory.
        tensorboard: also write each scalar to TensorBoard's event files.

    Attributes:
        lines: lines in metrics.jsonl (saved with each checkpoint).
    """

    def __init__(self, run_dir: Path, *, tensorboard: bool = False):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tensorboard_dir = Path(run_dir) / TENSORBOARD_DIR
        self.lines = 0
        self._writer_class = summary_writer_class() if tensorboard else None
        self._writer = None

    def truncate(self, step: int, lines: Optional[int] = None) -> None:
        """Drop lines an interrupted run wrote after its last checkpoint: beyond its first
        ``lines`` (the count the checkpoint saved), and any of a later step.

        The count also drops a line of the checkpoint's own step that its save did not
        include: a final evaluation whose save failed (a full disk) is evaluated again.
        """
        if not self.path.exists():
            return
        kept = []
        for ln in self.path.read_text().splitlines():
            if lines is not None and len(kept) >= lines:
                break
            # a blank line, or one cut by the kill, is dropped
            with contextlib.suppress(json.JSONDecodeError):
                if json.loads(ln).get("step", 0) <= step:
                    kept.append(ln)
        atomic_write_text(self.path, "".join(ln + "\n" for ln in kept))
        self.lines = len(kept)

    def rows(self) -> List[Dict[str, Any]]:
        """The records in metrics.jsonl (lines that do not parse are skipped)."""
        rows = []
        with contextlib.suppress(OSError):
            for ln in self.path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    rows.append(json.loads(ln))
        return [r for r in rows if isinstance(r, dict)]

    def open(self, step: int) -> None:
        """Start a training session at ``step``: TensorBoard's events after it, left by
        an interrupted session, are hidden."""
        if self._writer_class is not None and self._writer is None:
            self._writer = self._writer_class(log_dir=str(self.tensorboard_dir),
                                              purge_step=step + 1 if step else None)

    def append(self, record: Dict[str, Any]) -> None:
        """Add ``record`` (with its ``step``): a line of metrics.jsonl; TensorBoard's scalars."""
        size = None
        try:
            size = self.path.stat().st_size if self.path.exists() else 0
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            self.lines += 1
        except OSError as e:  # a full disk: no half line left behind
            if size is not None:
                with contextlib.suppress(OSError):
                    os.truncate(self.path, size)
            raise write_error(e, self.path) from None
        if self._writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) \
                        and not isinstance(value, bool):
                    self._writer.add_scalar(key, value, global_step=record["step"])

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
