"""Time a 2-layer SRU++ against the reference package, nn.LSTM and a Transformer.

Prints one JSON object. All contenders run in this one process, alternating
round by round, and the medians are reported with ratios to the reference
package (``sru==3.0.0.dev6``, always fp32). Run it with nothing else on the
machine:

    .venv/bin/python benchmarks/layer.py [--rounds 5] [--L 256 --B 16 --d 512 --proj 128]
        [--ablate-recurrence] [--compile]

By default the process first calls ``srupp.tune_cpu_allocator()`` (as the
``srupp`` CLI does), which applies to all contenders alike; ``--no-tune-allocator``
measures with glibc's defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from _common import (add_layer_shape_args, causal_mask, layer_model_and_input,
                     layer_training_step, reference_call, reference_layer, seconds_per_call)
from torch import nn


def main():
    ap = argparse.ArgumentParser()
    add_layer_shape_args(ap)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-tune-allocator", action="store_true",
                    help="leave glibc's malloc at its defaults (see srupp.allocator); the "
                         "setting is process-wide, so it applies to every contender alike")
    ap.add_argument("--ablate-recurrence", action="store_true",
                    help="also time the srupp stack with its recurrence replaced by one "
                         "element-wise op, to see what the layer around it costs")
    ap.add_argument("--compile", action="store_true",
                    help="also time the srupp stack under torch.compile (its compilation, "
                         "the first calls, is reported apart as compile_s)")
    args = ap.parse_args()
    tuned = False
    if not args.no_tune_allocator:
        from srupp import tune_cpu_allocator
        tuned = tune_cpu_allocator()
    L, B, d, P = args.L, args.B, args.d, args.proj
    mine, x = layer_model_and_input(args)
    contenders = {}

    def srupp_infer(model, bf16: bool):
        def run():
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                model(x)
        return run

    for dt in ("fp32", "bf16"):
        contenders[f"srupp_{dt}"] = (layer_training_step(mine, x, dt == "bf16"),
                                     srupp_infer(mine, dt == "bf16"))

    compile_s = {}
    if args.compile:
        import time

        compiled = torch.compile(mine)
        for dt in ("fp32", "bf16"):
            name = f"srupp_{dt}_compiled"
            contenders[name] = (layer_training_step(compiled, x, dt == "bf16"),
                                srupp_infer(compiled, dt == "bf16"))
            t0 = time.perf_counter()
            for run in contenders[name]:
                run()
            compile_s[name] = round(time.perf_counter() - t0, 1)

    if args.ablate_recurrence:
        # The same stack with the recurrence replaced by one element-wise op
        # (h = u0 + x): what everything around the recurrence costs.
        import copy
        import types

        def no_recurrence(layer, U, x_in, c0, mask_pad):
            return U[..., :layer.output_size] + x_in.to(U.dtype), c0

        lean_model = copy.deepcopy(mine)
        for layer in lean_model.layers:
            layer.recur = types.MethodType(no_recurrence, layer)

        for dt in ("fp32", "bf16"):
            contenders[f"srupp_{dt}_no_recurrence"] = (
                layer_training_step(lean_model, x, dt == "bf16"),
                srupp_infer(lean_model, dt == "bf16"))

    have_ref = False
    causal = causal_mask(L)
    try:
        ref = reference_layer(args)
        contenders["reference_fp32"] = (reference_call(ref, x, causal, train=True),
                                        reference_call(ref, x, causal, train=False))
        have_ref = True
    except Exception as e:  # noqa: BLE001 - report why and go on
        print(json.dumps({"note": f"reference package unavailable: {e}"}))

    lstm = nn.LSTM(d, d, num_layers=2)
    contenders["lstm_fp32"] = (lambda: lstm(x)[0].sum().backward(),
                               lambda: torch.no_grad()(lambda: lstm(x))())
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.0),
                                num_layers=2, enable_nested_tensor=False)
    contenders["transformer_fp32"] = (
        lambda: enc(x, mask=causal, is_causal=True).sum().backward(),
        lambda: torch.no_grad()(lambda: enc(x, mask=causal, is_causal=True))())

    times = {name: {"train": [], "infer": []} for name in contenders}
    for _ in range(args.rounds):
        for name, (train, infer) in contenders.items():
            times[name]["train"].append(seconds_per_call(train, args.reps))
            times[name]["infer"].append(seconds_per_call(infer, args.reps))

    tokens = L * B
    result = {"config": {"L": L, "B": B, "d": d, "proj_size": P, "num_layers": 2,
                         "threads": torch.get_num_threads(), "torch": torch.__version__,
                         "rounds": args.rounds, "reps": args.reps,
                         "allocator_tuned": tuned},
              "loadavg_1m": os.getloadavg()[0], "tokens_per_s": {}, "ratio_to_reference": {}}
    if compile_s:
        result["compile_s"] = compile_s
    for name, t in times.items():
        result["tokens_per_s"][name] = {k: tokens / statistics.median(v) for k, v in t.items()}
    if have_ref:
        refs = result["tokens_per_s"]["reference_fp32"]
        for name, v in result["tokens_per_s"].items():
            result["ratio_to_reference"][name] = {k: round(v[k] / refs[k], 2) for k in v}
        # The reference's speed drifts between rounds on a shared machine, so also
        # give the ratio within each round (contenders alternate, so a round's
        # figures were taken close together): median and range over rounds.
        result["ratio_per_round"] = {}
        ref_t = times["reference_fp32"]
        for name, t in times.items():
            if name == "reference_fp32":
                continue
            result["ratio_per_round"][name] = {}
            for k in t:
                r = sorted(a / b for a, b in zip(ref_t[k], t[k]))
                result["ratio_per_round"][name][k] = {
                    "median": round(statistics.median(r), 2), "min": round(r[0], 2),
                    "max": round(r[-1], 2)}
    try:
        from srupp.ops import get_attention_backend, get_backend, get_matmul_backend
        result["config"]["srupp_backend"] = get_backend()
        result["config"]["srupp_matmul"] = get_matmul_backend()
        result["config"]["srupp_attention"] = get_attention_backend()
    except ImportError:
        pass
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
