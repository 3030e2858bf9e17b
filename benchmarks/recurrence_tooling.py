"""How to build the recurrence kernel: the C++ kernel against Numba and torch.compile.

The issue asked to choose the CPU kernel's tooling by measurement. This times
the forward of the SRU recurrence (k=3 with the skip term, fp32, no padding or
dropout; the training forward, which stores c for every step) written four ways,
all in this one process, alternating round by round:

- ``cpp``: srupp's fused C++ kernel (``torch.ops.srupp.sru_fwd``, at::vec,
  at::parallel_for over batch rows and unit chunks);
- ``numba`` / ``numba_fastmath``: the same loop nest as a Numba
  ``@njit(parallel=True)`` function (prange over batch rows, the inner loop over
  units left to LLVM's vectoriser), without and with ``fastmath``; skipped with
  a note when numba is not installed (``pip install numba``);
- ``compiled_step``: one time step as a ``torch.compile``d function (inductor
  fuses its element-wise ops into one C++ loop), called from a Python loop over
  time; compiling the whole loop would unroll L steps into one graph;
- ``reference``: srupp's plain PyTorch per-step loop.

For the two that have a backward here (``cpp`` and ``compiled_step``, through
autograd; numba's would be a second hand-written loop) it also times forward and
backward together. Every variant's h and c are checked against the reference.
Prints one JSON object. Run it with nothing else on the machine:

    .venv/bin/python benchmarks/recurrence_tooling.py [--L 512 --B 16 --d 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from srupp.ops import cpu, sru_recurrence, sru_recurrence_reference, use_backend


def numba_forward(fastmath: bool):
    """A Numba forward (h, c_all, c_last) of the k=3 recurrence, or None without numba."""
    try:
        import numba
        import numpy as np
    except ImportError:
        return None

    one = np.float32(1.0)

    @numba.njit(parallel=True, fastmath=fastmath, cache=False)
    def kernel(U, x, wc, bias, c0, scale, h, c_all, c_last):
        B, L, _, D = U.shape
        for b in numba.prange(B):
            c = c0[b].copy()
            for t in range(L):
                for j in range(D):
                    cj = c[j]
                    f = one / (one + np.exp(-(U[b, t, 1, j] + wc[0, j] * cj + bias[0, j])))
                    r = one / (one + np.exp(-(U[b, t, 2, j] + wc[1, j] * cj + bias[1, j])))
                    cn = f * cj + (one - f) * U[b, t, 0, j]
                    sk = x[b, t, j] * scale
                    h[b, t, j] = sk + r * (cn - sk)
                    c_all[b, t, j] = cn
                    c[j] = cn
            c_last[b] = c

    def forward(U, x, wc, bias, c0):
        B, L, _, D = U.shape
        h = torch.empty(B, L, D)
        c_all = torch.empty(B, L, D)
        c_last = torch.empty(B, D)
        kernel(U.numpy(), x.numpy(), wc.numpy(), bias.numpy(), c0.numpy(),
               np.float32(1.0), h.numpy(), c_all.numpy(), c_last.numpy())
        return h, c_last
    return forward


def compiled_step_forward():
    def step(u0, u1, u2, x, c, vf, vr, bf, br):
        f = torch.sigmoid(u1 + vf * c + bf)
        r = torch.sigmoid(u2 + vr * c + br)
        c = f * c + (1 - f) * u0
        return x + r * (c - x), c

    step = torch.compile(step, dynamic=False, fullgraph=True)

    def forward(U, x, wc, bias, c0):
        # unbind, not U[:, t]: the backward of one unbind is one stack, while each
        # indexing's backward would build a zero tensor the size of all of U
        c, hs = c0, []
        for u, xt in zip(U.unbind(1), x.unbind(1)):              # (B, 3, D), (B, D)
            h, c = step(u[:, 0], u[:, 1], u[:, 2], xt, c, wc[0], wc[1], bias[0], bias[1])
            hs.append(h)
        return torch.stack(hs, dim=1), c
    return forward


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", type=int, default=512)
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true",
                    help="leave out the torch.compile'd step (its first compile takes seconds)")
    ap.add_argument("--no-reference-timing", action="store_true",
                    help="check against the reference but do not time it (it is slow)")
    args = ap.parse_args()
    B, L, D = args.B, args.L, args.d
    g = torch.Generator().manual_seed(0)
    U = torch.randn(B, L, 3 * D, generator=g).view(B, L, 3, D)
    x = torch.randn(L, B, D, generator=g).transpose(0, 1)   # time-major, as the layers pass it
    wc = torch.rand(2, D, generator=g) * 2 - 1
    bias = torch.randn(2, D, generator=g)
    c0 = torch.randn(B, D, generator=g)
    gh = torch.randn(B, L, D, generator=g)
    result = {"shape": {"L": L, "B": B, "D": D, "k": 3, "dtype": "float32"},
              "threads": torch.get_num_threads(), "loadavg_before": os.getloadavg(),
              "notes": []}

    def reference(U, x, wc, bias, c0):
        return sru_recurrence_reference(U, x, wc, bias, c0)

    forwards = {}
    if cpu.is_available():
        forwards["cpp"] = lambda U, x, wc, bias, c0: torch.ops.srupp.sru_fwd(
            U, x, wc, bias, c0, None, None, 1.0, False, True)[:2]
    else:
        result["notes"].append(f"C++ kernel unavailable: {cpu.build_error()}")
    for name, fm in (("numba", False), ("numba_fastmath", True)):
        fn = numba_forward(fm)
        if fn is None:
            result["notes"].append("numba not installed: pip install numba")
            break
        forwards[name] = fn
    if not args.no_compile:
        forwards["compiled_step"] = compiled_step_forward()
    if not args.no_reference_timing:
        forwards["reference"] = reference

    # First calls: JIT compilation (numba, inductor) or the C++ build (cached on disk).
    with torch.no_grad():
        want_h, want_c = reference(U, x, wc, bias, c0)
        result["first_call_s"], result["max_abs_error"] = {}, {}
        for name, fn in forwards.items():
            start = time.perf_counter()
            h, c = fn(U, x, wc, bias, c0)
            result["first_call_s"][name] = round(time.perf_counter() - start, 2)
            result["max_abs_error"][name] = max((h - want_h).abs().max().item(),
                                                (c - want_c).abs().max().item())

    def fwd_bwd(name):
        Ur = U.detach().requires_grad_()
        xr = x.detach().requires_grad_()
        if name == "cpp":
            with use_backend("cpu"):
                h, _ = sru_recurrence(Ur, xr, wc, bias, c0)
        else:
            h, _ = forwards[name](Ur, xr, wc, bias, c0)
        h.backward(gh)

    train = [n for n in ("cpp", "compiled_step", "reference") if n in forwards]
    if "compiled_step" in forwards:
        fwd_bwd("compiled_step")  # compile the backward outside the timing
    times = {f"{n}/forward": [] for n in forwards}
    times.update({f"{n}/forward+backward": [] for n in train})
    for _ in range(args.rounds):
        for name, fn in forwards.items():
            with torch.no_grad():
                start = time.perf_counter()
                for _ in range(args.reps if name != "reference" else 1):
                    fn(U, x, wc, bias, c0)
                times[f"{name}/forward"].append(
                    (time.perf_counter() - start) / (args.reps if name != "reference" else 1))
        for name in train:
            reps = args.reps if name != "reference" else 1
            start = time.perf_counter()
            for _ in range(reps):
                fwd_bwd(name)
            times[f"{name}/forward+backward"].append((time.perf_counter() - start) / reps)
    ms = {k: round(1e3 * statistics.median(v), 2) for k, v in times.items()}
    result["ms"] = ms
    if "cpp/forward" in ms:
        # each timing over the C++ kernel's for the same work ("forward" or "forward+backward")
        result["slowdown_vs_cpp"] = {k: round(v / ms["cpp/" + k.split("/", 1)[1]], 2)
                                     for k, v in ms.items()}
    result["loadavg_after"] = os.getloadavg()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
