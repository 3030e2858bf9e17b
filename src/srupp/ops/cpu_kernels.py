"""The C++ extension of CPU kernels (``csrc/cpu_kernels.cpp``), built on first use.

It holds the fused SRU recurrence (``sru_fwd`` / ``sru_bwd``, which
:mod:`srupp.ops.recurrence` runs as its "cpu" backend) and two decoding kernels:
few-row products (``linear_rows``, :func:`srupp.ops.matmul.linear_few_rows`) and
one query's attention (``attend_one_query``,
:func:`srupp.ops.attention.attention_one_query`). :func:`function` looks one up.

Nothing is compiled at import. The first call of :func:`load` (or
:func:`is_available`) builds the extension with
:func:`torch.utils.cpp_extension.load` (needs a C++ compiler and ninja; about a
minute the first time, then cached under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``). The build is tuned to this machine: ``-O3``, the
host's vector ISA (``-march=native``) and ATen's matching ``Vectorized``
specialisation (AVX-512, AVX2 or the portable one, following
``torch.backends.cpu.get_cpu_capability()``, which PyTorch's own
``ATEN_CPU_CAPABILITY=avx512|avx2|default`` overrides).

If the build fails, one warning says why and that the slower reference path is
used; the failure is remembered, so later calls neither retry nor warn again.
``build(verbose=True)`` compiles in the foreground and shows the compiler's output.

Memory. The recurrence is bandwidth-bound, and a fresh multi-megabyte output costs
the OS a page fault and a page zeroing per page, which can take longer than the
recurrence itself (docs/performance.md, "The recurrence kernel"). So (on Linux)
outputs of 4 MiB or more live on 2 MiB transparent huge pages, and freed ones are
kept for reuse by later calls of the same size, up to a limit: 512 MiB by
default, :func:`set_cache_limit` to change it (0 turns the cache off),
:func:`empty_cache` to hand the memory back. Outputs of 16 MiB or more are
written with streaming stores.

Debugging: ``SRUPP_DEBUG_NAN_FILL=1`` fills every output with NaN before the kernel
writes it, so the tests catch an element it forgets.
"""

from __future__ import annotations

import hashlib
import platform
import sys
import threading
import warnings
from pathlib import Path
from typing import Optional

__all__ = ["is_available", "load", "build", "build_error", "capability", "empty_cache",
           "set_cache_limit", "cache_limit", "cached_bytes"]

_SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_kernels.cpp"

_lock = threading.Lock()
_module = None                    # the loaded extension
_error: Optional[str] = None      # why the build failed, once it has


def capability() -> str:
    """The vector ISA to build for: 'avx512', 'avx2' or 'default'."""
    import torch

    cap = torch.backends.cpu.get_cpu_capability().upper()
    if cap.startswith("AVX512"):
        return "avx512"
    if cap.startswith("AVX2"):
        return "avx2"
    return "default"


def _flags(isa: str) -> list:
    machine = platform.machine().lower()
    if sys.platform == "win32":
        flags = ["/O2", "/openmp"]
        flags += {"avx512": ["/arch:AVX512"], "avx2": ["/arch:AVX2"]}.get(isa, [])
    else:
        flags = ["-O3"]
        if sys.platform != "darwin":
            flags.append("-fopenmp")  # at::parallel_for is OpenMP-backed in torch wheels
        if machine in ("x86_64", "amd64", "i686", "i386"):
            flags.append("-march=native")
            flags += {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
                      "avx2": ["-mavx2", "-mfma", "-mf16c"]}.get(isa, [])
        elif machine in ("aarch64", "arm64"):
            flags.append("-mcpu=native")
    # Select ATen's Vectorized specialisation; name the inline namespace after us so
    # our inline functions never collide with libtorch's copies of the same templates.
    if isa != "default":
        flags.append(f"-DCPU_CAPABILITY_{isa.upper()}")
    flags.append(f"-DCPU_CAPABILITY=srupp_{isa}")
    return flags


def build(verbose: bool = False):
    """Compile and import the extension now, raising if that fails (:func:`load`
    calls it once; ``verbose`` shows the compiler's output)."""
    from torch.utils.cpp_extension import load as _load

    from .settings import cpu_has_native_bf16

    isa = capability()
    ldflags = [] if sys.platform in ("win32", "darwin") else ["-fopenmp"]
    # -march=native may use AVX512-BF16 instructions: name the build after them too,
    # so a cache shared with a machine that lacks them is not reused there
    bf16 = "_bf16" if isa == "avx512" and cpu_has_native_bf16() else ""
    # and after the source: two checkouts (or versions) sharing the cache never
    # overwrite each other's build
    source = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:10]
    return _load(name=f"srupp_cpu_kernels_{isa}{bf16}_{source}", sources=[str(_SOURCE)],
                 extra_cflags=_flags(isa), extra_ldflags=ldflags, verbose=verbose)


def _summarise(e: BaseException) -> str:
    """One line: the exception's first line, plus the compiler's first error if any."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    head = lines[0] if lines else ""
    head = head.split(": [1/")[0]  # cpp_extension appends the whole ninja log
    errors = [ln for ln in lines[1:] if "error" in ln.lower() and ln != head]
    msg = f"{type(e).__name__}: {head}"
    if errors:
        msg += f" ({errors[0][:300]})"
    return msg


def load():
    """The compiled extension, building it on the first call; None if it can't be built."""
    global _module, _error
    if _module is not None or _error is not None:
        return _module
    with _lock:
        if _module is None and _error is None:
            try:
                _module = build()
            except Exception as e:  # compiler or ninja missing, compile error, ...
                _error = _summarise(e)
                warnings.warn(
                    "srupp: could not build the fused C++ CPU kernel of the SRU recurrence "
                    f"({_error}); using the pure-PyTorch reference recurrence instead: exact, "
                    "but an SRU++ layer then trains and infers at about half the speed "
                    "(docs/layers.md, 'Kernels and backends'). Install a C++ compiler and ninja "
                    "to get the fast path.",
                    RuntimeWarning, stacklevel=3)
    return _module


_functions: dict = {}  # name -> the extension's function, or False when it is not built


def function(name: str):
    """The extension's function ``name`` (building the extension on the first call),
    looked up once: hot paths call it per decoding step. None when it can't be built."""
    f = _functions.get(name)
    if f is None:
        mod = load()
        f = _functions[name] = False if mod is None else getattr(mod, name)
    return f or None


def is_available() -> bool:
    """Whether the fused CPU kernel can be used (builds it on the first call)."""
    return load() is not None


def build_error() -> Optional[str]:
    """Why the build failed, or None (not tried yet, or succeeded)."""
    return _error


def empty_cache() -> int:
    """Return the kernel's cached output blocks to the system; the bytes released.

    The kernel recycles its large output buffers (see ``csrc/cpu_kernels.cpp``); at most
    :func:`cache_limit` bytes of freed blocks are kept. No-op before the first build.
    """
    return int(_module.empty_cache()) if _module is not None else 0


def set_cache_limit(nbytes: int) -> None:
    """Keep at most ``nbytes`` of freed output blocks for reuse (0 disables the cache).

    The default is 512 MiB. Builds the extension if needed.
    """
    mod = load()
    if mod is not None:
        mod.set_cache_limit(int(nbytes))


def cache_limit() -> int:
    """The current limit of the output-block cache in bytes (0 if not built)."""
    return int(_module.cache_limit()) if _module is not None else 0


def cached_bytes() -> int:
    """Bytes currently held in the output-block cache."""
    return int(_module.cached_bytes()) if _module is not None else 0
