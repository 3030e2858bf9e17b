"""What the ops' dispatchers share: which backend each op runs, how the kernels are
tuned, and when to step aside.

Two typed objects hold every knob; assigning a field checks it, and ``use`` changes
fields for a ``with`` block. Both are the process's: change them while no other
thread runs the ops. docs/environment.md lists every field.

:func:`backends` holds the choice for each op ("auto", the default, picks by the
tensors):

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
``set_*_backend`` ran before.

:func:`tuning` holds the numbers the kernels and the decoding loop run by (no
environment variable sets them):

==================== ======= ==================================================
field                default what
==================== ======= ==================================================
``decode_chunk``     64      tokens per call of the C++ token loop
                             (``CausalLM.generate``); 0: the Python loop
``decode_row_group`` 16      rows the C++ token loop runs at once where it
                             may split the batch; 0: all rows together
``layer_step_team``  True    the C++ layer step at few rows in one parallel
                             region (False: a region per piece; tests compare)
``pair_packed``      True    bf16 decoding steps multiply by pair-packed copies
                             of the weights (AVX512-BF16 CPUs; False: the rows'
                             own layout)
``triton_block``     None    units per Triton program (a power of two); None
                             picks by size
``triton_warps``     None    warps per Triton program; None follows the block
``triton_stages``    None    software-pipeline depth of the Triton time loop
``triton_steps``     None    time steps per explicit block in the Triton loop
==================== ======= ==================================================

``layer_step_team`` and ``decode_row_group`` live in the C++ extension too:
:mod:`srupp.ops.cpu_kernels` hands the extension over when it loads it
(:func:`attach_extension`), and from then on every change of a field reaches it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any, Dict, Iterator, Optional

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


class _Settings:
    """What both settings objects share: a ``with`` block that changes fields, then
    restores them."""

    def _restore(self, field: str, value: Any) -> None:
        object.__setattr__(self, field, value)  # (a value the field held: checked already)

    @contextlib.contextmanager
    def _using(self, changes: Dict[str, Any]) -> Iterator[None]:
        previous = {}
        try:
            for field, value in changes.items():
                before = getattr(self, field, None)
                setattr(self, field, value)  # checks it
                previous[field] = before
            yield
        finally:
            for field, value in reversed(list(previous.items())):
                self._restore(field, value)


@dataclasses.dataclass
class Backends(_Settings):
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

    def use(self, op: str, name: str):
        """Run the enclosed code with ``op`` on backend ``name``, then restore the choice."""
        return self._using({op: name})


def _power_of_two(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1 and not v & (v - 1)


def _positive(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


# Each tuning field's rule: (whether a value passes, what it must be)
_TUNING_RULES: Dict[str, tuple] = {
    "decode_chunk": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                     "an integer >= 0 (0: the Python loop)"),
    "decode_row_group": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                         "an integer >= 0 (0: all rows together)"),
    "layer_step_team": (lambda v: isinstance(v, bool), "True or False"),
    "pair_packed": (lambda v: isinstance(v, bool), "True or False"),
    "triton_block": (lambda v: v is None or _power_of_two(v), "None or a power of two"),
    "triton_warps": (lambda v: v is None or _power_of_two(v), "None or a power of two"),
    "triton_stages": (lambda v: v is None or _positive(v), "None (off) or an integer >= 1"),
    "triton_steps": (lambda v: v is None or _positive(v), "None (off) or an integer >= 1"),
}

# The tuning fields the C++ extension keeps a copy of, and its function that sets it.
_CPP_SETTERS = {"layer_step_team": "set_layer_step_team",
                "decode_row_group": "set_decode_row_group"}


@dataclasses.dataclass
class Tuning(_Settings):
    """How the kernels and the decoding loop run (module docstring); assigning a field
    checks the value, and a field the C++ extension keeps reaches it."""

    #: Tokens per call of the C++ token loop that ``CausalLM.generate`` runs on the CPU
    #: (read by srupp/models/lm.py): enough to amortise the call and the buffer rows
    #: reserved for it, few enough that streaming keeps up. 0: the Python loop, one
    #: ``model.step`` per token.
    decode_chunk: int = 64
    #: Rows the C++ token loop runs at once where it may split the batch (no row's tokens
    #: depend on the others': csrc/decode_loop.cpp, rows_at_once): each group runs all the
    #: call's tokens before the next, so its keys and values stay in the cache between
    #: tokens. 16 rows of the 5M shakespeare-cpu model: 1.09x the tokens/s of 32 rows at
    #: once (docs/deploy.md). 0: all rows together. The same tokens either way.
    decode_row_group: int = 16
    #: Whether the C++ layer step (csrc/layer_step.cpp) runs a layer at few rows with float
    #: weights in one parallel region; False: one region per piece (the path int8 weights
    #: and larger batches take). Both give the same bits; the tests compare them.
    layer_step_team: bool = True
    #: Whether the fused decoding step (srupp/nn/stack_step.py) multiplies bf16 layers by
    #: copies of W1, W2, W3 packed in pairs of inputs (csrc/matmul_few_rows.cpp,
    #: pack_pairs_bf16): 1.25x the products of the rows' own layout at 8 and 32 rows, for
    #: a second copy of the weights. A plan made under one value keeps it; a model's
    #: streams all take the same plans, so batch invariance holds either way.
    pair_packed: bool = True
    #: Units per Triton program (a power of two; read by srupp/ops/triton_kernel.py). None
    #: picks by size; the tests set small blocks, so that D is not a multiple of the block
    #: and blocks straddle the directions.
    triton_block: Optional[int] = None
    #: Warps per Triton program (a power of two). None: block // 32, between 1 and 4, for a
    #: set ``triton_block``; else the size's choice.
    triton_warps: Optional[int] = None
    #: Software-pipeline depth of the Triton time loop (``tl.range(num_stages=...)``): the
    #: loads of later steps in flight while a step computes, so that a step need not wait
    #: for a DRAM round trip. None: the plain loop. Not the default until a GPU has timed
    #: it (triton_kernel.SWEEP_CONFIGS).
    triton_stages: Optional[int] = None
    #: Time steps per explicit block (K) of the Triton time loop: the loads of K steps
    #: issued before their K dependent updates, one DRAM round trip per block. None: no
    #: blocks. Not the default until a GPU has timed it.
    triton_steps: Optional[int] = None

    def __setattr__(self, field: str, value: Any) -> None:
        if field not in _TUNING_RULES:
            raise AttributeError(f"srupp has no tuning field {field!r}; fields: "
                                 f"{tuple(_TUNING_RULES)}")
        ok, what = _TUNING_RULES[field]
        if not ok(value):
            raise ValueError(f"srupp tuning: {field} must be {what}, got {value!r}")
        self._restore(field, value)

    def _restore(self, field: str, value: Any) -> None:
        object.__setattr__(self, field, value)
        if field in _CPP_SETTERS and self is _tuning:  # (not a copy, or the defaults)
            _push_to_extension(field)

    def use(self, **fields: Any):
        """Run the enclosed code with these fields set (``tuning().use(decode_chunk=0)``),
        then restore them."""
        return self._using(fields)


_backends: Optional[Backends] = None
_tuning: Optional[Tuning] = None
_extension: Any = None  # the C++ extension, once srupp.ops.cpu_kernels has loaded it


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


def tuning() -> Tuning:
    """The process's tuning settings (the defaults until something changes them)."""
    global _tuning
    if _tuning is None:
        _tuning = Tuning()
        for field in _CPP_SETTERS:
            _push_to_extension(field)
    return _tuning


def attach_extension(module: Any) -> None:
    """Hand over the loaded C++ extension (:func:`srupp.ops.cpu_kernels.load` does): the
    tuning fields it keeps a copy of are set in it now, and on every change from then on."""
    global _extension
    _extension = module
    tuning()
    for field in _CPP_SETTERS:
        _push_to_extension(field)


def _push_to_extension(field: str) -> None:
    """The process's value of the tuning field ``field`` into the C++ extension, if loaded."""
    if _extension is not None and _tuning is not None:
        getattr(_extension, _CPP_SETTERS[field])(getattr(_tuning, field))


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
