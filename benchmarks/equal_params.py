"""SRU++ against SRU at equal parameters: training tokens/s, eager and compiled.

Both models are sized as ``srupp compare`` sizes them (``--params``, default 5M,
on the recipe's byte vocabulary: SRU++ with d′ = d/4, SRU plain) and trained on
the recipe's batch shape, in each of ``--precisions``, with a bare step (forward, backward,
clip, RAdam; the recurrent state carried), on random tokens. Contenders
alternate round by round in this one process; the figures are medians of
seconds per step. ``--compile`` adds each model under ``torch.compile`` (as
``train.compile`` compiles it), with its compilation time (the first steps)
reported apart. ``--cpu-time`` times process CPU time instead of wall time: on a
machine shared with other work it moves less, but it also counts idle spinning
of the thread pool, so use it with ``--threads 1``.

The figure to read is ``srupp_over_sru``: SRU++'s tokens/s over SRU's, per
precision and mode. Prints one JSON object. Run with nothing else on the machine:

    .venv/bin/python benchmarks/equal_params.py [--recipe recipes/shakespeare-cpu.toml]
        [--params 5000000] [--precisions bf16,fp32] [--compile] [--rounds 5 --steps 3]
        [--threads 1 --cpu-time]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from _common import lm_training_step

from srupp.train import build_config
from srupp.train.compare import size_model

MODELS = ("srupp", "sru")
# The recipe's SRU++-only model fields, which a plain SRU config refuses.
SRUPP_ONLY = ("proj_size", "num_heads", "attn_dropout", "attention_every_n_layers",
              "attention_last_n_layers")


def base_for(name: str, recipe: str, sets):
    """The recipe's run config, without the SRU++-only model fields for SRU."""
    base = build_config(recipe, list(sets))
    if name == "srupp":
        return base
    tree = base.to_dict()
    tree["model"] = {k: v for k, v in tree["model"].items() if k not in SRUPP_ONLY}
    return build_config(None, [], base=tree)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="recipes/shakespeare-cpu.toml")
    ap.add_argument("--set", nargs="*", default=[], help="recipe overrides key=value")
    ap.add_argument("--params", type=int, default=5_000_000)
    ap.add_argument("--precisions", default="bf16,fp32")
    ap.add_argument("--compile", action="store_true", help="also time each model compiled")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per contender a round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before the rounds")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time process CPU time, not wall time (a shared machine; --threads 1)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter

    def seconds_per_step(step) -> float:
        t0 = clock()
        for _ in range(args.steps):
            step()
        return (clock() - t0) / args.steps

    vocab = 256
    base = build_config(args.recipe, list(args.set))
    sized = {name: size_model(name, base_for(name, args.recipe, args.set), vocab, args.params)
             for name in MODELS}
    modes = ("eager", "compiled") if args.compile else ("eager",)
    contenders, compile_s, params = {}, {}, {}
    for precision in args.precisions.split(","):
        for mode in modes:
            for name in MODELS:
                key = f"{name}_{precision}_{mode}"
                step, model = lm_training_step(sized[name].cfg, vocab, precision == "bf16",
                                               compiled=mode == "compiled")
                params[name] = sum(p.numel() for p in model.parameters())
                t0 = time.perf_counter()
                for _ in range(args.warmup):
                    step()
                if mode == "compiled":
                    compile_s[key] = round(time.perf_counter() - t0, 1)
                contenders[key] = step

    times = {k: [] for k in contenders}
    for _ in range(args.rounds):
        for k, step in contenders.items():
            times[k].append(seconds_per_step(step))

    t = base.train
    tokens = t.batch_size * t.unroll
    tps = {k: round(tokens / statistics.median(v)) for k, v in times.items()}
    ratio, per_round = {}, {}
    for precision in args.precisions.split(","):
        for mode in modes:
            a, b = f"srupp_{precision}_{mode}", f"sru_{precision}_{mode}"
            ratio[f"{precision}_{mode}"] = round(tps[a] / tps[b], 3)
            r = sorted(tb / ta for ta, tb in zip(times[a], times[b]))
            per_round[f"{precision}_{mode}"] = {"median": round(statistics.median(r), 3),
                                                "min": round(r[0], 3), "max": round(r[-1], 3)}
    shapes = {n: {k: s.cfg.model.get(k) for k in ("d_model", "proj_size", "num_layers")
                  if s.cfg.model.get(k) is not None} for n, s in sized.items()}
    print(json.dumps({
        "recipe": args.recipe, "sets": args.set, "params_target": args.params,
        "models": {n: {"params": params[n], **shapes[n]} for n in MODELS},
        "batch": [t.batch_size, t.unroll], "threads": torch.get_num_threads(),
        "clock": "process CPU time" if args.cpu_time else "wall",
        "torch": torch.__version__, "rounds": args.rounds, "steps": args.steps,
        "loadavg_1m": os.getloadavg()[0], "tokens_per_s": tps,
        "srupp_over_sru": ratio, "srupp_over_sru_per_round": per_round,
        "compile_s": compile_s}, indent=2))


if __name__ == "__main__":
    main()
