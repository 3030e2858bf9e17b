"""Decoding's few-row products by weight format: bf16 (rows and pair-packed), int8
(weight-only) and w8a8, against the copy of a buffer of the weights' bytes and the bf16
GEMM peak, in one process.

A decoding step multiplies one row (batch 1) by every weight matrix once, so each
product should read its weights at memory speed. Per shape (K input features, N
outputs) and rows R, this times, alternating in rounds:

* ``bf16``: srupp's ``linear_rows`` on bf16 weights (AVX512-BF16 dot products
  where the CPU has them);
* ``bf16_pairs``: ``linear_pairs_bf16`` on the same weights packed by
  ``pack_pairs_bf16`` (AVX512-BF16 CPUs only): what the fused decoding step multiplies
  bf16 layers by;
* ``int8``: ``linear_int8_rows`` (int8 weights widened to fp32, bf16 activations);
* ``w8a8``: ``linear_w8a8_rows`` (int8 weights, activations rounded to int8 per
  row, VNNI where the CPU has it), and its plain loop as ``w8a8_plain``;
* ``copy``: ``dst.copy_(src)`` of a buffer of each format's weight bytes (it
  reads and writes each byte: a product only reads, so shares above 1 can occur).

Shapes: ``cache`` (1024 × 4096: the weights stay in L2/L3 between calls),
``dram`` (4096 × 32768, 134 MB of int8: beyond any L3, as at paper size) and ``w3``
(256 × 3072: the 5M ``shakespeare-cpu`` model's largest product, which a 32-stream
serving step runs at 32 rows). Prints one JSON object: µs per call (median), GB/s of
weight bytes, the share of the copy bound, the share of the bf16 GEMM peak (measured
first, in this process; the bound of many rows), and each format's speed over bf16.
Run with nothing else on the machine:

    .venv/bin/python benchmarks/int8_kernels.py [--rounds 7] [--rows 1,8] [--shapes w3 --rows 1,8,32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from _common import bf16_gemm_peak, cpu_name, median_seconds

from srupp.ops import cpu_kernels
from srupp.ops.quant import (linear_int8_rows, linear_w8a8_rows, quantize_per_channel,
                             w8a8_vnni)
from srupp.ops.settings import cpu_has_native_bf16

SHAPES = {"cache": (1024, 4096), "dram": (4096, 32768), "w3": (256, 3072),
          "tiny": (100, 48)}  # tiny: tests


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", default="1,8", help="rows of x, comma-separated")
    ap.add_argument("--shapes", default="cache,dram", help=f"from {', '.join(SHAPES)}")
    a = ap.parse_args()
    if not cpu_kernels.is_available():
        print(json.dumps({"skipped": f"the C++ extension is unavailable "
                                     f"({cpu_kernels.build_error()})"}))
        return
    rows = [int(r) for r in a.rows.split(",")]
    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    peak = bf16_gemm_peak(0.2 if shapes == ["tiny"] else 2.0)
    out = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "native_bf16": cpu_has_native_bf16(), "w8a8_kernel": "vnni" if w8a8_vnni() else "plain",
           "bf16_gemm_peak_gflops": round(peak, 1),
           "loadavg_before": [round(v, 2) for v in os.getloadavg()], "shapes": {}}
    bf16_rows = cpu_kernels.function("linear_rows")
    pairs = cpu_kernels.load().linear_rows_bf16_native()
    formats = ["bf16"] + (["bf16_pairs"] if pairs else []) + ["int8", "w8a8", "w8a8_plain"]
    for name in shapes:
        K, N = SHAPES[name]
        g = torch.Generator().manual_seed(0)
        w = torch.randn(N, K, generator=g) / K ** 0.5
        q, scale = quantize_per_channel(w)
        wb = w.bfloat16()
        wp = cpu_kernels.function("pack_pairs_bf16")(wb) if pairs else None
        del w
        nbytes = {"bf16": wb.numel() * 2, "int8": q.numel() + scale.numel() * 4}
        nbytes["bf16_pairs"] = nbytes["bf16"]
        nbytes["w8a8"] = nbytes["w8a8_plain"] = nbytes["int8"]
        bufs = {k: (torch.empty(v, dtype=torch.uint8), torch.empty(v, dtype=torch.uint8))
                for k, v in (("bf16", nbytes["bf16"]), ("int8", nbytes["int8"]))}
        for R in rows:
            x = torch.randn(R, K, generator=g).bfloat16()
            calls = {
                "bf16": lambda: bf16_rows(x, wb, None),
                "bf16_pairs": lambda: cpu_kernels.function("linear_pairs_bf16")(x, wp, N, None),
                "int8": lambda: linear_int8_rows(x, q, scale, None),
                "w8a8": lambda: linear_w8a8_rows(x, q, scale, None),
                "w8a8_plain": lambda: linear_w8a8_rows(x, q, scale, None, True),
                "copy_bf16": lambda: bufs["bf16"][1].copy_(bufs["bf16"][0]),
                "copy_int8": lambda: bufs["int8"][1].copy_(bufs["int8"][0]),
            }
            if not pairs:
                del calls["bf16_pairs"]
            repeats = 20 if name == "dram" else 200
            times = {k: [] for k in calls}
            for _ in range(a.rounds):
                for k, fn in calls.items():
                    times[k].append(median_seconds(fn, repeats, warmup=2))
            med = {k: statistics.median(v) for k, v in times.items()}
            res = {"K": K, "N": N, "rows": R}
            for k in formats:
                copy = med["copy_bf16" if k.startswith("bf16") else "copy_int8"]
                res[k] = {"us": round(med[k] * 1e6, 1),
                          "GBps": round(nbytes[k] / med[k] / 1e9, 1),
                          "share_of_copy": round(copy / med[k], 2),
                          "share_of_gemm_peak": round(2 * R * K * N / med[k] / 1e9 / peak, 3),
                          "speed_over_bf16": round(med["bf16"] / med[k], 2)}
            for k in ("copy_bf16", "copy_int8"):
                n = nbytes[k.split("_")[1]]
                res[k] = {"us": round(med[k] * 1e6, 1), "GBps": round(n / med[k] / 1e9, 1)}
            out["shapes"][f"{name} R={R}"] = res
    out["loadavg_after"] = [round(v, 2) for v in os.getloadavg()]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
