"""Time the SRU recurrence: the fused CPU kernel against the reference, fwd and bwd.

Prints one JSON object. Bandwidths are effective: the bytes a direction must move
at least (every large tensor it reads or writes, once) divided by its median time,
and are compared with the copy bandwidth of ``y.copy_(x)`` on a 200 MB tensor
(2 x nbytes / time) measured in the same run.

    forward  reads U, x, c0 and writes h and the per-step state c (training mode)
    backward reads U, x, c (stored), grad_h, and writes grad_U, grad_x, grad_c0

The kernel recycles its large output buffers (a training loop frees and re-asks
for the same sizes every step), so "forward" / "backward" are steady-state
timings; "*_fresh_pages" repeat them with that cache off, as a first call sees.

Run it on an otherwise idle machine (the JSON records os.getloadavg()).

    python benchmarks/recurrence.py                 # L=512, B=16, d=1024, k=3, fp32
    python benchmarks/recurrence.py --quick         # a small sanity run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

import srupp
from _common import median_seconds
from srupp.ops import cpu_kernels, sru_recurrence_reference


def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--L", type=int, default=512)
    p.add_argument("--B", type=int, default=16)
    p.add_argument("--d", type=int, default=1024, help="units D (one direction)")
    p.add_argument("--k", type=int, default=3, choices=(3, 4))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--ref-repeats", type=int, default=1)
    p.add_argument("--copy-mb", type=float, default=200.0)
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--quick", action="store_true", help="small shapes, for a sanity check")
    a = p.parse_args()
    if a.quick:
        a.L, a.B, a.d, a.repeats, a.copy_mb = 64, 4, 256, 5, 32.0

    load_before = os.getloadavg()
    dtype = getattr(torch, a.dtype)
    B, L, D, k = a.B, a.L, a.d, a.k
    g = torch.Generator().manual_seed(0)
    # Layouts as the layers produce them: U is a linear layer's (B, L, k*D) output,
    # x a batch-first view of a time-major (L, B, D) tensor.
    U = torch.randn(B, L, k * D, generator=g).to(dtype).view(B, L, k, D)
    x = torch.randn(L, B, D, generator=g).to(dtype).transpose(0, 1) if k == 3 else None
    wc = torch.rand(2, D, generator=g) * 2 - 1
    bias = torch.randn(2, D, generator=g)
    c0 = torch.randn(B, D, generator=g)
    grad_h = torch.randn(B, L, D, generator=g).to(dtype)
    result = {
        "torch": torch.__version__, "srupp": srupp.__version__,
        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "shape": {"L": L, "B": B, "D": D, "k": k, "dtype": a.dtype},
        "loadavg_before": [round(v, 2) for v in load_before],
    }

    # Copy bandwidth.
    n = int(a.copy_mb * 1e6 / 4)
    src = torch.randn(n)
    dst = torch.empty_like(src)
    t_copy = median_seconds(lambda: dst.copy_(src), max(a.repeats, 10), warmup=2)
    copy_bw = 2 * src.numel() * 4 / t_copy
    result["copy"] = {"mbytes": round(src.numel() * 4 / 1e6, 1), "s": t_copy,
                      "GBps": round(copy_bw / 1e9, 2)}
    del src, dst

    def report(name, t, moved):
        bw = moved / t
        return {"s": round(t, 6), "MB_moved": round(moved / 1e6, 1), "GBps": round(bw / 1e9, 2),
                "frac_of_copy": round(bw / copy_bw, 3), "tokens_per_s": round(B * L / t)}

    if not cpu_kernels.is_available():
        result["cpu_kernel"] = f"unavailable: {cpu_kernels.build_error()}"
    else:
        result["cpu_isa"] = cpu_kernels.load().capability()
        fwd = torch.ops.srupp.sru_fwd
        bwd = torch.ops.srupp.sru_bwd
        with torch.no_grad():
            h, c_last, c_all = fwd(U, x, wc, bias, c0, None, None, 1.0, False, True)
            t_f = median_seconds(lambda: fwd(U, x, wc, bias, c0, None, None, 1.0, False, True),
                                 a.repeats)
            t_i = median_seconds(lambda: fwd(U, x, wc, bias, c0, None, None, 1.0, False, False),
                                 a.repeats)
            t_b = median_seconds(lambda: bwd(U, x, wc, bias, c0, None, None, c_all, grad_h,
                                             None, 1.0, False, True), a.repeats)
            gU, gx, *_ = bwd(U, x, wc, bias, c0, None, None, c_all, grad_h, None, 1.0, False, True)
        fwd_bytes = nbytes(U, x, c0, h, c_all)
        inf_bytes = nbytes(U, x, c0, h)
        bwd_bytes = nbytes(U, x, c_all, grad_h, gU, gx, c0)
        result["cpu_kernel"] = {
            "forward": report("forward", t_f, fwd_bytes),
            "backward": report("backward", t_b, bwd_bytes),
            "forward_inference": report("forward_inference", t_i, inf_bytes),
        }
        # The same with the output-block cache off: every call writes fresh (huge)
        # pages, which the OS must fault in and zero -- the cost of a first call.
        limit = cpu_kernels.cache_limit()
        cpu_kernels.set_cache_limit(0)
        try:
            with torch.no_grad():
                t_f0 = median_seconds(
                    lambda: fwd(U, x, wc, bias, c0, None, None, 1.0, False, True), a.repeats)
                t_b0 = median_seconds(lambda: bwd(U, x, wc, bias, c0, None, None, c_all, grad_h,
                                                  None, 1.0, False, True), a.repeats)
        finally:
            cpu_kernels.set_cache_limit(limit)
        result["cpu_kernel"]["forward_fresh_pages"] = report("forward", t_f0, fwd_bytes)
        result["cpu_kernel"]["backward_fresh_pages"] = report("backward", t_b0, bwd_bytes)
        del h, c_last, c_all, gU, gx

    if not a.no_reference:
        leaves = [t.detach().clone().requires_grad_() if t is not None else None
                  for t in (U, x, wc, bias, c0)]
        t0 = time.perf_counter()
        h_ref, c_ref = sru_recurrence_reference(*leaves)
        t_rf = time.perf_counter() - t0
        t_rb = median_seconds(
            lambda: torch.autograd.grad(h_ref, [t for t in leaves if t is not None], grad_h,
                                        retain_graph=True), a.ref_repeats, warmup=0)
        if a.ref_repeats > 1:
            t_rf = median_seconds(lambda: sru_recurrence_reference(*leaves), a.ref_repeats - 1,
                                  warmup=0)
        result["reference"] = {
            "forward": report("forward", t_rf, nbytes(U, x, c0, h_ref)),
            "backward": report("backward", t_rb, nbytes(U, x, grad_h, U, x, c0)),
            "note": "autograd saves its own intermediates; bytes counted as for the kernel",
        }
        if isinstance(result.get("cpu_kernel"), dict):
            result["speedup_vs_reference"] = {
                "forward": round(t_rf / result["cpu_kernel"]["forward"]["s"], 1),
                "backward": round(t_rb / result["cpu_kernel"]["backward"]["s"], 1),
            }
    result["loadavg_after"] = [round(v, 2) for v in os.getloadavg()]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
