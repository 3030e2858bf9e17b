"""How fast can the layer benchmark's training step get with today's kernels?

``benchmarks/layer.py`` times a whole SRU++ training step. This script splits
that step into its three kinds of heavy work and times each one alone, at the
exact shapes, dtypes and strides the step gives it:

- ``projections``: every bias-free linear (W1, W2, W3 of each layer), forward
  and backward, through the layers' own modules (so srupp's GEMM dispatch and
  autocast's weight casts are included);
- ``attention``: ``srupp.ops.attend`` forward and backward, as each layer calls it;
- ``recurrence``: ``srupp.ops.sru_recurrence`` forward and backward, as each layer calls it.

The inputs are captured from one real step (hooks on the modules, wrappers on
the two functions), so nothing about the shapes is re-derived here. The sum of
the three is the *floor*: the step's time if everything else (LayerNorm,
residuals, casts, the autograd engine) cost nothing and each piece ran as fast
together as it does alone. Against the reference package's step, timed in the
same rounds, it gives the most the ratio could reach with these kernels:
``reference step / floor``.

Prints one JSON object; everything alternates round by round in one process.
Run it with nothing else on the machine:

    .venv/bin/python benchmarks/layer_floor.py [--rounds 5 --reps 3] [--L 256 --B 16 --d 512 --proj 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Callable, Dict, List

import torch
from _common import (add_layer_shape_args, causal_mask, layer_model_and_input,
                     layer_training_step, reference_call, reference_layer, seconds_per_call)

from torch.utils.flop_counter import FlopCounterMode

import srupp.nn
import srupp.ops as ops
from srupp import tune_cpu_allocator
from srupp.ops import linear, use_matmul_backend

PIECES = ("projections", "attention", "recurrence")


def _detached(a, keep_grad: bool = True):
    """A leaf copy of a captured argument that requires grad where the original did."""
    if not isinstance(a, torch.Tensor):
        return a
    # same strides as the original (k and v are strided halves of one buffer)
    t = torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device)
    t.copy_(a.detach())
    return t.requires_grad_(keep_grad and a.requires_grad and t.is_floating_point())


def _replay(fn: Callable, args: tuple, kwargs: dict, autocast: bool) -> Callable[[], None]:
    """A closure running ``fn`` forward and backward on (copies of) the captured inputs.

    The upstream gradient is fixed random data of each floating output's shape,
    as the real backward would bring.
    """
    args = tuple(_detached(a) for a in args)
    kwargs = {k: _detached(v) for k, v in kwargs.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        outs = fn(*args, **kwargs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    keep = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
    grads = [torch.randn_like(outs[i]) for i in keep]

    leaves = [t for t in (*args, *kwargs.values())
              if isinstance(t, torch.Tensor) and t.requires_grad]

    def run():
        for t in leaves:  # the real step passes these gradients on, it does not sum them
            t.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            o = fn(*args, **kwargs)
        o = o if isinstance(o, tuple) else (o,)
        torch.autograd.backward([o[i] for i in keep], grads)
    return run


def capture_pieces(model, x: torch.Tensor, autocast: bool) -> Dict[str, List[Callable]]:
    """Run one training step of ``model`` on ``x`` and return, per piece, one replay
    closure for every call the step made."""
    calls: Dict[str, list] = {p: [] for p in PIECES}
    hooks = [mod.register_forward_pre_hook(
                 lambda mod, inp: calls["projections"].append((mod, inp, {})))
             for mod in model.modules() if isinstance(mod, torch.nn.Linear)]

    # The layers call srupp.ops.attend and srupp.ops.sru_recurrence through
    # names bound in srupp.nn's modules: wrap every such binding, whichever
    # module of the package it is in.
    sites = []
    for piece, fn in (("attention", ops.attend), ("recurrence", ops.sru_recurrence)):
        def spy(*a, _piece=piece, _fn=fn, **k):
            calls[_piece].append((_fn, a, k))
            return _fn(*a, **k)
        for name, module in list(sys.modules.items()):
            if name == srupp.nn.__name__ or name.startswith(srupp.nn.__name__ + "."):
                sites += [(module, attr, fn, spy) for attr, value in list(vars(module).items())
                          if value is fn]
    for module, attr, _, spy in sites:
        setattr(module, attr, spy)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, _ = model(x)
        out.float().sum().backward()
    finally:
        for module, attr, fn, _ in sites:
            setattr(module, attr, fn)
        for h in hooks:
            h.remove()
    return {p: [_replay(fn, a, k, autocast) for fn, a, k in calls[p]] for p in PIECES}


def main():
    ap = argparse.ArgumentParser()
    add_layer_shape_args(ap)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--peak-n", type=int, default=2048,
                    help="side of the square GEMM that gives this machine's best GEMM rate")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the reference package's step (no ceiling is computed)")
    args = ap.parse_args()
    tune_cpu_allocator()  # as benchmarks/layer.py and the srupp CLI
    model, x = layer_model_and_input(args)
    timed: Dict[str, Callable[[], None]] = {}
    projection_flops, calls = {}, {}
    n = args.peak_n
    for prec in ("fp32", "bf16"):
        ac = prec == "bf16"
        timed[f"{prec}/step"] = layer_training_step(model, x, ac)
        for piece, runs in capture_pieces(model, x, ac).items():
            timed[f"{prec}/{piece}"] = (lambda runs=runs: [r() for r in runs])
            calls[piece] = len(runs)
        # counted on PyTorch's own matmuls (FlopCounterMode has no formula for
        # oneDNN's linear op); the products are the same
        with use_matmul_backend("aten"), FlopCounterMode(display=False) as counter:
            timed[f"{prec}/projections"]()
        projection_flops[prec] = counter.get_total_flops()
        # the best rate this machine's GEMM reaches: one large square product,
        # through srupp's own dispatch (oneDNN for fp32 here)
        a = torch.randn(n, n, dtype=torch.bfloat16 if ac else torch.float32)
        timed[f"{prec}/square_gemm"] = (lambda a=a: linear(a, a))
    notes = []
    if not args.no_reference:
        try:
            ref = reference_layer(args)
            timed["reference/step"] = reference_call(ref, x, causal_mask(args.L), train=True)
        except Exception as e:  # noqa: BLE001 - report why and go on
            notes.append(f"reference package unavailable: {e}")

    times: Dict[str, List[float]] = {k: [] for k in timed}
    for _ in range(args.rounds):
        for name, fn in timed.items():
            times[name].append(seconds_per_call(fn, args.reps))
    ms = {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}

    result = {"config": {"L": args.L, "B": args.B, "d": args.d, "proj_size": args.proj,
                         "num_layers": 2,
                         "threads": torch.get_num_threads(), "torch": torch.__version__,
                         "rounds": args.rounds, "reps": args.reps, "calls_per_step": calls},
              "loadavg_1m": os.getloadavg()[0], "ms": ms, "precisions": {}}
    targets = {"fp32": 5.0, "bf16": 8.0}  # the training goals against the reference
    for prec in ("fp32", "bf16"):
        floor = sum(ms[f"{prec}/{p}"] for p in PIECES)
        step_ms = ms[f"{prec}/step"]
        gemm_rate = 2 * n ** 3 / (ms[f"{prec}/square_gemm"] / 1e3)
        proj_rate = projection_flops[prec] / (ms[f"{prec}/projections"] / 1e3)
        # the floor again, with the projections' products at the square GEMM's rate
        floor_at_peak = (projection_flops[prec] / gemm_rate * 1e3
                         + ms[f"{prec}/attention"] + ms[f"{prec}/recurrence"])
        r = {"floor_ms": round(floor, 2), "step_ms": step_ms,
             "everything_else_ms": round(step_ms - floor, 2),
             "share_of_step": {p: round(ms[f"{prec}/{p}"] / step_ms, 3) for p in PIECES},
             "projection_flop": int(projection_flops[prec]),
             "projection_gflops_per_s": round(proj_rate / 1e9, 1),
             "square_gemm_gflops_per_s": round(gemm_rate / 1e9, 1),
             "floor_with_projections_at_square_gemm_rate_ms": round(floor_at_peak, 2)}
        if "reference/step" in ms:
            ref_ms = ms["reference/step"]
            r["ratio_to_reference"] = round(ref_ms / step_ms, 2)
            r["ceiling_ratio_to_reference"] = round(ref_ms / floor, 2)
            r["ceiling_with_projections_at_square_gemm_rate"] = round(ref_ms / floor_at_peak, 2)
            r["target_ratio"] = targets[prec]
            # The floor per round, against that round's reference step.
            per_round = sorted(
                times["reference/step"][i] / sum(times[f"{prec}/{p}"][i] for p in PIECES)
                for i in range(args.rounds))
            r["ceiling_per_round"] = {"median": round(statistics.median(per_round), 2),
                                      "min": round(per_round[0], 2),
                                      "max": round(per_round[-1], 2)}
        result["precisions"][prec] = r
    if notes:
        result["notes"] = notes
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
