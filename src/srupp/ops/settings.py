"""What the ops' dispatchers share: which backend each op runs, and when to step aside.

One typed object, :func:`backends`, holds the choice for each op ("auto", the
default, picks by the tensors):

==============  ===============================  =================
field           choices                          default from
==============  ===============================  =================
``recurrence``  auto, reference, cpu, triton     ``SRUPP_BACKEND``
``matmul``      auto, aten, onednn               ``SRUPP_MATMUL``
``attention``   auto, sdpa, matmul               ``SRUPP_ATTENTION``
``step``        auto, fused, modules             ``SRUPP_STEP``
==============  ===============================  =================

``step`` is how an SRU++ stack runs one token under no_grad: "fused" (and
"auto", where it applies) runs each layer as one C++ op
(:mod:`srupp.ops.layer_step`); "modules" runs the layer's modules one by one,
the path everything else takes.

The environment variables choose for a whole process (a ``srupp`` command, a
benchmark script); they are read when a dispatcher first asks, unless a
``set_*_backend`` ran before. docs/environment.md lists every variable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Iterator, Optional

import torch

CHOICES = {"recurrence": ("auto", "reference", "cpu", "triton"),
           "matmul": ("auto", "aten", "onednn"),
           "attention": ("auto", "sdpa", "matmul"),
           "step": ("auto", "fused", "modules")}
ENV = {"recurrence": "SRUPP_BACKEND", "matmul": "SRUPP_MATMUL", "attention": "SRUPP_ATTENTION",
       "step": "SRUPP_STEP"}
# The dtypes each recurrence kernel computes in: the dispatcher routes other dtypes
# (float64, for gradcheck) to the reference, and the Triton kernels' ahead-of-time
# compilation (srupp.ops.triton_compile) lists a variant for each.
RECURRENCE_DTYPES = {"cpu": (torch.float32, torch.bfloat16),
                     "triton": (torch.float32, torch.bfloat16, torch.float16)}


@dataclasses.dataclass
class Backends:
    """The backend of each op; assigning a field checks the name."""

    recurrence: str = "auto"
    matmul: str = "auto"
    attention: str = "auto"
    step: str = "auto"

    def __setattr__(self, op: str, name: str) -> None:
        if op not in CHOICES:
            raise AttributeError(f"srupp has no op {op!r}; ops: {tuple(CHOICES)}")
        name = str(name).strip().lower()
        if name not in CHOICES[op]:
            raise ValueError(f"unknown srupp {op} backend {name!r} (from set_*_backend or "
                             f"{ENV[op]}); choose one of {CHOICES[op]}")
        object.__setattr__(self, op, name)

    @contextlib.contextmanager
    def use(self, op: str, name: str) -> Iterator[None]:
        """Run the enclosed code with ``op`` on backend ``name``, then restore the choice."""
        previous = getattr(self, op)
        setattr(self, op, name)
        try:
            yield
        finally:
            object.__setattr__(self, op, previous)


_backends: Optional[Backends] = None


def accessors(op: str):
    """The ``set_*``, ``get_*`` and ``use_*`` functions of ``op``'s backend: force one of
    ``CHOICES[op]`` ("auto" is the default), read the choice (the environment the first
    time), and a context manager that runs the enclosed code on one, then restores it."""
    def set_backend(name: str) -> None:
        setattr(backends(), op, name)

    def get_backend() -> str:
        return getattr(backends(), op)

    def use_backend(name: str):
        return backends().use(op, name)

    return set_backend, get_backend, use_backend


def backends() -> Backends:
    """The process's backend settings (reading the environment the first time)."""
    global _backends
    if _backends is None:
        _backends = Backends(**{op: os.environ.get(var) or "auto" for op, var in ENV.items()})
    return _backends


def tracing() -> bool:
    """Whether torch.compile, torch.export or torch.jit is recording the model.

    The eager fast paths (oneDNN projections, matmul attention) then step aside
    for the plain ops those tools know.
    """
    return (torch.compiler.is_compiling() or torch.jit.is_tracing()
            or torch.jit.is_scripting())


@functools.lru_cache(maxsize=None)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes in bf16 in hardware (AVX-512 BF16 or AMX), as
    ``torch.cpu`` reports it; False when it can't tell.

    Without it, bf16 arithmetic is emulated: slower than fp32 matrix products.
    """
    try:
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    except Exception:  # noqa: BLE001 - an older torch without the probes: unknown means "no"
        return False


def debug_nan_fill() -> bool:
    """``SRUPP_DEBUG_NAN_FILL=1``: the recurrence kernels fill every output with NaN
    before writing it, so an element they forget shows up. Read at every call (the
    C++ kernel reads the same variable)."""
    return os.environ.get("SRUPP_DEBUG_NAN_FILL", "") not in ("", "0")
