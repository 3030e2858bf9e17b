"""What the ops' dispatchers share: their backend settings, and when to step aside.

The recurrence (``SRUPP_BACKEND``), the projections (``SRUPP_MATMUL``) and the
attention (``SRUPP_ATTENTION``) each have a :class:`BackendSetting`. The
environment variable is read at the first :meth:`~BackendSetting.get` unless
:meth:`~BackendSetting.set` ran before.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional, Sequence

import torch


def tracing() -> bool:
    """Whether torch.compile, torch.export or torch.jit is recording the model.

    The eager fast paths (oneDNN projections, matmul attention) then step aside
    for the plain ops those tools know.
    """
    return (torch.compiler.is_compiling() or torch.jit.is_tracing()
            or torch.jit.is_scripting())


def cpu_supports(*features: str) -> bool:
    """Whether ``torch.cpu`` reports any of these features ("avx512_bf16", "amx_tile",
    ... as in its ``_is_<feature>_supported`` probes); False when it cannot tell."""
    try:
        return any(getattr(torch.cpu, f"_is_{f}_supported", lambda: False)() for f in features)
    except Exception:  # noqa: BLE001 - unknown means "no"
        return False


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
