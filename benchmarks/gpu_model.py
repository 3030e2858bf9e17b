"""Where does one training step's time go on a GPU? A model of it, built without a GPU.

The step is the trainer's own (``Trainer._train_step``: forward, loss,
backward, gradient clipping, the optimizer's step) on a recipe's language
model, run on fake CUDA tensors (``FakeTensorMode``: shapes, dtypes and
devices, no data), so srupp takes the paths it takes on CUDA: autocast's casts,
the Triton recurrence's custom ops (``srupp::sru_fwd`` / ``sru_bwd``), SDPA
with the mask form its CUDA route picks, torch's foreach optimizer and
clipping. A dispatch mode records every kernel-level operation: its FLOPs
(torch.utils.flop_counter's formulas; the recurrence's and attention's are
written here), the bytes it reads and writes, its launches and its kind.

Each operation is then priced on a GPU set (``--gpu h200|h100|a100``)::

    device time = max(FLOPs / rate, bytes / copy bandwidth)
    rate: GEMMs at the full-wave peak x their wave efficiency (128 x 256 output
          blocks over the SMs); fused attention at its SDPA backend's share of
          the datasheet peak by head dim (public figures), the memory-efficient
          backward over the SMs its grid fills, plus its fp32 accumulators' bytes
          at head dim > 128; anything else at the GEMM peak
    host time   = dispatcher calls x call cost + launches x launch cost
    step        = max(device, host) in a training loop (the host runs ahead);
                  a timeline from idle where something waits (syncs, or one call
                  timed alone: gpu_check's layer step)

except the recurrence, whose plain time loop is latency-bound:
max(bytes / bandwidth, L x the per-step latency measured on the H200), or with
``--recurrence pipelined`` bandwidth-bound at a share of copy bandwidth (a
hypothesis until a GPU times it). ``--compiled``, ``--fused-optimizer`` and
``--attention matmul`` (srupp's explicit products, traced as they run) model the
changes being built now, ``--scenarios`` all of them alone and together;
``calibration`` compares the model with the first H200 run (docs/gpu.json) at
two points, the enwik8-base step and the single-layer step, and lists what the
model lacks where it misses. Every constant is in ``assumptions``, each with its
measurement or public source. :func:`compare_to_profile` sets a prediction beside
gpu_check.py's profile of the step, kind by kind.

How the step runs without a GPU (torch's CPU build): autograd refuses CUDA
tensors there, in two places. A no-op CUDA device guard (torch's Python
device-guard class, placed in the CUDA slot of c10's registry) lets the forward
record its autograd graph, and the backward is run by :func:`run_backward`,
which calls each node of that graph as torch's engine does (the engine itself
needs CUDA streams). The model never leaves the worker process that does this
(``--trace meta`` runs the step on the meta device instead: no autocast, bf16
weights, srupp's non-CUDA paths except the recurrence; approximate).

    python benchmarks/gpu_model.py --recipe recipes/enwik8-base.toml --batch 16 [--json]
    ... --compiled --fused-optimizer --recurrence pipelined --attention matmul --gpu h100
    ... --scenarios
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import heapq
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
GPU_JSON = ROOT / "docs" / "gpu.json"
CALIBRATION_DATE = "2026-11-27"

# --------------------------------------------------------------------------- GPU sets

# Public datasheet figures (dense, no sparsity), SXM parts: bf16/fp16 tensor-core
# TFLOP/s, fp32 (CUDA cores; the runs do not enable TF32) TFLOP/s, HBM GB/s, SMs.
# h200: NVIDIA H200 (141 GB HBM3e); h100: H100 SXM5 (80 GB HBM3); a100: A100 SXM4 80 GB.
# (docs/gpu.json's H200 reports 132 multiprocessors.)
SPECS = {
    "h200": {"half_tflops": 989.0, "fp32_tflops": 67.0, "hbm_GBps": 4800.0, "capability": (9, 0),
             "sms": 132},
    "h100": {"half_tflops": 989.0, "fp32_tflops": 67.0, "hbm_GBps": 3350.0, "capability": (9, 0),
             "sms": 132},
    "a100": {"half_tflops": 312.0, "fp32_tflops": 19.5, "hbm_GBps": 2039.0, "capability": (8, 0),
             "sms": 108},
}
# The H200 is measured (docs/gpu.json's bounds, read at run time); the other sets are
# their datasheet figures times the H200's measured/datasheet ratio of each. On the
# 2026-11-27 run those ratios were 768.9/989 = 0.78 (bf16 GEMM), 50.56/67 = 0.75 (fp32
# GEMM) and 4126.9/4800 = 0.86 (copy).

# GEMMs: cuBLAS's Hopper kernels tile the output in 128 x 256 blocks (the tile in the
# names of its sm90 bf16 kernels, e.g. "..._tilesize128x256x64_..."), one block per SM at
# a time. A product whose blocks do not fill the last wave leaves SMs idle: its speed is
# the full-wave rate x blocks / (waves x SMs), in the better of the two orientations.
# Where the blocks fill less than a wave and K is long, cuBLAS splits K (split-K /
# stream-K): up to K / GEMM_SPLIT_K_MIN splits. The full-wave rate is the measured
# 8192^3 rate over that product's own wave efficiency. Wave quantisation alone: no
# public per-shape cuBLAS figures were found for these shapes, so the cost of a short K
# (prologue and epilogue against few main-loop steps) is not modelled (see MISSING).
GEMM_TILE = (128, 256)
GEMM_SPLIT_K_MIN = 1024
GEMM_CALIBRATION = (8192, 8192, 8192)  # gpu_check's bounds step: an 8192^3 product

# Fused attention's speed, as a share of the datasheet 16-bit tensor peak, by SDPA
# backend and head dim, from public measurements (rates over the FLOPs that
# attention_cost counts; the public figures count them alike, the backward's 5 products):
# - flash (PyTorch's FlashAttention-2 kernels, built for sm80, on sm90): 0.30 forward,
#   SDPA's flash backend at head dim 128 on an H100 at 287-304 TFLOP/s
#   (pytorch/benchmark#2296); the FlashAttention-3 paper (Shah et al. 2024,
#   arXiv:2407.08608) puts FlashAttention-2 at about 35% of an H100. The backward is
#   taken at the forward's share: no public SDPA-flash backward figure on sm90 was found.
# - cudnn (sm90): 2.0 x flash: huggingface/transformers#48163 measured cuDNN's SDPA at
#   1.7-2.3 x flash for training shapes on Hopper.
# - efficient (xFormers' CUTLASS kernels, sm80 code on every GPU): on an A100, f16,
#   B 64, M 1024, H 16: 3.09 ms at K 128 and 7.03 ms at K 256, forward
#   (facebookresearch/xformers#587), i.e. 178 and 156 TFLOP/s, 0.57 and 0.50 of 312.
#   K > 128 runs the kMaxK=65536 kernels (value dim in chunks, the output accumulated
#   in fp32 in global memory), whose work per key block grows with K as the FLOPs do,
#   so K 256's share stands for every K > 128. On sm90 the sm80 code reaches the share
#   FlashAttention-2 (also sm80 code) keeps there: 35% on an H100 (arXiv:2407.08608)
#   against 73% on an A100 (Dao 2023, arXiv:2307.08691): x 0.48. The backward: no
#   public K > 128 figure was found; its per-tile rate is taken at the forward's, and
#   what the kernel's source says it does besides is priced: the fp32 gradient
#   accumulators in global memory for K > 128 (attention_cost) and its grid
#   (efficient_backward_ctas).
# - math: SDPA's unfused path (bmm, softmax in fp32): priced as the GEMM peak.
SM80_ON_SM90 = 0.35 / 0.73
ATTENTION_SHARE = {  # (backend, "le128" | "gt128") -> forward share on sm80
    ("efficient", "le128"): 178.0 / 312.0,
    ("efficient", "gt128"): 156.0 / 312.0,
}
FLASH_SHARE_SM90 = 0.30
CUDNN_OVER_FLASH_SM90 = 2.0
CUDNN_OVER_FLASH_SM80 = 0.82  # the same thread: 0.82x flash on an A100
ATTENTION_SOURCES = {
    "flash": "pytorch/benchmark#2296 (SDPA flash, H100, hd 128: 287-304 TFLOP/s forward); "
             "arXiv:2407.08608 (FlashAttention-2 at ~35% of an H100)",
    "cudnn": "huggingface/transformers#48163 (cuDNN 1.7-2.3x flash for training on Hopper, "
             "0.82x on an A100)",
    "efficient": "facebookresearch/xformers#587 (A100 forward, K 128: 3.09 ms, K 256: 7.03 ms "
                 "for B 64 M 1024 H 16); x 0.35/0.73 on sm90 (arXiv:2407.08608, "
                 "arXiv:2307.08691); backward at the forward's per-tile rate (no public "
                 "figure), plus its fp32 accumulators and grid from PyTorch's "
                 "mem_eff_attention/kernel_backward.h and attention_backward.cu",
}
# The memory-efficient backward's grid (PyTorch's attention_backward.cu): (num_splits_key,
# H, B) blocks of 8 warps for the 128 x 64 tiles it runs at K > 128
# (fmha_cutlassB_*_128x64_k65536_sm80), num_splits_key = ceil(S / 64) capped at
# 200 // (B H) where the kernel keeps fp32 gradient accumulators (K > 128, 16-bit); one
# block per SM (its launch bound: 12 warps per SM / 8).
EFFICIENT_BWD_TILE = (128, 64)   # (queries, keys) per block
EFFICIENT_FWD_TILE = (32, 128)   # fmha_cutlassF_*_32x128_gmem_sm80 at K > 128
EFFICIENT_SPLITS_CAP = 200

# Host time. Per launch: the host-side cost of one eager PyTorch CUDA op that launches a
# kernel (Python, the dispatcher, cudaLaunchKernel), the low end of the 5-25 us quoted
# for it in public write-ups
# (e.g. https://jiahuanglin.xyz/all_lessons/gpu_kernel_serving/18_pytorch_to_kernel.html).
# Per dispatcher call (every aten op the trace records, views and the optimizer's CPU
# scalar ops included): by default measured on this machine (:func:`measure_host`: the
# model's structure trained at tiny widths on one CPU thread, where the time is the
# host's: Python between the calls, srupp's routing, the dispatcher, autograd), about
# 4 us on a 2-core AMD EPYC for enwik8-base; --call-us gives another, e.g. the
# public figure for a bare op from Python with autograd recording, 6.8 us
# (pytorch/pytorch#41383: 10^6 calls of 2 * x with requires_grad in 6.8 s, 5 s without;
# the one-element kernel is negligible), which leaves out srupp's own Python. A
# launching op pays both. The host runs ahead of the GPU until something waits for the
# device (a sync): see :func:`timeline`.
LAUNCH_US = 5.0
LAUNCH_SOURCE = ("eager PyTorch's host cost per CUDA op, low end of the 5-25 us public "
                 "write-ups quote; charged per launch on top of the call's cost")
CALL_US = 6.8
CALL_SOURCE = ("an eager PyTorch op from Python with autograd recording: 6.8 us a call "
               "(pytorch/pytorch#41383); charged to every dispatcher call the trace records")

# What the model does not know, said in its output (each could explain a miss).
MISSING = (
    "the memory-efficient attention backward at head dim > 128: no public measurement; "
    "its per-tile rate is taken at the forward's, and its fp32 accumulators move at copy "
    "bandwidth (L2 hits would make it faster)",
    "GEMM efficiency by shape beyond wave quantisation (short K, epilogues, cuBLAS's own "
    "tile and split choices): no public per-shape cuBLAS figures for these shapes",
    "element-wise kernels at the 2 GiB copy's bandwidth: broadcasts, strided and mixed-"
    "dtype operands and small tensors run below it",
    "the plain recurrence's per-step latency at other B x D than docs/gpu.json's rows "
    "(B 16, D 2048), taken as equal",
    "the GPU machine's host CPU: the cost per dispatcher call is measured on this "
    "machine's, and a faster host shortens a host-bound step in proportion",
    "gaps between back-to-back kernels on the device; Dynamo's guards and Inductor's "
    "kernel quality under --compiled",
)

# foreach kernels (torch's multi_tensor_apply): tensors per launch by number of tensor
# lists (1..5), blocks of 65536 elements per launch
FOREACH_MAX_TENSORS = (110, 64, 48, 36, 30)
FOREACH_MAX_BLOCKS = 320
FOREACH_CHUNK = 65536

KINDS = ("gemm", "attention", "recurrence", "elementwise", "casts", "optimizer", "other")


def read_gpu_json(path: Path = GPU_JSON) -> Dict[str, Any]:
    """The measured H200 figures in docs/gpu.json: bounds, recurrence rows, and the
    enwik8-base run (gpu_check's enwik8 step, or the eager SRU++ row of the
    side-by-side step that replaces it)."""
    report = json.loads(Path(path).read_text())
    steps = report["steps"]
    run = (steps.get("enwik8") or {}).get("result")
    side = (steps.get("side_by_side") or {}).get("result")
    if run is None and side:
        row = next((r for r in side["rows"] if r["name"] == "srupp eager"
                    and "tokens_per_s" in r), None)
        run = row and {**row, **{k: side[k] for k in ("batch", "unroll", "precision")}}
    if run is None:
        raise ValueError(f"{path} holds no enwik8-base run to calibrate against")
    return {"bounds": steps["bounds"]["result"], "recurrence": steps["recurrence"]["result"],
            "enwik8": run, "layer": (steps.get("layer") or {}).get("result"),
            "date": steps["environment"]["result"].get("date_utc", "")[:10],
            "targets": report.get("targets", {})}


def gpu_set(name: str, measured: Dict[str, Any]) -> Dict[str, Any]:
    """Peaks, bandwidth, capability and the recurrence's per-step latency of a GPU set."""
    if name not in SPECS:
        raise ValueError(f"unknown GPU set {name!r}; choose one of {', '.join(SPECS)}")
    b, h200 = measured["bounds"], SPECS["h200"]
    ratios = {"half": b["gemm_bf16_TFLOPs"] / h200["half_tflops"],
              "fp32": b["gemm_fp32_TFLOPs"] / h200["fp32_tflops"],
              "copy": b["copy_GBps"] / h200["hbm_GBps"]}
    spec = SPECS[name]
    out = {"name": name, "capability": spec["capability"], "ratios": ratios,
           "half_tflops": spec["half_tflops"] * ratios["half"],
           "fp32_tflops": spec["fp32_tflops"] * ratios["fp32"],
           "copy_GBps": spec["hbm_GBps"] * ratios["copy"],
           "datasheet_half_tflops": spec["half_tflops"], "sms": spec["sms"],
           "source": "measured (docs/gpu.json bounds)" if name == "h200" else
                     "datasheet x the H200's measured/datasheet ratios"}
    # the measured 8192^3 rate is itself below a full wave by its own quantisation (on the
    # H200's SMs, where it was measured): the rate per full wave is above it
    calib = gemm_wave_efficiency([1, *GEMM_CALIBRATION], h200["sms"])
    out["full_wave_half_tflops"] = out["half_tflops"] / calib
    out["full_wave_fp32_tflops"] = out["fp32_tflops"] / calib
    # the recurrence's time loop waits one DRAM round trip a step; taken as the H200's
    # on the other sets too (their DRAM latency is alike)
    out["recurrence_rows"] = [r for r in measured["recurrence"]["rows"] if "forward_ms" in r]
    return out


def _wave_efficiency(blocks: int, slots: int) -> float:
    """blocks / (waves x slots): the busy share of ``slots`` SMs over whole waves."""
    if blocks <= 0:
        return 1.0
    return blocks / (math.ceil(blocks / slots) * slots)


def gemm_wave_efficiency(shape: List[int], sms: int) -> float:
    """The share of a full wave's rate that a product of ``shape`` [batch, M, K, N] keeps:
    output blocks of GEMM_TILE (either orientation, the better), and where they fill
    less than one wave, K split into up to K // GEMM_SPLIT_K_MIN parts (split-K)."""
    batch, M, K, N = shape
    best = 0.0
    for tm, tn in (GEMM_TILE, GEMM_TILE[::-1]):
        blocks = batch * math.ceil(M / tm) * math.ceil(N / tn)
        splits = range(1, max(1, K // GEMM_SPLIT_K_MIN) + 1) if blocks < sms else (1,)
        for sp in splits:
            best = max(best, _wave_efficiency(blocks * sp, sms))
    return best


def step_latency_us(rows: List[dict], dtype: str, L: int, direction: str) -> float:
    """Microseconds per time step of the plain recurrence: forward_ms / L (or backward)
    of the measured row of this dtype whose L is nearest (on a log scale)."""
    mine = [r for r in rows if r["dtype"] == dtype] or [r for r in rows if r["dtype"] == "fp32"]
    if not mine:
        raise ValueError(f"docs/gpu.json has no recurrence rows for {dtype}")
    row = min(mine, key=lambda r: abs(math.log(r["L"] / max(L, 1))))
    return row[f"{direction}_ms"] * 1e3 / row["L"]


# --------------------------------------------------------------------------- counting one op

def _tensors(tree) -> list:
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def tensor_bytes(t) -> int:
    """Bytes a kernel touches in ``t``: its elements, a broadcast (stride 0) dim once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm", "mv", "addmv", "dot"}
# data movement: copies, fills, concatenation, gathers and scatters
_MOVES = {"cat", "stack", "clone", "copy_", "_to_copy", "fill_", "fill", "zero_", "zeros",
          "zeros_like", "ones", "ones_like", "full", "full_like", "new_zeros", "new_ones",
          "new_full", "scalar_tensor", "arange", "embedding", "embedding_dense_backward",
          "index_select", "gather", "scatter", "scatter_add", "scatter_add_", "index_add",
          "index_add_", "index_put", "index_put_", "_index_put_impl_", "index",
          "constant_pad_nd", "slice_backward", "select_backward", "slice_scatter",
          "select_scatter", "as_strided_scatter", "repeat", "_pin_memory", "lift_fresh_copy"}
# in-place ops that overwrite their first argument without reading it
_WRITE_ONLY = {"copy_", "fill_", "zero_", "bernoulli_", "uniform_", "normal_", "random_",
               "exponential_", "geometric_", "cauchy_", "log_normal_"}
# gathers: they read as many elements of their source as they write
_GATHERS = {"embedding", "index_select", "gather", "index"}
# metadata only: no kernel
_FREE = {"detach", "_unsafe_view", "lift_fresh", "empty", "empty_like", "empty_strided",
         "new_empty", "new_empty_strided", "alias", "set_", "resize_", "_local_scalar_dense",
         "device", "promote_types", "sym_size", "sym_stride", "sym_numel", "is_same_size",
         "_has_compatible_shallow_copy_type", "record_stream"}


def _op_name(func) -> str:
    return func._schema.name.split("::")[-1]


def _mutated(func, args, kwargs) -> list:
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out += _tensors(args[i] if i < len(args) else kwargs.get(a.name))
    return out


def foreach_launches(numels: List[int], depth: int) -> int:
    """Kernel launches of one foreach op over tensors of ``numels`` elements with
    ``depth`` tensor lists, by multi_tensor_apply's rule: a launch whenever its block
    table (320 blocks of 65536 elements) or its tensor table fills, and one for the rest."""
    max_tensors = FOREACH_MAX_TENSORS[min(max(depth, 1), 5) - 1]
    launches = tensors = blocks = 0
    for n in numels:
        if n == 0:
            continue
        tensors += 1
        chunks = -(-n // FOREACH_CHUNK)
        for c in range(chunks):
            blocks += 1
            last = c == chunks - 1
            if blocks == FOREACH_MAX_BLOCKS or (last and tensors == max_tensors):
                launches += 1
                blocks = 0
                tensors = 0 if last else 1
    return launches + (1 if blocks else 0)


def count_op(func, args, kwargs, out) -> Optional[Dict[str, Any]]:
    """FLOPs, bytes and launches of one aten (or custom) op, or None when it launches
    no kernel: a view, metadata, an allocation, or work on CPU tensors only (host).

    Bytes: every tensor argument read once (a broadcast dim once), every output or
    mutated argument written once; ops that overwrite an argument (copy_, fill_, ...)
    do not read it, and gathers read what they write. Launches: one, or for foreach
    and fused optimizer ops multi_tensor_apply's count (:func:`foreach_launches`;
    _foreach_norm one more for its final reduction).
    """
    from torch.utils.flop_counter import flop_registry

    name = _op_name(func)
    ins, outs = _tensors((args, kwargs)), _tensors(out)
    every = ins + outs
    if not every or all(t.device.type == "cpu" for t in every):
        return None  # host work (the optimizer's step counts on CPU tensors, say)
    if name in _FREE or func.namespace == "profiler" or getattr(func, "is_view", False):
        return None
    mutated = _mutated(func, args, kwargs)
    mut_ids = {id(t) for t in mutated}
    reads, seen = [], set()
    for t in ins:
        if id(t) in seen or (name in _WRITE_ONLY and id(t) in mut_ids):
            continue
        seen.add(id(t))
        reads.append(t)
    writes, seen = list(mutated), set(mut_ids)
    for t in outs:
        if id(t) not in seen:
            seen.add(id(t))
            writes.append(t)
    written = sum(tensor_bytes(t) for t in writes)
    if name in _GATHERS:  # (the source is the first argument)
        read = written + sum(tensor_bytes(t) for t in reads if t is not ins[0])
    else:
        read = sum(tensor_bytes(t) for t in reads)
    flops = 0
    formula = flop_registry.get(func.overloadpacket)
    if formula is not None:
        flops = int(formula(*args, **kwargs, out_val=out))
    launches = 1
    if name.startswith(("_foreach_", "_fused_")):  # (torch's fused Adam/AdamW/SGD too)
        lists = [a for a in args if isinstance(a, (list, tuple)) and a
                 and all(hasattr(t, "numel") for t in a)]
        launches = foreach_launches([t.numel() for t in lists[0]], len(lists)) if lists else 1
        launches += 1 if name == "_foreach_norm" else 0
    dtype = next((t.dtype for t in ins if t.is_floating_point()),
                 next((t.dtype for t in outs if t.is_floating_point()), None))
    rec = {"name": name, "flops": flops, "read": read, "written": written,
           "launches": launches, "dtype": str(dtype).replace("torch.", "") if dtype else None,
           "reads": reads, "writes": writes}
    shape = gemm_shape(name, args)
    if shape is not None:
        rec["gemm"] = shape
    return rec


def gemm_shape(name: str, args) -> Optional[List[int]]:
    """[batch, M, K, N] of a matrix product (output batch x M x N, reduction K), or None."""
    mats = [a for a in args if hasattr(a, "dim")]
    if name in ("mm", "addmm", "_scaled_mm") and len(mats) >= 2:
        a, b = mats[-2:]
        if a.dim() == 2 and b.dim() == 2:
            return [1, int(a.shape[0]), int(a.shape[1]), int(b.shape[1])]
    if name in ("bmm", "baddbmm") and len(mats) >= 2:
        a, b = mats[-2:]
        if a.dim() == 3 and b.dim() == 3:
            return [int(a.shape[0]), int(a.shape[1]), int(a.shape[2]), int(b.shape[2])]
    return None


def op_kind(name: str, rec: Dict[str, Any], phase: str, attention: bool) -> str:
    """The kind of a counted op (see KINDS)."""
    if phase in ("clip", "optimizer"):
        return "optimizer"
    if name in ("sru_fwd", "sru_bwd"):
        return "recurrence"
    if attention:
        return "attention"
    if name in _GEMMS:
        return "gemm"
    if name in ("_to_copy", "copy_") and rec.get("cast"):
        return "casts"
    if name in _MOVES:
        return "other"
    return "elementwise"


# --------------------------------------------------------------------------- the recorder

_ATTENTION_FILE = os.path.join("srupp", "ops", "attention.py")
_SCOPE = "srupp_gpu_model_scope"  # the key of a node's scope in its metadata


def _in_attention() -> bool:
    """Whether srupp's attention code is on the Python stack (its ops are attention)."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_filename.endswith(_ATTENTION_FILE):
            return True
        f = f.f_back
    return False


def _recorder_class():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        """Records the kernel-level ops dispatched below autograd while ``on``.

        Each record: the op, its kind, phase (forward, backward, clip, optimizer,
        other), the SRU++ layer it belongs to (None outside the layers), FLOPs,
        bytes, launches, dtype, and the storages it reads and writes (for the
        ``--compiled`` fusion rule)."""

        def __init__(self):
            super().__init__()
            self.records: List[dict] = []
            self.on = False
            self.phase = "forward"
            self.layer: Optional[int] = None
            self.backward_scope = (None, False)  # (layer, attention) of the node running
            self._keep: list = []  # every tensor seen stays alive: its storage key is unique
            self.syncs = 0
            self.calls: Dict[str, int] = {}  # every dispatcher call, views included, by phase
            # calls and syncs since the last record: the next record carries them
            # (calls_before, syncs_before), so that the host's time can be laid out in order
            self.pending = {"calls": 0, "syncs": 0}

        def scope(self):
            if self.phase == "backward":
                return self.backward_scope
            return (self.layer, _in_attention())

        def key(self, t) -> int:
            self._keep.append(t)
            return t.untyped_storage()._cdata

        def count_call(self) -> None:
            self.calls[self.phase] = self.calls.get(self.phase, 0) + 1
            self.pending["calls"] += 1

        def add(self, rec: dict, kind: Optional[str] = None) -> None:
            layer, attention = self.scope()
            rec["phase"], rec["layer"] = self.phase, layer
            rec["kind"] = kind or op_kind(rec["name"], rec, self.phase, attention)
            rec["reads"] = [[self.key(t), tensor_bytes(t)] for t in rec["reads"]]
            rec["writes"] = [[self.key(t), tensor_bytes(t)] for t in rec["writes"]]
            rec["calls_before"], rec["syncs_before"] = self.pending["calls"], self.pending["syncs"]
            self.pending = {"calls": 0, "syncs": 0}
            self.records.append(rec)

        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if not self.on:
                return out
            self.count_call()
            if _op_name(func) == "_local_scalar_dense" and any(
                    t.device.type != "cpu" for t in _tensors(args)):
                self.syncs += 1  # .item() on a device tensor: the host waits for the GPU
                self.pending["syncs"] += 1
            rec = count_op(func, args, kwargs, out)
            if rec is not None:
                if rec["name"] in ("_to_copy", "copy_"):
                    src = _tensors(args)[-1 if rec["name"] == "copy_" else 0]
                    dst = _tensors(out)[0]
                    rec["cast"] = src.dtype != dst.dtype
                if rec["name"] in ("sru_fwd", "sru_bwd"):
                    U = args[0]  # (B, L, k, D)
                    rec["extra"] = {"L": int(U.shape[1]), "B": int(U.shape[0]),
                                    "D": int(U.shape[3]),
                                    "dtype": str(U.dtype).replace("torch.", ""),
                                    "direction": "forward" if rec["name"] == "sru_fwd"
                                    else "backward"}
                    # per (b, t, d): two sigmoids, the state and output updates
                    rec["flops"] = (12 if rec["name"] == "sru_fwd" else 24) * U.shape[0] \
                        * U.shape[1] * U.shape[3]
                self.add(rec)
            return out

    return Recorder


def record_ops(fn, *args, **kwargs) -> List[dict]:
    """The records of the ops that ``fn(*args, **kwargs)`` launches, in order (tensors
    on a device other than the CPU: meta, or fake CUDA; phase "forward")."""
    recorder = _recorder_class()()
    with recorder:
        recorder.on = True
        fn(*args, **kwargs)
    return recorder.records


# --------------------------------------------------------------------------- attention

_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def visible_blocks(L: int, S: int, mask: str, bq: int, bk: int) -> int:
    """Blocks of ``bq`` queries x ``bk`` keys that a fused kernel visits: all of them, or
    for causal masks those with a key a query of the block may see (query i sees keys
    j <= i, or j <= S - L + i for causal_lower_right)."""
    nk = math.ceil(S / bk)
    if mask not in ("causal", "causal_lower_right"):
        return math.ceil(L / bq) * nk
    offset = S - L if mask == "causal_lower_right" else 0
    return sum(min(nk, math.ceil((offset + min(q0 + bq, L)) / bk)) for q0 in range(0, L, bq))


def efficient_backward_ctas(B: int, H: int, S: int, k: int) -> int:
    """Blocks in the memory-efficient backward's grid: (num_splits_key, H, B), with
    num_splits_key = ceil(S / 64), capped at 200 // (B H) (at least 1) where it keeps fp32
    accumulators in global memory (K > 128: PyTorch's attention_backward.cu heuristic)."""
    splits = math.ceil(S / EFFICIENT_BWD_TILE[1])
    if k > 128:
        splits = max(1, min(splits, EFFICIENT_SPLITS_CAP // max(B * H, 1)))
    return splits * H * B


def attention_cost(B: int, H: int, L: int, S: int, hd: int, dv: int, mask: str, backend: str,
                   itemsize: int) -> Dict[str, Dict[str, float]]:
    """FLOPs, bytes and launches of one SDPA call, forward and backward.

    Query-key pairs computed: all L x S for no mask or a dense one; the visible ones
    for causal masks (fused kernels skip blocks above the diagonal). Forward: q·k and
    p·v, 2 x pairs x (hd + dv). Backward: dv, dp, dq, dk, 2 x pairs x (2 hd + 2 dv),
    and the fused kernels recompute q·k (+ 2 x pairs x hd). Bytes: the fused kernels
    read q, k, v and write o and the log-sum-exp (fp32, B x H x L); the backward
    reads those and dO and writes dq, dk, dv. The math backend also writes and reads
    the scores and probabilities (fp32, B x H x L x S), twice each way.

    The memory-efficient kernels at K = max(hd, dv) > 128 (PyTorch's
    mem_eff_attention/kernel_forward.h and kernel_backward.h, kMaxK = 65536) also move
    fp32 accumulators through global memory: the forward reads and writes a block's
    output (32 x K) once per 128-key block it visits; the backward reads and writes dK
    and dV (64 x K each) and dQ (128 x K) once per 128-query x 64-key block. Those
    bytes are added, and the backward's grid is recorded (``ctas``).
    """
    if mask == "causal":
        pairs = L * (L + 1) // 2
    elif mask == "causal_lower_right":
        pairs = L * (S - L) + L * (L + 1) // 2
    else:
        pairs = L * S
    pairs *= B * H
    q, o = B * H * L * hd * itemsize, B * H * L * dv * itemsize
    kv = B * H * S * (hd + dv) * itemsize
    lse = B * H * L * 4
    fused = backend != "math"
    fwd = {"flops": 2 * pairs * (hd + dv), "read": q + kv, "written": o + lse,
           "launches": 1 if fused else 5}
    bwd = {"flops": 2 * pairs * (2 * hd + 2 * dv) + (2 * pairs * hd if fused else 0),
           "read": q + kv + 2 * o + lse, "written": q + kv, "launches": 2 if fused else 8}
    if not fused:
        scores = B * H * L * S * 4
        fwd["read"] += 2 * scores
        fwd["written"] += 2 * scores
        bwd["read"] += 2 * scores
        bwd["written"] += 2 * scores
    k = max(hd, dv)
    if backend == "efficient":
        bwd["ctas"] = efficient_backward_ctas(B, H, S, k)
        if k > 128:
            bq, bk = EFFICIENT_FWD_TILE
            acc = B * H * visible_blocks(L, S, mask, bq, bk) * bq * dv * 4
            fwd["read"] += acc
            fwd["written"] += acc
            bq, bk = EFFICIENT_BWD_TILE
            tiles = B * H * visible_blocks(L, S, mask, bq, bk)
            acc = tiles * (bk * (hd + dv) + bq * hd) * 4
            bwd["read"] += acc
            bwd["written"] += acc
    return {"forward": fwd, "backward": bwd}


def attention_share(backend: str, k: int, capability) -> float:
    """A fused SDPA kernel's speed as a share of the datasheet 16-bit tensor peak (see
    ATTENTION_SHARE and its sources), for K = max(hd, dv) on a GPU of ``capability``."""
    sm90 = tuple(capability) >= (9, 0)
    if backend == "efficient":
        share = ATTENTION_SHARE[("efficient", "le128" if k <= 128 else "gt128")]
        return share * (SM80_ON_SM90 if sm90 else 1.0)
    flash = FLASH_SHARE_SM90 / (1.0 if sm90 else SM80_ON_SM90)
    if backend == "flash":
        return flash
    if backend == "cudnn":
        return flash * (CUDNN_OVER_FLASH_SM90 if sm90 else CUDNN_OVER_FLASH_SM80)
    raise ValueError(f"no attention share for backend {backend!r}")


def _sdpa_mask(q, k, attn_mask, is_causal) -> str:
    """The mask form of an SDPA call, in cuda_sdpa_backend's words."""
    L, S = q.shape[-2], k.shape[-2]
    if attn_mask is None:
        return ("causal" if L == S else "dense") if is_causal else "none"
    variant = getattr(attn_mask, "variant", None)
    if variant is not None:  # torch.nn.attention.bias.CausalBias
        if L == S:
            return "causal"
        lower_right = getattr(variant, "name", str(variant)) == "LOWER_RIGHT"
        return "causal_lower_right" if lower_right else "dense"
    return "dense"


def _sdpa_backend(hd: int, dtype, mask: str, dropout: float, capability) -> str:
    """srupp.ops.attention.cuda_sdpa_backend's answer, or "unknown" before it exists."""
    from srupp.ops import attention

    rule = getattr(attention, "cuda_sdpa_backend", None)
    if rule is None:
        return "unknown"
    return rule(hd, dtype, mask, bool(dropout), tuple(capability))


def _attention_stand_in(recorder, capability):
    """F.scaled_dot_product_attention's stand-in: an autograd function whose forward
    and backward each record one attention op (:func:`attention_cost`) and return
    empty tensors of the right shapes. What torch's CPU build would run for a CUDA
    call (it has no fused CUDA kernels) is not what a GPU runs; the cost is the
    backend's that cuda_sdpa_backend names."""
    import torch

    class SdpaStandIn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, mask_tensor, info):
            ctx.info = info
            ctx.save_for_backward(q, k, v)
            o = q.new_empty(q.shape[:-1] + (v.shape[-1],))
            rec = dict(info["cost"]["forward"], name="scaled_dot_product_attention",
                       dtype=info["dtype"], reads=[q, k, v] + ([mask_tensor] if
                                                                 mask_tensor is not None else []),
                       writes=[o], extra=dict(info["extra"], direction="forward"))
            recorder.count_call()  # the SDPA call itself, whose kernel this stands in for
            recorder.add(rec, kind="attention")
            return o

        @staticmethod
        def backward(ctx, go):
            q, k, v = ctx.saved_tensors
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            info = ctx.info
            rec = dict(info["cost"]["backward"], name="scaled_dot_product_attention_backward",
                       dtype=info["dtype"], reads=[q, k, v, go], writes=[dq, dk, dv],
                       extra=dict(info["extra"], direction="backward",
                                  ctas=info["cost"]["backward"].get("ctas")))
            recorder.count_call()
            recorder.add(rec, kind="attention")
            return dq, dk, dv, None, None

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        mask = _sdpa_mask(query, key, attn_mask, is_causal)
        B, H, L, hd = query.shape
        S, dv = key.shape[-2], value.shape[-1]
        dtype = query.dtype
        backend = _sdpa_backend(hd, dtype, mask, dropout_p, capability)
        info = {"mask": mask, "head_dim": hd, "backend": backend,
                "dtype": str(dtype).replace("torch.", ""),
                "cost": attention_cost(B, H, L, S, hd, dv, mask, backend, query.element_size()),
                "extra": {"backend": backend, "mask": mask, "head_dim": hd, "dv": dv}}
        tensor_mask = attn_mask if isinstance(attn_mask, torch.Tensor) and mask == "dense" \
            and getattr(attn_mask, "variant", None) is None else None
        recorder.attention_calls.append({"layer": recorder.layer, "mask": mask, "head_dim": hd,
                                         "dtype": _SHORT.get(info["dtype"], info["dtype"]),
                                         "dropout": float(dropout_p), "backend": backend})
        return SdpaStandIn.apply(query, key, value, tensor_mask, info)

    return sdpa


# --------------------------------------------------------------------------- backward

class _FunctionInfo:
    """What torch's engine knows of a custom autograd Function's node and Python does not
    see: which forward arguments were tensors, and whether it materialises None grads."""

    tensor_args: Dict[Any, tuple] = {}
    no_materialize: set = set()


@contextlib.contextmanager
def tracked_functions():
    """While open, custom autograd Functions' nodes are known to :func:`run_backward`."""
    patches = _Patches()
    _patch_functions(patches)
    try:
        yield
    finally:
        patches.restore()
        _FunctionInfo.tensor_args.clear()
        _FunctionInfo.no_materialize.clear()


def _patch_functions(patches: "_Patches") -> None:
    import torch
    from torch.autograd.function import BackwardCFunction, Function, FunctionCtx

    orig_apply = Function.apply.__func__

    def apply(cls, *args, **kwargs):
        out = orig_apply(cls, *args, **kwargs)
        for t in _tensors(out):
            if isinstance(t.grad_fn, BackwardCFunction):
                _FunctionInfo.tensor_args[t.grad_fn] = tuple(isinstance(a, torch.Tensor)
                                                             for a in args)
                break
        return out

    orig_smg = FunctionCtx.set_materialize_grads

    def set_materialize_grads(self, value):
        (_FunctionInfo.no_materialize.discard if value else _FunctionInfo.no_materialize.add)(self)
        return orig_smg(self, value)

    patches.set(Function, "apply", classmethod(apply))
    patches.set(FunctionCtx, "set_materialize_grads", set_materialize_grads)


def _call_node(fn, grads: list) -> tuple:
    import torch
    from torch.autograd.function import BackwardCFunction

    if isinstance(fn, BackwardCFunction):
        if fn not in _FunctionInfo.no_materialize:
            grads = [torch.zeros(m.shape, dtype=m.dtype, device=m.device) if g is None else g
                     for g, m in zip(grads, fn._input_metadata)]
        res = fn.apply(*grads)
        res = res if isinstance(res, tuple) else (res,)
        mask = _FunctionInfo.tensor_args.get(fn)
        if mask is not None:  # (extra trailing Nones are allowed, as torch's engine allows)
            res = tuple(r for r, is_tensor in zip(res[:len(mask)], mask) if is_tensor)
        return res
    out = fn(*grads)
    return out if isinstance(out, tuple) else (out,)


def _accumulate(fn, g) -> None:
    """AccumulateGrad as torch's engine runs it: the gradient is stolen (no kernel) when
    it has the parameter's layout, copied when not, added when a gradient is there."""
    import torch

    var = fn.variable
    if var.grad is None:
        if g.stride() != var.stride():
            g = torch.empty_strided(var.shape, var.stride(), dtype=g.dtype,
                                    device=g.device).copy_(g)
        var.grad = g
    else:
        var.grad.add_(g)


def _attention_function(fn) -> bool:
    """Whether an autograd node is the backward of a Function defined in srupp's attention."""
    cls = getattr(fn, "_forward_cls", None)
    mod = sys.modules.get(getattr(cls, "__module__", ""), None)
    return bool(mod and getattr(mod, "__file__", "").endswith(_ATTENTION_FILE))


def run_backward(root, grad_root, recorder=None) -> None:
    """Backpropagate from ``root`` as torch's engine does, in Python: every node of the
    graph called once its gradients are all in (the later-created node first), each
    gradient summed to its input's shape and cast to its dtype where they differ
    (the engine's validate_outputs), several arriving at one input added, leaves
    accumulated (:func:`_accumulate`). Nodes created inside an SRU++ layer or srupp's
    attention carry that scope; the others take the scope of the first node that
    sends them a gradient."""
    import torch

    fn0 = root.grad_fn
    deps, seen, stack = {}, {fn0}, [fn0]
    while stack:
        fn = stack.pop()
        for nxt, _ in fn.next_functions:
            if nxt is None:
                continue
            deps[nxt] = deps.get(nxt, 0) + 1
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    scopes = {fn0: fn0.metadata.get(_SCOPE, (None, False))}
    buffers = {fn0: [grad_root]}
    ready, tick = [(-fn0._sequence_nr(), 0, fn0)], 1
    prev_phase = recorder.phase if recorder else None
    if recorder:
        recorder.phase = "backward"
    try:
        with torch.no_grad():
            while ready:
                _, _, fn = heapq.heappop(ready)
                scope = fn.metadata.get(_SCOPE, scopes.get(fn, (None, False)))
                if _attention_function(fn):  # (a custom Function of srupp's attention)
                    scope = (scope[0], True)
                if recorder:
                    recorder.backward_scope = scope
                grads = buffers.pop(fn, [])
                grads += [None] * (len(fn._input_metadata) - len(grads))
                if type(fn).__name__ == "AccumulateGrad":
                    if grads[0] is not None:
                        _accumulate(fn, grads[0])
                    continue
                outs = _call_node(fn, grads)
                for (nxt, slot), g in zip(fn.next_functions, outs):
                    if nxt is None:
                        continue
                    scopes.setdefault(nxt, scope)
                    if g is not None:
                        meta = nxt._input_metadata[slot]
                        if tuple(g.shape) != tuple(meta.shape):
                            g = g.sum_to_size(meta.shape)
                        if g.dtype != meta.dtype:
                            g = g.to(meta.dtype)
                    buf = buffers.setdefault(nxt, [])
                    buf += [None] * (slot + 1 - len(buf))
                    if g is not None:
                        buf[slot] = g if buf[slot] is None else buf[slot] + g
                    deps[nxt] -= 1
                    if deps[nxt] == 0:
                        heapq.heappush(ready, (-nxt._sequence_nr(), tick, nxt))
                        tick += 1
    finally:
        if recorder:
            recorder.phase = prev_phase


# --------------------------------------------------------------------------- the worker

class _Patches:
    """Attributes set for the worker's trace, put back on exit."""

    def __init__(self):
        self._undo = []

    def set(self, obj, name, value):
        own = name in vars(obj)  # (else inherited: deleting ours restores it)
        self._undo.append((obj, name, own, vars(obj).get(name)))
        setattr(obj, name, value)

    def restore(self):
        for obj, name, own, value in reversed(self._undo):
            if own:
                setattr(obj, name, value)
            else:
                delattr(obj, name)
        self._undo.clear()


_CUDA_GUARD = None


def install_cuda_guard() -> bool:
    """On a CPU-only build of torch, a no-op CUDA device guard, so that autograd can
    record CUDA (fake) tensors: torch's Python device-guard class, registered in the
    PrivateUse1 slot of c10's registry, moved to the CUDA slot (PrivateUse1 stays
    free). Returns whether one was installed (False where torch has CUDA)."""
    global _CUDA_GUARD
    import torch

    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    registry = ctypes.c_void_p.in_dll(lib, "_ZN3c104impl26device_guard_impl_registryE")
    cuda = int(torch._C._autograd.DeviceType.CUDA)
    pu1 = int(torch._C._autograd.DeviceType.PrivateUse1)
    slots = (ctypes.c_void_p * (pu1 + 1)).from_address(ctypes.addressof(registry))
    if slots[cuda]:
        return False
    if slots[pu1]:
        raise RuntimeError("a PrivateUse1 device guard is registered: cannot fake CUDA here")

    class NoOpCudaGuard(torch._C._acc.DeviceGuard):
        def type_(self):
            return torch._C._autograd.DeviceType.CUDA

    _CUDA_GUARD = NoOpCudaGuard()
    torch._C._acc.register_python_privateuseone_device_guard(_CUDA_GUARD)
    slots[cuda], slots[pu1] = slots[pu1], None
    return True


def _causal_lower_right_outside_modes(orig):
    """torch's causal_lower_right builds its CausalBias (a tensor subclass) under no
    mode: under the fake mode and the recorder its constructor fails."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    def build(*args):
        with _disable_current_modes():
            prev = torch._C._only_lift_cpu_tensors()
            torch._C._set_only_lift_cpu_tensors(False)
            try:
                return orig(*args)
            finally:
                torch._C._set_only_lift_cpu_tensors(prev)

    return build


def _scopes_mode(recorder, sdpa):
    """A torch-function mode: SDPA goes to its stand-in, and every autograd node made
    in the forward gets the scope (layer, attention) it was made in."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class Scopes(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                return sdpa(*args, **kwargs)
            out = func(*args, **kwargs)
            if recorder.on and recorder.phase == "forward" and torch.is_grad_enabled():
                scope = recorder.scope()
                for t in _tensors(out):
                    if t.grad_fn is not None and _SCOPE not in t.grad_fn.metadata:
                        t.grad_fn.metadata[_SCOPE] = scope
            return out

    return Scopes()


def _vocab_size(cfg) -> int:
    if cfg.data.tokenizer == "byte":
        return 256
    if cfg.data.vocab_size is not None:
        return cfg.data.vocab_size
    raise ValueError(f"a {cfg.data.tokenizer} tokenizer's vocabulary comes from the corpus; "
                     f"give its size with --set data.vocab_size=N")


def _build_config(spec: dict):
    """The run config of a trace: gpu_check.py's for the calibration (the enwik8 run of
    2026-11-27, built as it built it), else the recipe with the overrides."""
    from srupp.train import build_config

    if spec.get("calibration"):
        from _gpu_training import enwik8_config

        work = Path(tempfile.mkdtemp(prefix="gpu_model_"))
        try:  # (it writes a synthetic corpus, which the step does not read)
            return enwik8_config(
                argparse.Namespace(dry_run=False, enwik8_batch=spec["batch"]), work, 200)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    sets = list(spec.get("sets") or [])
    if spec.get("batch"):
        sets.append(f"train.batch_size={spec['batch']}")
    if spec.get("unroll"):
        sets.append(f"train.unroll={spec['unroll']}")
    sets.append(f"train.precision={spec['precision']}")
    return build_config(spec.get("recipe"), sets)


def _fake_cuda_patches(patches: _Patches, capability) -> None:
    """What a CPU build of torch needs to run a CUDA step on fake tensors."""
    import torch

    # autocast("cuda") refuses to start without CUDA; the fake tensors carry its keys
    patches.set(torch.cuda.amp.common, "amp_definitely_not_available", lambda: False)
    patches.set(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    # srupp's CUDA attention route asks for the device's capability: the set's
    patches.set(torch.cuda, "get_device_capability", lambda *a, **k: tuple(capability))


def _meta_patches(patches: _Patches) -> None:
    """The meta device instead: the recurrence routed as on CUDA (its custom ops), and
    autocast's question answered for a device torch has no autocast for."""
    import torch

    from srupp.ops import recurrence

    orig_route = recurrence.route
    patches.set(recurrence, "route", lambda U, *a: "triton"
                if U.dtype in (torch.float32, torch.bfloat16, torch.float16)
                else orig_route(U, *a))
    is_autocast = torch.is_autocast_enabled
    patches.set(torch, "is_autocast_enabled",
                lambda *a: False if a and a[0] == "meta" else is_autocast(*a))


def _step_patches(patches: _Patches, recorder) -> None:
    """The trainer's step as torch runs it on CUDA, recorded phase by phase."""
    import torch
    import torch.nn.attention.bias as attention_bias
    import torch.optim.optimizer as optim_mod
    import torch.utils._foreach_utils as foreach_utils
    from torch._subclasses.fake_tensor import FakeTensor

    patches.set(torch.Tensor, "pin_memory", lambda self, *a, **k: self)  # host-side
    patches.set(torch.Tensor, "backward", lambda self, gradient=None, *a, **k: run_backward(
        self, torch.ones_like(self) if gradient is None else gradient, recorder))
    patches.set(attention_bias, "causal_lower_right",
                _causal_lower_right_outside_modes(attention_bias.causal_lower_right))
    # torch takes its foreach paths (clipping, optimizer) for tensors of these types
    for mod in (optim_mod, foreach_utils):
        patches.set(mod, "_foreach_supported_types",
                    list(mod._foreach_supported_types) + [FakeTensor])
    clip = torch.nn.utils.clip_grad_norm_

    def clip_recorded(*a, **k):
        recorder.phase = "clip"
        try:
            return clip(*a, **k)
        finally:
            recorder.phase = "other"

    patches.set(torch.nn.utils, "clip_grad_norm_", clip_recorded)
    _patch_functions(patches)


def _setup_device(spec: dict, patches: _Patches, model, precision: str):
    """The device a trace runs on and the precision it runs at; patches torch for it."""
    import torch

    if spec.get("mode", "fake-cuda") == "fake-cuda":
        install_cuda_guard()
        _fake_cuda_patches(patches, tuple(spec.get("capability", (9, 0))))
        return torch.device("cuda"), precision
    _meta_patches(patches)
    if precision == "bf16":
        model.to(torch.bfloat16)
    return torch.device("meta"), "fp32"  # no autocast on meta


def _scope_layers(model, recorder) -> list:
    """Each SRU++ layer's ops carry its index (the stack calls layer_forward directly)."""
    layers = [m for m in model.modules() if hasattr(type(m), "layer_forward")]
    for i, layer in enumerate(layers):
        def scoped(*a, _run=layer.layer_forward, _i=i, **k):
            prev, recorder.layer = recorder.layer, _i
            try:
                return _run(*a, **k)
            finally:
                recorder.layer = prev
        layer.layer_forward = scoped
    return layers


def trace_step(spec: dict) -> dict:
    """Run one steady-state training step under the recorder; returns its records and facts.

    ``spec``: workload ("lm", the default: the trainer's step on a recipe's model, the
    second step, after the first has filled the carried memory and the optimizer's
    state; or "layer": gpu_check.py's layer step, one SRU++ layer's forward and backward
    of its output's sum under autocast, the second call), recipe, sets, batch, unroll,
    precision ("bf16" or "fp32"), capability [major, minor], mode ("fake-cuda" or
    "meta"), calibration (bool), attention ("sdpa" or "matmul": srupp's attention
    backend; default: srupp's own choice); for "layer": d, proj, L, B.
    """
    from srupp.ops.attention import use_attention_backend

    _FunctionInfo.tensor_args.clear()
    _FunctionInfo.no_materialize.clear()
    recorder = _recorder_class()()
    recorder.attention_calls = []
    patches = _Patches()
    try:
        with use_attention_backend(spec.get("attention") or "auto"):
            if spec.get("workload", "lm") == "layer":
                out = _trace_layer(spec, recorder, patches)
            else:
                out = _trace_lm(spec, recorder, patches)
    finally:
        patches.restore()
    for r in recorder.records:
        r.pop("cast", None)
    out.update(mode=spec.get("mode", "fake-cuda"), records=recorder.records,
               syncs=recorder.syncs, calls=recorder.calls,
               calls_after=recorder.pending["calls"], syncs_after=recorder.pending["syncs"],
               attention_calls=recorder.attention_calls,
               capability=list(spec.get("capability", (9, 0))),
               attention=spec.get("attention") or "auto")
    return out


def _trace_lm(spec: dict, recorder, patches: _Patches) -> dict:
    """The trainer's step (``Trainer._train_step``) on a recipe's language model."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from _common import model_flops_per_token
    from srupp.data.batching import Batch
    from srupp.models import build_model
    from srupp.train.distributed import SINGLE
    from srupp.train.trainer import Trainer, _new_interval, build_optimizer

    cfg = _build_config(spec)
    if cfg.task != "lm":
        raise ValueError(f"gpu_model models language-model recipes (task lm); this one "
                         f"trains task {cfg.task!r}")
    precision = cfg.train.precision
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision must be bf16 or fp32, got {precision!r}")
    capability = tuple(spec.get("capability", (9, 0)))
    model_cfg = cfg.model_config(_vocab_size(cfg))
    model = build_model(model_cfg, device="meta")
    flops_per_token = model_flops_per_token(model, model_cfg.mem_len or 0, cfg.train.unroll)
    params = model.num_parameters()
    task = cfg.task_class(cfg)
    sdpa = _attention_stand_in(recorder, capability)
    B, L = cfg.train.batch_size, cfg.train.unroll
    device, run_precision = _setup_device(spec, patches, model, precision)
    _step_patches(patches, recorder)
    layers = _scope_layers(model, recorder)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device=device)
        model.train()
        # what Trainer._train_step reads of its trainer (it touches no run directory,
        # data or checkpoint): the step is the trainer's own code
        me = types.SimpleNamespace(
            cfg=cfg, model=model, train_model=model, device=device, task=task,
            carried=None, precision=run_precision, dist=SINGLE, sharded=False,
            scaler=torch.amp.GradScaler("cuda", enabled=False), step=0, tokens_seen=0,
            interval=_new_interval(), _mid_step=False)
        me.optimizer = build_optimizer(Trainer._param_groups(me), cfg.train)
        me.scheduler = torch.optim.lr_scheduler.LambdaLR(me.optimizer, lambda s: 1.0)
        me.optimizer.register_step_pre_hook(lambda *a: setattr(recorder, "phase", "optimizer"))
        me.optimizer.register_step_post_hook(lambda *a: setattr(recorder, "phase", "other"))

        def batches():
            while True:
                yield Batch(torch.zeros(B, L, dtype=torch.long),
                            torch.zeros(B, L, dtype=torch.long), 0, 0, False)

        it = batches()
        Trainer._train_step(me, it)
        group = me.optimizer.param_groups[0]
        impl = "fused" if group.get("fused") else "foreach" if group.get("foreach") else "loop"
        with recorder, _scopes_mode(recorder, sdpa):
            recorder.on, recorder.phase = True, "forward"
            _, _, tokens = Trainer._train_step(me, it)
            recorder.on = False
    return {"workload": "lm", "params": params, "flops_per_token": flops_per_token,
            "tokens_per_step": int(tokens), "batch": B, "unroll": L,
            "mem_len": model_cfg.mem_len, "grad_accum": cfg.train.grad_accum,
            "precision": precision, "optimizer": cfg.train.optimizer, "optimizer_impl": impl,
            "recipe_compile": cfg.train.compile, "layers": len(layers),
            "param_numels": [p.numel() for p in model.parameters()]}


def _trace_layer(spec: dict, recorder, patches: _Patches) -> dict:
    """gpu_check.py's layer step: ``SRUpp(d, d, proj, num_layers=1, causal=True)`` on
    (L, B, d) fp32 input, forward under autocast, ``out.float().sum().backward()``."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from srupp.nn import SRUpp

    d, proj, L, B = (int(spec[k]) for k in ("d", "proj", "L", "B"))
    precision = spec.get("precision", "bf16")
    capability = tuple(spec.get("capability", (9, 0)))
    model = SRUpp(d, d, proj, num_layers=1, causal=True, device="meta")
    sdpa = _attention_stand_in(recorder, capability)
    device, run_precision = _setup_device(spec, patches, model, precision)
    _step_patches(patches, recorder)
    layers = _scope_layers(model, recorder)
    params = sum(p.numel() for p in model.parameters())
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device=device)
        model.train()
        x = torch.empty(L, B, d, device=device)

        def run():
            with torch.autocast(device.type, dtype=torch.bfloat16,
                                enabled=run_precision == "bf16"):
                out = model(x)[0]
            out.float().sum().backward()

        run()  # the first call: the parameters' gradients then exist, as in steady state
        with recorder, _scopes_mode(recorder, sdpa):
            recorder.on, recorder.phase = True, "forward"
            run()
            recorder.on = False
    from _common import model_flops_per_token

    return {"workload": "layer", "params": params,
            "flops_per_token": model_flops_per_token(model, 0, L),
            "tokens_per_step": L * B,
            "batch": B, "unroll": L, "mem_len": 0, "grad_accum": 1, "precision": precision,
            "optimizer": None, "optimizer_impl": None, "recipe_compile": "off",
            "layers": len(layers), "param_numels": [p.numel() for p in model.parameters()],
            "d": d, "proj": proj}


# The widths measure_host trains the model's structure at: every op's kernel is then
# a few microseconds on one CPU thread, so that a step's time is the host's own.
HOST_WIDTHS = ("model.d_model=64", "model.proj_size=16", "train.batch_size=2",
               "train.unroll=16")


def measure_host(spec: dict, steps: int = 7) -> dict:
    """The host's cost per dispatcher call, measured on this machine: the model of
    ``spec`` (same depth, layers and options) trains at tiny widths (HOST_WIDTHS) on one
    CPU thread, where each op's kernel costs little beside the host's own work per call
    (Python, srupp's routing, the dispatcher, autograd, the allocator). Forward under
    the run's precision, backward, clipping and the optimizer; ``steps`` timed after
    three untimed; the calls counted in one more step.

    Not on the meta device: there many ops compute their output's shape in Python
    (torch._refs), which costs several times what the same op's host side costs on
    CUDA. Returns ``call_us`` (seconds per step / calls per step), ``step_ms``,
    ``calls`` and the ``cpu`` it ran on; the trace's calls times ``call_us`` is then
    the host's time on CUDA, its launches (LAUNCH_US each) apart.
    """
    import statistics

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from srupp.models import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = _build_config({**spec, "calibration": False,
                             "sets": [*(spec.get("sets") or []), *HOST_WIDTHS],
                             "batch": None, "unroll": None,
                             "recipe": spec.get("recipe") or str(ROOT / "recipes" /
                                                                 "enwik8-base.toml")})
        torch.manual_seed(0)
        model = build_model(cfg.model_config(_vocab_size(cfg)))
        model.train()
        opt = torch.optim.RAdam(model.parameters(), lr=1e-4, decoupled_weight_decay=True,
                                foreach=False)
        B, L = cfg.train.batch_size, cfg.train.unroll
        x = torch.zeros(B, L, dtype=torch.long)
        state = [None]
        bf16 = spec["precision"] == "bf16"

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = model(x, state[0], targets=x)
            out.loss.backward()
            state[0] = out.state.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip or 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)

        class Count(TorchDispatchMode):
            calls = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                Count.calls += 1
                return func(*args, **(kwargs or {}))

        with Count():
            step()
    finally:
        torch.set_num_threads(threads)
    from _common import cpu_name

    seconds = statistics.median(times)
    return {"workload": "host", "call_us": round(seconds / Count.calls * 1e6, 2),
            "step_ms": round(seconds * 1e3, 2), "calls": Count.calls,
            "cpu": cpu_name(),
            "widths": list(HOST_WIDTHS)}


def _worker() -> None:
    """``--_worker``: traces the specs (a JSON list on stdin); prints a JSON list."""
    specs = json.loads(sys.stdin.read())
    out = []
    for spec in specs:
        try:
            out.append(measure_host(spec) if spec.get("workload") == "host"
                       else trace_step(spec))
        except Exception as e:  # noqa: BLE001 - reported to the parent, which decides
            traceback.print_exc()
            out.append({"error": f"{type(e).__name__}: {e}"})
    print(json.dumps(out))


def run_traces(specs: List[dict], timeout: float = 600) -> List[dict]:
    """Trace ``specs`` in a fresh process (the fake-CUDA setup changes torch for good).

    A spec with mode "auto" runs on fake CUDA tensors, and again on the meta device if
    that fails."""
    todo = [dict(s, mode="fake-cuda" if s.get("mode", "auto") == "auto" else s["mode"])
            for s in specs]
    try:
        results = _spawn(todo, timeout)
    except RuntimeError as e:  # the process died (torch aborted, say)
        results = [{"error": str(e)} for _ in todo]
    retry = [i for i, (s, r) in enumerate(zip(specs, results))
             if "error" in r and s.get("mode", "auto") == "auto"]
    if retry:
        again = _spawn([dict(todo[i], mode="meta") for i in retry], timeout)
        for i, r in zip(retry, again):
            if "error" not in r:
                r["fallback_reason"] = results[i]["error"]
            results[i] = r
    for s, r in zip(todo, results):
        if "error" in r:
            raise RuntimeError(f"tracing the step failed ({s.get('recipe') or 'calibration'}, "
                               f"{s['mode']}): {r['error']}")
    return results


def _spawn(specs: List[dict], timeout: float) -> List[dict]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--_worker"],
                          input=json.dumps(specs), capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"the tracing process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- transforms

_FUSIBLE = ("elementwise", "casts", "other")


def fuse_compiled(records: List[dict]) -> List[dict]:
    """Regional torch.compile of each SRU++ layer, modelled: inside a layer (its forward
    and its backward), each run of consecutive element-wise, norm, cast and
    data-movement ops (GEMMs, attention and the recurrence end a run; ops that launch
    nothing do not) becomes one kernel: one launch, and only the bytes at its
    boundary: what it reads that it did not make, and what it makes that an op
    outside it reads later in the step (or that it writes into a tensor it did not
    make). Ops outside the layers stay as they are."""
    later: Dict[int, List[int]] = {}
    born: Dict[int, int] = {}  # storage -> the record that first wrote it
    touched: set = set()
    for i, r in enumerate(records):
        for key, _ in r["reads"]:
            later.setdefault(key, []).append(i)
            touched.add(key)
        for key, _ in r["writes"]:
            if key not in touched:
                born.setdefault(key, i)
            touched.add(key)
    out, i = [], 0
    while i < len(records):
        r = records[i]
        in_layer = r["layer"] is not None and r["phase"] in ("forward", "backward")
        fusible = r["kind"] in _FUSIBLE and in_layer
        if not fusible:
            # inside a compiled layer the graph calls each remaining kernel once: no
            # views, no dispatcher calls besides (the host's cost is its one call)
            out.append(dict(r, calls_before=1) if in_layer else r)
            i += 1
            continue
        j = i
        while (j < len(records) and records[j]["kind"] in _FUSIBLE
               and records[j]["layer"] == r["layer"] and records[j]["phase"] == r["phase"]):
            j += 1
        run = records[i:j]
        if len(run) == 1:
            out.append(dict(r, calls_before=1))
            i = j
            continue
        inside = set(range(i, j))
        made = {key for k in inside for key, _ in records[k]["writes"] if born.get(key) == k}
        reads, writes = {}, {}
        for k in inside:
            for key, n in records[k]["reads"]:
                if key not in made:
                    reads[key] = max(reads.get(key, 0), n)
            for key, n in records[k]["writes"]:
                if key not in made or any(x >= j for x in later.get(key, ())):
                    writes[key] = max(writes.get(key, 0), n)
        casts_only = all(x["kind"] == "casts" for x in run)
        out.append({"name": f"fused[{len(run)} ops]", "kind": "casts" if casts_only
                    else "elementwise", "phase": r["phase"], "layer": r["layer"],
                    "flops": sum(x["flops"] for x in run), "read": sum(reads.values()),
                    "written": sum(writes.values()), "launches": 1, "dtype": r["dtype"],
                    "reads": [[k, n] for k, n in reads.items()],
                    "writes": [[k, n] for k, n in writes.items()],
                    "fused": [x["name"] for x in run], "calls_before": 1,
                    "syncs_before": sum(x.get("syncs_before", 0) for x in run)})
        i = j
    return out


def fuse_optimizer(records: List[dict], params_numels: Optional[List[int]] = None) -> List[dict]:
    """A fused optimizer, modelled: the device ops of the optimizer's step become one
    kernel per multi_tensor_apply chunk of 4 tensor lists (parameter, gradient, and two
    moments, fp32), reading the 4 and writing 3 of them: 28 bytes per parameter
    element, from one call on the host (the Python step's scalar work goes). Gradient
    clipping stays as it is."""
    step = [r for r in records if r["phase"] == "optimizer"]
    if not step:
        return records
    numels = params_numels or []
    rest = [r for r in records if r["phase"] != "optimizer"]
    n = sum(numels)
    fused = {"name": "fused_optimizer_step", "kind": "optimizer", "phase": "optimizer",
             "layer": None, "flops": 0, "read": 16 * n, "written": 12 * n,
             "launches": foreach_launches(numels, 4), "dtype": "float32", "reads": [],
             "writes": [], "calls_before": 1,  # one call; the Python step's own ops go
             "syncs_before": sum(r.get("syncs_before", 0) for r in step)}
    return rest + [fused]


# --------------------------------------------------------------------------- pricing

_SDPA_OPS = ("scaled_dot_product_attention", "scaled_dot_product_attention_backward")


def op_rate_tflops(r: dict, gpu: dict) -> float:
    """The compute rate (TFLOP/s) a record's FLOPs run at: fused attention at its backend's
    share of the datasheet peak (the backward over the SMs its grid fills); GEMMs, and
    SDPA's math path, at the full-wave peak of their dtype x their wave efficiency;
    anything else at the GEMM peak of its dtype (an upper bound: their FLOPs are few)."""
    half = r.get("dtype") in ("bfloat16", "float16")
    extra = r.get("extra") or {}
    if r["name"] in _SDPA_OPS and extra.get("backend") not in (None, "math", "unknown"):
        k = max(extra.get("head_dim", 0), extra.get("dv", 0))
        peak = gpu["datasheet_half_tflops"] if half else SPECS[gpu["name"]]["fp32_tflops"]
        rate = peak * attention_share(extra["backend"], k, gpu["capability"])
        if extra.get("ctas"):  # (one block per SM)
            rate *= _wave_efficiency(extra["ctas"], gpu["sms"])
        return rate
    full = gpu["full_wave_half_tflops"] if half else gpu["full_wave_fp32_tflops"]
    if "gemm" in r:
        return full * gemm_wave_efficiency(r["gemm"], gpu["sms"])
    return gpu["half_tflops"] if half else gpu["fp32_tflops"]


def op_ms(r: dict, gpu: dict, recurrence: str, share: float) -> float:
    """Device milliseconds of one record: max(FLOPs / its rate, bytes / copy bandwidth);
    the plain recurrence at its measured per-step latency (host costs apart)."""
    if r["launches"] == 0:
        return 0.0
    bw = gpu["copy_GBps"] * 1e9
    moved = (r["read"] + r["written"]) / bw
    if r["kind"] == "recurrence" and "extra" in r:
        e = r["extra"]
        if recurrence == "pipelined":
            return (r["read"] + r["written"]) / (share * bw) * 1e3
        step = step_latency_us(gpu["recurrence_rows"], _SHORT.get(e["dtype"], e["dtype"]),
                               e["L"], e["direction"])
        return max(moved, e["L"] * step * 1e-6) * 1e3
    return max(r["flops"] / (op_rate_tflops(r, gpu) * 1e12), moved) * 1e3


# gpu_check.py's profile step sorts kernels into kinds by their names (its KERNEL_KINDS,
# first match, else "other element-wise"). What each recorded op's kernels are called on
# CUDA decides where it lands there, so each op is given that kind here, by name:
PROFILE_OTHER = "other element-wise"
PROFILE_KIND_OF_OP = {
    # SDPA's fused kernels: fmha_cutlassF/B_* (efficient), flash_fwd/bwd_* (flash), cudnn
    # "...attention...": the "attention" pattern
    "scaled_dot_product_attention": "attention",
    "scaled_dot_product_attention_backward": "attention",
    # srupp's Triton kernels are named _sru_*
    "sru_fwd": "recurrence", "sru_bwd": "recurrence",
    # cuBLAS: nvjet_* / sm90_xmma_gemm_* / cutlass_*: the "gemm" pattern
    **{name: "gemm" for name in _GEMMS},
    # vectorized_layer_norm_kernel, layer_norm_grad_input_kernel; the clip's final
    # reduction (reduce_kernel over NormTwoOps)
    "native_layer_norm": "norm", "native_layer_norm_backward": "norm",
    "linalg_vector_norm": "norm", "norm": "norm",
    # cunn_SoftMaxForward / cunn_SoftMaxBackward, nll_loss_*_kernel
    "_softmax": "softmax / loss", "_softmax_backward_data": "softmax / loss",
    "_log_softmax": "softmax / loss", "_log_softmax_backward_data": "softmax / loss",
    "nll_loss_forward": "softmax / loss", "nll_loss_backward": "softmax / loss",
    "nll_loss2d_forward": "softmax / loss", "nll_loss2d_backward": "softmax / loss",
    # fused_dropout_kernel_vec; bernoulli_ (its name); the backward is masked_scale_kernel,
    # which no pattern but the default takes
    "native_dropout": "dropout", "bernoulli_": "dropout", "bernoulli": "dropout",
    "native_dropout_backward": PROFILE_OTHER,
    # copy kernels (casts too), CatArrayBatchedCopy, FillFunctor
    "_to_copy": "copy / cast", "copy_": "copy / cast", "clone": "copy / cast",
    "cat": "copy / cast", "stack": "copy / cast", "fill_": "copy / cast",
    "zero_": "copy / cast", "zeros": "copy / cast", "zeros_like": "copy / cast",
    "full": "copy / cast", "fill": "copy / cast", "new_zeros": "copy / cast",
    "ones": "copy / cast", "ones_like": "copy / cast",
}
PROFILE_KINDS = ("recurrence", "attention", "gemm", "optimizer", "norm", "softmax / loss",
                 "dropout", "copy / cast", PROFILE_OTHER)


def profile_kind(r: dict) -> str:
    """The gpu_check.KERNEL_KINDS kind that a record's kernels would be counted under."""
    name = r["name"]
    if name.startswith(("_foreach_", "_fused_")) or name == "fused_optimizer_step":
        return "optimizer"  # multi_tensor_apply_kernel / fused optimizer kernels
    if name.startswith("fused["):  # an Inductor kernel: triton_*_fused_<its ops>
        ops = r.get("fused", [])
        for kind, names in (("norm", ("native_layer_norm", "native_layer_norm_backward")),
                            ("softmax / loss", ("_softmax", "_log_softmax")),
                            ("dropout", ("native_dropout",)),
                            ("copy / cast", ("_to_copy", "copy_", "cat", "clone"))):
            if any(o in names for o in ops):
                return kind
        return PROFILE_OTHER
    return PROFILE_KIND_OF_OP.get(name, PROFILE_OTHER)


def timeline(records: List[dict], device_ms: List[float], call_us: float, launch_us: float,
             calls_after: int = 0, syncs_after: int = 0) -> Dict[str, float]:
    """The host and the device through one step, from both idle, in the records' order.

    The host spends ``call_us`` on every dispatcher call (the calls since the previous
    record, views and CPU scalar work included) and ``launch_us`` on every launch, then
    queues the record's kernels; the device runs each when queued and free. At a sync
    the host waits for the device. Returns host_ms and device_ms (busy) and synced_ms:
    the step's time from both idle until both are done (a timer that waits for the
    device at each end, as gpu_check's layer step)."""
    host = dev = busy = 0.0
    for r, ms in zip(records, device_ms):
        if r.get("syncs_before"):
            host = max(host, dev)
        host += (r.get("calls_before", 1) * call_us + r["launches"] * launch_us) * 1e-3
        dev = max(dev, host) + ms
        busy += ms
    host += calls_after * call_us * 1e-3
    if syncs_after:
        host = max(host, dev)
    return {"host_ms": host, "device_ms": busy, "synced_ms": max(host, dev)}


def predict(trace: dict, gpu: dict, *, compiled: bool = False, fused_optimizer: bool = False,
            recurrence: str = "plain", call_us: float = CALL_US, launch_us: float = LAUNCH_US,
            share: float = 0.7, timing: Optional[str] = None, top: int = 15) -> dict:
    """The step's predicted time on ``gpu``, by kind, with the options applied.

    Device time: the records' kernel times (:func:`op_ms`). Host time: dispatcher calls x
    ``call_us`` + launches x ``launch_us`` (:func:`timeline`). The step (``timing``):
    "steady", a training loop's step, where the host runs ahead of the device from
    step to step: max(device, host), or with syncs in the step the timeline's; or
    "synced", one call timed alone (gpu_check's layer step): the timeline from idle.
    Default: "synced" for the layer workload, else "steady"."""
    records = trace["records"]
    if compiled:
        records = fuse_compiled(records)
    if fused_optimizer:
        records = fuse_optimizer(records, trace.get("param_numels"))
    timing = timing or ("synced" if trace.get("workload") == "layer" else "steady")
    if timing not in ("steady", "synced"):
        raise ValueError(f"timing must be 'steady' or 'synced', got {timing!r}")
    by_kind = {k: 0.0 for k in KINDS}
    by_profile = {k: 0.0 for k in PROFILE_KINDS}
    by_phase: Dict[str, float] = {}
    groups: Dict[tuple, dict] = {}
    launches = calls = syncs = 0
    times = []
    for r in records:
        ms = op_ms(r, gpu, recurrence, share)
        times.append(ms)
        by_kind[r["kind"]] += ms
        by_profile[profile_kind(r)] += ms
        by_phase[r["phase"]] = by_phase.get(r["phase"], 0.0) + ms
        launches += r["launches"]
        calls += r.get("calls_before", 1)
        syncs += r.get("syncs_before", 0)
        key = (r["name"], r["kind"], r["phase"], r.get("dtype"))
        g = groups.setdefault(key, {"op": r["name"], "kind": r["kind"], "phase": r["phase"],
                                    "dtype": r.get("dtype"), "calls": 0, "ms": 0.0,
                                    "launches": 0})
        g["calls"] += 1
        g["ms"] += ms
        g["launches"] += r["launches"]
    tail = {"calls_after": trace.get("calls_after", 0), "syncs_after": trace.get("syncs_after", 0)}
    line = timeline(records, times, call_us, launch_us, **tail)
    calls += tail["calls_after"]
    syncs += tail["syncs_after"]
    device_ms, host_ms = line["device_ms"], line["host_ms"]
    if timing == "synced" or syncs:
        step_ms = line["synced_ms"]
    else:
        step_ms = max(device_ms, host_ms)
    tokens = trace["tokens_per_step"]
    peak = gpu["half_tflops"] if trace["precision"] == "bf16" else gpu["fp32_tflops"]
    tps = tokens / (step_ms * 1e-3)
    ranked = sorted(groups.values(), key=lambda g: -g["ms"])[:top]
    return {"predicted_step_ms": round(step_ms, 3), "predicted_tokens_per_s": round(tps),
            "predicted_mfu": float(f"{trace['flops_per_token'] * tps / (peak * 1e12):.4g}"),
            "device_ms": round(device_ms, 3), "host_ms": round(host_ms, 3),
            "bound": "device" if device_ms >= host_ms else "host", "timing": timing,
            "host": {"calls": calls, "call_us": call_us, "calls_ms": round(calls * call_us
                                                                           * 1e-3, 3),
                     "launches": launches, "launch_us": launch_us,
                     "launches_ms": round(launches * launch_us * 1e-3, 3), "syncs": syncs},
            "by_kind": {k: round(v, 3) for k, v in by_kind.items()},
            "by_profile_kind": {k: round(v, 3) for k, v in by_profile.items()},
            "by_phase": {k: round(v, 3) for k, v in by_phase.items()},
            "launches": launches,
            "top": [dict(g, ms=round(g["ms"], 3)) for g in ranked]}


def compare_to_profile(prediction: dict, profile: dict) -> dict:
    """The model's prediction beside gpu_check.py's profile of the same step.

    ``prediction``: gpu_model's JSON (or :func:`predict`'s dict): its
    ``by_profile_kind`` (device ms by gpu_check's kernel kinds), ``device_ms`` and
    ``predicted_step_ms``. ``profile``: the profile step's result (``by_kind_ms``,
    ``step_ms``, ``device_busy_ms``; the step's record with its ``result`` is taken
    too). Returns per kind the predicted and measured ms and predicted / measured
    (None where nothing was measured), and the same for the step and the device's
    busy time; kinds the profile has that the model does not name are listed."""
    if "result" in profile and "by_kind_ms" not in profile:
        profile = profile["result"] or {}
    mine = prediction.get("by_profile_kind")
    if mine is None:
        raise ValueError("the prediction has no by_profile_kind: it predates compare_to_profile;"
                         " rerun gpu_model.py --json")
    theirs = profile.get("by_kind_ms")
    if theirs is None:
        raise ValueError("the profile has no by_kind_ms: pass gpu_check's profile step result "
                         "(run on a GPU)")

    def pair(predicted, measured):
        ratio = (round(predicted / measured, 3) if measured else None)
        return {"predicted_ms": round(predicted, 3),
                "measured_ms": None if measured is None else round(measured, 3),
                "ratio": ratio}

    kinds = {k: pair(mine.get(k, 0.0), theirs.get(k, 0.0)) for k in PROFILE_KINDS}
    unknown = sorted(set(theirs) - set(PROFILE_KINDS))
    for k in unknown:
        kinds[k] = pair(0.0, theirs[k])
    return {"kinds": kinds,
            "step": pair(prediction["predicted_step_ms"], profile.get("step_ms")),
            "device_busy": pair(prediction["device_ms"], profile.get("device_busy_ms")),
            "unmapped_profile_kinds": unknown}


def attention_summary(trace: dict) -> dict:
    """Attention calls by (mask, head dim, dtype, backend), with the layers that make them."""
    out: Dict[str, dict] = {}
    for c in trace["attention_calls"]:
        key = f"{c['mask']} hd={c['head_dim']} {c['dtype']}"
        g = out.setdefault(key, {"mask": c["mask"], "head_dim": c["head_dim"],
                                 "dtype": c["dtype"], "dropout": c["dropout"],
                                 "backend": c["backend"], "calls": 0, "layers": []})
        g["calls"] += 1
        if c["layer"] is not None and c["layer"] not in g["layers"]:
            g["layers"].append(c["layer"])
    counts: Dict[str, int] = {}
    for g in out.values():
        counts[g["backend"]] = counts.get(g["backend"], 0) + g["calls"]
    return {"by_backend": counts, "sites": list(out.values())}


def _point(measured_ms: float, p: dict) -> dict:
    ratio = p["predicted_step_ms"] / measured_ms
    return {"measured_ms": round(measured_ms, 3), "predicted_ms": p["predicted_step_ms"],
            "ratio": round(ratio, 3), "within_25_percent": abs(ratio - 1) <= 0.25,
            "device_ms": p["device_ms"], "host_ms": p["host_ms"], "bound": p["bound"],
            "timing": p["timing"], "by_kind": p["by_kind"], "host": p["host"]}


def layer_measured_ms(measured: dict) -> Optional[float]:
    """gpu_check's layer step, bf16 training: milliseconds per call (L x B tokens)."""
    layer = measured.get("layer") or {}
    tps = (layer.get("tokens_per_s") or {}).get("srupp_bf16_train")
    shape = layer.get("shape")
    if not tps or not shape:
        return None
    return shape["L"] * shape["B"] / tps * 1e3


def calibration(cal_trace: dict, measured: dict, call_us: float = CALL_US,
                launch_us: float = LAUNCH_US, layer_trace: Optional[dict] = None) -> dict:
    """The model beside the 2026-11-27 H200 run, at two points with the same constants:
    the enwik8-base training step (``measured_ms``, ``predicted_ms``) and gpu_check's
    single-layer step (``layer_measured_ms``, ``layer_predicted_ms``), each with its
    terms (device time by kind, host time, which bound), and what the model lacks."""
    gpu = gpu_set("h200", measured)
    run = measured["enwik8"]
    measured_ms = run["batch"] * run["unroll"] / run["tokens_per_s"] * 1e3
    p = predict(cal_trace, gpu, call_us=call_us, launch_us=launch_us)
    step = _point(measured_ms, p)
    out = {"run": f"enwik8-base, {run['precision']}, batch {run['batch']} x unroll "
                  f"{run['unroll']}, eager, plain recurrence, {cal_trace['optimizer_impl']} "
                  f"{cal_trace['optimizer']} "
                  f"(docs/gpu.json, {measured['date'] or CALIBRATION_DATE})",
           "measured_ms": step["measured_ms"], "predicted_ms": step["predicted_ms"],
           "ratio": step["ratio"], "within_25_percent": step["within_25_percent"],
           "trace": cal_trace["mode"], "step": step, "predicted_by_kind": p["by_kind"]}
    lm = layer_measured_ms(measured)
    if layer_trace is not None and lm is not None:
        lp = predict(layer_trace, gpu, call_us=call_us, launch_us=launch_us)
        layer = _point(lm, lp)
        shape = measured["layer"]["shape"]
        out.update(layer_run=f"one SRU++ layer (d {shape['d']}, d' {shape['proj']}, L "
                             f"{shape['L']}, B {shape['B']}), bf16 autocast, forward and "
                             f"backward of the output's sum, timed alone (gpu_check layer)",
                   layer_measured_ms=layer["measured_ms"],
                   layer_predicted_ms=layer["predicted_ms"], layer_ratio=layer["ratio"],
                   layer=layer)
    points = [out["step"]] + ([out["layer"]] if "layer" in out else [])
    out["within_25_percent_both"] = all(x["within_25_percent"] for x in points)
    if not out["within_25_percent_both"]:
        out["lacks"] = list(MISSING)
    return out


def assumptions(gpu: dict, measured: dict, args, trace: dict) -> dict:
    rows = gpu["recurrence_rows"]
    lat = {}
    for r in trace["records"]:
        if r["kind"] == "recurrence" and "extra" in r:
            e = r["extra"]
            d = _SHORT.get(e["dtype"], e["dtype"])
            lat[f"{d} {e['direction']} L={e['L']}"] = round(
                step_latency_us(rows, d, e["L"], e["direction"]), 4)
    waves = {}
    for r in trace["records"]:
        if "gemm" in r:
            key = "x".join(str(v) for v in r["gemm"])
            waves[key] = round(gemm_wave_efficiency(r["gemm"], gpu["sms"]), 3)
    shares = {}
    for r in trace["records"]:
        e = r.get("extra") or {}
        if r["name"] in _SDPA_OPS and e.get("backend") not in (None, "math", "unknown"):
            k = max(e.get("head_dim", 0), e.get("dv", 0))
            rate = op_rate_tflops(r, gpu)
            shares[f"{e['backend']} hd={k} {e['direction']}"] = {
                "share_of_datasheet": round(attention_share(e["backend"], k,
                                                            gpu["capability"]), 4),
                "blocks": e.get("ctas"), "TFLOPs": round(rate, 1),
                "source": ATTENTION_SOURCES.get(e["backend"], "")}
    return {
        "gpu": {k: (round(v, 2) if isinstance(v, float) else v) for k, v in gpu.items()
                if k not in ("recurrence_rows", "ratios")},
        "h200_measured_over_datasheet": {k: round(v, 3) for k, v in gpu["ratios"].items()},
        "datasheets": SPECS,
        "op_time": "max(FLOPs / rate, (bytes read + written) / copy bandwidth); rate: GEMMs "
                   "at the full-wave peak of their dtype x wave efficiency, fused attention "
                   "at its backend's share of the datasheet peak, the rest at the GEMM peak",
        "gemm": f"output blocks of {GEMM_TILE[0]}x{GEMM_TILE[1]} (either orientation), one "
                f"per SM; split-K up to K/{GEMM_SPLIT_K_MIN} where the blocks fill less than "
                f"a wave; full-wave peak = measured {GEMM_CALIBRATION[0]}^3 rate / its own "
                f"wave efficiency ({gemm_wave_efficiency([1, *GEMM_CALIBRATION], 132):.3f}): "
                f"wave quantisation alone, no public per-shape figures",
        "gemm_wave_efficiency": waves,
        "attention_shares": shares,
        "attention": "one fused kernel forward (1 launch), backward (2) for flash, efficient "
                     "and cudnn; math 5 and 8 with fp32 scores; FLOPs over the visible "
                     "query-key pairs, the backward recomputing q.k in fused kernels; the "
                     "memory-efficient kernels at K > 128 add their fp32 accumulators' bytes "
                     "and the backward runs on its grid's blocks, one per SM",
        "host": {"call_us": args.call_us, "call_source": CALL_SOURCE,
                 "launch_us": args.launch_us, "launch_source": LAUNCH_SOURCE,
                 "step": "steady (a training loop): max(device, host), the host running "
                         "ahead from step to step; with syncs, or timed alone (the layer "
                         "step): the timeline from idle, the device waiting for the host's "
                         "launches"},
        "launch_us": args.launch_us, "launch_source": LAUNCH_SOURCE,
        "recurrence": (f"pipelined: bytes / ({args.share} x copy bandwidth), a hypothesis "
                       f"until a GPU times it" if args.recurrence == "pipelined" else
                       "plain: max(bytes / copy bandwidth, L x per-step latency); per-step = "
                       "forward_ms (backward_ms) / L of docs/gpu.json's H200 row of the dtype "
                       "with the nearest L (B 16, D 2048 there; the loop waits one DRAM round "
                       "trip a step whatever D)"),
        "recurrence_step_us": lat, "pipelined_share": args.share,
        "foreach": "multi_tensor_apply: a launch per 320 blocks of 65536 elements or per "
                   "110/64/48/36/30 tensors (1..5 tensor lists); _foreach_norm one more",
        "compiled": "each run of consecutive element-wise/norm/cast/copy ops inside an SRU++ "
                    "layer (forward or backward) is one kernel: one launch, the bytes at its "
                    "boundary only (fuse_compiled); inside the layers one host call per "
                    "kernel (no views)",
        "fused_optimizer": "one kernel per multi_tensor_apply chunk of (param, grad, 2 moments)"
                           ", 28 bytes per parameter element, one host call; clipping "
                           "unchanged",
        "attention_backend": trace.get("attention", "auto"),
        "trace": trace["mode"] + (" (fake CUDA tensors; torch.autocast('cuda') itself, its "
                                  "CUDA-availability checks patched; backward by run_backward)"
                                  if trace["mode"] == "fake-cuda" else
                                  " (approximate: no autocast casts, bf16 weights, srupp's "
                                  "non-CUDA paths except the recurrence)"),
        "host_work": "ops on CPU tensors only (the optimizer's step counters) launch nothing "
                     "and cost their call; the batch's host-to-device copy is priced at HBM "
                     "bandwidth",
        "missing": list(MISSING),
    }


# --------------------------------------------------------------------------- CLI

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=str(ROOT / "recipes" / "enwik8-base.toml"),
                   help="a TOML recipe of a language model (default: enwik8-base)")
    p.add_argument("--gpu", default="h200", choices=list(SPECS))
    p.add_argument("--batch", type=int, help="streams a step (default: the recipe's)")
    p.add_argument("--unroll", type=int, help="tokens a stream a step (default: the recipe's)")
    p.add_argument("--precision", choices=["bf16", "fp32"],
                   help="default: the recipe's if bf16 or fp32, else bf16 (as the GPU run)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="recipe overrides, as srupp train --set")
    p.add_argument("--compiled", action="store_true",
                   help="regional torch.compile of each SRU++ layer (fused element-wise runs)")
    p.add_argument("--fused-optimizer", action="store_true",
                   help="one optimizer kernel per parameter chunk instead of foreach ops")
    p.add_argument("--recurrence", choices=["plain", "pipelined"], default="plain")
    p.add_argument("--share", type=float, default=None,
                   help="pipelined recurrence's share of copy bandwidth (default: the "
                        "target in docs/gpu.json, 0.7)")
    p.add_argument("--attention", choices=["auto", "sdpa", "matmul"], default="auto",
                   help="srupp's attention backend (matmul: its explicit bf16 products, "
                        "the probabilities kept)")
    p.add_argument("--launch-us", type=float, default=LAUNCH_US,
                   help="host cost of one kernel launch")
    p.add_argument("--call-us", type=float, default=None,
                   help="host cost of one dispatcher call (default: measured here, the "
                        f"calibration's model trained on the meta device; {CALL_US} is "
                        "the public figure for a bare op)")
    p.add_argument("--scenarios", action="store_true",
                   help="also predict the changes in flight, alone and together (eager "
                        "baseline, --compiled, --fused-optimizer, --recurrence pipelined, "
                        "--attention matmul; all of them eager, and compiled with SDPA)")
    p.add_argument("--trace", choices=["auto", "fake-cuda", "meta"], default="auto",
                   help="where the step runs: fake CUDA tensors (auto falls back to meta)")
    p.add_argument("--gpu-json", default=str(GPU_JSON), help="the measured GPU run")
    p.add_argument("--top", type=int, default=15, help="the costliest ops listed")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _recipe_precision(recipe: str, sets: List[str]) -> str:
    for s in sets:
        if s.startswith("train.precision="):
            value = s.split("=", 1)[1]
            return value if value in ("bf16", "fp32") else "bf16"
    import tomllib

    value = tomllib.loads(Path(recipe).read_text()).get("train", {}).get("precision", "fp32")
    return value if value in ("bf16", "fp32") else "bf16"


# name -> (compiled, fused optimizer, recurrence, attention). Compiled layers attend
# through SDPA whatever the backend setting (srupp's attend steps aside for SDPA while
# torch.compile traces: settings.tracing), so the matmul attention is eager only.
SCENARIOS = {
    "eager": (False, False, "plain", "auto"),
    "compiled": (True, False, "plain", "auto"),
    "fused_optimizer": (False, True, "plain", "auto"),
    "recurrence_pipelined": (False, False, "pipelined", "auto"),
    "attention_matmul": (False, False, "plain", "matmul"),
    "all_eager": (False, True, "pipelined", "matmul"),
    "all_compiled": (True, True, "pipelined", "auto"),
}


def _summary(p: dict) -> dict:
    keep = ("predicted_step_ms", "predicted_tokens_per_s", "predicted_mfu", "device_ms",
            "host_ms", "bound", "launches", "by_kind")
    return {k: p[k] for k in keep}


def model_step(args) -> dict:
    """The prediction for ``args`` (parsed by :func:`parse_args`), as one dict."""
    if args.compiled and args.attention == "matmul":
        raise ValueError("--attention matmul does not run in compiled layers: srupp's attend "
                         "hands a model torch.compile traces to SDPA; drop one of the two")
    measured = read_gpu_json(Path(args.gpu_json))
    gpu = gpu_set(args.gpu, measured)
    if args.share is None:
        args.share = float(measured["targets"].get("recurrence_share_of_copy", 0.7))
    precision = args.precision or _recipe_precision(args.recipe, args.set)
    spec = {"recipe": str(args.recipe), "sets": args.set, "batch": args.batch,
            "unroll": args.unroll, "precision": precision, "capability": gpu["capability"],
            "mode": args.trace, "attention": args.attention}
    cal = {"calibration": True, "batch": measured["enwik8"]["batch"], "precision": "bf16",
           "capability": SPECS["h200"]["capability"], "mode": args.trace}
    specs = [spec, cal]
    shape = (measured.get("layer") or {}).get("shape")
    if shape:
        specs.append({"workload": "layer", "d": shape["d"], "proj": shape["proj"],
                      "L": shape["L"], "B": shape["B"], "precision": "bf16",
                      "capability": SPECS["h200"]["capability"], "mode": args.trace})
    other = "matmul" if args.attention != "matmul" else "auto"
    if args.scenarios:
        specs.append(dict(spec, attention=other))
    if args.call_us is None:  # measured here, on the calibration's model at tiny widths
        specs.append({"workload": "host", "mode": "cpu", "precision": "bf16",
                      "sets": ["train.precision=bf16"]})
    traces = run_traces(specs)
    trace, cal_trace = traces[:2]
    layer_trace = traces[2] if shape else None
    host = traces.pop() if args.call_us is None else None
    if host is not None:
        args.call_us = host["call_us"]
    out = {"recipe": Path(args.recipe).name, "gpu": args.gpu, "trace": trace["mode"],
           "config": {"batch": trace["batch"], "unroll": trace["unroll"],
                      "mem_len": trace["mem_len"], "grad_accum": trace["grad_accum"],
                      "precision": precision, "params": trace["params"],
                      "tokens_per_step": trace["tokens_per_step"],
                      "compiled": args.compiled, "fused_optimizer": args.fused_optimizer,
                      "recurrence": args.recurrence, "attention": args.attention,
                      "optimizer": trace["optimizer"],
                      "optimizer_impl": trace["optimizer_impl"],
                      "recipe_compile": trace["recipe_compile"]}}
    if "fallback_reason" in trace:
        out["trace_fallback_reason"] = trace["fallback_reason"]
    costs = dict(call_us=args.call_us, launch_us=args.launch_us, share=args.share)
    out.update(predict(trace, gpu, compiled=args.compiled, fused_optimizer=args.fused_optimizer,
                       recurrence=args.recurrence, top=args.top, **costs))
    out["model_flops_per_token"] = trace["flops_per_token"]
    out["syncs"] = trace["syncs"]
    out["attention_backends"] = attention_summary(trace)
    if args.scenarios:
        by_attention = {args.attention: trace, other: traces[-1]}
        by_attention.setdefault("auto", by_attention.get("sdpa", trace))
        out["scenarios"] = {
            name: _summary(predict(by_attention[att], gpu, compiled=comp, fused_optimizer=fo,
                                   recurrence=rec, **costs))
            for name, (comp, fo, rec, att) in SCENARIOS.items()}
    out["calibration"] = calibration(cal_trace, measured, args.call_us, args.launch_us,
                                     layer_trace)
    out["assumptions"] = assumptions(gpu, measured, args, trace)
    if host is not None:
        out["assumptions"]["host"]["call_source"] = (
            f"measured here: enwik8-base's structure at tiny widths ({', '.join(HOST_WIDTHS)}) "
            f"trained in bf16 on one thread of {host['cpu']}, {host['step_ms']} ms for "
            f"{host['calls']} dispatcher calls a step (the GPU machine's host CPU may "
            f"differ); --call-us {CALL_US} is the public figure for a bare op "
            f"({CALL_SOURCE})")
        out["host_measurement"] = host
    return out


def table(res: dict) -> str:
    c = res["config"]
    opts = [("compiled" if c["compiled"] else "eager"), f"{c['recurrence']} recurrence",
            ("fused (modelled)" if c["fused_optimizer"] else c["optimizer_impl"])
            + f" {c['optimizer']}", f"attention {c['attention']}"]
    h = res["host"]
    lines = [f"{res['recipe']} on {res['gpu']}: {c['precision']}, batch {c['batch']} x unroll "
             f"{c['unroll']} (memory {c['mem_len']}), {', '.join(opts)}; trace {res['trace']}",
             f"predicted step {res['predicted_step_ms']:.1f} ms = "
             f"{res['predicted_tokens_per_s']:,} tokens/s, MFU {res['predicted_mfu']:.3f}; "
             f"{res['bound']}-bound: device {res['device_ms']:.1f} ms, host "
             f"{res['host_ms']:.1f} ms ({h['calls']} calls x {h['call_us']} us + "
             f"{h['launches']} launches x {h['launch_us']} us)", "",
             f"{'device, by kind':<16}{'ms':>9}{'share':>8}"]
    total = res["device_ms"] or 1.0
    for k, v in res["by_kind"].items():
        lines.append(f"{k:<16}{v:>9.2f}{v / total:>8.1%}")
    a = res["attention_backends"]
    lines += ["", "attention: " + ("; ".join(f"{s['calls']} x {s['backend']} ({s['mask']}, "
                                             f"hd {s['head_dim']}, {s['dtype']})"
                                             for s in a["sites"]) or c["attention"])]
    if c["recurrence"] == "pipelined":
        lines.append(f"recurrence pipelined at {res['assumptions']['pipelined_share']} of copy "
                     f"bandwidth: a hypothesis until a GPU times it")
    if "scenarios" in res:
        lines += ["", f"{'scenario':<22}{'step ms':>9}{'tokens/s':>11}{'MFU':>7}{'bound':>8}"]
        for name, sc in res["scenarios"].items():
            lines.append(f"{name:<22}{sc['predicted_step_ms']:>9.1f}"
                         f"{sc['predicted_tokens_per_s']:>11,}{sc['predicted_mfu']:>7.3f}"
                         f"{sc['bound']:>8}")
    cal = res["calibration"]
    lines += ["", f"calibration: {cal['run']}: measured {cal['measured_ms']:.1f} ms, predicted "
                  f"{cal['predicted_ms']:.1f} ms, ratio {cal['ratio']:.2f}"]
    if "layer" in cal:
        lines.append(f"  and {cal['layer_run']}: measured {cal['layer_measured_ms']:.2f} ms, "
                     f"predicted {cal['layer_predicted_ms']:.2f} ms, ratio "
                     f"{cal['layer_ratio']:.2f}")
    if cal.get("lacks"):
        lines += ["  misses by more than 25%; the model lacks:"]
        lines += [f"  - {x}" for x in cal["lacks"]]
    lines += ["", f"{'top ops':<40}{'kind':<13}{'phase':<10}{'calls':>6}{'ms':>9}"]
    for t in res["top"]:
        lines.append(f"{t['op'][:39]:<40}{t['kind']:<13}{t['phase']:<10}{t['calls']:>6}"
                     f"{t['ms']:>9.2f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args._worker:
        _worker()
        return
    try:
        res = model_step(args)
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        print(f"gpu_model: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(res, indent=1) if args.json else table(res))


if __name__ == "__main__":
    main()
