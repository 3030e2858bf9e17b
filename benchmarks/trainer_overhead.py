"""The trainer's overhead against a bare training loop on the same model and data.

Both run the same recipe's model, batches, precision and optimiser; the bare loop
is only forward, backward, clip and optimiser step (with the state carried). They
alternate round by round in this one process; medians of seconds per step are
reported. Prints JSON. Run with nothing else on the machine:

    .venv/bin/python benchmarks/trainer_overhead.py recipes/shakespeare-cpu.toml [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from _common import bare_training_step, seconds_per_call

from srupp.train import Trainer, build_config


def trainer_seconds_per_step(recipe, sets, steps) -> tuple:
    with tempfile.TemporaryDirectory() as d:
        cfg = build_config(recipe, sets + [f"train.max_steps={steps + 5}", "train.max_seconds=none",
                                           "train.eval_every=100000", "train.save_every=100000"])
        t = Trainer(cfg, d, progress=True)
        it = t.batcher.iter_from(0)
        for _ in range(5):  # warm-up steps, not timed
            t._train_step(it)
        t.schedule.total_steps = t.step + steps
        t.train_seconds = 0.0
        start = time.perf_counter()
        # the real loop (progress bar, logging, schedule) minus the final evaluation
        nan = float("nan")
        t._evaluate_and_save = lambda max_batches, final=False: {"bpc": nan, "ppl": nan, "loss": nan}
        t.plot = lambda: None
        t.train()
        wall = time.perf_counter() - start
        return wall / steps, t


def bare_seconds_per_step(t: Trainer, steps) -> float:
    """Seconds per training step of the bare loop (the trainer's work minus the trainer)."""
    return seconds_per_call(bare_training_step(t, t.cfg.train.grad_clip), steps, warmup=5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--set", nargs="*", default=[])
    args = ap.parse_args()
    trainer_t, bare_t = [], []
    for _ in range(args.rounds):
        s, t = trainer_seconds_per_step(args.recipe, args.set, args.steps)
        trainer_t.append(s)
        bare_t.append(bare_seconds_per_step(t, args.steps))
    tr, ba = statistics.median(trainer_t), statistics.median(bare_t)
    print(json.dumps({"recipe": args.recipe, "sets": args.set, "steps": args.steps,
                      "trainer_s_per_step": tr, "bare_s_per_step": ba,
                      "overhead": tr / ba - 1, "loadavg_1m": os.getloadavg()[0],
                      "threads": torch.get_num_threads()}, indent=2))


if __name__ == "__main__":
    main()
