"""Time a 2-layer SRU++ against the reference package, nn.LSTM and a Transformer.

Prints one JSON object. All contenders run in this one process, alternating
round by round, and the medians are reported with ratios to the reference
package (``sru==3.0.0.dev6`` in fp32; ``--reference-precisions fp32,bf16`` adds
it under bf16 autocast). Run it with nothing else on the machine:

    .venv/bin/python benchmarks/layer.py [--rounds 5] [--L 256 --B 16 --d 512 --proj 128]
        [--ablate-recurrence] [--compile]

On a GPU, ``--device cuda`` runs every contender there (each timing waits for
the device's work); gpu_check.py's layer step is
``--device cuda --num-layers 1 --contenders srupp,reference`` at the
``enwik8-base`` layer's shape.

On the CPU the process first calls ``srupp.tune_cpu_allocator()`` (as the
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


CONTENDERS = ("srupp", "reference", "lstm", "transformer")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_layer_shape_args(ap)
    ap.add_argument("--num-layers", type=int, default=2, help="layers of every contender")
    ap.add_argument("--device", default="cpu", help="cpu or cuda: where every contender runs")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help=f"which of {', '.join(CONTENDERS)} to time")
    ap.add_argument("--reference-precisions", default="fp32",
                    help="the reference's precisions, fp32 and/or bf16 (autocast); a mode "
                         "that fails is reported under errors")
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
    args = ap.parse_args(argv)
    unknown = set(args.contenders.split(",")) - set(CONTENDERS)
    if unknown:
        ap.error(f"unknown contenders {sorted(unknown)}; choose from {', '.join(CONTENDERS)}")
    return args


def measure(args) -> dict:
    """The JSON object: tokens/s of every contender's training and inference step,
    and their ratios to the reference. ``args``: :func:`parse_args`'s namespace."""
    dev = torch.device(args.device)
    wanted = args.contenders.split(",")
    tuned = False
    if not args.no_tune_allocator and dev.type == "cpu":  # (glibc's malloc: the host's)
        from srupp import tune_cpu_allocator
        tuned = tune_cpu_allocator()
    L, B, d, P = args.L, args.B, args.d, args.proj
    mine, x = layer_model_and_input(args, device=dev, num_layers=args.num_layers)
    contenders = {}  # name -> {"train": step, "infer": step}
    errors = {}

    def srupp_infer(model, bf16: bool):
        def run():
            with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                model(x)
        return run

    def srupp_modes(model, dt):
        return {"train": layer_training_step(model, x, dt == "bf16"),
                "infer": srupp_infer(model, dt == "bf16")}

    if "srupp" in wanted:
        for dt in ("fp32", "bf16"):
            contenders[f"srupp_{dt}"] = srupp_modes(mine, dt)

    compile_s = {}
    if args.compile:
        import time

        compiled = torch.compile(mine)
        for dt in ("fp32", "bf16"):
            name = f"srupp_{dt}_compiled"
            contenders[name] = srupp_modes(compiled, dt)
            t0 = time.perf_counter()
            for run in contenders[name].values():
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
            contenders[f"srupp_{dt}_no_recurrence"] = srupp_modes(lean_model, dt)

    causal = causal_mask(L, dev)
    if "reference" in wanted:
        try:
            ref = reference_layer(args, device=dev, num_layers=args.num_layers)
        except Exception as e:  # noqa: BLE001 - report why and go on
            errors["reference_import"] = f"{type(e).__name__}: {e}"[:4000]
        else:
            for prec in args.reference_precisions.split(","):
                modes = {mode: reference_call(ref, x, causal, train=mode == "train",
                                              bf16=prec == "bf16")
                         for mode in ("train", "infer")}
                # each mode may fail on its own (its CPU path takes no bf16, say):
                # tried once here, and left out with its error
                for mode, run in list(modes.items()):
                    try:
                        run()
                    except Exception as e:  # noqa: BLE001
                        errors[f"reference_{prec}_{mode}"] = f"{type(e).__name__}: {e}"[-2000:]
                        del modes[mode]
                if modes:
                    contenders[f"reference_{prec}"] = modes

    if "lstm" in wanted:
        lstm = nn.LSTM(d, d, num_layers=args.num_layers).to(dev)
        contenders["lstm_fp32"] = {"train": lambda: lstm(x)[0].sum().backward(),
                                   "infer": lambda: torch.no_grad()(lambda: lstm(x))()}
    if "transformer" in wanted:
        enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.0),
                                    num_layers=args.num_layers,
                                    enable_nested_tensor=False).to(dev)
        contenders["transformer_fp32"] = {
            "train": lambda: enc(x, mask=causal, is_causal=True).sum().backward(),
            "infer": lambda: torch.no_grad()(lambda: enc(x, mask=causal, is_causal=True))()}

    times = {name: {mode: [] for mode in modes} for name, modes in contenders.items()}
    for _ in range(args.rounds):
        for name, modes in contenders.items():
            for mode, run in modes.items():
                times[name][mode].append(seconds_per_call(run, args.reps, device=dev))

    tokens = L * B
    result = {"config": {"L": L, "B": B, "d": d, "proj_size": P, "num_layers": args.num_layers,
                         "device": str(dev), "threads": torch.get_num_threads(),
                         "torch": torch.__version__, "rounds": args.rounds, "reps": args.reps,
                         "allocator_tuned": tuned},
              "loadavg_1m": os.getloadavg()[0], "tokens_per_s": {}, "ratio_to_reference": {},
              "errors": errors}
    if compile_s:
        result["compile_s"] = compile_s
    for name, t in times.items():
        result["tokens_per_s"][name] = {k: tokens / statistics.median(v) for k, v in t.items()}
    if "reference_fp32" in times:
        refs = result["tokens_per_s"]["reference_fp32"]
        for name, v in result["tokens_per_s"].items():
            result["ratio_to_reference"][name] = {k: round(v[k] / refs[k], 2)
                                                  for k in v if k in refs}
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
                if k not in ref_t:
                    continue
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
    return result


def main(argv=None):
    print(json.dumps(measure(parse_args(argv)), indent=2))


if __name__ == "__main__":
    main()
