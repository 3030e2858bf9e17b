"""The Triton kernels compile for real GPUs (sm_80, sm_90) without spilling, and the
list of their variants is what the host functions launch.

The kernels' other tests run them under the Triton interpreter, which never
compiles them. Here :func:`srupp.ops.triton_compile.compile_specializations`
compiles them to PTX and cubin for sm_80 and sm_90 in child processes without
``TRITON_INTERPRET`` (no GPU needed: ptxas ships with triton), and ptxas reports
registers and spills. A variant takes about half a second to compile, and there
are about 1500 per arch, too many for CI: this test compiles a pairwise cover of
them (every pair of values of two fields that occurs in the full list occurs in
the subset: some 25 variants), and ``benchmarks/triton_compile.py`` compiles them all.

The launch configurations a GPU sweep times (``SWEEP_CONFIGS``) are compiled too,
each kernel's heaviest variant (every flag on) in fp32 and bf16, on sm_80 and sm_90;
their PTX shows that explicit blocks of time steps issue every step's loads before
the first update.

Every compilation here runs in one call (the ``compiled`` fixture: two child
processes, about 30 s on 2 cores), once per test run however pytest -n spreads the
tests that read it (``once_per_run``, tests/conftest.py).
Nothing here disassembles the cubins (cuobjdump took longer than compiling a small
variant): the checks read ptxas' figures and the PTX.

The variants' list must not drift from the launches: the launches of real calls
(through the dispatcher and the layers, under the interpreter) and of the two
launch configurations are checked to be in it.
"""

import dataclasses
import os
import statistics
import time

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton not installed (pip install srupp[test])")

import srupp.ops as ops  # noqa: E402
from srupp.nn import SRU, SRUpp  # noqa: E402
from srupp.ops import sru_recurrence  # noqa: E402
from srupp.ops import triton_compile as tc  # noqa: E402
from srupp.ops import triton_kernel as tk  # noqa: E402
from srupp.ops.reference import sru_recurrence_reference  # noqa: E402
from srupp.ops.settings import Tuning, tuning  # noqa: E402

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the kernels on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py sets it)")

FIELDS = [f.name for f in dataclasses.fields(tc.Specialization) if f.name != "kernel"]


@pytest.fixture(scope="module")
def specs():
    return tc.specializations()


@pytest.fixture(scope="module")
def cover(specs):
    return tc.pairwise_cover(specs)


@pytest.fixture(scope="module")
def spec_keys(specs):
    return {tc.launch_key(tc.example_launch(s)): s for s in specs}


def values(specs, kernel):
    return {(f, getattr(s, f)) for s in specs if s.kernel == kernel for f in FIELDS}


def test_specializations_are_distinct_and_complete(specs, spec_keys):
    assert len(spec_keys) == len(specs), "two variants compile to the same kernel"
    for s in specs:  # the setup code launches the constexprs a variant names
        assert tc.example_launch(s).constexprs == s.constexprs, s.name
    for kernel in ("fwd", "bwd"):
        seen = values(specs, kernel)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert ("dtype", dtype) in seen and ("x_dtype", dtype) in seen
        assert {("param_dtype", torch.float32), ("param_dtype", torch.bfloat16),
                ("param_dtype", torch.float16), ("k", 3), ("k", 4), ("x_dtype", None)} <= seen
        flags = ["mask", "dropout", "bidirectional"]
        flags += ["store_c"] if kernel == "fwd" else ["grad_c_last", "grad_x"]
        assert {(f, v) for f in flags for v in (False, True)} <= seen
        assert {("block", b) for _, b, _ in tk._LAUNCH_CONFIGS} <= seen
    # fp32 U meets fp32 parameters only; half U meets its own dtype or fp32
    assert {(s.dtype, s.param_dtype) for s in specs} == {
        (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
        (torch.float16, torch.float32)}


class Recorder:
    """Replaces triton_kernel._run: records each launch's key, and runs it if ``run``."""

    def __init__(self, run=True):
        self.keys, self.run, self._real = [], run, tk._run

    def __call__(self, launch):
        self.keys.append(tc.launch_key(launch))
        if self.run:
            self._real(launch)

    def check(self, spec_keys, kernels=("_sru_fwd_kernel", "_sru_bwd_kernel")):
        assert {k[0] for k in self.keys} == set(kernels), "the expected kernels did not run"
        missing = [k for k in self.keys if k not in spec_keys]
        assert not missing, f"launches not in specializations(): {missing}"


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(tk, "_run", rec)
    with tuning().use(triton_block=None, triton_warps=None):  # production configurations
        yield rec


@interpreted
@pytest.mark.parametrize("case", ["fp32", "bf16_module", "fp16_module", "bf16_autocast",
                                  "fp16_autocast"])
def test_layer_launches_are_specializations(case, recorder, spec_keys):
    """The dtype combinations the layers produce (module dtype, autocast, a first layer
    with k = 4 and a second with k = 3 and x) are all in the list."""
    torch.manual_seed(0)
    module_dtype = {"bf16_module": torch.bfloat16, "fp16_module": torch.float16}.get(case)
    autocast = {"bf16_autocast": torch.bfloat16, "fp16_autocast": torch.float16}.get(case)
    sru = SRU(6, 4, num_layers=2, dropout=0.2, bidirectional=True, dtype=module_dtype)
    srupp = SRUpp(8, 8, 4, num_layers=2, dropout=0.1, dtype=module_dtype)
    x = torch.randn(3, 2, 6, dtype=module_dtype, requires_grad=True)          # (L, B, n_in)
    y = torch.randn(3, 2, 8, dtype=module_dtype, requires_grad=True)
    mask = torch.tensor([[False, False], [False, False], [False, True]])     # (L, B)
    with ops.use_backend("triton"), torch.autocast("cpu", dtype=autocast or torch.bfloat16,
                                                   enabled=autocast is not None):
        h, _ = sru(x, mask_pad=mask)
        out, _ = srupp(y, mask_pad=mask)
        loss = h.float().sum() + out.float().sum()
    loss.backward()
    with torch.no_grad(), ops.use_backend("triton"):  # inference: store_c=False
        sru.eval()(x)
    recorder.check(spec_keys)


@interpreted
def test_mixed_dtypes_are_read_as_listed(recorder, spec_keys):
    """Direct callers may mix dtypes the layers never do; the kernels read them as
    fp32 (one of the listed variants), and the results still match the reference."""
    g = torch.Generator().manual_seed(3)
    B, L, D = 2, 3, 6

    def r(*shape, dtype):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    U, x = r(B, L, 3, D, dtype=torch.bfloat16), r(B, L, D, dtype=torch.float16)
    wc, bias = r(2, D, dtype=torch.float16), r(2, D, dtype=torch.bfloat16)
    dm = (torch.rand(B, D, generator=g) > 0.3).to(torch.bfloat16) / 0.7
    kw = dict(scale_x=1.3, dropout_mask=dm, bidirectional=True)
    with ops.use_backend("triton"):
        h, c = sru_recurrence(U, x, wc, bias, **kw)
    h_r, c_r = sru_recurrence_reference(U, x, wc, bias, **kw)
    gh = torch.randn(h.shape, generator=g).to(h.dtype)
    grads = torch.autograd.grad((h.float() * gh.float()).sum() + c.sum(), (U, x, wc, bias))
    grads_r = torch.autograd.grad((h_r.float() * gh.float()).sum() + c_r.sum(), (U, x, wc, bias))
    half = dict(rtol=1.6e-2, atol=1e-5)  # 2 bf16 ulps, as in test_triton_kernel.py
    torch.testing.assert_close(h, h_r, **half)
    torch.testing.assert_close(c, c_r, rtol=1e-5, atol=1e-5)
    for a, b, t in zip(grads, grads_r, (U, x, wc, bias)):
        assert a.dtype == t.dtype
        torch.testing.assert_close(a, b, **half)
    recorder.check(spec_keys)


def test_both_launch_configurations_are_specializations(monkeypatch, spec_keys):
    """A large B * D takes the other launch configuration (recorded, not run: the
    interpreter would take minutes)."""
    rec = Recorder(run=False)
    monkeypatch.setattr(tk, "_run", rec)
    assert tuning().triton_block is None and tuning().triton_warps is None  # by size
    for B, D in ((2, 16), (64, 1024)):
        for dtype in (torch.float32, torch.bfloat16):
            U = torch.zeros(B, 2, 3, D, dtype=dtype)
            x = torch.zeros(B, 2, D, dtype=torch.float32)
            wc = bias = torch.zeros(2, D)
            _, _, c_all = tk.sru_fwd(U, x, wc, bias, None, None, None, 1.0, False, True)
            tk.sru_bwd(U, x, wc, bias, None, None, None, c_all, torch.zeros(B, 2, D, dtype=dtype),
                       None, 1.0, False, True)
    rec.check(spec_keys)
    assert {(dict(k[2])["BLOCK"], k[3]) for k in rec.keys} == {
        (block, warps) for _, block, warps in tk._LAUNCH_CONFIGS}


# the two dtypes of the pipelined loop's check: (U's dtype, BLOCK)
PIPELINED = {"fp32": (torch.float32, 64), "bf16": (torch.bfloat16, 128)}


def _pipelined_specs(dtype, block):
    """A forward without and with a pipelined time loop, and a pipelined backward."""
    common = dict(dtype=dtype, param_dtype=torch.float32, x_dtype=dtype, k=3, mask=False,
                  dropout=False, bidirectional=False, block=block, num_warps=2)
    specs = [tc.Specialization("fwd", store_c=True, stages=stages, **common)
             for stages in (None, 4)]
    return specs + [tc.Specialization("bwd", grad_x=True, stages=4, **common)]


def _sweep_pairs():
    """Every sweep configuration's heaviest forward and backward
    (sweep_specializations()), for sm_80 and sm_90: fp32 on one arch and bf16 on the
    other, alternating from one configuration to the next."""
    specs = tc.sweep_specializations()
    assert {s.config for s in specs} == set(tk.SWEEP_CONFIGS)
    index = {c: i for i, c in enumerate(tk.SWEEP_CONFIGS)}
    return [(s, 80 if (index[s.config] + (s.dtype == torch.bfloat16)) % 2 == 0 else 90)
            for s in specs]


@pytest.fixture(scope="module")
def compiled(cover, once_per_run):
    """{check: its results}: every compilation of this file's checks, in one
    compile_pairs call (one start of its two child processes), the sweep's heavy
    variants first; once per test run."""
    pairs = {"sweep": _sweep_pairs(),
             "cover": [(s, a) for s in cover for a in tc.ARCHS],
             **{f"pipelined {k}": [(s, 90) for s in _pipelined_specs(*v)]
                for k, v in PIPELINED.items()}}

    def compile_all():
        start = time.perf_counter()
        results = tc.compile_pairs([p for ps in pairs.values() for p in ps], workers=2,
                                   sass=False)
        print(f"compiled {len(results)} variants in {time.perf_counter() - start:.1f} s")
        it = iter(results)
        return {check: [next(it) for _ in ps] for check, ps in pairs.items()}

    return once_per_run("triton_compiled", compile_all)


def test_compiles_for_sm80_and_sm90_without_spills(specs, cover, compiled):
    # the subset holds every value of every field, for both kernels
    for kernel in ("fwd", "bwd"):
        assert values(cover, kernel) == values(specs, kernel)
    results = compiled["cover"]
    assert len(results) == len(cover) * len(tc.ARCHS)
    assert {(r["name"], r["arch"]) for r in results} == {
        (s.name, a) for s in cover for a in tc.ARCHS}
    errors = [f"{r['name']} sm_{r['arch']}: {r['error']}" for r in results if "error" in r]
    assert not errors, "\n".join(errors)
    for r in results:
        where = f"{r['name']} sm_{r['arch']}"
        assert r["ptx"] and r["cubin"], f"{where}: no PTX or cubin"
        assert r["n_spills"] == 0 and r["spill_bytes"] == 0, (
            f"{where} spills: {r['spill_bytes']} bytes of spill stores and loads, "
            f"{r['n_spills']} words of local memory, {r['n_regs']} registers")
        assert 0 < r["n_regs"] <= 255
    per_variant = statistics.median(r["compile_s"] for r in results)
    print(f"{len(results)} variants ({len(cover)} x sm_80, sm_90); median {per_variant:.2f} s "
          f"a variant; registers {min(r['n_regs'] for r in results)}-"
          f"{max(r['n_regs'] for r in results)}")


@pytest.mark.parametrize("dtype", list(PIPELINED))
def test_a_pipelined_time_loop_compiles_to_asynchronous_copies(dtype, compiled):
    """tuning().triton_stages (not yet the default): for sm_90 the pipelined loop's loads
    become asynchronous copies (cp.async) without spilling, and the plain loop's are
    not. bf16 takes two units a thread (block 128, 2 warps): an asynchronous copy
    moves 4 bytes or more."""
    specs = _pipelined_specs(*PIPELINED[dtype])
    results = compiled[f"pipelined {dtype}"]
    assert [(r["name"], r["arch"]) for r in results] == [(s.name, 90) for s in specs]
    errors = [f"{r['name']}: {r['error']}" for r in results if "error" in r]
    assert not errors, "\n".join(errors)
    by_name = {r["name"]: r for r in results}
    plain, fwd, bwd = (by_name[s.name] for s in specs)
    assert plain["async_copies"] == 0
    for r in (fwd, bwd):
        assert r["async_copies"] > 0, f"{r['name']}: no cp.async in the PTX"
        assert r["n_spills"] == 0 and r["spill_bytes"] == 0, r


def test_sweep_configs_are_listed():
    """SWEEP_CONFIGS, the launch configurations a GPU times: few enough for the GPU
    check's minute, the production defaults among them, and every kind of variant."""
    configs = tk.SWEEP_CONFIGS
    assert len(set(configs)) == len(configs) <= 14
    assert all(tk._config(c) == c for c in configs)
    assert {tk.LaunchConfig(block, warps) for _, block, warps in tk._LAUNCH_CONFIGS} <= set(configs)
    assert {(128, 4), (256, 8)} <= {(c.block, c.num_warps) for c in configs if c.steps is None}
    assert {4, 8} <= {c.stages for c in configs if c.steps is None}
    assert {4, 8, 12} <= {c.steps for c in configs}
    assert any(c.stages and c.steps for c in configs)
    default = Tuning()
    assert default.triton_stages is None and default.triton_steps is None  # not yet the default


def _no_spills(sweep_results):
    """Every sweep configuration compiles for sm_80 and sm_90, without spills."""
    errors = [f"{r['name']} sm_{r['arch']}: {r['error']}" for r in sweep_results if "error" in r]
    assert not errors, "\n".join(errors)
    seen = {(r["name"].split("BLOCK=")[1], r["kernel"], r["arch"]) for r in sweep_results}
    assert seen == {(c.name, k, a) for c in tk.SWEEP_CONFIGS for k in ("fwd", "bwd")
                    for a in tc.ARCHS}
    for r in sweep_results:
        where = f"{r['name']} sm_{r['arch']}"
        assert r["ptx"] and r["cubin"], f"{where}: no PTX or cubin"
        assert r["n_spills"] == 0 and r["spill_bytes"] == 0, (
            f"{where} spills: {r['spill_bytes']} bytes of spill stores and loads, "
            f"{r['n_spills']} words of local memory, {r['n_regs']} registers")
        assert 0 < r["n_regs"] <= 255


def test_sweep_configs_issue_their_loads_first_and_do_not_spill(compiled):
    sweep_results = compiled["sweep"]
    assert [(r["name"], r["arch"]) for r in sweep_results] == [
        (s.name, a) for s, a in _sweep_pairs()]
    _no_spills(sweep_results)
    _loads_first(sweep_results)


def _loads_first(sweep_results):
    """In the PTX, a block of K steps issues all its K steps' loads before the first
    ex2 (the first sigmoid) of its updates, where the plain loop issues one step's;
    the steps after the last whole block run the plain loop. (ptxas then moves many
    of them down among the first updates: benchmarks/triton_compile.py --sweep reports
    the SASS figures; they are not asserted.) The variants here load u0, u1, u2, x and the padding flag each step,
    and in the backward also c_{t-1} and grad_h."""
    for r in sweep_results:
        if "error" in r or r["stages"] is not None:  # (pipelined: asynchronous copies)
            continue
        per_step = 5 if r["kernel"] == "fwd" else 7
        loops = [(p["loads"], p["before_first_ex2"]) for p in r["ptx_loops"]]
        where = f"{r['name']} sm_{r['arch']}: {loops}"
        if r["steps"] is None:
            assert loops == [(per_step, per_step)], where
        else:
            block = r["steps"] * per_step
            assert loops == [(block, block), (per_step, per_step)], where
