"""The C++ recurrence kernel against another build of it, alternating in one process.

For kernel development: build a second copy of the extension from another
version of its sources (say, the previous commit's), check that both give the same
results, and time their forward (training mode) and backward in fp32 and bf16,
alternating round by round so that this machine's drift hits both alike. Prints one
JSON object with median times and the per-round speedup of the current build. Run it
with nothing else on the machine:

    .venv/bin/python benchmarks/kernel_ab.py HEAD~1 [--L 256 --B 16 --d 512]

The other version is a git revision (its src/srupp/ops/csrc), a folder holding
a version of src/srupp/ops/csrc, or a single .cpp file: a version from before the
kernels were split into several files. Of a version split into files, only what
the A/B compares is built: recurrence.cpp and its headers, bound by a two-function
module (a third of the whole extension's compile time); --whole-extension builds
every .cpp in it, as the package's own build does. The build is cached by the hash
of its files: a second run on the same sources compiles nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import srupp.ops.cpu_kernels as cpu_kernels

ROOT = Path(__file__).resolve().parents[1]
CSRC = "src/srupp/ops/csrc"  # the sources' folder in the repository


def _stable_folder(write) -> Path:
    """A folder under the temporary directory holding the files ``write(folder)`` writes,
    named after their hash and written once: later runs with the same sources find the
    same files at the same path, which the cached build names, and compile nothing."""
    root = Path(tempfile.gettempdir()) / "srupp_kernel_ab"
    root.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix="partial.", dir=root))
    write(partial)
    folder = root / cpu_kernels.source_hash(partial)
    try:
        partial.rename(folder)
    except OSError:  # written before (or meanwhile): keep that one
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def other_sources(other: str) -> Path:
    """The folder of the other version's sources (see the module's docstring)."""
    path = Path(other)
    if path.is_dir():
        return path
    if path.is_file():  # one file: a folder holding just it
        return _stable_folder(lambda folder: shutil.copyfile(path, folder / path.name))

    def git(*args: str) -> bytes:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True)
        if done.returncode != 0:
            raise SystemExit(f"{other!r} is neither a folder, a file nor a git revision here: "
                             f"git {' '.join(args)}: {done.stderr.decode().strip()}")
        return done.stdout

    commit = git("rev-parse", "--verify", f"{other}^{{commit}}").decode().strip()
    names = [n for n in git("ls-tree", "--name-only", f"{commit}:{CSRC}").decode().split()
             if n.endswith((".cpp", ".h"))]
    if not any(n.endswith(".cpp") for n in names):
        raise SystemExit(f"revision {other} has no .cpp file in {CSRC}")

    def write(folder: Path) -> None:
        for name in names:
            (folder / name).write_bytes(git("show", f"{commit}:{CSRC}/{name}"))

    return _stable_folder(write)


RECURRENCE = "recurrence.cpp"  # the file of a split version that holds sru_fwd / sru_bwd

# The other build's module when only its recurrence is built: the two kernels the A/B
# calls, bound as the package's cpu_kernels.cpp binds them (the GIL let go).
RECURRENCE_BINDINGS = """\
// written by benchmarks/kernel_ab.py: the recurrence alone, as a Python module
#include "common.h"

#include <torch/csrc/utils/pybind.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("sru_fwd", &srupp_cpu::sru_fwd_cpu, "SRU recurrence forward (CPU)", nogil);
  m.def("sru_bwd", &srupp_cpu::sru_bwd_cpu, "SRU recurrence backward (CPU)", nogil);
}
"""


def recurrence_only(folder: Path) -> Path:
    """A folder holding ``folder``'s recurrence.cpp, its headers and RECURRENCE_BINDINGS,
    or ``folder`` itself when it has no recurrence.cpp (a single-file version)."""
    if not (folder / RECURRENCE).is_file():
        return folder

    def write(out: Path) -> None:
        for path in folder.iterdir():
            if path.name == RECURRENCE or path.suffix == ".h":
                shutil.copyfile(path, out / path.name)
        (out / "kernel_ab_bindings.cpp").write_text(RECURRENCE_BINDINGS)

    return _stable_folder(write)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("other", help="another version of the kernels' sources: a git revision, "
                    "a folder like src/srupp/ops/csrc, or a single .cpp file")
    ap.add_argument("--L", type=int, default=256)
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--whole-extension", action="store_true",
                    help="build every .cpp of the other version, not its recurrence alone")
    args = ap.parse_args()
    current = cpu_kernels.load()
    if current is None:
        raise SystemExit(f"the C++ kernel is unavailable: {cpu_kernels.build_error()}")
    # its own name (prefix and hash): a second library even for the same sources
    sources = other_sources(args.other)
    if not args.whole_extension:
        sources = recurrence_only(sources)
    other = cpu_kernels.build(csrc=sources, prefix="srupp_kernel_ab")
    builds = {"current": current, "other": other}

    B, L, D = args.B, args.L, args.d
    g = torch.Generator().manual_seed(0)
    result = {"shape": {"L": L, "B": B, "D": D, "k": 3}, "threads": torch.get_num_threads(),
              "loadavg_before": os.getloadavg(), "max_abs_difference": {}, "ms": {},
              "current_speedup_per_round": {}}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[-1]
        U = torch.randn(B, L, 3 * D, generator=g).to(dtype).view(B, L, 3, D)
        x = torch.randn(B, L, D, generator=g).to(dtype)
        wc = torch.rand(2, D, generator=g) * 2 - 1
        bias = torch.randn(2, D, generator=g)
        c0 = torch.randn(B, D, generator=g)
        gh = torch.randn(B, L, D, generator=g).to(dtype)

        def fwd(mod):
            return mod.sru_fwd(U, x, wc, bias, c0, None, None, 1.0, False, True)

        def bwd(mod, c_all):
            return mod.sru_bwd(U, x, wc, bias, c0, None, None, c_all, gh, None, 1.0, False, True)

        outs = {k: fwd(m) for k, m in builds.items()}
        grads = {k: bwd(m, outs[k][2]) for k, m in builds.items()}
        diff = max((a.float() - b.float()).abs().max().item()
                   for a, b in zip(list(outs["current"]) + list(grads["current"]),
                                   list(outs["other"]) + list(grads["other"])))
        result["max_abs_difference"][name] = diff
        c_all = outs["current"][2]
        times = {(k, d): [] for k in builds for d in ("forward", "backward")}
        for _ in range(args.rounds):
            for k, m in builds.items():
                for direction, fn in (("forward", lambda: fwd(m)), ("backward", lambda: bwd(m, c_all))):
                    fn()
                    start = time.perf_counter()
                    for _ in range(args.reps):
                        fn()
                    times[(k, direction)].append((time.perf_counter() - start) / args.reps)
        for direction in ("forward", "backward"):
            cur, oth = times[("current", direction)], times[("other", direction)]
            r = sorted(o / c for c, o in zip(cur, oth))
            result["ms"][f"{name}/{direction}"] = {
                "current": round(1e3 * statistics.median(cur), 3),
                "other": round(1e3 * statistics.median(oth), 3)}
            result["current_speedup_per_round"][f"{name}/{direction}"] = {
                "median": round(statistics.median(r), 3), "min": round(r[0], 3),
                "max": round(r[-1], 3)}
    result["loadavg_after"] = os.getloadavg()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
