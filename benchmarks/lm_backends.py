"""A recipe's training step with srupp's fast paths on and off, side by side.

Times bare training steps (forward, backward, optimiser step, state carried) of
the recipe's model and data, alternating round by round in this one process
between the backends of :mod:`srupp.ops`: the projections (``aten`` = F.linear
vs ``auto`` = oneDNN for large fp32 products) and the attention (``sdpa`` vs
``auto`` = explicit matmul attention for bf16 on CPU). Prints one JSON object
with medians and ratios to the all-plain setting. Run with nothing else on the
machine:

    .venv/bin/python benchmarks/lm_backends.py recipes/shakespeare-cpu.toml [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch
from _common import bare_training_step, seconds_per_call

import srupp.ops as ops
from srupp.train import Trainer, build_config

SETTINGS = {"plain (aten, sdpa)": ("aten", "sdpa"), "srupp (auto, auto)": ("auto", "auto")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per round and setting")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--set", nargs="*", default=[])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        cfg = build_config(args.recipe, args.set + ["train.max_steps=1000000",
                                                    "train.max_seconds=none"])
        t = Trainer(cfg, d, progress=False)
        step = bare_training_step(t)

        times = {name: [] for name in SETTINGS}
        for _ in range(args.rounds):
            for name, (mm, att) in SETTINGS.items():
                with ops.use_matmul_backend(mm), ops.use_attention_backend(att):
                    times[name].append(seconds_per_call(step, args.steps))  # 1 untimed step first
        tokens = cfg.train.batch_size * cfg.train.unroll
        med = {k: statistics.median(v) for k, v in times.items()}
        base = med["plain (aten, sdpa)"]
        print(json.dumps({"recipe": args.recipe, "sets": args.set, "precision": t.precision,
                          "tokens_per_step": tokens, "threads": torch.get_num_threads(),
                          "loadavg_1m": os.getloadavg()[0],
                          "tokens_per_s": {k: round(tokens / v) for k, v in med.items()},
                          "speedup": {k: round(base / v, 3) for k, v in med.items()}}, indent=2))


if __name__ == "__main__":
    main()
