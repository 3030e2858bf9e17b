"""Time the attention paths on the shapes SRU++ uses, forward and backward.

SRU++ attends in a small dimension (d′ = d/4, often one head) over short
windows, a shape the fused (flash) CPU kernel was not tuned for. This prints
one JSON object comparing, on causal attention, SDPA's default choice, its MATH
backend and srupp's explicit-matmul causal path
(``srupp.ops.attention_causal_matmul``, which ``srupp.ops.attend`` picks for
fp32, and for bf16 where the CPU multiplies bf16 natively): with its default
rows per block ("srupp_matmul"), as one block covering the whole square
("srupp_one_block", no skipping), and with ``--blocks`` sizes of your choice.
fp32 and bf16 by default (``--dtypes`` adds fp16), all in one process and
alternating round by round. Run it with nothing else on the machine:

    .venv/bin/python benchmarks/attention.py [--B 16 --L 128 --d 248 --heads 1] [--blocks 64 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from srupp.ops.attention import attention_causal_matmul

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--L", type=int, default=128)
    ap.add_argument("--d", type=int, default=248, help="d′, summed over heads")
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16")
    ap.add_argument("--blocks", type=int, nargs="*", default=[],
                    help="also time srupp's causal path with these rows per block")
    args = ap.parse_args()
    dts = [d.strip() for d in args.dtypes.split(",")]
    if not set(dts) <= set(DTYPES):
        raise SystemExit(f"--dtypes takes {', '.join(DTYPES)}, got {args.dtypes}")
    B, L, H = args.B, args.L, args.heads
    hd = args.d // H
    torch.manual_seed(0)

    def make(dtype):
        q, k, v = (torch.randn(B, H, L, hd, dtype=dtype, requires_grad=True) for _ in range(3))
        g = torch.randn(B, H, L, hd, dtype=dtype)
        return q, k, v, g

    def case(dtype, backend):
        q, k, v, g = make(dtype)

        def attend():
            if not isinstance(backend, list):  # srupp's causal path, rows per block (None: default)
                return attention_causal_matmul(q, k, v, block=backend)
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd():
            attend().backward(g)
            q.grad = k.grad = v.grad = None

        def fwd():
            with torch.no_grad():
                attend()
        return fwd_bwd, fwd

    backends = {"default": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                            SDPBackend.MATH],
                "math": [SDPBackend.MATH], "srupp_matmul": None,
                "srupp_one_block": L}
    for b in args.blocks:
        backends[f"srupp_block{b}"] = b
    cases = {f"{name}_{dt}": case(dtype, b) for name, b in backends.items()
             for dt, dtype in DTYPES.items() if dt in dts}
    times = {k: {"train": [], "infer": []} for k in cases}
    for fns in cases.values():  # warm-up
        fns[0](), fns[1]()
    for _ in range(args.rounds):
        for k, (train, infer) in cases.items():
            for mode, fn in (("train", train), ("infer", infer)):
                start = time.perf_counter()
                for _ in range(args.reps):
                    fn()
                times[k][mode].append((time.perf_counter() - start) / args.reps)
    ms = {k: {m: statistics.median(v) * 1e3 for m, v in t.items()} for k, t in times.items()}
    out = {"shape": {"B": B, "L": L, "d_proj": args.d, "heads": H}, "threads": torch.get_num_threads(),
           "loadavg": os.getloadavg(), "ms": ms,
           "math_speedup_over_default": {
               dt: {m: ms[f"default_{dt}"][m] / ms[f"math_{dt}"][m] for m in ("train", "infer")}
               for dt in dts},
           **{f"{name}_speedup_over_default": {
               dt: {m: ms[f"default_{dt}"][m] / ms[f"{name}_{dt}"][m]
                    for m in ("train", "infer")}
               for dt in dts} for name in backends if name.startswith("srupp")}}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
