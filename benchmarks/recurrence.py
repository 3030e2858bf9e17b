"""Time the SRU recurrence kernel srupp routes to, forward and backward, against copy bandwidth.

Prints one JSON object. Bandwidths are effective: the bytes a direction must move
at least (every large tensor it reads or writes, once) divided by its median time,
and are compared with the copy bandwidth of ``y.copy_(x)`` on a 200 MB tensor
(2 x nbytes / time) measured on the same device in the same run, or given
(``--copy-gbps``, as gpu_check.py passes its bounds step's).

    forward  reads U, x, c0 and writes h and the per-step state c (training mode)
    backward reads U, x, c (stored), c0, grad_h, and writes grad_U, grad_x

``rows`` holds one row per dtype and length, timed on the kernel srupp routes
those tensors to (``srupp.ops.recurrence.route``): the C++ kernel on the CPU, the
Triton kernel on CUDA. ``--triton`` on the CPU (with TRITON_INTERPRET=1) adds the
Triton kernel at the first length, under its interpreter: the path a GPU takes,
exercised (its times mean nothing).

On the CPU, ``cpu_kernel`` gives the C++ kernel's first row in detail: forward
and backward, forward inference (no per-step state), and "*_fresh_pages". The
kernel recycles its large output buffers (a training loop frees and re-asks for
the same sizes every step), so "forward" / "backward" are steady-state timings;
"*_fresh_pages" repeat them with that cache off, as a first call sees.

Run it on an otherwise idle machine (the JSON records os.getloadavg()).

    python benchmarks/recurrence.py                 # L=512, B=16, d=1024, k=3, fp32
    python benchmarks/recurrence.py --quick         # a small sanity run
    PYTHONPATH=src python3 benchmarks/recurrence.py --device cuda --d 2048 \\
        --dtype float32 bfloat16 float16 --L 512 1024 2048 4096
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
from srupp.ops import cpu_kernels, recurrence, sru_recurrence_reference

# --dtype's names -> the rows' (and gpu_check's) short names
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def make_inputs(B: int, L: int, D: int, k: int, dtype, device, seed: int = 0) -> tuple:
    """(U, x, weight_c, bias, c0, grad_h), laid out as the layers produce them: U is
    a linear layer's (B, L, k*D) output, x a batch-first view of a time-major (L, B, D)
    tensor (None for k = 4). Drawn on the CPU from ``seed``, then moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    U = torch.randn(B, L, k * D, generator=g).to(device, dtype).view(B, L, k, D)
    x = torch.randn(L, B, D, generator=g).to(device, dtype).transpose(0, 1) if k == 3 else None
    wc = (torch.rand(2, D, generator=g) * 2 - 1).to(device)
    bias = torch.randn(2, D, generator=g).to(device)
    c0 = torch.randn(B, D, generator=g).to(device)
    grad_h = torch.randn(B, L, D, generator=g).to(device, dtype)
    return U, x, wc, bias, c0, grad_h


def copy_bandwidth(device, mbytes: float, repeats: int) -> dict:
    """``y.copy_(x)`` on an fp32 tensor of ``mbytes``: the bytes read and written over
    its median time."""
    src = torch.randn(int(mbytes * 1e6 / 4), device=device)
    dst = torch.empty_like(src)
    s = median_seconds(lambda: dst.copy_(src), max(repeats, 10), warmup=2, device=device)
    return {"mbytes": round(src.numel() * 4 / 1e6, 1), "s": s,
            "GBps": round(2 * src.numel() * 4 / s / 1e9, 2)}


def time_kernel(kernels, U, x, wc, bias, c0, grad_h, copy_GBps, reps: int,
                config=None) -> dict:
    """Training forward (per-step state kept) and backward of one kernel module
    (``srupp.ops.recurrence.kernels``'s; the Triton one takes a launch ``config``):
    median milliseconds, the bytes each direction moves, effective GB/s and, given
    the copy bandwidth, their share of it."""
    kw = {} if config is None else {"config": config}
    fwd = lambda: kernels.sru_fwd(U, x, wc, bias, c0, None, None, 1.0, False, True,  # noqa: E731
                                  **kw)
    h, _, c_all = fwd()
    bwd = lambda: kernels.sru_bwd(U, x, wc, bias, c0, None, None, c_all, grad_h,  # noqa: E731
                                  None, 1.0, False, True, **kw)
    grad_U, grad_x = bwd()[:2]
    moved = {"forward": nbytes(U, x, c0, h, c_all),
             "backward": nbytes(U, x, c0, c_all, grad_h, grad_U, grad_x)}
    device, warmup = U.device, 1 if reps < 3 else 2
    ms = {"forward": median_seconds(fwd, reps, warmup, device=device) * 1e3,
          "backward": median_seconds(bwd, reps, warmup, device=device) * 1e3}
    row = {}
    for d in ("forward", "backward"):
        row[f"{d}_ms"] = float(f"{ms[d]:.4g}")
        row[f"{d}_bytes"] = moved[d]
        row[f"{d}_GBps"] = float(f"{moved[d] / ms[d] / 1e6:.4g}")
    if copy_GBps:
        for d in ("forward", "backward"):
            row[f"{d}_share"] = float(f"{moved[d] / ms[d] / 1e6 / copy_GBps:.3g}")
    return row


def cpu_kernel_detail(row: dict, U, x, wc, bias, c0, grad_h, copy_GBps, repeats: int) -> dict:
    """The C++ kernel's row in detail: its forward and backward, forward inference (no
    per-step state), and both directions again with the kernel's output-block cache
    off: every call then writes fresh (huge) pages, which the OS must fault in and
    zero (the cost of a first call)."""
    mod = cpu_kernels.load()
    B, L = U.shape[:2]

    def report(s, moved):
        bw = moved / s
        return {"s": round(s, 6), "MB_moved": round(moved / 1e6, 1), "GBps": round(bw / 1e9, 2),
                "frac_of_copy": round(bw / 1e9 / copy_GBps, 3), "tokens_per_s": round(B * L / s)}

    infer = lambda: mod.sru_fwd(U, x, wc, bias, c0, None, None, 1.0, False, False)  # noqa: E731
    t_i = median_seconds(infer, repeats)
    out = {d: report(row[f"{d}_ms"] / 1e3, row[f"{d}_bytes"]) for d in ("forward", "backward")}
    out["forward_inference"] = report(t_i, nbytes(U, x, c0, infer()[0]))
    limit = cpu_kernels.cache_limit()
    cpu_kernels.set_cache_limit(0)
    try:
        fresh = time_kernel(mod, U, x, wc, bias, c0, grad_h, copy_GBps, repeats)
    finally:
        cpu_kernels.set_cache_limit(limit)
    for d in ("forward", "backward"):
        out[f"{d}_fresh_pages"] = report(fresh[f"{d}_ms"] / 1e3, fresh[f"{d}_bytes"])
    return out


def reference_timings(U, x, wc, bias, c0, grad_h, repeats: int) -> dict:
    """The plain PyTorch reference (autograd) at the same inputs: forward once (or the
    median of ``repeats - 1``), backward the median of ``repeats``."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None
              for t in (U, x, wc, bias, c0)]
    t0 = time.perf_counter()
    h_ref, _ = sru_recurrence_reference(*leaves)
    t_f = time.perf_counter() - t0
    t_b = median_seconds(
        lambda: torch.autograd.grad(h_ref, [t for t in leaves if t is not None], grad_h,
                                    retain_graph=True), repeats, warmup=0, device=U.device)
    if repeats > 1:
        t_f = median_seconds(lambda: sru_recurrence_reference(*leaves), repeats - 1,
                             warmup=0, device=U.device)
    B, L = U.shape[:2]

    def report(s, moved):
        return {"s": round(s, 6), "MB_moved": round(moved / 1e6, 1),
                "GBps": round(moved / s / 1e9, 2), "tokens_per_s": round(B * L / s)}

    return {"forward": report(t_f, nbytes(U, x, c0, h_ref)),
            "backward": report(t_b, nbytes(U, x, grad_h, U, x, c0)),
            "note": "autograd saves its own intermediates; bytes counted as for the kernel"}


def measure(a) -> dict:
    """The JSON object: the copy bandwidth, a row per dtype and length, the C++
    kernel's detail (CPU), the reference. ``a``: :func:`parse_args`'s namespace."""
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("recurrence.py: --device cuda, but torch sees no CUDA device here")
    result = {
        "torch": torch.__version__, "srupp": srupp.__version__, "device": str(dev),
        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "shape": {"L": a.L, "B": a.B, "D": a.d, "k": a.k, "dtype": a.dtype},
        "loadavg_before": [round(v, 2) for v in os.getloadavg()],
    }
    if dev.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(dev)
    result["copy"] = ({"GBps": a.copy_gbps, "given": True} if a.copy_gbps
                      else copy_bandwidth(dev, a.copy_mb, a.repeats))
    copy = result["copy"]["GBps"]
    cpu_ok = dev.type == "cpu" and cpu_kernels.is_available()
    if dev.type == "cpu":
        result["cpu_isa"] = cpu_kernels.load().capability() if cpu_ok else None
        if not cpu_ok:
            result["cpu_kernel"] = f"unavailable: {cpu_kernels.build_error()}"
    interpreted = dev.type == "cpu" and a.triton
    rows = []
    for name in a.dtype:
        for L in a.L:
            t = make_inputs(a.B, L, a.d, a.k, getattr(torch, name), dev, seed=L)
            routed = recurrence.route(*t[:5], None)
            # (the interpreter is slow: one length shows that the path works)
            extra = ["triton"] if interpreted and L == a.L[0] else []
            for kernel in dict.fromkeys([routed, *extra]):
                row = {"dtype": DTYPES[name], "L": L, "B": a.B, "D": a.d, "kernel": kernel}
                if kernel == "reference":  # (the C++ kernel computes no fp16)
                    rows.append({**row, "skipped": "no fast kernel for this dtype here"})
                    continue
                reps = 1 if kernel == "triton" and interpreted else a.repeats
                row.update(time_kernel(recurrence.kernels(t[0], kernel == "triton"), *t,
                                       copy, reps))
                rows.append(row)
                if kernel == "cpu" and "cpu_kernel" not in result:
                    result["cpu_kernel"] = cpu_kernel_detail(row, *t, copy, a.repeats)
            del t
    shares = [min(r["forward_share"], r["backward_share"]) for r in rows if "forward_share" in r]
    result["rows"], result["worst_share"] = rows, min(shares) if shares else None

    if not a.no_reference:
        first = next((r for r in rows if "forward_ms" in r), None)
        t = make_inputs(a.B, a.L[0], a.d, a.k, getattr(torch, a.dtype[0]), dev, seed=a.L[0])
        result["reference"] = reference_timings(*t, a.ref_repeats)
        if first is not None and first["L"] == a.L[0] and first["dtype"] == DTYPES[a.dtype[0]]:
            result["speedup_vs_reference"] = {
                d: round(result["reference"][d]["s"] / (first[f"{d}_ms"] / 1e3), 1)
                for d in ("forward", "backward")}
    result["loadavg_after"] = [round(v, 2) for v in os.getloadavg()]
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu",
                   help="cpu, or cuda: the kernel srupp routes that device's tensors to")
    p.add_argument("--L", type=int, nargs="+", default=[512], help="lengths: a row each")
    p.add_argument("--B", type=int, default=16)
    p.add_argument("--d", type=int, default=1024, help="units D (one direction)")
    p.add_argument("--k", type=int, default=3, choices=(3, 4))
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=tuple(DTYPES),
                   help="dtypes: a row each, at each length")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--ref-repeats", type=int, default=1)
    p.add_argument("--copy-mb", type=float, default=200.0)
    p.add_argument("--copy-gbps", type=float, default=None,
                   help="the device's copy bandwidth, measured elsewhere: not measured again")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--triton", action="store_true",
                   help="on the CPU, the Triton kernel too, at the first length, under "
                        "TRITON_INTERPRET=1 (slow: the GPU's path exercised, not timed)")
    p.add_argument("--quick", action="store_true", help="small shapes, for a sanity check")
    a = p.parse_args(argv)
    if a.triton and a.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--triton on the CPU runs Triton's interpreter: set TRITON_INTERPRET=1")
    if a.quick:
        a.L, a.B, a.d, a.repeats, a.copy_mb = [64], 4, 256, 5, 32.0
    return a


def main(argv=None):
    print(json.dumps(measure(parse_args(argv)), indent=2))


if __name__ == "__main__":
    main()
