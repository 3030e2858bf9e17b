"""A backend choice set by a function, a context manager or an environment variable.

The recurrence (``SRUPP_BACKEND``), the projections (``SRUPP_MATMUL``) and the
attention (``SRUPP_ATTENTION``) each have one. The environment variable is read
at the first :meth:`get` unless :meth:`set` ran before.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional, Sequence


class BackendSetting:
    """One named choice among ``choices``; "auto" is the default."""

    def __init__(self, what: str, env_var: str, choices: Sequence[str]):
        self.what = what
        self.env_var = env_var
        self.choices = tuple(choices)
        self.value: Optional[str] = None  # None until set() or the first get()

    def check(self, name: str) -> str:
        name = str(name).strip().lower()
        if name not in self.choices:
            raise ValueError(f"unknown srupp {self.what} backend {name!r} (from set_*_backend or "
                             f"{self.env_var}); choose one of {self.choices}")
        return name

    def set(self, name: str) -> None:
        self.value = self.check(name)

    def get(self) -> str:
        if self.value is None:
            self.value = self.check(os.environ.get(self.env_var, "auto") or "auto")
        return self.value

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[None]:
        previous = self.get()
        self.set(name)
        try:
            yield
        finally:
            self.value = previous
