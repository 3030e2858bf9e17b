"""gpu_check.py's training steps: side_by_side (enwik8-base and the project's
Transformer at the same parameter count, trained by the trainer under each setting)
and profile (where the enwik8-base step's time goes: benchmarks/step_profile.py's
``trainer_profile``, beside gpu_model.py's prediction). Each is
``step_<name>(args, done) -> dict``, as in _gpu_steps.py.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _common import model_flops_per_token
from _gpu_steps import ROOT, TARGETS, device


def enwik8_config(args, work: Path, steps: int):
    """The enwik8-base recipe's config, on synthetic bytes written into ``work``, in
    bf16 at --enwik8-batch streams a step (tiny on --dry-run)."""
    import numpy as np

    from srupp.train import build_config

    n_bytes = 200_000 if args.dry_run else 4_000_000
    rng = np.random.default_rng(0)
    # printable ASCII and line breaks: bytes the byte tokenizer reads one to one
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ETAOIN,.\n0123456789", np.uint8)
    (work / "bytes.txt").write_bytes(alphabet[rng.integers(0, len(alphabet), n_bytes)]
                                     .tobytes())
    sets = [f"data.corpus={work / 'bytes.txt'}", f"train.max_steps={steps}",
            f"train.device={device(args).type}", "train.warmup_steps=20",
            f"train.log_every={2 if args.dry_run else 20}",
            "train.eval_every=1000000", "train.save_every=1000000",
            "eval.batch_size=4", "eval.mem_len=1024"]
    if args.dry_run:
        sets += ["model.d_model=32", "model.proj_size=8", "model.num_layers=2",
                 "train.unroll=16", "train.batch_size=2", "eval.unroll=16",
                 "eval.mem_len=16", "eval.batch_size=2", "train.precision=fp32"]
    else:
        sets += [f"train.batch_size={args.enwik8_batch}", "train.precision=bf16"]
    return build_config(str(ROOT / "recipes" / "enwik8-base.toml"), sets)


# The contenders of the side-by-side step, in the order they run (the most telling
# first, so that a step cut short by its time limit keeps them): (row name, model,
# run settings, srupp op backends). Each trains the same steps, batch and length
# through the trainer. "srupp" is the enwik8-base recipe as it stands (eager,
# RAdam); "transformer" is the project's Transformer at the same parameter count,
# GPT-style (12 layers, heads about 64 wide, flash SDPA with is_causal, fused
# AdamW). A row's backends (srupp.ops.settings) hold for that row only: attention
# "matmul" runs SRU++'s one head of 768 as bf16 products with the probabilities
# kept, the alternative to SDPA's memory-efficient kernel, which alone takes head
# dims past 256 (srupp.ops.attention.cuda_sdpa_backend); launch "sweep" runs the
# Triton recurrence in the sweep step's fastest bf16 launch configuration.
SIDE_BY_SIDE = (
    ("srupp eager", "srupp", [], {}),
    ("transformer eager", "transformer", [], {}),
    ("srupp compiled by layer", "srupp", ["train.compile=layers"], {}),
    ("transformer compiled", "transformer", ["train.compile=model"], {}),
    ("srupp compiled by layer, the sweep's fastest recurrence", "srupp",
     ["train.compile=layers"], {"launch": "sweep"}),
    ("srupp eager, attention as bf16 products", "srupp", [], {"attention": "matmul"}),
    ("srupp compiled by layer, CUDA graphs", "srupp", ["train.compile=layers-cudagraphs"], {}),
    ("srupp AdamW fused", "srupp", ["train.optimizer=adamw", "train.optimizer_impl=fused"], {}),
    ("srupp AdamW foreach", "srupp", ["train.optimizer=adamw", "train.optimizer_impl=foreach"],
     {}),
)
TRANSFORMER_SETS = ["model.num_layers=12", "train.optimizer=adamw", "eval.mem_len=0"]


def _transformer_config(srupp_cfg, params: int):
    """The project's Transformer sized to ``params`` as ``srupp compare`` sizes it, on
    the SRU++ run's data, batch and length; 12 layers (GPT-2 small's depth) and
    learned positions over the whole segment, without memory."""
    from srupp.train.compare import size_model

    sets = TRANSFORMER_SETS + [f"model.max_positions={srupp_cfg.train.unroll}"]
    if srupp_cfg.model.get("d_model", 0) < 256:  # --dry-run: a tiny model
        sets[0] = "model.num_layers=2"
    return size_model("transformer", srupp_cfg, 256, params, sets).cfg


def _train_row(cfg, work: Path, dev, peak) -> dict:
    """Train ``cfg`` for its steps; tokens/s (median of the logged intervals after the
    first, which holds the warm-up), MFU against ``peak`` and peak memory."""
    import gc

    import torch

    from srupp.train import Trainer

    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer = Trainer(cfg, work, progress=False)
    try:
        summary = trainer.train()
        rows = [json.loads(ln) for ln in (work / "metrics.jsonl").read_text().splitlines()]
        speeds = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
        tok_s = statistics.median(speeds[1:] or speeds)
        flops = model_flops_per_token(trainer.model, trainer.model_config.mem_len or 0,
                                      cfg.train.unroll)
        out = {"params": trainer.model.num_parameters(), "steps": summary["step"],
               "tokens_per_s": round(tok_s), "flops_per_token": flops,
               "wall_seconds": round(time.perf_counter() - t0, 1)}
        if peak:
            out["mfu"] = float(f"{tok_s * flops / (peak * 1e12):.3g}")
        if dev.type == "cuda":
            out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        return out
    finally:
        # (compiled code stays cached from row to row: a row on the same model code
        # reuses it, and the trainer compiles before its clock starts anyway)
        del trainer
        gc.collect()


def _sweep_launch(done) -> list:
    """The sweep step's fastest bf16 launch configuration (block, warps, stages, steps)."""
    best = ((done.get("sweep") or {}).get("best_launch") or {}).get("bf16")
    if best is None:
        raise RuntimeError("no sweep result to take the fastest launch configuration from")
    return best


def _triton_launch_context(dev):
    """triton_kernel.use_launch_config, where the recurrence runs on Triton (CUDA, or
    the interpreter on --dry-run); elsewhere a context that leaves the launch as is."""
    from srupp.ops import recurrence

    if dev.type == "cuda" or recurrence._triton_importable():
        from srupp.ops.triton_kernel import use_launch_config

        return use_launch_config
    return lambda launch: contextlib.nullcontext()


def step_side_by_side(args, done):
    """SRU++ (enwik8-base) and the project's Transformer at the same parameter count,
    batch and length, trained for the same steps in this one process, each under
    every setting of SIDE_BY_SIDE: tokens/s, MFU and peak memory per row, and
    ``srupp_over_transformer``, the best SRU++ row's tokens/s over the best
    Transformer row's (the headline, first in the result)."""
    from srupp.models import parameter_counts
    from srupp.ops.settings import backends
    from srupp.train import build_config

    dev = device(args)
    peak = (done.get("bounds") or {}).get("gemm_bf16_TFLOPs")
    steps = 6 if args.dry_run else args.steps
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    t0, rows = time.perf_counter(), []
    use_launch_config = _triton_launch_context(dev)
    try:
        srupp_cfg = enwik8_config(args, work, steps)
        params = parameter_counts(srupp_cfg.model_config(256))["params"]
        base = {"srupp": srupp_cfg, "transformer": _transformer_config(srupp_cfg, params)}
        for i, (name, model, sets, ops) in enumerate(SIDE_BY_SIDE):
            row = {"name": name, "model": model, "settings": sets, "backends": ops}
            left = args.step_timeout - (time.perf_counter() - t0)
            if left < (30 if dev.type == "cuda" else 5):  # keep what was measured
                rows.append({**row, "skipped": f"not run: {left:.0f} s left in the step"})
                continue
            if "cudagraphs" in " ".join(sets) and dev.type != "cuda":
                rows.append({**row, "skipped": "CUDA graphs need a CUDA device"})
                continue
            try:
                cfg = build_config(None, list(sets), base=base[model].to_dict())
                with contextlib.ExitStack() as stack:
                    for op, choice in ops.items():
                        if op == "launch":
                            launch = _sweep_launch(done)
                            row["launch"] = launch
                            stack.enter_context(use_launch_config(launch))
                        else:
                            stack.enter_context(backends().use(op, choice))
                    rows.append({**row, **_train_row(cfg, work / f"run{i}", dev, peak)})
            except Exception as e:  # noqa: BLE001 - one row's failure is its result
                rows.append({**row, "error": f"{type(e).__name__}: {e}"[-2000:]})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def best(model):
        timed = [r for r in rows if r["model"] == model and "tokens_per_s" in r]
        return max(timed, key=lambda r: r["tokens_per_s"], default=None)

    def ratio(a, b):
        return float(f"{a['tokens_per_s'] / b['tokens_per_s']:.3g}") if a and b else None

    eager = {m: next((r for r in rows if r["name"] == f"{m} eager" and "tokens_per_s" in r),
                     None) for m in ("srupp", "transformer")}
    s_best, t_best = best("srupp"), best("transformer")
    return {"srupp_over_transformer": ratio(s_best, t_best),
            "srupp_over_transformer_eager": ratio(eager["srupp"], eager["transformer"]),
            "best": {"srupp": s_best and s_best["name"], "transformer": t_best and t_best["name"]},
            "srupp_mfu": s_best and s_best.get("mfu"),
            "batch": srupp_cfg.train.batch_size, "unroll": srupp_cfg.train.unroll,
            "precision": srupp_cfg.train.precision, "params_target": params,
            "rows": rows, "targets": {"srupp_over_transformer": TARGETS["srupp_over_transformer"],
                                      "enwik8_mfu": TARGETS["enwik8_mfu"]}}


def step_profile(args, done):
    """Where the enwik8-base training step's time goes: step_profile.py's
    ``trainer_profile`` of the trainer's own steps (warm-up, timed, then under
    torch.profiler). On the GPU, its kernels' time by kind and the top kernels, and
    the share of the step's wall time that the GPU was busy (the rest is the host:
    Python, launches, waits); on the CPU (--dry-run), the top operators. Beside it,
    gpu_model.py's prediction of the same step."""
    import step_profile as bench

    dev = device(args)
    # warm-up steps, then steps timed without the profiler, then profiled steps
    warm, timed, active = (2, 2, 2) if args.dry_run else (5, 4, 4)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    try:
        cfg = enwik8_config(args, work, warm + timed + active)
        result = bench.trainer_profile(cfg, work / "run", dev, warm, timed, active)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["model"] = _beside_the_model(result)
    return result


def _beside_the_model(profile: dict) -> dict:
    """gpu_model.py's prediction of this step (docs/gpu_model.json, made without a GPU:
    enwik8-base, batch 16, eager) beside the profile, kind by kind, and the step and
    the device's busy time: where the model is wrong, and whether the step waits for
    the host (busy time well under the step)."""
    import gpu_model

    prediction = json.loads((ROOT / "docs" / "gpu_model.json").read_text())
    return {"prediction": "docs/gpu_model.json",
            **gpu_model.compare_to_profile(prediction, profile)}
