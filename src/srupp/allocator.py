"""Keep large freed CPU buffers in the process instead of handing them back to the OS.

glibc's malloc serves large requests (beyond an adaptive threshold of at most
32 MiB) with fresh ``mmap`` pages and unmaps them on free. A training step
allocates and frees tens of megabytes of activations, so every step the kernel
faults in and zeroes those pages again; :func:`tune_cpu_allocator` keeps them
instead (the measurements are in docs/performance.md, "The CPU allocator").

This is a process-wide malloc setting (``mallopt``), so the library never
applies it on import. The ``srupp`` command-line tool applies it at start
(``SRUPP_TUNE_ALLOCATOR=0`` opts out); call it yourself in your own training
scripts. The cost: memory freed by PyTorch stays reserved by the process (as
with PyTorch's CUDA caching allocator), so resident memory stays near its peak.
The same effect is available without code through the environment:
``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=2147483647``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["tune_cpu_allocator"]

# mallopt parameter numbers from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# the largest mmap threshold glibc accepts on 64-bit (HEAP_MAX_SIZE / 2)
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes a C int

_applied = False


def tune_cpu_allocator() -> bool:
    """Make glibc keep freed large buffers for reuse (see the module docstring).

    Idempotent. Returns True when the setting is in effect, False where it does
    not apply (not Linux with glibc) or was refused; nothing else changes then.
    """
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
            return False  # musl and other libcs: different malloc, no such knob
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        ok = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
              and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
    except (OSError, AttributeError):
        return False
    _applied = ok
    return ok


def tune_from_env() -> bool:
    """Apply :func:`tune_cpu_allocator` unless ``SRUPP_TUNE_ALLOCATOR`` is 0/false/no."""
    if os.environ.get("SRUPP_TUNE_ALLOCATOR", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return tune_cpu_allocator()
