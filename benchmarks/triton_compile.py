"""Do the Triton recurrence kernels compile for real GPUs, with how many registers,
and does any variant spill?

Compiles every variant the host functions can launch
(``srupp.ops.triton_compile.specializations()``: dtypes, flags and launch
configurations) for sm_80 and sm_90, without a GPU (triton ships ptxas), in
``--workers`` child processes, and prints one JSON object: a record per variant and
arch (registers, spills, shared memory, compile seconds) and a summary.
``--markdown PATH`` also writes the summary table of docs/performance.md.
Exits with status 1 if a variant fails to compile or spills.

    .venv/bin/python benchmarks/triton_compile.py --markdown /tmp/triton_compile.md

``--pairwise`` compiles the subset CI compiles (tests/ops/test_triton_compile.py);
``--limit N`` the first N variants only.

``--sweep`` compiles instead the launch configurations a GPU times
(``triton_kernel.SWEEP_CONFIGS``), each kernel's heaviest variant in fp32 and bf16
(``sweep_specializations()``), and the summary has one row per configuration,
kernel, dtype and arch: registers, spills, shared memory, asynchronous copies and
where each time loop's loads sit (PTX: loads before the first ex2; SASS: loads
issued before the first instruction that needs one).

    .venv/bin/python benchmarks/triton_compile.py --sweep
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import defaultdict

import triton

from srupp.ops import triton_compile as tc


def summarise(records):
    """One row per kernel x U dtype x arch: the extremes over every other field."""
    groups = defaultdict(list)
    for r in records:
        groups[(r["kernel"], r["dtype"], r["arch"])].append(r)
    order = {"fwd": 0, "bwd": 1, "fp32": 0, "bf16": 1, "fp16": 2}
    rows = []
    for key in sorted(groups, key=lambda k: (order[k[0]], order[k[1]], k[2])):
        rs = groups[key]
        heaviest = max(rs, key=lambda r: r["n_regs"])
        rows.append(dict(
            kernel=key[0], dtype=key[1], arch=key[2], variants=len(rs),
            min_regs=min(r["n_regs"] for r in rs), max_regs=heaviest["n_regs"],
            heaviest=heaviest["name"], max_n_spills=max(r["n_spills"] for r in rs),
            max_spill_bytes=max(r["spill_bytes"] for r in rs),
            max_shared=max(r["shared"] for r in rs),
            median_compile_s=round(statistics.median(r["compile_s"] for r in rs), 2)))
    return rows


def summarise_sweep(records):
    """One row per launch configuration x kernel x U dtype x arch."""
    rows = []
    for r in records:
        rows.append(dict(
            config=r["name"].split("BLOCK=")[1], kernel=r["kernel"], dtype=r["dtype"],
            arch=r["arch"], n_regs=r["n_regs"], spill_bytes=r["spill_bytes"],
            shared=r["shared"], async_copies=r["async_copies"],
            # per time loop (the blocks', then the plain tail's)
            ptx_loads_before_ex2=[(p["loads"], p["before_first_ex2"]) for p in r["ptx_loops"]],
            sass_loads_before_use=[(x["loads"], x["before_first_use"]) for x in r["loops"]],
            compile_s=r["compile_s"]))
    return rows


def markdown(rows, spilling, command, triton_version):
    lines = [
        f"`{command}` (triton {triton_version}; CPU only: ptxas compiles for the target "
        "without a GPU). Registers are per thread; spills are ptxas' spill stores + loads "
        "(bytes) and the local memory frame (4-byte words, as `CompiledKernel.n_spills`); "
        "shared memory in bytes. Each row is the extremes over the dtypes of weight_c/bias "
        "and x, k, mask, dropout, bidirectional, store_c / grad_c_last / grad_x and the "
        "two launch configurations.",
        "",
        "| kernel | U dtype | arch | variants | registers (min-max) | most registers | "
        "spills (bytes / words) | shared | compile s (median) |",
        "|---|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kernel']} | {r['dtype']} | sm_{r['arch']} | {r['variants']} | "
            f"{r['min_regs']}-{r['max_regs']} | `{r['heaviest']}` | "
            f"{r['max_spill_bytes']} / {r['max_n_spills']} | {r['max_shared']} | "
            f"{r['median_compile_s']} |")
    lines.append("")
    if spilling:
        lines.append("Variants that spill:")
        lines += [f"- `{r['name']}` on sm_{r['arch']}: {r['spill_bytes']} bytes, "
                  f"{r['n_regs']} registers" for r in spilling]
    else:
        lines.append("No variant spills.")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", type=int, nargs="+", default=list(tc.ARCHS),
                    help="compute capabilities (default: 80 90)")
    ap.add_argument("--workers", type=int, default=2, help="compiling processes (default 2)")
    ap.add_argument("--kernel", choices=["fwd", "bwd"], help="one kernel only")
    ap.add_argument("--pairwise", action="store_true",
                    help="only the pairwise cover of the variants that CI compiles")
    ap.add_argument("--limit", type=int, help="only the first N variants")
    ap.add_argument("--sweep", action="store_true",
                    help="the GPU sweep's launch configurations (SWEEP_CONFIGS) instead, "
                         "each kernel's heaviest variant in fp32 and bf16")
    ap.add_argument("--markdown", metavar="PATH", help="write the summary table here")
    args = ap.parse_args(argv)

    if args.sweep and args.markdown:
        ap.error("--markdown writes the table of the production variants; not with --sweep")
    specs = tc.sweep_specializations() if args.sweep else tc.specializations()
    if args.kernel:
        specs = [s for s in specs if s.kernel == args.kernel]
    if args.pairwise:
        specs = tc.pairwise_cover(specs)
    if args.limit is not None:
        specs = specs[:args.limit]
    total = len(specs) * len(args.archs)
    done = 0

    def progress(_):
        nonlocal done
        done += 1
        if done % 100 == 0 or done == total:
            print(f"{done}/{total} compiled", file=sys.stderr, flush=True)

    start = time.perf_counter()
    records = tc.compile_specializations(specs, args.archs, args.workers, progress)
    wall = time.perf_counter() - start
    errors = [r for r in records if "error" in r]
    ok = [r for r in records if "error" not in r]
    spilling = [r for r in ok if r["n_spills"] or r["spill_bytes"]]
    rows = summarise_sweep(ok) if args.sweep else summarise(ok)
    command = "benchmarks/triton_compile.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = dict(
        triton=triton.__version__, python=platform.python_version(), archs=args.archs,
        variants=len(specs), compilations=total, workers=args.workers, wall_s=round(wall, 1),
        compile_s=dict(median=round(statistics.median(r["compile_s"] for r in ok), 3),
                       max=max(r["compile_s"] for r in ok),
                       total=round(sum(r["compile_s"] for r in ok), 1)) if ok else None,
        max_regs=max((r["n_regs"] for r in ok), default=None),
        spilling=[dict(name=r["name"], arch=r["arch"], spill_bytes=r["spill_bytes"])
                  for r in spilling],
        errors=[dict(name=r["name"], arch=r["arch"], error=r["error"]) for r in errors],
        no_ptx_or_cubin=[dict(name=r["name"], arch=r["arch"]) for r in ok
                         if not (r["ptx"] and r["cubin"])],
        summary=rows, records=records)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(rows, spilling, command.strip(), triton.__version__))
    # one record a line, so that the output stays readable (and greppable)
    head = json.dumps({k: v for k, v in result.items() if k != "records"}, indent=1)
    body = ",\n".join("  " + json.dumps(r) for r in records)
    print(head[:-2] + ',\n "records": [\n' + body + "\n ]\n}")
    return 1 if errors or spilling or result["no_ptx_or_cubin"] else 0


if __name__ == "__main__":
    sys.exit(main())
