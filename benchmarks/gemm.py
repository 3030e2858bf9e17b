"""fp32 GEMM on CPU: PyTorch's default (MKL) against oneDNN, on SRU++'s shapes.

This is the measurement behind ``srupp.ops.linear``'s rule (oneDNN for the
forward ``x @ Wᵀ`` and the input gradient ``g @ W``; MKL for the weight gradient
``gᵀ @ x``). Shapes are the layer benchmark's (B·L = 4096 rows, d = 512,
d′ = 128, k·D = 1536). Alternating rounds in one process; prints one JSON object
with GFLOP/s medians and oneDNN's speed-up. Run with nothing else on the machine:

    .venv/bin/python benchmarks/gemm.py [--rows 4096 --rounds 7 --reps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from _common import seconds_per_call

from srupp.ops.matmul import _onednn_mm, onednn_available


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not onednn_available():
        print(json.dumps({"note": "this torch build has no oneDNN fp32 linear op"}))
        return
    M = args.rows
    # (K, N) of W1, W2, W3 in the layer: y = x @ Wᵀ with x (M, K), W (N, K)
    shapes = {"W1 512->128": (512, 128), "W2 128->256": (128, 256), "W3 128->1536": (128, 1536)}
    cases = {}
    for name, (K, N) in shapes.items():
        x, w, g = torch.randn(M, K), torch.randn(N, K), torch.randn(M, N)
        cases[(name, "forward")] = (lambda x=x, w=w: x @ w.t(), lambda x=x, w=w: _onednn_mm(x, w))
        cases[(name, "grad_input")] = (lambda g=g, w=w: g @ w, lambda g=g, w=w: _onednn_mm(g, w.t()))
        cases[(name, "grad_weight")] = (lambda g=g, x=x: g.t() @ x,
                                        lambda g=g, x=x: _onednn_mm(g.t(), x.t()))
    flops = {key: 2 * M * shapes[key[0]][0] * shapes[key[0]][1] for key in cases}
    times = {key: ([], []) for key in cases}
    for _ in range(args.rounds):
        for key, (mkl, dnn) in cases.items():
            times[key][0].append(seconds_per_call(mkl, args.reps))
            times[key][1].append(seconds_per_call(dnn, args.reps))
    out = {"rows": M, "threads": torch.get_num_threads(), "loadavg_1m": os.getloadavg()[0],
           "gflops": {}, "onednn_speedup": {}}
    for (name, op), (a, b) in times.items():
        ta, tb = statistics.median(a), statistics.median(b)
        out["gflops"][f"{name} {op}"] = {"mkl": round(flops[(name, op)] / ta / 1e9),
                                         "onednn": round(flops[(name, op)] / tb / 1e9)}
        out["onednn_speedup"][f"{name} {op}"] = round(ta / tb, 2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
