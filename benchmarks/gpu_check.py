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

``DIR/gpu.json`` is rewritten after every step, so a run cut short keeps what it
measured; a markdown table goes to stdout at the end, and every step's output
to ``DIR/gpu_check.log``. ``--dry-run`` runs every step on the CPU at tiny
sizes (tests/test_benchmarks.py runs it in CI, so the script never reaches a
GPU broken). benchmarks/README.md gives the one call for a GPU machine.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

from _common import median_seconds, model_flops_per_token

ROOT = Path(__file__).resolve().parents[1]

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

TARGETS = {  # the figures a GPU run is held to (the GPU-readiness issue)
    "recurrence_share_of_copy": 0.60,
    "layer_bf16_train_vs_reference": 2.0,
    "enwik8_mfu": 0.35,
    "srupp_over_transformer": 0.8,
}


# --------------------------------------------------------------------------- helpers

def _device(args):
    import torch

    return torch.device("cpu" if args.dry_run else "cuda")


def median_ms(fn, device, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()``: CUDA events on a GPU (the work is
    asynchronous), the host clock on the CPU."""
    import torch

    if device.type != "cuda":
        return median_seconds(fn, reps, warmup) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


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


# --------------------------------------------------------------------------- steps

def step_environment(args, done):
    import torch

    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": args.commit or _run(["git", "-C", str(ROOT), "rev-parse", "HEAD"]) or None,
        "python": platform.python_version(),
        "cpu": platform.processor() or _cpu_name(),
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
    # (--quick leaves the reference out: compiling its CUDA kernel takes a minute)
    info["reference"] = "not imported (--quick)" if args.quick else import_reference()
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


def compiler_errors(message: str, most: int = 12) -> str:
    """The lines of a failed build's log that say why (nvcc's and g++'s ``error``
    lines), and its last line; the log's tail alone is ninja's "build stopped"."""
    lines = message.splitlines()
    why = [ln.strip()[:400] for ln in lines if re.search(r"\berror\b", ln, re.I)
           and "build stopped" not in ln][:most]
    last = [ln.strip() for ln in lines[-1:] if ln.strip() not in why]
    return "\n".join(why + last)[:4000]


def _has(module: str, name: str) -> bool:
    import importlib

    try:
        return hasattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001
        return False


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


_WORDS = "PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS"
# a verbose line, from xdist ("[gw0] [ 4%] PASSED id") or plain pytest ("id PASSED [ 4%]")
_OUTCOME = re.compile(rf"^(?:\[gw\d+\] \[\s*\d+%\] (?P<a>{_WORDS}) (?P<id1>\S+::.+?)\s*$"
                      rf"|(?P<id2>\S+::.+?) (?P<b>{_WORDS})\b)")


def step_pytest(args, done):
    """The agreement tests on the device. Stops after --maxfail failures, not the
    first: a short GPU window should report every failure it can. Verbose, so that
    a run cut short by its time limit still says which tests passed and failed."""
    device = "cpu" if args.dry_run else "cuda"
    targets = args.pytest_targets or (["tests/ops/test_reference.py"] if args.dry_run
                                      else ["tests"])
    cmd = [sys.executable, "-m", "pytest", "--device", device, "-v", "-p", "no:cacheprovider",
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


def step_bounds(args, done):
    """Copy bandwidth (bytes read + written by a device-to-device copy) and bf16 GEMM peak."""
    import torch

    dev = _device(args)
    n = (32 if args.dry_run else 1024) * 2**20 // 4
    x = torch.randn(n, device=dev)
    y = torch.empty_like(x)
    copy_ms = median_ms(lambda: y.copy_(x), dev, reps=5 if args.dry_run else 30)
    del x, y
    out = {"copy_GBps": round(2 * n * 4 / copy_ms / 1e6, 1), "copy_bytes": 2 * n * 4}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        size = 256 if args.dry_run else 8192
        a = torch.randn(size, size, device=dev).to(dtype)
        b = torch.randn(size, size, device=dev).to(dtype)
        ms = median_ms(lambda: a @ b, dev, reps=3 if args.dry_run else 15)
        out[f"gemm_{name}_TFLOPs"] = float(f"{2 * size**3 / ms / 1e9:.4g}")
        out["gemm_size"] = size
    if dev.type == "cuda":
        out["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    return out


def step_recurrence(args, done):
    """Effective bandwidth of the recurrence kernel that srupp routes to: the bytes a
    direction must move at least, over its median time, as a share of copy bandwidth.

    forward (training: per-step state kept) reads U, x and writes h, c_all (fp32)
    backward reads U, x, c_all, grad_h and writes grad_U, grad_x
    """
    import torch

    from srupp.ops import recurrence

    dev = _device(args)
    copy = (done.get("bounds") or {}).get("copy_GBps")
    B, D = (2, 64) if args.dry_run else (args.rec_batch, args.rec_units)
    lengths = (16, 32) if args.dry_run else (512, 1024, 2048, 4096)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    # on the CPU (--dry-run) the Triton kernels also run, under the interpreter, so
    # that the path a GPU takes is exercised too
    interpreted = args.dry_run and os.environ.get("TRITON_INTERPRET") == "1"
    rows = []
    for name, dtype in dtypes.items():
        for L in lengths:
            g = torch.Generator().manual_seed(L)
            U = torch.randn(B, L, 3, D, generator=g).to(dev, dtype)
            x = torch.randn(B, L, D, generator=g).to(dev, dtype)
            wc = (0.5 * torch.randn(2, D, generator=g)).to(dev)
            bias = torch.zeros(2, D, device=dev)
            c0 = torch.zeros(B, D, device=dev)
            gh = torch.randn(B, L, D, generator=g).to(dev, dtype)
            routed = recurrence.route(U, x, wc, bias, c0, None)
            # (the interpreter is slow: one length is enough to show the path works)
            extra = ["triton"] if interpreted and L == lengths[0] else []
            for kernel in dict.fromkeys([routed] + extra):
                row = {"dtype": name, "L": L, "B": B, "D": D, "kernel": kernel}
                if kernel == "reference":  # (the CPU kernel computes no fp16)
                    rows.append({**row, "skipped": "no fast kernel for this dtype here"})
                    continue
                reps = 10 if not args.dry_run else 1 if kernel == "triton" else 3
                rows.append({**row, **_time_recurrence(recurrence.kernels(U, kernel == "triton"),
                                                       U, x, wc, bias, c0, gh, dev, copy, reps)})
            del U, x, gh
    shares = [min(r["forward_share"], r["backward_share"]) for r in rows if "forward_share" in r]
    return {"rows": rows, "copy_GBps": copy, "worst_share": min(shares) if shares else None,
            "target_share": TARGETS["recurrence_share_of_copy"]}


def step_sweep(args, done):
    """The Triton recurrence at L = 1024 under each launch configuration of
    ``triton_kernel.SWEEP_CONFIGS`` after the kernel's own default (the plain loop at
    other program shapes, the loop software-pipelined, explicit blocks of K steps):
    bf16 first (what training runs), then fp32; which configuration the kernel
    should default to, per dtype. Every configuration computes the same outputs, to
    the last bit (only the loop's schedule differs): each row carries its largest
    difference from the first row of its dtype."""
    import torch

    from srupp.ops import triton_kernel as tk

    dev = _device(args)
    copy = (done.get("bounds") or {}).get("copy_GBps")
    B, D, L = (2, 64, 8) if args.dry_run else (args.rec_batch, args.rec_units, 1024)
    default = tk._launch_config(B, D)
    # (the interpreter is slow: on --dry-run the default and one of each kind)
    sweep = ([c for c in tk.SWEEP_CONFIGS if c.name in DRY_SWEEP] if args.dry_run
             else tk.SWEEP_CONFIGS)
    configs = list(dict.fromkeys([default, *sweep]))
    t0, rows, cut_short = time.perf_counter(), [], False
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        g = torch.Generator().manual_seed(0)
        U = torch.randn(B, L, 3, D, generator=g).to(dev, dtype)
        x = torch.randn(B, L, D, generator=g).to(dev, dtype)
        wc = (0.5 * torch.randn(2, D, generator=g)).to(dev)
        bias, c0 = torch.zeros(2, D, device=dev), torch.zeros(B, D, device=dev)
        gh = torch.randn(B, L, D, generator=g).to(dev, dtype)
        first = None
        for config in configs:
            if time.perf_counter() - t0 > args.step_timeout - 15:  # keep what was measured
                cut_short = True
                break
            row = {"dtype": name, "L": L, "B": B, "D": D, "config": config.name,
                   **config._asdict(), "default": config == default}
            try:
                timed = _time_recurrence(tk, U, x, wc, bias, c0, gh, dev, copy,
                                         reps=1 if args.dry_run else 10, config=config)
                # (keeping c_all, as timed: no other variant to compile)
                h = tk.sru_fwd(U, x, wc, bias, c0, None, None, 1.0, False, True,
                               config=config)[0].float()
                first = h if first is None else first
                timed["max_abs_diff_to_first"] = float((h - first).abs().max())
                rows.append({**row, **timed})
            except Exception as e:  # noqa: BLE001 - a configuration that fails to compile
                rows.append({**row, "error": f"{type(e).__name__}: {e}"[:500]})
        del U, x, gh
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


# the configurations --dry-run runs under the interpreter: one of each kind
DRY_SWEEP = ("64/2w/4s", "128/4w/k4")


def _time_recurrence(mod, U, x, wc, bias, c0, gh, dev, copy, reps, config=None) -> dict:
    """Forward (per-step state kept, as in training) and backward of one kernel module
    (the Triton module's with ``config``, a launch configuration, if given)."""
    B, L, _, D = U.shape
    kw = {} if config is None else {"config": config}
    fwd = lambda: mod.sru_fwd(U, x, wc, bias, c0, None, None, 1.0, False, True,  # noqa: E731
                              **kw)
    c_all = fwd()[2]
    bwd = lambda: mod.sru_bwd(U, x, wc, bias, c0, None, None, c_all, gh, None,  # noqa: E731
                              1.0, False, True, **kw)
    warmup = 1 if reps < 3 else 2
    f_ms, b_ms = median_ms(fwd, dev, reps, warmup), median_ms(bwd, dev, reps, warmup)
    el = U.element_size()
    fwd_bytes = B * L * D * (3 * el + el + el + 4)               # U, x -> h, c_all
    bwd_bytes = B * L * D * (3 * el + el + 4 + el + 3 * el + el)  # U, x, c_all, gh -> gU, gx
    row = {"forward_ms": float(f"{f_ms:.4g}"), "backward_ms": float(f"{b_ms:.4g}"),
           "forward_GBps": float(f"{fwd_bytes / f_ms / 1e6:.4g}"),
           "backward_GBps": float(f"{bwd_bytes / b_ms / 1e6:.4g}")}
    if copy:
        row.update(forward_share=float(f"{fwd_bytes / f_ms / 1e6 / copy:.3g}"),
                   backward_share=float(f"{bwd_bytes / b_ms / 1e6 / copy:.3g}"))
    return row


def step_layer(args, done):
    """One SRU++ layer (the enwik8-base layer's sizes), training step (forward and
    backward of the output's sum) and inference step, in tokens/s."""
    import torch

    from srupp.nn import SRUpp

    dev = _device(args)
    L, B, d, P = (16, 2, 32, 8) if args.dry_run else (args.layer_L, args.layer_B, 3072, 768)
    reps = 2 if args.dry_run else 10
    torch.manual_seed(0)
    x = torch.randn(L, B, d, device=dev)
    mask = torch.triu(torch.full((L, L), float("-inf"), device=dev), diagonal=1)
    half = torch.bfloat16

    def timed(model, call, precision, train):
        def run():
            with torch.autocast(dev.type, dtype=half, enabled=precision == "bf16"), \
                    torch.set_grad_enabled(train):
                out = call(model)
            if train:
                out.float().sum().backward()
        return L * B / (median_ms(run, dev, reps) / 1e3)

    ours = SRUpp(d, d, P, num_layers=1, causal=True, device=dev)
    res = {"shape": {"L": L, "B": B, "d": d, "proj": P}, "tokens_per_s": {}}
    for prec in ("fp32", "bf16"):
        for mode, train in (("train", True), ("infer", False)):
            res["tokens_per_s"][f"srupp_{prec}_{mode}"] = round(
                timed(ours, lambda m: m(x)[0], prec, train))
    del ours
    # the reference: its CUDA kernel is compiled by nvcc when the package is imported;
    # each of its modes may fail on its own (its CPU path takes no bf16, say)
    res["reference_errors"] = {}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import sru
        failed = [str(w.message) for w in caught if "unsuccessful" in str(w.message)]
        if failed and dev.type == "cuda":
            raise RuntimeError("the reference's CUDA kernel did not compile:\n"
                               + compiler_errors(failed[0]))
        ref = sru.SRUpp(d, d, P, num_layers=1).to(dev)
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        res["reference_errors"]["import"] = f"{type(e).__name__}: {e}"[:4000]
        ref = None
    for prec in ("fp32", "bf16"):
        for mode, train in (("train", True), ("infer", False)):
            if ref is None:
                break
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    res["tokens_per_s"][f"reference_{prec}_{mode}"] = round(timed(
                        ref, lambda m: m(x, attn_mask=mask)[0], prec, train))
            except Exception as e:  # noqa: BLE001
                res["reference_errors"][f"{prec}_{mode}"] = f"{type(e).__name__}: {e}"[-2000:]
    tps = res["tokens_per_s"]
    refs = [tps[k] for k in ("reference_bf16_train", "reference_fp32_train") if k in tps]
    if refs:  # against the reference's faster training mode
        res["bf16_train_vs_best_reference"] = round(tps["srupp_bf16_train"] / max(refs), 2)
    res["target_vs_reference"] = TARGETS["layer_bf16_train_vs_reference"]
    return res


def _enwik8_config(args, work: Path, steps: int):
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
            f"train.device={_device(args).type}", "train.warmup_steps=20",
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
    dev = _device(args)
    peak = (done.get("bounds") or {}).get("gemm_bf16_TFLOPs")
    steps = 6 if args.dry_run else args.steps
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    t0, rows = time.perf_counter(), []
    from srupp.ops.settings import backends

    use_launch_config = _triton_launch_context(dev)

    try:
        srupp_cfg = _enwik8_config(args, work, steps)
        from srupp.models import parameter_counts

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
                from srupp.train import build_config

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


# a kernel's kind, from its name (first match): what a training step's GPU time is
KERNEL_KINDS = (
    ("recurrence", r"_sru_"),
    ("attention", r"flash|fmha|attention|efficient"),
    ("gemm", r"gemm|cutlass|cublas|nvjet|xmma|wgmma|sm\d\d_|ampere_|hopper_|addmm|matmul|mm\b"),
    ("optimizer", r"multi_tensor|foreach|adam|_amp_"),
    ("norm", r"norm"),
    ("softmax / loss", r"softmax|nll|cross_entropy|log_softmax"),
    ("dropout", r"dropout|bernoulli|philox|fused_dropout"),
    ("copy / cast", r"copy|cast|convert|(?<!s)cat|fill|memcpy|memset"),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, pattern in KERNEL_KINDS:
        if re.search(pattern, low):
            return kind
    return "other element-wise"


def step_profile(args, done):
    """Where the enwik8-base training step's time goes: the trainer's own steps, after
    a warm-up, under torch.profiler. On the GPU, its kernels' time by kind and the top
    kernels, and the share of the step's wall time that the GPU was busy (the rest is
    the host: Python, launches, waits); on the CPU (--dry-run), the top operators."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from srupp.train import Trainer

    dev = _device(args)
    # warm-up steps, then steps timed without the profiler, then profiled steps
    warm, timed, active = (2, 2, 2) if args.dry_run else (5, 4, 4)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    try:
        cfg = _enwik8_config(args, work, warm + timed + active)
        trainer = Trainer(cfg, work / "run", progress=False)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda"
                                               else [])
        prof = profile(activities=activities)
        step_of_trainer, n, wall = trainer._train_step, 0, {}

        def profiled_step(it):  # the trainer's own step: timed, then profiled
            nonlocal n
            n += 1
            if n == warm + 1:
                _sync(dev)
                wall["t0"] = time.perf_counter()
            if n == warm + timed + 1:
                _sync(dev)
                wall["seconds"] = time.perf_counter() - wall["t0"]
                prof.start()
            out = step_of_trainer(it)
            if n == warm + timed + active:
                _sync(dev)
                prof.stop()
                wall["profiled"] = True
            return out

        trainer._train_step = profiled_step
        trainer.train()
        if "profiled" not in wall:
            raise RuntimeError(f"the trainer ran {n} steps, fewer than {warm + timed + active}")
        if dev.type == "cuda":
            # kernels only: record_function ranges (the optimizer's step, say) are
            # device events too, and would count their kernels twice
            times = [(e.name, e.time_range.elapsed_us()) for e in prof.events()
                     if e.device_type == DeviceType.CUDA
                     and not getattr(e, "is_user_annotation", False)]
        else:
            times = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
        by_name, by_kind = {}, {}
        for name, us in times:
            by_name[name] = by_name.get(name, 0.0) + us
            by_kind[kernel_kind(name)] = by_kind.get(kernel_kind(name), 0.0) + us
        busy_ms = sum(by_name.values()) / 1e3 / active
        step_ms = wall["seconds"] * 1e3 / timed  # without the profiler's own cost
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
        result = {"steps_profiled": active, "steps_timed": timed, "step_ms": round(step_ms, 2),
                "device_busy_ms": round(busy_ms, 2),
                "device_busy_share": round(busy_ms / step_ms, 3),
                "by_kind_ms": {k: round(v / 1e3 / active, 2)
                               for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
                "top": [{"name": k[:160], "kind": kernel_kind(k),
                         "ms_per_step": round(v / 1e3 / active, 3)} for k, v in top]}
        result["model"] = _beside_the_model(result)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _beside_the_model(profile: dict) -> dict:
    """gpu_model.py's prediction of this step (docs/gpu_model.json, made without a GPU:
    enwik8-base, batch 16, eager) beside the profile, kind by kind, and the step and
    the device's busy time: where the model is wrong, and whether the step waits for
    the host (busy time well under the step)."""
    import gpu_model

    prediction = json.loads((ROOT / "docs" / "gpu_model.json").read_text())
    return {"prediction": "docs/gpu_model.json",
            **gpu_model.compare_to_profile(prediction, profile)}


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


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
