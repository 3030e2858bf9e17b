"""Training tokens/s of a recipe: one process against torchrun with 2, and compiled.

Each contender trains the recipe for ``--steps`` steps in its own processes
(`srupp train`, or `torchrun --nproc_per_node N -m srupp train`), with
``train.threads`` threads per process, evaluation and checkpoints off; its
tokens/s is the median over the logged intervals after the first (which
holds start-up, warm-up and, compiled, the compilation). Contenders
alternate round by round. The bound beside them: the machine's GEMM rate
per thread, measured here at the model's width, times the threads in use,
over 6 × (non-embedding parameters) FLOPs per token.

Prints one JSON object. Run with nothing else on the machine:

    .venv/bin/python benchmarks/training_scale.py recipes/shakespeare-cpu.toml \
        [--steps 60 --rounds 2 --compile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from _common import seconds_per_call


def tokens_per_s(recipe, sets, steps, nproc, log_every) -> float:
    with tempfile.TemporaryDirectory() as d:
        train = ["-m", "srupp", "train", recipe, "--out", str(Path(d) / "run"), "--no-progress",
                 "--set", *sets, f"train.max_steps={steps}", "train.max_seconds=none",
                 f"train.eval_every={steps * log_every}", f"train.save_every={steps * log_every}",
                 f"train.log_every={log_every}", "train.eval_max_batches=1"]
        if nproc == 1:
            cmd = [sys.executable, *train]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", *train]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        rows = [json.loads(ln) for ln in (Path(d) / "run" / "metrics.jsonl").read_text()
                .splitlines()]
        rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][1:]
        return statistics.median(rates) if rates else float("nan")


def gemm_flops_per_thread(d: int, rows: int, bf16: bool) -> float:
    """FLOP/s of a (rows, d) x (d, 3d) matmul on one thread (the projections' shape)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dtype = torch.bfloat16 if bf16 else torch.float32
    x, w = torch.randn(rows, d, dtype=dtype), torch.randn(d, 3 * d, dtype=dtype)
    try:
        s = seconds_per_call(lambda: x @ w, reps=5, warmup=2)
    finally:
        torch.set_num_threads(threads)
    return 2 * rows * d * 3 * d / s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="threads per process")
    ap.add_argument("--nproc", type=int, default=2, help="processes of the torchrun contender")
    ap.add_argument("--compile", action="store_true", help="also train.compile=true, 1 process")
    ap.add_argument("--set", nargs="*", default=[])
    args = ap.parse_args()

    from srupp.train import build_config

    sets = args.set + [f"train.threads={args.threads}"]
    cfg = build_config(args.recipe, sets)
    log_every = max(1, args.steps // 5)
    contenders = {"1 process": (1, []), f"{args.nproc} processes": (args.nproc, [])}
    if args.compile:
        contenders["1 process, compiled"] = (1, ["train.compile=true"])
    rates = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, (nproc, extra) in contenders.items():
            rates[name].append(tokens_per_s(args.recipe, sets + extra, args.steps, nproc,
                                            log_every))
    d = int(cfg.model.get("d_model", 512))
    bf16 = cfg.train.precision == "bf16"
    per_thread = gemm_flops_per_thread(d, 2048, bf16)
    from srupp.models import build_model

    with torch.device("meta"):
        vocab = 256 if cfg.data.tokenizer == "byte" else cfg.data.vocab_size
        model = build_model(cfg.model_config(vocab))
    embedding = sum(p.numel() for n, p in model.named_parameters()
                    if "embed" in n or "head" in n or "output" in n)
    body = model.num_parameters() - embedding
    out = {"recipe": args.recipe, "steps": args.steps, "threads_per_process": args.threads,
           "precision": cfg.train.precision, "cpu_count": os.cpu_count(),
           "loadavg_1m": os.getloadavg()[0], "body_parameters": body,
           "gemm_gflops_per_thread": round(per_thread / 1e9, 1), "tokens_per_s": {},
           "fraction_of_bound": {}}
    for name, (nproc, _) in contenders.items():
        rate = statistics.median(rates[name])
        bound = per_thread * nproc * args.threads / (6 * max(body, 1))
        out["tokens_per_s"][name] = round(rate, 1)
        out["fraction_of_bound"][name] = round(rate / bound, 3)
    base = out["tokens_per_s"]["1 process"]
    out["speedup_vs_1_process"] = {k: round(v / base, 2) for k, v in out["tokens_per_s"].items()}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
