"""The C++ recurrence kernel against another build of it, alternating in one process.

For kernel development: build a second copy of the extension from another
source file (say, the previous commit's), check that both give the same results,
and time their forward (training mode) and backward in fp32 and bf16, alternating
round by round so that this machine's drift hits both alike. Prints one JSON
object with median times and the per-round speedup of the current build. Run it
with nothing else on the machine:

    git show HEAD~1:src/srupp/ops/csrc/cpu_kernels.cpp > /tmp/other.cpp
    .venv/bin/python benchmarks/kernel_ab.py /tmp/other.cpp [--L 256 --B 16 --d 512]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time

import torch
from torch.utils.cpp_extension import load

import srupp.ops.cpu_kernels as cpu_kernels


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("other", help="another version of src/srupp/ops/csrc/cpu_kernels.cpp")
    ap.add_argument("--L", type=int, default=256)
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    current = cpu_kernels.load()
    if current is None:
        raise SystemExit(f"the C++ kernel is unavailable: {cpu_kernels.build_error()}")
    tag = hashlib.sha1(open(args.other, "rb").read()).hexdigest()[:10]
    other = load(name=f"srupp_kernel_ab_{tag}", sources=[args.other],
                 extra_cflags=cpu_kernels._flags(cpu_kernels.capability()),
                 extra_ldflags=[] if os.name == "nt" else ["-fopenmp"])
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
