"""The C++ extension of CPU kernels (``csrc/``), built on first use.

It holds the fused SRU recurrence (``sru_fwd`` / ``sru_bwd``, which
:mod:`srupp.ops.recurrence` runs as its "cpu" backend) and the decoding kernels:
few-row products (``linear_rows``, :func:`srupp.ops.matmul.linear_few_rows`, and their
int8 forms), one query's attention (``attend_one_query``,
:func:`srupp.ops.attention.attention_one_query`), a stack's step and the token loop.
:func:`function` looks one up. Its sources are the folder ``csrc``: ``common.h``
(what the files share) and one ``.cpp`` file per kernel family, compiled into one
extension; ``csrc/cpu_kernels.cpp`` binds them into the Python module.

Nothing is compiled at import. The first call of :func:`load` (or
:func:`is_available`) builds the extension with
:func:`torch.utils.cpp_extension.load` (needs a C++ compiler and ninja, which
compiles the files in parallel): up to about a minute the first time, announced by
one line on stderr, then cached under ``TORCH_EXTENSIONS_DIR`` (by default
``~/.cache/torch_extensions``). The build is named after a hash of every file in
``csrc`` (:func:`extension_name`), so two checkouts or versions sharing the cache
never overwrite each other's build. The build is tuned to this machine: ``-O3``, the
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

Settings: ``srupp.ops.settings.tuning().layer_step_team`` reaches the extension's one
mutable global (the layer step's one-region path) when :func:`load` loads it, and on
every change after.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
import warnings
from pathlib import Path
from typing import Optional

__all__ = ["is_available", "load", "build", "build_error", "capability", "empty_cache",
           "set_cache_limit", "cache_limit", "cached_bytes", "source_files", "source_hash",
           "extension_name"]

CSRC = Path(__file__).resolve().parent / "csrc"  # the extension's sources
FIRST_BUILD_MESSAGE = "srupp: compiling the CPU kernels{where} (once, about a minute) ..."

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


def source_files(csrc: Path = CSRC) -> list:
    """The extension's files in ``csrc``, sorted: every ``.cpp`` (one object each, compiled
    in parallel) and every ``.h`` they include."""
    return sorted(p for p in Path(csrc).iterdir() if p.is_file() and p.suffix in (".cpp", ".h"))


def source_hash(csrc: Path = CSRC) -> str:
    """A hash of every file of the extension (names and contents): any change to any of
    them, a header included, names another build."""
    h = hashlib.sha256()
    for path in source_files(csrc):
        data = path.read_bytes()
        h.update(f"{path.name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:10]


def extension_name(csrc: Path = CSRC, prefix: str = "srupp_cpu_kernels") -> str:
    """The name of the build of ``csrc`` on this machine: its ISA and a hash of its files."""
    from .settings import cpu_has_native_bf16

    isa = capability()
    # -march=native may use AVX512-BF16 instructions: name the build after them too,
    # so a cache shared with a machine that lacks them is not reused there
    bf16 = "_bf16" if isa == "avx512" and cpu_has_native_bf16() else ""
    # and after the sources: two checkouts (or versions) sharing the cache never
    # overwrite each other's build
    return f"{prefix}_{isa}{bf16}_{source_hash(csrc)}"


def _compiled(csrc: Path) -> list:
    """The paths of the ``.cpp`` files of ``csrc``, the longest compilations first: ninja
    starts them in this order and runs a few at once. The bindings (pybind11's templates)
    take longest, then the larger files."""
    cpp = sorted((p for p in source_files(csrc) if p.suffix == ".cpp"),
                 key=lambda p: (p.name != "cpu_kernels.cpp", -p.stat().st_size, p.name))
    if not cpp:
        raise ValueError(f"srupp: no .cpp files in {csrc}: pass the folder of the kernels' sources")
    return [str(p) for p in cpp]


def _is_built(name: str, sources: list) -> bool:
    """Whether torch's extension cache holds build ``name`` of these very files, so that
    loading it compiles nothing: its library, and its ninja file naming each source (the
    same sources at another path, another checkout's, are compiled again)."""
    from torch.utils import cpp_extension

    try:  # where load() builds it (TORCH_EXTENSIONS_DIR or torch's default)
        directory = Path(cpp_extension._get_build_directory(name, verbose=False))
        ninja = (directory / "build.ninja").read_text()
    except Exception:  # not built there yet (or a torch without this helper)
        return False

    def in_ninja(source: str) -> bool:  # as torch writes a source's path there
        path = os.path.abspath(source)
        if sys.platform == "win32":
            path = path.replace(":", "$:")
        return f" {path.replace(' ', '$ ')}\n" in ninja

    return (directory / (name + cpp_extension.LIB_EXT)).exists() and all(map(in_ninja, sources))


def _announce_first_build(name: str, csrc: Path, sources: list) -> None:
    """One line on stderr before a build that compiles (it takes a while); nothing when
    the cache already holds it. (:func:`load` builds once per process at most.)"""
    if _is_built(name, sources):
        return
    where = "" if Path(csrc).resolve() == CSRC else f" of {csrc}"
    print(FIRST_BUILD_MESSAGE.format(where=where), file=sys.stderr, flush=True)


def build(verbose: bool = False, csrc: Optional[Path] = None, prefix: str = "srupp_cpu_kernels"):
    """Compile and import the extension now, raising if that fails (:func:`load`
    calls it once; ``verbose`` shows the compiler's output). ``csrc`` and ``prefix``
    build another version of the sources under another name (benchmarks/kernel_ab.py)."""
    from torch.utils.cpp_extension import load as _load

    csrc = CSRC if csrc is None else Path(csrc)
    sources = _compiled(csrc)
    isa = capability()
    name = extension_name(csrc, prefix)
    ldflags = [] if sys.platform in ("win32", "darwin") else ["-fopenmp"]
    _announce_first_build(name, csrc, sources)
    return _load(name=name, sources=sources, extra_cflags=_flags(isa), extra_ldflags=ldflags,
                 verbose=verbose)


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
                module = build()
                from .settings import attach_extension

                attach_extension(module)  # the tuning fields it keeps (layer_step_team)
                _module = module
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

    The kernel recycles its large output buffers (see ``csrc/recurrence.cpp``); at most
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
