"""Batch-1 generation speed of trained models, side by side in one process.

Loads the checkpoints of runs (for example the model folders of a
``srupp compare`` output) and times each decoding the same prompt token by
token: PROMPT tokens of prefill, then NEW sampled tokens, the Transformer
through its KV cache and the recurrent models through their state. Rounds
alternate between models; medians and the ratio of each model to the first
one named are printed as one JSON object. Run it with nothing else on the
machine:

    .venv/bin/python benchmarks/generation.py runs/compare-shakespeare/srupp \\
        runs/compare-shakespeare/transformer [--rounds 5] [--prompt 64 --new 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="run directories or checkpoint folders")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (prefill)")
    ap.add_argument("--new", type=int, default=256, help="tokens generated one by one")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from srupp.models import load_model
    from srupp.runs import resolve_checkpoint

    models = {}
    for r in args.runs:
        ckpt = resolve_checkpoint(Path(r), prefer="last")
        models[Path(r).name] = load_model(ckpt)
    prompt = torch.randint(0, 256, (args.prompt,), generator=torch.Generator().manual_seed(0))
    prompt = [int(t) % min(m.config.vocab_size for m in models.values()) for t in prompt]

    def once(model) -> float:
        gen = torch.Generator().manual_seed(0)
        start = time.perf_counter()
        new = model.generate([prompt], args.new, temperature=1.0, generator=gen)[0]
        seconds = time.perf_counter() - start
        assert len(new) == args.new
        return args.new / seconds

    for m in models.values():  # warm-up: first-use kernel builds, allocator
        once(m)
    speeds = {n: [] for n in models}
    for _ in range(args.rounds):
        for n, m in models.items():
            speeds[n].append(once(m))
    first = next(iter(models))
    med = {n: statistics.median(v) for n, v in speeds.items()}
    print(json.dumps({
        "prompt_tokens": args.prompt, "new_tokens": args.new, "rounds": args.rounds,
        "threads": torch.get_num_threads(), "loadavg_1min": os.getloadavg()[0],
        "tokens_per_s": {n: round(v, 1) for n, v in med.items()},
        "params": {n: m.num_parameters() for n, m in models.items()},
        f"ratio_to_{first}": {n: round(v / med[first], 3) for n, v in med.items()},
    }, indent=2))


if __name__ == "__main__":
    main()
