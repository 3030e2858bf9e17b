"""Ctrl-C (SIGINT) and SIGTERM as requests to stop training at the next step boundary.

The handler only counts: raising inside it would land anywhere (after the
batcher advanced, between ``optimizer.step()`` and the step counter) and
leave nothing consistent to save, so the trainer looks at :attr:`count`
between optimiser steps. A second signal raises ``KeyboardInterrupt`` at
once: the user asked twice, and the last checkpoint stays, as after SIGKILL.
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Dict

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequests:
    """While entered (``with``), SIGINT and SIGTERM ask for a stop; the previous handlers
    come back on exit.

    Handlers are installed from the main thread only (Python allows no other);
    signals are delivered to it anyway.
    """

    def __init__(self) -> None:
        self.count = 0  # signals received since entered
        self._previous: Dict[int, Any] = {}

    def __enter__(self) -> "StopRequests":
        self.count = 0
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                old = signal.signal(signum, self._on_signal)
                # None: a handler set outside Python
                self._previous[signum] = signal.SIG_DFL if old is None else old
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _on_signal(self, signum, frame) -> None:
        # printing is left to the trainer: the handler may run inside a write to stderr
        self.count += 1
        if self.count > 1:
            raise KeyboardInterrupt  # asked twice: stop now
