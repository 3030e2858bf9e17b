"""One command for a GPU machine: does srupp work there, and how fast is it?

Run from the repository root, from source, on the GPU machine's own Python:

    PYTHONPATH=src python3 benchmarks/gpu_check.py --out DIR      # at most 560 s
    PYTHONPATH=src python3 benchmarks/gpu_check.py --quick --out DIR   # at most 230 s
    PYTHONPATH=src python3 benchmarks/gpu_check.py --dry-run      # the same code on CPU, tiny sizes

Steps, in order, each in its own process (a crash, a hang or a CUDA error in
one is recorded with its error and the next step still runs; --quick runs
only environment, bounds, sweep and side_by_side):

    environment  device, driver, torch, CUDA, triton and library versions; imports
                 the reference (which compiles its CUDA kernel once)
    pytest       the agreement tests on the device (pytest --device cuda)
    bounds       the device's copy bandwidth and bf16 GEMM peak
    recurrence   the recurrence kernel's forward and backward bandwidth (fp32,
                 bf16, fp16; L = 512 to 4096) as a share of that copy bandwidth
    sweep        the same kernel at L = 1024 under every launch configuration
                 of triton_kernel.SWEEP_CONFIGS (program shapes, the time loop
                 software-pipelined, explicit blocks of K steps), bf16 then fp32:
                 the default to choose (the first run found the plain loop
                 latency-bound)
    layer        one SRU++ layer's training and inference step, bf16 and fp32,
                 beside the reference sru==3.0.0.dev6 (its CUDA kernel, if it
                 compiles there)
    side_by_side the enwik8-base recipe (108M parameters) and the project's
                 Transformer at the same parameter count, batch and length, each
                 trained for --steps steps on synthetic bytes in bf16 by the
                 trainer under every setting of SIDE_BY_SIDE (eager, compiled by
                 layer, CUDA graphs, fused and foreach AdamW; the Transformer eager
                 and compiled): tokens/s, peak memory, model FLOP utilisation
                 against the measured GEMM peak, and SRU++ / Transformer tokens/s
    profile      where that recipe's training step spends its time: the GPU's
                 kernels by kind (GEMM, attention, recurrence, optimizer, ...), the
                 top kernels, and the share of the step the GPU is busy

This file is the driver: the plan, each step in its own process, gpu.json and
the report. The steps live in _gpu_steps.py (environment to layer) and
_gpu_training.py (side_by_side, profile); the recurrence, layer and profile
steps run recurrence.py, layer.py and step_profile.py on the device, at the
sizes above.

``DIR/gpu.json`` is rewritten after every step, so a run cut short keeps what it
measured; a markdown table goes to stdout at the end, and every step's output
to ``DIR/gpu_check.log``. ``--dry-run`` runs every step on the CPU at tiny
sizes (tests/test_benchmarks.py runs it in CI, so the script never reaches a
GPU broken). benchmarks/README.md gives the one call for a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from _gpu_steps import (ROOT, TARGETS, step_bounds, step_environment, step_layer,
                        step_pytest, step_recurrence, step_sweep)
from _gpu_training import step_profile, step_side_by_side

# (name, the most seconds it may take on a GPU, the seconds kept for it while
# earlier steps run); the whole run fits --budget (default 560 s: inside the
# 10 minutes one call of the device tool allows)
STEPS = (
    ("environment", 150, 10),  # the reference's CUDA kernel is compiled here
    ("pytest", 150, 0),
    ("bounds", 45, 10),
    ("recurrence", 60, 20),
    ("sweep", 90, 40),
    ("layer", 60, 15),
    ("side_by_side", 240, 150),
    ("profile", 90, 30),
)
# --quick: versions, the bounds, the recurrence sweep and both models side by side,
# in at most QUICK_BUDGET seconds (two such calls fit one 15-minute GPU loan)
QUICK_STEPS = ("environment", "bounds", "sweep", "side_by_side")
QUICK_BUDGET = 240
DRY_TIMEOUT = 300  # a step on the CPU at tiny sizes

STEP_FUNCS = {"environment": step_environment, "pytest": step_pytest, "bounds": step_bounds,
              "recurrence": step_recurrence, "sweep": step_sweep, "layer": step_layer,
              "side_by_side": step_side_by_side, "profile": step_profile}


# --------------------------------------------------------------------------- report

def markdown(results: dict) -> str:
    """The run as a short markdown report."""
    lines = ["| step | ok | seconds | result |", "|---|---|---|---|"]
    for name, _, _ in STEPS:
        r = results["steps"].get(name)
        if r is None:
            continue
        lines.append(f"| {name} | {'yes' if r['ok'] else 'NO'} | {r['seconds']} | "
                     f"{_headline(name, r)} |")
    rec = results["steps"].get("recurrence", {}).get("result") or {}
    if rec.get("rows"):
        lines += ["", "| kernel | dtype | L | fwd GB/s | bwd GB/s | fwd share | bwd share |",
                  "|---|---|---|---|---|---|---|"]
        for r in rec["rows"]:
            if "skipped" in r:
                lines.append(f"| {r['kernel']} | {r['dtype']} | {r['L']} | {r['skipped']} | | | |")
            else:
                lines.append(f"| {r['kernel']} | {r['dtype']} | {r['L']} | {r['forward_GBps']} | "
                             f"{r['backward_GBps']} | {r.get('forward_share', '-')} | "
                             f"{r.get('backward_share', '-')} |")
    sweep = results["steps"].get("sweep", {}).get("result") or {}
    if sweep.get("rows"):
        lines += ["", "| dtype | launch | fwd ms | bwd ms | fwd share | bwd share |",
                  "|---|---|---|---|---|---|"]
        for r in sweep["rows"]:
            if "error" in r:
                err = r["error"][:80].replace("|", "/").replace("\n", " ")
                lines.append(f"| {r['dtype']} | {r['config']} | {err} | | | |")
            else:
                lines.append(f"| {r['dtype']} | {r['config']} | {r['forward_ms']} | "
                             f"{r['backward_ms']} | {r.get('forward_share', '-')} | "
                             f"{r.get('backward_share', '-')} |")
    side = results["steps"].get("side_by_side", {}).get("result") or {}
    if side.get("rows"):
        lines += ["", f"| side by side (SRU++ / Transformer {side['srupp_over_transformer']}) "
                      "| tokens/s | MFU | peak GiB |", "|---|---|---|---|"]
        for r in side["rows"]:
            if "tokens_per_s" in r:
                lines.append(f"| {r['name']} | {r['tokens_per_s']:,} | {r.get('mfu', '-')} | "
                             f"{r.get('peak_memory_gib', '-')} |")
            else:
                why = (r.get("error") or r.get("skipped", ""))[:80].replace("|", "/")
                lines.append(f"| {r['name']} | {why} | | |".replace("\n", " "))
    prof = results["steps"].get("profile", {}).get("result") or {}
    if prof.get("by_kind_ms"):
        kinds = (prof.get("model") or {}).get("kinds", {})
        step = (prof.get("model") or {}).get("step", {})
        lines += ["", f"| enwik8 step {prof['step_ms']} ms (gpu_model.py: "
                      f"{step.get('predicted_ms', '-')}), device busy "
                      f"{prof['device_busy_share']} | ms per step | gpu_model.py |",
                  "|---|---|---|"]
        lines += [f"| {k} | {v} | {kinds.get(k, {}).get('predicted_ms', '-')} |"
                  for k, v in prof["by_kind_ms"].items()]
    lay = results["steps"].get("layer", {}).get("result") or {}
    if lay.get("tokens_per_s"):
        lines += ["", "| layer (tokens/s) | value |", "|---|---|"]
        lines += [f"| {k} | {v:,} |" for k, v in lay["tokens_per_s"].items()]
    return "\n".join(lines)


def _headline(name: str, r: dict) -> str:
    if not r["ok"]:
        return (r.get("error") or "").splitlines()[-1][:160] if r.get("error") else "failed"
    x = r["result"]
    if name == "environment":
        return f"{x.get('device')}, torch {x.get('torch')}, triton {x.get('triton')}"
    if name == "pytest":
        return ", ".join(f"{v} {k}" for k, v in x["counts"].items()) or "no summary"
    if name == "bounds":
        return f"copy {x['copy_GBps']} GB/s, bf16 GEMM {x['gemm_bf16_TFLOPs']} TFLOP/s"
    if name == "recurrence":
        return f"worst share of copy bandwidth {x['worst_share']} (target {x['target_share']})"
    if name == "sweep":
        return "fastest launch: " + ", ".join(f"{k} {v}" for k, v in x["best_config"].items())
    if name == "profile":
        return (f"step {x['step_ms']} ms, device busy {x['device_busy_share']}; "
                + ", ".join(f"{k} {v}" for k, v in list(x["by_kind_ms"].items())[:4]))
    if name == "layer":
        ratio = x.get("bf16_train_vs_best_reference")
        return (f"bf16 training {ratio}x the reference (target {x['target_vs_reference']})"
                if ratio is not None else ("reference: " + "; ".join(
                    f"{k}: {v}" for k, v in x.get("reference_errors", {}).items()))[:200].replace("\n", " / "))
    if name == "side_by_side":
        return (f"SRU++ / Transformer tokens/s {x['srupp_over_transformer']} (eager "
                f"{x['srupp_over_transformer_eager']}; target "
                f"{x['targets']['srupp_over_transformer']}); SRU++ MFU {x['srupp_mfu']} "
                f"(target {x['targets']['enwik8_mfu']})")
    return ""


# --------------------------------------------------------------------------- driver

def run_one(args) -> None:
    """Child process: run one step, write its result (or its error) to --result."""
    done = json.loads(Path(args.state).read_text()) if args.state else {}
    t0 = time.perf_counter()
    try:
        record = {"ok": True, "result": STEP_FUNCS[args.step](args, done)}
        if args.step == "pytest" and not record["result"]["passed"]:
            record["ok"] = False
            record["error"] = ("pytest failed: " if record["result"]["complete"] else
                               "pytest stopped at its time limit: ") + ", ".join(
                f"{v} {k}" for k, v in record["result"]["counts"].items())
    except Exception:  # noqa: BLE001 - each step is isolated; its error is the result
        record = {"ok": False, "error": traceback.format_exc()[-4000:]}
    record["seconds"] = round(time.perf_counter() - t0, 1)
    Path(args.result).write_text(json.dumps(record))


def plan(args) -> tuple:
    """The steps to run (STEPS' entries, in order) and the seconds for them all:
    --only's steps, or all; with --quick, only those of QUICK_STEPS."""
    names = [s for s in STEPS if (not args.only or s[0] in args.only)
             and (not args.quick or s[0] in QUICK_STEPS)]
    return names, args.budget or (QUICK_BUDGET if args.quick else 560)


def run_all(args, passthrough) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "gpu_check.log", "w")
    results = {"dry_run": args.dry_run, "quick": args.quick, "targets": TARGETS, "steps": {}}
    names, budget = plan(args)
    deadline = time.monotonic() + budget
    with tempfile.TemporaryDirectory() as tmp:
        state, result = Path(tmp) / "state.json", Path(tmp) / "result.json"
        for i, (name, cap, _) in enumerate(names):
            reserve = sum(r for _, _, r in names[i + 1:])
            timeout = DRY_TIMEOUT if args.dry_run else \
                int(min(cap, deadline - time.monotonic() - reserve))
            if timeout < 5:
                results["steps"][name] = {"ok": False, "seconds": 0,
                                          "error": "not run: the time budget was spent"}
                continue
            state.write_text(json.dumps({k: v.get("result") for k, v in results["steps"].items()}))
            result.unlink(missing_ok=True)
            cmd = [sys.executable, __file__, "--step", name, "--state", str(state),
                   "--result", str(result), "--step-timeout", str(timeout), *passthrough]
            print(f"gpu_check: {name} (at most {timeout} s)", file=sys.stderr, flush=True)
            log.write(f"\n===== {name} =====\n")
            log.flush()
            t0 = time.perf_counter()
            env = dict(os.environ)
            if args.dry_run:  # the Triton kernels run on the CPU under the interpreter
                env["TRITON_INTERPRET"] = "1"
            try:
                proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                      cwd=ROOT, env=env)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
            if result.exists():
                rec = json.loads(result.read_text())
            else:
                why = (f"timed out after {timeout} s" if code == "timeout"
                       else f"the step's process exited with {code}; see gpu_check.log")
                rec = {"ok": False, "error": why, "seconds": round(time.perf_counter() - t0, 1)}
            results["steps"][name] = rec
            (out / "gpu.json").write_text(json.dumps(results, indent=1))
    log.close()
    return results


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".", help="folder for gpu.json and gpu_check.log")
    p.add_argument("--dry-run", action="store_true", help="every step on the CPU, tiny sizes")
    p.add_argument("--only", nargs="+", choices=[s[0] for s in STEPS], help="these steps only")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for the whole run (default 560; {QUICK_BUDGET} with --quick)")
    p.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD)")
    p.add_argument("--maxfail", type=int, default=25, help="pytest stops after this many failures")
    p.add_argument("--workers", type=int, default=8, help="pytest-xdist workers (if installed)")
    p.add_argument("--pytest-targets", nargs="+", default=None)
    p.add_argument("--rec-batch", type=int, default=16)
    p.add_argument("--rec-units", type=int, default=2048)
    p.add_argument("--layer-L", type=int, default=1024)
    p.add_argument("--layer-B", type=int, default=8)
    p.add_argument("--quick", action="store_true",
                   help=f"only {', '.join(QUICK_STEPS)}, in at most {QUICK_BUDGET} s")
    p.add_argument("--steps", type=int, default=50,
                   help="training steps of each side-by-side row")
    p.add_argument("--enwik8-batch", type=int, default=16, help="streams of 1,024 bytes a step")
    # a child process's own arguments
    p.add_argument("--step", choices=list(STEP_FUNCS), help=argparse.SUPPRESS)
    p.add_argument("--state", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--step-timeout", type=int, default=DRY_TIMEOUT, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# arguments the driver hands on to each step's process
_PASSED_ON = ("dry_run", "commit", "maxfail", "workers", "pytest_targets", "rec_batch",
              "rec_units", "layer_L", "layer_B", "steps", "enwik8_batch", "quick")


def main(argv=None):
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))  # from source, as on the GPU machine
    if args.step:
        run_one(args)
        return
    passthrough = []
    for key in _PASSED_ON:
        val = getattr(args, key)
        flag = "--" + key.replace("_", "-")
        if val is True:
            passthrough.append(flag)
        elif val not in (None, False):
            passthrough += [flag, *map(str, val)] if isinstance(val, list) else [flag, str(val)]
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here; run it on a GPU machine, or with --dry-run",
                  file=sys.stderr)
            sys.exit(2)
    results = run_all(args, passthrough)
    print(markdown(results))
    print(json.dumps({"gpu_json": str(Path(args.out) / "gpu.json"),
                      "ok": all(r["ok"] for r in results["steps"].values())}))


if __name__ == "__main__":
    main()
