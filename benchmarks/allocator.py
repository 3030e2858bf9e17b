"""Page faults, system time and step time with and without ``srupp.tune_cpu_allocator()``.

The allocator setting is process-wide and can't be undone, so each setting runs
in its own child process (one after the other, alternating over rounds). Each
child builds the layer benchmark's 2-layer SRU++ (L=256, B=16, d=512, d′=128),
warms up, then times training steps and reads ``getrusage`` around them.
Prints one JSON object with medians per setting. Run with nothing else on the
machine:

    .venv/bin/python benchmarks/allocator.py [--precision bf16|fp32] [--rounds 3 --steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import torch
import srupp
tuned = sys.argv[1] == "tuned" and srupp.tune_cpu_allocator()
from srupp.nn import SRUpp
bf16 = sys.argv[2] == "bf16"
steps = int(sys.argv[3])
torch.manual_seed(0)
L, B, d, P = 256, 16, 512, 128
m = SRUpp(d, d, P, num_layers=2, causal=True)
x = torch.randn(L, B, d)
def step():
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out, _ = m(x)
    out.float().sum().backward()
for _ in range(3):
    step()
r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
for _ in range(steps):
    step()
t1 = time.perf_counter(); r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"tuned": bool(tuned),
                  "minor_faults_per_step": (r1.ru_minflt - r0.ru_minflt) / steps,
                  "system_ms_per_step": (r1.ru_stime - r0.ru_stime) / steps * 1e3,
                  "ms_per_step": (t1 - t0) / steps * 1e3}))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    runs = {"default": [], "tuned": []}
    for _ in range(args.rounds):
        for mode in runs:
            out = subprocess.run([sys.executable, "-c", CHILD, mode, args.precision,
                                  str(args.steps)], capture_output=True, text=True, check=True)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    result = {"precision": args.precision, "rounds": args.rounds, "steps": args.steps,
              "loadavg_1m": os.getloadavg()[0], "applied": runs["tuned"][0]["tuned"]}
    for mode, rs in runs.items():
        result[mode] = {k: round(statistics.median(r[k] for r in rs), 2)
                        for k in ("minor_faults_per_step", "system_ms_per_step", "ms_per_step")}
    result["speedup"] = round(result["default"]["ms_per_step"] / result["tuned"]["ms_per_step"], 3)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
