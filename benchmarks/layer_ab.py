"""The layer benchmark's training step under srupp's backend settings, side by side.

Times training steps (forward and backward) of the 2-layer SRU++ of
``benchmarks/layer.py`` (L=256, B=16, d=512, proj 128, causal) in fp32 and in
bf16 autocast, alternating round by round in this one process between:

- ``plain``: PyTorch's defaults (``SRUPP_MATMUL=aten``, ``SRUPP_ATTENTION=sdpa``);
- ``one_block``: srupp's paths, but the causal attention as one block over the
  whole square (no skipping of the masked blocks);
- ``auto``: srupp's paths as shipped;
- ``compiled`` (with ``--compile``): the model under ``torch.compile`` (inductor),
  where the dispatchers see a trace and pick ``F.linear`` and SDPA.

Prints one JSON object: median ms per step, and per-round speedups of each
setting over ``plain`` and of ``auto`` over ``one_block``. Run it with nothing
else on the machine:

    .venv/bin/python benchmarks/layer_ab.py [--rounds 7 --steps 3] [--compile]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics

import torch
from _common import (add_layer_shape_args, layer_model_and_input, layer_training_step,
                     seconds_per_call)

import srupp.ops as ops
from srupp import tune_cpu_allocator
from srupp.ops import sdpa


@contextlib.contextmanager
def setting(name: str):
    if name == "plain":
        with ops.use_matmul_backend("aten"), ops.use_attention_backend("sdpa"):
            yield
    elif name == "one_block":
        real = sdpa.causal_block
        sdpa.causal_block = lambda dtype: 1 << 30
        try:
            yield
        finally:
            sdpa.causal_block = real
    else:
        yield


def main():
    ap = argparse.ArgumentParser()
    add_layer_shape_args(ap)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round and setting")
    ap.add_argument("--compile", action="store_true", help="add the torch.compile'd model")
    args = ap.parse_args()
    tune_cpu_allocator()
    model, x = layer_model_and_input(args)
    compiled = torch.compile(model) if args.compile else None

    names = ("plain", "one_block", "auto") + (("compiled",) if args.compile else ())
    times = {(p, n): [] for p in ("fp32", "bf16") for n in names}
    for prec in ("fp32", "bf16"):
        for _ in range(args.rounds):
            for name in names:
                step = layer_training_step(compiled if name == "compiled" else model, x,
                                           prec == "bf16")
                with setting(name):  # one untimed step first (compiles once)
                    times[(prec, name)].append(seconds_per_call(step, args.steps))

    def per_round(prec, fast, slow):
        r = sorted(a / b for a, b in zip(times[(prec, slow)], times[(prec, fast)]))
        return {"median": round(statistics.median(r), 3), "min": round(r[0], 3),
                "max": round(r[-1], 3)}

    out = {"config": {"L": args.L, "B": args.B, "d": args.d, "proj_size": args.proj,
                      "rounds": args.rounds, "steps": args.steps,
                      "threads": torch.get_num_threads()},
           "loadavg_1m": os.getloadavg()[0],
           "ms_per_step": {f"{p}/{n}": round(1e3 * statistics.median(v), 1)
                           for (p, n), v in times.items()},
           "speedup_per_round": {
               f"{p}/{what}": per_round(p, fast, slow)
               for p in ("fp32", "bf16")
               for what, fast, slow in (("auto_over_plain", "auto", "plain"),
                                        ("one_block_over_plain", "one_block", "plain"),
                                        ("auto_over_one_block", "auto", "one_block"))
               + ((("compiled_over_auto", "compiled", "auto"),) if args.compile else ())}}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
