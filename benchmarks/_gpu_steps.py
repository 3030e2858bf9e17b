"""gpu_check.py's steps on one device: environment, pytest, bounds, recurrence, sweep
and layer. Each is ``step_<name>(args, done) -> dict``: ``args`` gpu_check's
arguments, ``done`` the results of the steps before it (by name); the dict is the
step's result in gpu.json. The recurrence and layer steps run
benchmarks/recurrence.py and benchmarks/layer.py (their ``measure``) at the GPU
run's sizes; --dry-run runs everything on the CPU at tiny sizes.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

from _common import compiler_errors, cpu_name, median_seconds

ROOT = Path(__file__).resolve().parents[1]

TARGETS = {  # the figures a GPU run is held to (the GPU-readiness issue)
    "recurrence_share_of_copy": 0.60,
    "layer_bf16_train_vs_reference": 2.0,
    "enwik8_mfu": 0.35,
    "srupp_over_transformer": 0.8,
}

# the configurations --dry-run's sweep runs under the interpreter: one of each kind
DRY_SWEEP = ("64/2w/4s", "128/4w/k4")
# the tests --dry-run's pytest step runs: two of the agreement tests (the whole suite
# runs them all anyway; the step's command and its reading of the output are what
# a dry run checks)
DRY_PYTEST = "tests/ops/test_reference.py::test_matches_equations"


def device(args):
    """The device a step runs on: CUDA, or the CPU under --dry-run."""
    import torch

    return torch.device("cpu" if args.dry_run else "cuda")


def _version(module: str):
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - not installed
        return None


def _run(cmd, timeout=20):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout.strip()
    except Exception:  # noqa: BLE001 - the tool is absent
        return None


def _has(module: str, name: str) -> bool:
    import importlib

    try:
        return hasattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001
        return False


# --------------------------------------------------------------------------- environment

def step_environment(args, done):
    import torch

    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": args.commit or _run(["git", "-C", str(ROOT), "rev-parse", "HEAD"]) or None,
        "python": platform.python_version(),
        "cpu": platform.processor() or cpu_name(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        **{name: _version(name) for name in ("triton", "transformers", "onnxruntime", "onnx",
                                             "numpy", "sru")},
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, capability=f"{p.major}.{p.minor}",
                    multiprocessors=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1),
                    driver=_run(["nvidia-smi", "--query-gpu=driver_version",
                                 "--format=csv,noheader"]),
                    nvcc=(_run(["nvcc", "--version"]) or "").splitlines()[-1:] or None)
    else:
        info["device"] = "cpu"
    # what srupp can do with this torch: each detected, none assumed
    import srupp
    from srupp.ops import recurrence

    info["srupp"] = srupp.__version__
    info["triton_kernel_importable"] = recurrence._triton_importable()
    info["custom_ops"] = [n for n in ("sru_fwd", "sru_bwd")
                          if hasattr(torch.ops.srupp, n)]
    info["sdpa_lower_right_causal"] = _has("torch.nn.attention.bias", "causal_lower_right")
    info["fully_shard"] = (_has("torch.distributed.fsdp", "fully_shard")
                           or _has("torch.distributed._composable.fsdp", "fully_shard"))
    info["nccl"] = bool(torch.distributed.is_available() and torch.distributed.is_nccl_available())
    # (--quick leaves the reference out: compiling its CUDA kernel takes a minute; so does
    # --dry-run, on a CPU, where the import's failed CUDA build alone took 19 s of the
    # test suite's time and the agreement tests import it anyway)
    skip = "--quick" if args.quick else "--dry-run" if args.dry_run else None
    info["reference"] = f"not imported ({skip})" if skip else import_reference()
    return info


def import_reference() -> dict:
    """Import ``sru==3.0.0.dev6``, which compiles its CUDA kernel with nvcc on import
    (a minute or more, once: torch caches the build). Done here, before the tests
    (whose collection imports it) and the layer step, which then find it built."""
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import sru  # noqa: F401
    except Exception as e:  # noqa: BLE001 - not installed, or broken
        return {"imported": False, "error": f"{type(e).__name__}: {e}"[:500]}
    failed = [str(w.message) for w in caught if "unsuccessful" in str(w.message)]
    return {"imported": True, "cuda_kernel_compiled": not failed,
            "error": compiler_errors(failed[0]) if failed else None,
            "seconds": round(time.perf_counter() - t0, 1)}


# --------------------------------------------------------------------------- pytest

_WORDS = "PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS"
# a verbose line, from xdist ("[gw0] [ 4%] PASSED id") or plain pytest ("id PASSED [ 4%]")
_OUTCOME = re.compile(rf"^(?:\[gw\d+\] \[\s*\d+%\] (?P<a>{_WORDS}) (?P<id1>\S+::.+?)\s*$"
                      rf"|(?P<id2>\S+::.+?) (?P<b>{_WORDS})\b)")


def step_pytest(args, done):
    """The agreement tests on the device. Stops after --maxfail failures, not the
    first: a short GPU window should report every failure it can. Verbose, so that
    a run cut short by its time limit still says which tests passed and failed."""
    dev = "cpu" if args.dry_run else "cuda"
    targets = args.pytest_targets or ([DRY_PYTEST] if args.dry_run else ["tests"])
    cmd = [sys.executable, "-m", "pytest", "--device", dev, "-v", "-p", "no:cacheprovider",
           f"--maxfail={args.maxfail}", "--durations=5", *targets]
    if not args.dry_run and args.workers > 1 and _version("pytest-xdist"):
        cmd += ["-n", str(args.workers)]
    env = dict(os.environ)
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)  # real kernels on the GPU
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    t0, limit = time.perf_counter(), args.step_timeout - 10
    # its own process group: on time-out, its xdist workers go with it
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out, code = out + f"\n[gpu_check: pytest stopped after {limit} s]", None
    outcomes = {}
    for ln in out.splitlines():
        m = _OUTCOME.match(ln)
        if m:
            outcomes[m["id1"] or m["id2"]] = m["a"] or m["b"]
    counts = {}
    summary = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed)",
                              summary[-1] if summary else ""):
        counts[what.rstrip("s") if what.startswith("error") else what] = int(n)
    if not counts:  # cut short: count what it printed
        for outcome in outcomes.values():
            key = outcome.lower()
            counts[key] = counts.get(key, 0) + 1
    failed = sorted(t for t, o in outcomes.items() if o in ("FAILED", "ERROR"))
    failed += [ln for ln in out.splitlines() if ln.startswith("ERROR ")]  # collection errors
    print(out[-20000:])
    return {"command": " ".join(cmd[1:]), "returncode": code, "counts": counts,
            "complete": code is not None, "failures": failed[:50],
            "seconds": round(time.perf_counter() - t0, 1), "passed": code == 0}


# --------------------------------------------------------------------------- speed

def step_bounds(args, done):
    """Copy bandwidth (bytes read + written by a device-to-device copy) and bf16 GEMM peak."""
    import torch

    dev = device(args)
    n = (32 if args.dry_run else 1024) * 2**20 // 4
    x = torch.randn(n, device=dev)
    y = torch.empty_like(x)
    copy_ms = median_seconds(lambda: y.copy_(x), 5 if args.dry_run else 30, 2, device=dev) * 1e3
    del x, y
    out = {"copy_GBps": round(2 * n * 4 / copy_ms / 1e6, 1), "copy_bytes": 2 * n * 4}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        size = 256 if args.dry_run else 8192
        a = torch.randn(size, size, device=dev).to(dtype)
        b = torch.randn(size, size, device=dev).to(dtype)
        ms = median_seconds(lambda: a @ b, 3 if args.dry_run else 15, 2, device=dev) * 1e3
        out[f"gemm_{name}_TFLOPs"] = float(f"{2 * size**3 / ms / 1e9:.4g}")
        out["gemm_size"] = size
    if dev.type == "cuda":
        out["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    return out


def step_recurrence(args, done):
    """benchmarks/recurrence.py on the device: the forward and backward bandwidth of
    the recurrence kernel srupp routes to (fp32, bf16, fp16; L = 512 to 4096) as a
    share of the bounds step's copy bandwidth. On --dry-run (tiny, on the CPU) the
    Triton kernels run too, under the interpreter, so that the path a GPU takes is
    exercised."""
    import recurrence as bench

    B, D = (2, 64) if args.dry_run else (args.rec_batch, args.rec_units)
    lengths = (8, 16) if args.dry_run else (512, 1024, 2048, 4096)
    copy = (done.get("bounds") or {}).get("copy_GBps")
    argv = ["--device", device(args).type, "--B", str(B), "--d", str(D),
            "--L", *map(str, lengths), "--dtype", "float32", "bfloat16", "float16",
            "--repeats", "3" if args.dry_run else "10", "--no-reference"]
    if args.dry_run and os.environ.get("TRITON_INTERPRET") == "1":
        argv.append("--triton")
    if copy:
        argv += ["--copy-gbps", str(copy)]
    res = bench.measure(bench.parse_args(argv))
    return {"rows": res["rows"], "copy_GBps": res["copy"]["GBps"],
            "worst_share": res["worst_share"],
            "target_share": TARGETS["recurrence_share_of_copy"]}


def step_sweep(args, done):
    """The Triton recurrence at L = 1024 under each launch configuration of
    ``triton_kernel.SWEEP_CONFIGS`` after the kernel's own default (the plain loop at
    other program shapes, the loop software-pipelined, explicit blocks of K steps):
    bf16 first (what training runs), then fp32; which configuration the kernel
    should default to, per dtype. Every configuration computes the same outputs, to
    the last bit (only the loop's schedule differs): each row carries its largest
    difference from the first row of its dtype. Timed by recurrence.py's
    ``time_kernel``."""
    import torch

    import recurrence as bench
    from srupp.ops import triton_kernel as tk

    dev = device(args)
    copy = (done.get("bounds") or {}).get("copy_GBps")
    B, D, L = (2, 64, 8) if args.dry_run else (args.rec_batch, args.rec_units, 1024)
    default = tk._launch_config(B, D)
    # (the interpreter is slow: on --dry-run the default and one of each kind)
    sweep = ([c for c in tk.SWEEP_CONFIGS if c.name in DRY_SWEEP] if args.dry_run
             else tk.SWEEP_CONFIGS)
    configs = list(dict.fromkeys([default, *sweep]))
    t0, rows, cut_short = time.perf_counter(), [], False
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        t = bench.make_inputs(B, L, D, 3, dtype, dev)
        first = None
        for config in configs:
            if time.perf_counter() - t0 > args.step_timeout - 15:  # keep what was measured
                cut_short = True
                break
            row = {"dtype": name, "L": L, "B": B, "D": D, "config": config.name,
                   **config._asdict(), "default": config == default}
            try:
                timed = bench.time_kernel(tk, *t, copy, reps=1 if args.dry_run else 10,
                                          config=config)
                # (keeping c_all, as timed: no other variant to compile)
                h = tk.sru_fwd(*t[:5], None, None, 1.0, False, True, config=config)[0].float()
                first = h if first is None else first
                timed["max_abs_diff_to_first"] = float((h - first).abs().max())
                rows.append({**row, **timed})
            except Exception as e:  # noqa: BLE001 - a configuration that fails to compile
                rows.append({**row, "error": f"{type(e).__name__}: {e}"[:500]})
        del t
    best = {}  # dtype -> the row of the least forward + backward time
    for r in rows:
        if "forward_ms" in r and (r["dtype"] not in best or r["forward_ms"] + r["backward_ms"]
                                  < best[r["dtype"]]["forward_ms"] + best[r["dtype"]]["backward_ms"]):
            best[r["dtype"]] = r
    return {"rows": rows, "copy_GBps": copy, "default_config": default.name,
            "best_config": {k: r["config"] for k, r in best.items()},
            # (block, num_warps, stages, steps): what use_launch_config takes
            "best_launch": {k: [r["block"], r["num_warps"], r["stages"], r["steps"]]
                            for k, r in best.items()},
            "cut_short": cut_short}


def step_layer(args, done):
    """benchmarks/layer.py on the device: one SRU++ layer (the enwik8-base layer's
    sizes), training step (forward and backward of the output's sum) and inference
    step in fp32 and bf16, in tokens/s, beside the reference sru==3.0.0.dev6 (its
    CUDA kernel, if it compiled; each of its modes may fail on its own)."""
    import layer as bench

    L, B, d, P = (16, 2, 32, 8) if args.dry_run else (args.layer_L, args.layer_B, 3072, 768)
    res = bench.measure(bench.parse_args([
        "--device", device(args).type, "--L", str(L), "--B", str(B), "--d", str(d),
        "--proj", str(P), "--num-layers", "1", "--contenders", "srupp,reference",
        "--reference-precisions", "fp32,bf16", "--rounds", "1" if args.dry_run else "5",
        "--reps", "2", "--no-tune-allocator"]))
    tps = {f"{name}_{mode}": round(v) for name, modes in res["tokens_per_s"].items()
           for mode, v in modes.items()}
    out = {"shape": {"L": L, "B": B, "d": d, "proj": P}, "tokens_per_s": tps,
           # ("reference_import" -> "import", "reference_bf16_infer" -> "bf16_infer")
           "reference_errors": {k.removeprefix("reference_"): v
                                for k, v in res["errors"].items()}}
    refs = [tps[k] for k in ("reference_bf16_train", "reference_fp32_train") if k in tps]
    if refs:  # against the reference's faster training mode
        out["bf16_train_vs_best_reference"] = round(tps["srupp_bf16_train"] / max(refs), 2)
    out["target_vs_reference"] = TARGETS["layer_bf16_train_vs_reference"]
    return out
