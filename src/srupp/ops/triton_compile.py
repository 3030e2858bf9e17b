"""Every variant of the Triton recurrence kernels, and compiling them ahead of time.

Triton compiles a variant of a kernel (:mod:`srupp.ops.triton_kernel`) per
combination of constexprs and pointer dtypes.  :func:`specializations` lists every
variant the host functions can launch; it is derived from the functions they decide
with (``_launch_config``, ``_fwd_constexprs``, ``_bwd_constexprs``, and
``_param_dtype`` / ``_x_dtype``, which keep the dtype combinations to those the
layers produce) and from the dtypes the dispatcher sends to Triton
(:data:`srupp.ops.settings.RECURRENCE_DTYPES`).  :func:`sweep_specializations` lists
the heaviest variant of each launch configuration a GPU sweep times
(``triton_kernel.SWEEP_CONFIGS``).

:func:`compile_specializations` compiles variants for real GPU targets (sm_80,
sm_90) on a machine without a GPU and reports registers, spills and where the time
loops' loads sit; CI compiles them that way (tests/ops/test_triton_compile.py,
benchmarks/triton_compile.py).

Tooling only: the kernels and the dispatcher never import this module.  It imports
triton (through the kernel module) at its top; importing it compiles nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import triton
from torch import Tensor

from .settings import RECURRENCE_DTYPES, tuning
from .triton_kernel import (_DROPOUT_DTYPE, _LAUNCH_CONFIGS, SWEEP_CONFIGS, Launch,
                            LaunchConfig, _bwd_constexprs, _bwd_setup, _config, _fwd_constexprs,
                            _fwd_setup, _param_dtype, _x_dtype)

__all__ = ["ARCHS", "Specialization", "specializations", "sweep_specializations",
           "example_launch", "launch_key", "compile_specialization", "compile_specializations",
           "compile_pairs", "pairwise_cover", "loop_loads"]

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_NAMED_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}

#: The GPU architectures the variants are compiled for ahead of time: sm_80 (A100),
#: sm_90 (H100).
ARCHS = (80, 90)

# The shape of the example launches that specializations are compiled from:
# contiguous tensors with L and D multiples of 16.  Triton's JIT specialises integer
# arguments (== 1: a constant; a multiple of 16: an alignment hint), so these give
# the variant that typical training shapes compile.  Other shapes compile
# other variants of the same code (L = 1 when decoding makes L a constant; D not a
# multiple of 16 drops the hints), and tensors of 2**31 elements or more, int64 strides.
_EXAMPLE_B, _EXAMPLE_L, _EXAMPLE_D = 2, 16, 1024


@dataclass(frozen=True)
class Specialization:
    """One variant of a kernel: what the host functions decide for a call.

    dtype is U's (and h's, grad_h's, grad_U's); param_dtype and x_dtype are
    weight_c/bias's and the skip input's as the kernels read them (x_dtype None:
    no x).  The flags are the host functions' arguments; store_c is the forward's,
    grad_c_last and grad_x the backward's (False for the other kernel).
    """
    kernel: str                 # "fwd" or "bwd"
    dtype: torch.dtype
    param_dtype: torch.dtype
    x_dtype: Optional[torch.dtype]
    k: int
    mask: bool
    dropout: bool
    bidirectional: bool
    block: int
    num_warps: int
    store_c: bool = False
    grad_c_last: bool = False
    grad_x: bool = False
    stages: Optional[int] = None   # tuning().triton_stages
    steps: Optional[int] = None    # tuning().triton_steps

    @property
    def config(self) -> LaunchConfig:
        """The launch configuration."""
        return LaunchConfig(self.block, self.num_warps, self.stages, self.steps)

    @property
    def constexprs(self) -> Dict[str, Any]:
        """The kernel's constexpr arguments, BLOCK included."""
        if self.kernel == "fwd":
            flags = _fwd_constexprs(self.k, self.x_dtype is not None, self.mask, self.dropout,
                                    self.bidirectional, self.store_c)
        else:
            flags = _bwd_constexprs(self.k, self.x_dtype is not None, self.grad_x, self.mask,
                                    self.dropout, self.bidirectional, self.grad_c_last)
        return dict(flags, BLOCK=self.block, STAGES=self.stages, STEPS=self.steps)

    @property
    def name(self) -> str:
        """A short readable name, e.g. ``bwd bf16 p=fp32 x=fp32 k3 mask gx BLOCK=64/2w``
        (``BLOCK=`` and the :attr:`LaunchConfig.name`: ``/4s`` pipelined in 4 stages,
        ``/k8`` in blocks of 8 steps)."""
        x = f" x={_DTYPE_NAMES[self.x_dtype]}" if self.x_dtype is not None else ""
        flags = [f for f, on in (("mask", self.mask), ("drop", self.dropout),
                                 ("bidir", self.bidirectional), ("store_c", self.store_c),
                                 ("gcl", self.grad_c_last), ("gx", self.grad_x)) if on]
        return " ".join([f"{self.kernel} {_DTYPE_NAMES[self.dtype]}",
                         f"p={_DTYPE_NAMES[self.param_dtype]}{x} k{self.k}", *flags,
                         f"BLOCK={self.config.name}"])

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready fields (dtypes by their short names)."""
        d = dataclasses.asdict(self)
        for f in ("dtype", "param_dtype", "x_dtype"):
            d[f] = None if d[f] is None else _DTYPE_NAMES[d[f]]
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Specialization":
        d = dict(d)
        for f in ("dtype", "param_dtype", "x_dtype"):
            d[f] = None if d[f] is None else _NAMED_DTYPES[d[f]]
        return cls(**d)


def specializations(configs: Optional[Sequence[LaunchConfig]] = None,
                    dtypes: Optional[Sequence[torch.dtype]] = None) -> List[Specialization]:
    """Every variant of the two kernels that ``triton_kernel.sru_fwd`` / ``sru_bwd`` can
    launch (with ``tuning().triton_block`` and ``triton_warps`` None, as in production).

    The dtypes are those the dispatcher sends to Triton (U in fp32, bf16 or fp16),
    mapped through the host's own rules for what the kernels read weight_c, bias
    and x in; the flags are all the host functions' flag combinations; the launch
    configurations are ``triton_kernel._launch_config``'s.  The constexprs follow from the
    host's own functions (:attr:`Specialization.constexprs`).

    ``configs``: these launch configurations instead (``SWEEP_CONFIGS``);
    ``dtypes``: these dtypes of U only.
    """
    all_dtypes = RECURRENCE_DTYPES["triton"]
    both = (False, True)
    if configs is None:
        # (the stages and steps set now, as _launch_config reads them)
        configs = [LaunchConfig(block, num_warps, tuning().triton_stages,
                                tuning().triton_steps)
                   for _, block, num_warps in _LAUNCH_CONFIGS]
    configs = [_config(c) for c in configs]
    out = []
    for kernel in ("fwd", "bwd"):
        for u in (all_dtypes if dtypes is None else dtypes):
            params = [p for p in all_dtypes
                      if any(_param_dtype(u, w, b) == p for w in all_dtypes for b in all_dtypes)]
            xs = [x for x in all_dtypes if any(_x_dtype(u, y) == x for y in all_dtypes)]
            # k = 4 carries its skip term in U and takes no x (check_args)
            kx = [(3, None)] + [(3, x) for x in xs] + [(4, None)]
            for p, (k, x), mask, drop, bidir, config in itertools.product(
                    params, kx, both, both, both, configs):
                if kernel == "fwd":
                    extras = [dict(store_c=s) for s in both]
                else:  # a gradient for x exists only with an x
                    extras = [dict(grad_c_last=g, grad_x=gx) for g in both
                              for gx in (both if x is not None else (False,))]
                out += [Specialization(kernel, u, p, x, k, mask, drop, bidir, config.block,
                                       config.num_warps, stages=config.stages,
                                       steps=config.steps, **e) for e in extras]
    return out


def sweep_specializations(configs: Sequence[LaunchConfig] = SWEEP_CONFIGS,
                          dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16)
                          ) -> List[Specialization]:
    """For each launch configuration, kernel and U dtype, the variant with the most
    registers live: every flag on (x, read in fp32, and grad_x; padding, dropout,
    bidirectional; store_c / grad_c_last), where a configuration would spill first."""
    out = []
    for config in configs:
        config = _config(config)
        for kernel in ("fwd", "bwd"):
            extra = (dict(store_c=True) if kernel == "fwd"
                     else dict(grad_c_last=True, grad_x=True))
            out += [Specialization(kernel, dtype, torch.float32, torch.float32, 3, True, True,
                                   True, config.block, config.num_warps, stages=config.stages,
                                   steps=config.steps, **extra) for dtype in dtypes]
    return out


def example_launch(spec: Specialization, device="meta") -> Launch:
    """The launch ``triton_kernel.sru_fwd`` / ``sru_bwd`` make for ``spec`` on example
    tensors (``_EXAMPLE_B``, ``_EXAMPLE_L``, ``_EXAMPLE_D``), through the same setup
    code.  On the meta device by default: nothing is allocated, and the JIT reads
    meta pointers as 16-byte aligned, as CUDA allocations are."""
    B, L, D = _EXAMPLE_B, _EXAMPLE_L, _EXAMPLE_D

    def empty(*shape, dtype=spec.dtype):
        return torch.empty(*shape, dtype=dtype, device=device)

    U = empty(B, L, spec.k, D)
    x = empty(B, L, D, dtype=spec.x_dtype) if spec.x_dtype is not None else None
    weight_c, bias = empty(2, D, dtype=spec.param_dtype), empty(2, D, dtype=spec.param_dtype)
    mask = empty(B, L, dtype=torch.bool) if spec.mask else None
    drop = empty(B, D, dtype=_DROPOUT_DTYPE) if spec.dropout else None
    config = spec.config
    if spec.kernel == "fwd":
        _, launch = _fwd_setup(U, x, weight_c, bias, None, mask, drop, 1.0, spec.bidirectional,
                               spec.store_c, config)
    else:
        gcl = empty(B, D, dtype=torch.float32) if spec.grad_c_last else None
        _, launch = _bwd_setup(U, x, weight_c, bias, None, mask, drop,
                               empty(B, L, D, dtype=torch.float32), empty(B, L, D), gcl, 1.0,
                               spec.bidirectional, spec.grad_x, config)
    return launch


def launch_key(launch: Launch) -> Tuple:
    """What a launch's compiled variant depends on, short of shapes: the kernel, the
    tensor arguments' dtypes, the constexprs and num_warps."""
    kernel = getattr(launch.kernel, "fn", launch.kernel)  # JIT or interpreted
    dtypes = tuple(str(a.dtype) for a in launch.args if isinstance(a, Tensor))
    return (kernel.__name__, dtypes, tuple(sorted(launch.constexprs.items())), launch.num_warps)


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack_frame": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


_SASS_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)\s*([^;]*);")
_SASS_REGISTER = re.compile(r"\bR(\d+)(?:\.(64|128))?\b")


def _sass_registers(operand: str, width: int = 1) -> set:
    """The general registers an operand names (``R70.64``: R70 and R71)."""
    regs = set()
    for m in _SASS_REGISTER.finditer(operand):
        n = {None: width, "64": 2, "128": 4}[m.group(2)]
        regs.update(range(int(m.group(1)), int(m.group(1)) + n))
    return regs


def loop_loads(sass: str) -> List[Dict[str, int]]:
    """Where the global loads sit in each loop of a kernel's SASS (``cuobjdump -sass``),
    in program order: ``loads`` (LDG), ``async_copies`` (LDGSTS, cp.async),
    ``used_same_pass`` (loads whose value an instruction later in the same pass through
    the body touches) and ``before_first_use`` (loads issued before the first such
    instruction: a warp runs ahead of a load until an instruction needs its register,
    so these are the loads in flight together; all of them when every load is for a
    later pass, as when blocks are loaded ahead).  A loop is the span from a
    backward branch's target to the branch."""
    code = [(int(a, 16), op, args) for a, op, args in _SASS_INSTRUCTION.findall(sass)]
    loops = []
    for i, (addr, op, args) in enumerate(code):
        if not op.startswith("BRA"):
            continue
        target = re.search(r"0x([0-9a-f]+)", args)
        if target is None or int(target.group(1), 16) >= addr:  # (>=: the final trap)
            continue
        body = [c for c in code[:i] if c[0] >= int(target.group(1), 16)]
        loaded, uses, first_use, used = {}, 0, None, set()
        for k, (_, op, args) in enumerate(body):
            operands = args.split(",")
            if op == "LDG" or op.startswith("LDG."):
                width = 4 if ".128" in op else 2 if ".64" in op else 1
                for r in _sass_registers(operands[0], width):
                    loaded[r] = k
                for r in _sass_registers(",".join(operands[1:])) & loaded.keys():
                    used.add(loaded[r])
                continue
            hit = _sass_registers(args) & loaded.keys()
            if hit and first_use is None:
                first_use = k
            used.update(loaded[r] for r in hit)
        ldg = [k for k, (_, op, _) in enumerate(body) if op == "LDG" or op.startswith("LDG.")]
        loops.append(dict(
            loads=len(ldg), async_copies=sum(op.startswith("LDGSTS") for _, op, _ in body),
            used_same_pass=len(used),
            before_first_use=sum(k < first_use for k in ldg) if first_use is not None
            else len(ldg)))
    return loops


def _ptx_loop_loads(ptx: str) -> List[Dict[str, int]]:
    """For each loop of a kernel's PTX (from a block labelled as a loop header to the
    last branch back to it): its global loads, and how many come before its first
    ``ex2`` (the first gate's sigmoid, the start of the dependent arithmetic)."""
    loops = []
    for m in re.finditer(r"^(\$L__BB\d+_\d+):[^\n]*(?:\n\s*//[^\n]*)?Loop Header", ptx,
                         re.M):
        back = ptx.rfind(f"bra.uni \t{m.group(1)};")
        back = max(back, ptx.rfind(f"bra \t{m.group(1)};"))
        if back < m.end():
            continue
        body = ptx[m.end():back]
        first_ex2 = body.find("ex2.approx")
        loops.append(dict(loads=body.count("ld.global"),
                          before_first_ex2=body[:first_ex2 if first_ex2 >= 0 else None]
                          .count("ld.global")))
    return loops


def _sass(cubin: bytes) -> str:
    from triton import knobs

    with tempfile.TemporaryDirectory(prefix="srupp-sass-") as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", str(path)],
                              capture_output=True, text=True, check=True).stdout


def compile_specialization(spec: Specialization, arch: int, sass: bool = True) -> Dict[str, Any]:
    """Compile one variant for ``sm_<arch>`` without a GPU, as Triton's JIT would
    compile it for :func:`example_launch`'s arguments.

    Returns the variant's fields and ``arch``, ``n_regs`` (registers per thread),
    ``n_spills`` (as ``CompiledKernel.n_spills`` counts them on a GPU: the local
    memory frame in 4-byte words), ``spill_bytes`` (ptxas' spill stores plus
    loads), ``shared`` (bytes of shared memory), ``async_copies`` (cp.async in the PTX),
    ``ptx`` / ``cubin`` (whether each was produced), ``compile_s``, and where the
    time loops' loads sit: ``loops`` (:func:`loop_loads` of the SASS; None with
    ``sass=False``, which skips disassembling the cubin: cuobjdump takes longer than
    compiling a small variant) and ``ptx_loops`` (each loop's ``ld.global`` count, and
    how many come before its first ``ex2``).

    The kernels must be JIT functions, i.e. the kernel module imported without
    ``TRITON_INTERPRET=1``: :func:`compile_specializations` runs this in such child
    processes.
    """
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    launch = example_launch(spec)
    kernel = launch.kernel
    if not isinstance(kernel, JITFunction):
        raise RuntimeError("the kernels are interpreted (TRITON_INTERPRET=1); compile them in a "
                           "process without it (compile_specializations does)")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    # The JIT's own binder turns the arguments into the signature, the constexprs
    # (integers equal to 1 among them) and the alignment attributes it would compile.
    # (create_function_from_signature and _pack_args are internals of triton 3.8,
    # which pyproject.toml pins.)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(launch.constexprs, num_warps=launch.num_warps)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                             specialization, options)
    log = io.StringIO()
    start = time.perf_counter()
    with knobs.compilation.scope(), knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.compilation.always_compile = True  # a cache hit has no ptxas log to read
        knobs.nvidia.dump_ptxas_log = True       # ptxas -v: registers, stack, spills
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                  target=target, options=options.__dict__)
    seconds = time.perf_counter() - start
    text = log.getvalue()
    found = {}
    for key, pattern in _PTXAS.items():
        m = pattern.search(text)
        if m is None:
            raise RuntimeError(f"no {key!r} in the ptxas log of {spec.name} (sm_{arch}):\n{text}")
        found[key] = int(m.group(1))
    ptx, cubin = compiled.asm.get("ptx", ""), compiled.asm.get("cubin")
    return dict(
        spec.to_dict(), name=spec.name, arch=arch, n_regs=found["registers"],
        n_spills=found["stack_frame"] // 4,
        spill_bytes=found["spill_stores"] + found["spill_loads"],
        shared=compiled.metadata.shared,
        async_copies=ptx.count("cp.async.ca") + ptx.count("cp.async.cg"),
        ptx=".entry" in ptx, cubin=bool(cubin), compile_s=round(seconds, 3),
        loops=(loop_loads(_sass(cubin)) if cubin else []) if sass else None,
        ptx_loops=_ptx_loop_loads(ptx))


def _compile_worker() -> None:
    """A child process of :func:`compile_specializations`: reads every task (a JSON
    line each) from stdin, then compiles them and writes one JSON line per result."""
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else printed to stdout (triton, ptxas) goes to stderr
    tasks = [json.loads(line) for line in sys.stdin]  # all first: the parent never blocks
    for task in tasks:
        spec = Specialization.from_dict(task["spec"])
        try:
            result = compile_specialization(spec, task["arch"], task["sass"])
        except Exception as e:  # noqa: BLE001 - reported with the variant that failed
            result = dict(spec.to_dict(), name=spec.name, arch=task["arch"],
                          error=f"{type(e).__name__}: {e}")
        result["index"] = task["index"]
        results.write(json.dumps(result) + "\n")
        results.flush()


def compile_specializations(specs: Sequence[Specialization], archs: Sequence[int] = ARCHS,
                            workers: int = 2,
                            on_result: Optional[Callable[[Dict[str, Any]], None]] = None,
                            sass: bool = True) -> List[Dict[str, Any]]:
    """Compile every ``spec`` for every arch in ``workers`` child processes; returns
    :func:`compile_specialization`'s results in order (spec by spec, arch by arch),
    with ``error`` instead of the figures for a variant that failed to compile.
    ``on_result`` sees each result as it arrives; ``sass=False`` leaves the SASS
    figures out (``loops`` None).

    The children run without ``TRITON_INTERPRET`` (under the interpreter the kernels
    can't be compiled) and with a fresh Triton cache, so every variant is compiled and
    timed, and nothing is left in the user's cache.
    """
    return compile_pairs([(s, a) for s in specs for a in archs], workers, on_result, sass)


def compile_pairs(pairs: Sequence[Tuple[Specialization, int]], workers: int = 2,
                  on_result: Optional[Callable[[Dict[str, Any]], None]] = None,
                  sass: bool = True) -> List[Dict[str, Any]]:
    """:func:`compile_specializations` for a list of (variant, arch) pairs, each
    variant on its own archs; the results in the pairs' order. Starting a child
    (importing torch and triton) costs as much as compiling a few variants: one call
    for all of them starts the fewest."""
    tasks = [dict(index=i, spec=s.to_dict(), arch=a, sass=sass)
             for i, (s, a) in enumerate(pairs)]
    if not tasks:
        return []
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # srupp imports in the children from where it imports here
    root = str(Path(__file__).resolve().parents[2])
    paths = [root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    results: List[Optional[Dict[str, Any]]] = [None] * len(tasks)
    done: "queue.Queue[Optional[Dict[str, Any]]]" = queue.Queue()
    with tempfile.TemporaryDirectory(prefix="srupp-triton-cache-") as cache:
        env["TRITON_CACHE_DIR"] = cache
        n = max(1, min(workers, len(tasks)))
        procs = [subprocess.Popen(
            [sys.executable, "-c",
             "from srupp.ops.triton_compile import _compile_worker; _compile_worker()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) for _ in range(n)]

        def read(proc):
            for line in proc.stdout:
                done.put(json.loads(line))
            done.put(None)  # this worker is finished (or died)

        readers = [threading.Thread(target=read, args=(p,), daemon=True) for p in procs]
        for t in readers:
            t.start()
        try:
            for w, proc in enumerate(procs):  # interleaved, so the workers' loads match
                proc.stdin.write("".join(json.dumps(t) + "\n" for t in tasks[w::n]))
                proc.stdin.close()
            finished = 0
            while finished < n:
                result = done.get()
                if result is None:
                    finished += 1
                    continue
                results[result.pop("index")] = result
                if on_result is not None:
                    on_result(result)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:
        codes = [p.returncode for p in procs]
        raise RuntimeError(f"{len(missing)} of {len(tasks)} compilations returned nothing "
                           f"(worker exit codes {codes}; their stderr is above)")
    return results


def pairwise_cover(specs: Sequence[Specialization]) -> List[Specialization]:
    """A subset of ``specs`` in which every pair of values of two fields that occurs
    together in ``specs`` (U's dtype with x's, mask with dropout, ...) occurs at
    least once: much smaller than ``specs`` and still exercising each value of each
    field in many settings (the fields of a kernel interact mostly in pairs).
    Greedy; deterministic."""
    fields = [f.name for f in dataclasses.fields(Specialization) if f.name != "kernel"]

    def pairs(s):
        values = [(f, getattr(s, f)) for f in fields]
        return {(s.kernel, a, b) for a, b in itertools.combinations(values, 2)}

    of = {s: pairs(s) for s in specs}
    todo = set().union(*of.values()) if specs else set()
    chosen = []
    while todo:
        best = max(specs, key=lambda s: len(of[s] & todo))
        chosen.append(best)
        todo -= of[best]
    return chosen
