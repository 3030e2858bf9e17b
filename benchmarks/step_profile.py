"""Where does an SRU++ training step's time go on this CPU?

Splits a training step into GEMMs, attention, the recurrence and everything else
(layer norm, element-wise ops, copies and casts, embedding, loss, autograd's own
bookkeeping), with ``torch.profiler`` on the CPU, in fp32 and under bf16 autocast,
at two shapes:

* ``recipe``: a recipe's model and batch (default ``recipes/shakespeare-cpu.toml``)
  on random tokens of its vocabulary, state carried from step to step as in
  training; its step is forward, backward, gradient clipping and RAdam, and the
  last three (the optimiser) are reported apart from the split;
* ``layer``: the layer benchmark's 2-layer SRU++ (``benchmarks/layer.py``: L=256,
  B=16, d=512, proj 128), forward and backward of the output's sum.

Each profiler event's *self* CPU time is counted once, in one category: an event
inside the recurrence (``srupp::sru_fwd``, ``srupp::sru_bwd`` and the custom op's
backward node) or inside an attention op (SDPA, srupp's ``_CausalMatmulAttention``
/ ``_MatmulAttention`` and their backward nodes, the one-query kernel) counts for
that op, children included (the attention's own ``bmm``s are attention, not
GEMM); anything else is classed by its own name: GEMM for ``mm``, ``addmm``,
``bmm``, ``matmul``, ``linear``, oneDNN's ``_linear_pointwise``, srupp's
``_OneDNNLinear`` and few-rows kernel; other for the rest. So autocast's casts of
a projection's inputs (``aten::to`` / ``copy_`` under ``aten::linear``) are
"other", and show in its top ops.

The step's wall time is the median of unprofiled steps, timed apart from the
profiled ones (the profiler slows small ops most). The profiled milliseconds are
per step, with the profiler's overhead in them; the shares are what to read.
``outside_ops_ms`` is the profiled wall time not inside any op (Python).

``--device cuda`` runs the steps on the GPU: the split above is then the host's
CPU time, and ``kernels`` adds the GPU's: its kernels' time by kind
(``KERNEL_KINDS``, by name), the top kernels, and how busy the GPU was.

A third shape, ``trainer`` (``--shapes trainer``), profiles the trainer's own
step (``Trainer._train_step``) on the recipe's data (``--set data.corpus=...``):
after warm-up steps, steps timed without the profiler, then profiled steps; the
device's time by kind and the share of the step it was busy (on the CPU, the
operators' self time). gpu_check.py's profile step is this, on the
``enwik8-base`` recipe, through :func:`trainer_profile`.

Prints one JSON object. Run with nothing else on the machine:

    .venv/bin/python benchmarks/step_profile.py [--recipe recipes/shakespeare-cpu.toml]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch
from _common import (add_layer_shape_args, layer_model_and_input, layer_training_step,
                     lm_training_step, median_seconds, synchronize)
from torch.profiler import ProfilerActivity, profile

CATEGORIES = ("gemm", "attention", "recurrence", "other")
OPTIMIZER_RANGE = "step_profile::optimizer"

# An event whose name contains one of these, and everything it calls, is that category.
RECURRENCE_MARKS = ("srupp::sru_", "GeneratedBackwardFor_srupp_sru")
ATTENTION_MARKS = ("scaled_dot_product", "ScaledDotProduct", "flash_attention",
                   "MatmulAttention", "attend_one_query", "_efficient_attention")
# An event with one of these names (after the namespace) is a GEMM by itself.
GEMM_NAMES = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_linear_pointwise",
              "mkldnn_linear", "_mkldnn_linear", "linear_rows", "_OneDNNLinear",
              "_OneDNNLinearBackward", "mv", "addmv", "dot"}

# A GPU kernel's kind, from its name (first match): what a training step's GPU time
# is spent on (gpu_model.py predicts the same kinds).
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


def cpu_info() -> dict:
    name, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and name in ("unknown", "", "x86_64"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"name": name, "avx512_bf16": "avx512_bf16" in flags,
            "amx_bf16": "amx_bf16" in flags, "amx_tile": "amx_tile" in flags}


def _own_category(name: str) -> str:
    short = name.rsplit("::", 1)[-1]
    return "gemm" if short in GEMM_NAMES else "other"


def category(evt) -> str:
    """The category of ``evt``'s self time: that of an enclosing recurrence, attention
    or optimiser range if any, else the event's own name's."""
    node = evt
    while node is not None:
        if node.name == OPTIMIZER_RANGE:
            return "optimizer"
        if any(m in node.name for m in RECURRENCE_MARKS):
            return "recurrence"
        if any(m in node.name for m in ATTENTION_MARKS):
            return "attention"
        node = node.cpu_parent
    return _own_category(evt.name)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, pattern in KERNEL_KINDS:
        if re.search(pattern, low):
            return kind
    return "other element-wise"


def _activities(device) -> list:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def kernel_time(prof, device, steps: int) -> dict:
    """The device's time per step by kernel kind, its top kernels, and its busy time.
    On CUDA the kernels alone: record_function ranges (the optimizer's step, say) are
    device events too, and would count their kernels twice. On the CPU the
    operators' self time, by the kind their names give."""
    if device.type == "cuda":
        times = [(e.name, e.time_range.elapsed_us()) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA
                 and not getattr(e, "is_user_annotation", False)]
    else:
        times = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    by_name, by_kind = collections.Counter(), collections.Counter()
    for name, us in times:
        by_name[name] += us
        by_kind[kernel_kind(name)] += us
    return {"busy_ms": round(sum(by_name.values()) / 1e3 / steps, 2),
            "by_kind_ms": {k: round(v / 1e3 / steps, 2) for k, v in by_kind.most_common()},
            "top": [{"name": k[:160], "kind": kernel_kind(k),
                     "ms_per_step": round(v / 1e3 / steps, 3)}
                    for k, v in by_name.most_common(15)]}


def split(step, steps: int, device=torch.device("cpu")) -> dict:
    """Profile ``steps`` calls of ``step`` and split their self CPU time by category;
    on CUDA also the GPU's kernels (``kernels``: :func:`kernel_time`)."""
    with profile(activities=_activities(device)) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        wall_us = (time.perf_counter() - t0) * 1e6
    per_cat = collections.Counter()
    other_ops = collections.Counter()
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CPU:
            continue
        us = evt.self_cpu_time_total
        cat = category(evt)
        per_cat[cat] += us
        if cat == "other":
            other_ops[evt.name] += us
    split_us = sum(per_cat[c] for c in CATEGORIES)
    ops_us = split_us + per_cat["optimizer"]
    out = {"categories": {c: {"ms": round(per_cat[c] / steps / 1e3, 3),
                              "share": round(per_cat[c] / split_us, 4) if split_us else 0.0}
                          for c in CATEGORIES},
           "profiled_ms_per_step": round(wall_us / steps / 1e3, 3),
           "outside_ops_ms": round(max(wall_us - ops_us, 0.0) / steps / 1e3, 3),
           "top_other_ops": [{"op": name, "ms": round(us / steps / 1e3, 3),
                              "share": round(us / split_us, 4) if split_us else 0.0}
                             for name, us in other_ops.most_common(10)]}
    if per_cat["optimizer"]:
        out["optimizer_ms"] = round(per_cat["optimizer"] / steps / 1e3, 3)
    if device.type == "cuda":
        out["kernels"] = kernel_time(prof, device, steps)
    return out


def trainer_profile(cfg, run_dir: Path, device, warm: int, timed: int, active: int) -> dict:
    """The trainer's own training step of ``cfg`` (``Trainer._train_step``): ``warm``
    steps, then ``timed`` steps timed without the profiler, then ``active`` steps under
    it (``cfg`` must train at least their sum). The step's wall time, the device's
    time by kind and its top kernels (:func:`kernel_time`), and the share of the step
    the device was busy (the rest is the host: Python, launches, waits)."""
    from srupp.train import Trainer

    trainer = Trainer(cfg, run_dir, progress=False)
    prof = profile(activities=_activities(device))
    step_of_trainer, n, wall = trainer._train_step, 0, {}

    def profiled_step(it):  # the trainer's own step: timed, then profiled
        nonlocal n
        n += 1
        if n == warm + 1:
            synchronize(device)
            wall["t0"] = time.perf_counter()
        if n == warm + timed + 1:
            synchronize(device)
            wall["seconds"] = time.perf_counter() - wall["t0"]
            prof.start()
        out = step_of_trainer(it)
        if n == warm + timed + active:
            synchronize(device)
            prof.stop()
            wall["profiled"] = True
        return out

    trainer._train_step = profiled_step
    trainer.train()
    if "profiled" not in wall:
        raise RuntimeError(f"the trainer ran {n} steps, fewer than {warm + timed + active}")
    kernels = kernel_time(prof, device, active)
    step_ms = wall["seconds"] * 1e3 / timed  # without the profiler's own cost
    return {"steps_profiled": active, "steps_timed": timed, "step_ms": round(step_ms, 2),
            "device_busy_ms": kernels["busy_ms"],
            "device_busy_share": round(kernels["busy_ms"] / step_ms, 3),
            "by_kind_ms": kernels["by_kind_ms"], "top": kernels["top"]}


def trainer_shape(args, precision: str, device) -> dict:
    """--shapes trainer: :func:`trainer_profile` of the recipe at ``precision``, with
    --warmup, --repeats and --profiled-steps steps, in a run folder deleted after."""
    from srupp.train import build_config

    warm, timed, active = args.warmup, args.repeats, args.profiled_steps
    sets = list(args.set) + [f"train.precision={precision}", f"train.device={device.type}",
                             f"train.max_steps={warm + timed + active}",
                             "train.eval_every=1000000", "train.save_every=1000000"]
    cfg = build_config(args.recipe, sets)
    work = Path(tempfile.mkdtemp(prefix="step_profile_"))
    try:
        return trainer_profile(cfg, work / "run", device, warm, timed, active)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def recipe_step(args, bf16: bool, device=torch.device("cpu")):
    """(step, description): the recipe's model on random tokens, forward under the
    precision, backward, clip, RAdam step, state carried."""
    from srupp.train import build_config

    cfg = build_config(args.recipe, list(args.set))
    vocab = args.vocab
    if vocab is None:
        if cfg.data.tokenizer not in (None, "byte"):
            raise SystemExit(f"data.tokenizer={cfg.data.tokenizer}: give --vocab")
        vocab = 256
    step, model = lm_training_step(cfg, vocab, bf16, optimizer_range=OPTIMIZER_RANGE,
                                   device=device)
    t = cfg.train
    B, L = t.batch_size, t.unroll
    desc = {"recipe": args.recipe, "sets": list(args.set), "batch_size": B, "unroll": L,
            "vocab": vocab, "parameters": sum(p.numel() for p in model.parameters()),
            "model": {k: cfg.model.get(k) for k in ("d_model", "proj_size", "num_layers")},
            "step": "forward, backward, clip, RAdam (optimizer apart from the split)"}
    return step, desc


def layer_step(args, bf16: bool, device=torch.device("cpu")):
    model, x = layer_model_and_input(args, device=device)
    desc = {"L": args.L, "B": args.B, "d": args.d, "proj": args.proj, "num_layers": 2,
            "step": "forward, backward of the output's sum (no optimizer)"}
    return layer_training_step(model, x, bf16), desc


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda: where the steps run")
    ap.add_argument("--recipe", default="recipes/shakespeare-cpu.toml")
    ap.add_argument("--set", nargs="*", default=[], help="recipe overrides key=value")
    ap.add_argument("--vocab", type=int, default=None,
                    help="vocabulary size (default: 256 for the byte tokenizer)")
    add_layer_shape_args(ap)
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--shapes", default="recipe,layer", help="recipe, layer and/or trainer")
    ap.add_argument("--repeats", type=int, default=15, help="timed unprofiled steps")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profiled-steps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true",
                    help="tiny shapes and few steps (a smoke test; times nothing useful)")
    args = ap.parse_args(argv)
    unknown = set(args.shapes.split(",")) - {"recipe", "layer", "trainer"}
    if unknown:
        ap.error(f"unknown shapes {sorted(unknown)}; choose from recipe, layer, trainer")
    if args.tiny:
        args.set = list(args.set) + ["model.d_model=32", "model.proj_size=8",
                                     "model.num_layers=2", "train.batch_size=2",
                                     "train.unroll=8"]
        args.L, args.B, args.d, args.proj = 8, 2, 16, 8
        args.repeats, args.warmup, args.profiled_steps = 2, 1, 1
    return args


def measure(args) -> dict:
    """The JSON object: per shape and precision, the step's time and its split.
    ``args``: :func:`parse_args`'s namespace."""
    dev = torch.device(args.device)
    cpu = cpu_info()
    result = {"cpu": cpu, "torch": torch.__version__, "device": str(dev),
              "threads": torch.get_num_threads(),
              "loadavg_1m": os.getloadavg()[0], "repeats": args.repeats,
              "profiled_steps": args.profiled_steps, "shapes": {}}
    builders = {"recipe": recipe_step, "layer": layer_step}
    for shape in args.shapes.split(","):
        entry = {}
        for precision in args.precisions.split(","):
            if shape == "trainer":
                entry["config"] = {"recipe": args.recipe, "sets": list(args.set),
                                   "step": "the trainer's own step (Trainer._train_step)"}
                entry[precision] = trainer_shape(args, precision, dev)
                continue
            step, desc = builders[shape](args, precision == "bf16", dev)
            entry["config"] = desc
            ms = median_seconds(step, args.repeats, args.warmup, device=dev) * 1e3
            entry[precision] = {"step_ms": round(ms, 3),
                                **split(step, args.profiled_steps, dev)}
        result["shapes"][shape] = entry
    return result


def main(argv=None):
    print(json.dumps(measure(parse_args(argv)), indent=2))


if __name__ == "__main__":
    main()
