"""Triton recurrence kernels against the reference oracle, through the production path.

Every test runs ``srupp.ops.sru_recurrence`` with ``use_backend("triton")``: the
dispatcher, the ``srupp::sru_fwd`` / ``srupp::sru_bwd`` custom ops and their
autograd, as users run them, and checks that the Triton kernels did the work.
Every test takes the ``device`` fixture; inputs are drawn on the CPU from seeded
generators and then moved, so both devices see the same values, and the
reference runs on the same device as the kernels.

* ``pytest`` (CPU): needs the Triton interpreter (tests/conftest.py sets
  TRITON_INTERPRET=1 before triton is imported), under which the dispatcher sends
  CPU tensors to Triton. The interpreter runs every program one after another in
  Python, so shapes are tiny (B <= 3, L <= 6) and small unit blocks are forced
  (``tuning().triton_block``) so that D is not a multiple of the block and,
  when bidirectional, blocks straddle the two directions.
* ``pytest --device cuda``: compiled kernels on real CUDA tensors (no
  interpreter; conftest refuses TRITON_INTERPRET=1 there), the same tiny cases,
  and in ``test_shapes`` also the sizes layers run at with the default launch
  configuration (:data:`CUDA_SHAPES`).

Tolerances:
* fp32 inputs: every output and gradient ``rtol=1e-5, atol=1e-6`` on CPU.  Both
  sides compute the same fp32 expressions; only the summation order of the
  weight_c/bias reductions and the sigmoid implementation differ.  On CUDA
  ``atol=1e-5`` (tests/tolerances.py's fp32 figure): compiled Triton computes
  fp32 exp as ``ex2.approx.f32`` of x*log2(e) (a few ulps, not numpy's
  correctly rounded exp), and contracts multiply-adds into FMAs.  With +-2.5 ulps
  of random error injected into the interpreter's exp and division, the worst
  fp32 comparison here reached 0.9 of the CPU tolerance and 0.23 of the CUDA one.
* bf16 / fp16 inputs: both sides read the very same rounded inputs and compute
  in fp32, so the only extra difference is the final rounding of h, grad_U and
  grad_x (and grad_weight_c/grad_bias when those are half) to the half format:
  a few-1e-7 fp32 difference can flip one rounding, i.e. 1 ulp.  1 ulp is at
  most 2^-7 = 7.8e-3 relative for bf16 (8-bit significand) and 2^-10 = 9.8e-4
  for fp16 (11-bit), so we allow 2 ulps: ``rtol=1.6e-2`` (bf16) /
  ``rtol=2e-3`` (fp16), with ``atol=1e-5`` for values that cancel to ~0 in
  fp32.  c_last and grad_c0 stay fp32 and are compared at ``rtol=1e-5,
  atol=1e-5`` (they pass through more steps of fp32 arithmetic on O(1) values).
* The CUDA-only long shapes (:data:`CUDA_SHAPES`, L = 64 steps, sums of up to 256
  terms): fp32 rounding alone, measured as the fp32 reference's distance from
  the float64 reference on the same inputs, reaches ~4e-6 of a tensor's largest
  entry there (grad_U, grad_bias), more than the tolerances above allow. These
  shapes are instead checked against the float64 reference: the kernels' error
  must stay within 4x the fp32 reference's own error plus ``1e-5`` of the
  tensor's largest entry (tests/tolerances.py's fp32 figure). The kernels' error
  is ~1-3x the reference's under the interpreter (L = 24, D = 40), and the
  compiled kernels' exp and division are PTX approximations, a few ulps; a wrong
  index or formula is an O(1e-2) error or more.
"""

import itertools
import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton not installed (pip install srupp[test])")

import srupp.ops as ops  # noqa: E402
from srupp.ops import sru_recurrence  # noqa: E402
from srupp.ops import triton_kernel as tk  # noqa: E402
from srupp.ops.reference import sru_recurrence_reference  # noqa: E402
from srupp.ops.settings import tuning  # noqa: E402
from tolerances import tol  # noqa: E402

FP32_TOL = dict(rtol=1e-5, atol=1e-6)
CUDA_FP32_TOL = tol(torch.float32)  # rtol=1e-5, atol=1e-5; see the module docstring
HALF_TOL = {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=1e-5)}
FP32_STATE_TOL = dict(rtol=1e-5, atol=1e-5)

calls = {"sru_fwd": 0, "sru_bwd": 0}


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch, device):
    """The triton backend; every output buffer starts as NaN, so an unwritten element
    fails the test; the kernels' calls are counted; the launch settings are the defaults,
    and whatever a test sets is restored after it. On CPU it needs the interpreter;
    on CUDA (``device`` skips without a GPU) the compiled kernels run."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("on CPU the Triton tests run under TRITON_INTERPRET=1 (tests/conftest.py "
                    "sets it unless the environment says otherwise)")
    monkeypatch.setenv("SRUPP_DEBUG_NAN_FILL", "1")
    for name in calls:
        calls[name] = 0

        def counted(*args, _real=getattr(tk, name), _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(tk, name, counted)
    with ops.use_backend("triton"), tuning().use(triton_block=None, triton_warps=None,
                                                 triton_stages=None, triton_steps=None):
        yield


def make_inputs(B, L, D, k=3, skip=True, pad=False, dropout=False, dtype=torch.float32,
                param_dtype=torch.float32, seed=0, time_major=False, device="cpu"):
    """Inputs on ``device``, drawn on the CPU (the same values on every device)."""
    g = torch.Generator().manual_seed(seed)

    def r(*s, dt=dtype):
        return torch.randn(*s, generator=g).to(device=device, dtype=dt)

    if time_major:  # U and x as transposed views of (L, B, ...) buffers
        U = r(L, B, k, D).transpose(0, 1)
        x = r(L, B, D).transpose(0, 1) if (skip and k == 3) else None
    else:
        U = r(B, L, k, D)
        x = r(B, L, D) if (skip and k == 3) else None
    wc = r(2, D, dt=param_dtype)
    bias = r(2, D, dt=param_dtype)
    c0 = r(B, D, dt=torch.float32)
    mask = None
    if pad:
        mask = torch.zeros(B, L, dtype=torch.bool)
        mask[0, -1] = True                  # right padding
        if B > 1:
            mask[1, 0] = True               # left padding
        if B > 2:
            mask[2, :] = True               # a fully padded row
        mask = mask.to(device)
    dm = None
    if dropout:
        dm = ((torch.rand(B, D, generator=g) > 0.3).float() / 0.7).to(device=device, dtype=dtype)
    leaves = [t.requires_grad_() for t in (U, x, wc, bias, c0) if t is not None]
    assert leaves
    return U, x, wc, bias, c0, mask, dm


def run_both(U, x, wc, bias, c0, mask, dm, *, block_size=4, **kw):
    """Forward + backward on both implementations with the same upstream grads, the
    kernels in blocks of ``block_size`` units (None: as the settings are)."""
    if block_size is None:
        return _run_both(U, x, wc, bias, c0, mask, dm, **kw)
    with tuning().use(triton_block=block_size):
        return _run_both(U, x, wc, bias, c0, mask, dm, **kw)


def _run_both(U, x, wc, bias, c0, mask, dm, *, scale_x=1.3, bidir=False, loss="random", seed=1):
    kw = dict(scale_x=scale_x, mask_pad=mask, dropout_mask=dm, bidirectional=bidir)
    h_t, c_t = sru_recurrence(U, x, wc, bias, c0, **kw)
    h_r, c_r = sru_recurrence_reference(U, x, wc, bias, c0, **kw)
    g = torch.Generator().manual_seed(seed)
    gh = torch.randn(h_r.shape, generator=g).to(device=h_r.device, dtype=h_r.dtype)
    gc = torch.randn(c_r.shape, generator=g).to(c_r.device)
    inputs = [t for t in (U, x, wc, bias, c0) if t is not None and t.requires_grad]

    def grads(h, c):
        if loss == "random":
            total = (h.float() * gh.float()).sum() + (c * gc).sum()
        elif loss == "h_sum":          # grad_h is an expanded (stride-0) tensor
            total = h.sum()
        elif loss == "h_only":
            total = (h.float() * gh.float()).sum()
        elif loss == "c_only":
            total = (c * gc).sum()
        else:
            raise ValueError(loss)
        # With loss="c_only" x does not reach the reference's graph: None = zeros.
        gs = torch.autograd.grad(total, inputs, allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, gs)]

    return (h_t, c_t, grads(h_t, c_t)), (h_r, c_r, grads(h_r, c_r)), inputs


def fp32_tol(device):
    """The fp32 tolerance on ``device`` (module docstring)."""
    return FP32_TOL if torch.device(device).type == "cpu" else CUDA_FP32_TOL


def check(tri, ref, inputs, dtype=torch.float32):
    (h_t, c_t, g_t), (h_r, c_r, g_r) = tri, ref
    assert calls["sru_fwd"] and calls["sru_bwd"], "the Triton kernels did not run"
    fp32 = fp32_tol(h_t.device)
    out_tol = fp32 if dtype == torch.float32 else HALF_TOL[dtype]
    state_tol = fp32 if dtype == torch.float32 else FP32_STATE_TOL
    assert h_t.dtype == h_r.dtype and c_t.dtype == torch.float32 == c_r.dtype
    torch.testing.assert_close(h_t, h_r, **out_tol)
    torch.testing.assert_close(c_t, c_r, **state_tol)
    for inp, a, b in zip(inputs, g_t, g_r):
        assert a.dtype == inp.dtype and a.shape == inp.shape
        tol = state_tol if inp.dtype == torch.float32 else out_tol
        torch.testing.assert_close(a, b, **tol)


def reference_fp64(inputs, mask, dm, *, scale_x=1.3, bidir=False, seed=1):
    """The reference in float64 on float64 copies of ``(U, x, wc, bias, c0)``, with
    run_both's upstream gradients (drawn from the same seed): the exact values the
    fp32 results are measured against."""
    leaves = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    h, c = sru_recurrence_reference(*leaves, scale_x=scale_x, mask_pad=mask,
                                    dropout_mask=None if dm is None else dm.double(),
                                    bidirectional=bidir)
    g = torch.Generator().manual_seed(seed)
    gh = torch.randn(h.shape, generator=g).to(h.device).double()
    gc = torch.randn(c.shape, generator=g).to(c.device).double()
    present = [t for t in leaves if t is not None]
    return h, c, list(torch.autograd.grad((h * gh).sum() + (c * gc).sum(), present))


def check_against_fp64(tri, ref, exact, inputs):
    """Long fp32 runs (module docstring): the kernels' largest error against the
    float64 reference is at most 4x the fp32 reference's, plus 1e-5 of the largest entry."""
    assert calls["sru_fwd"] and calls["sru_bwd"], "the Triton kernels did not run"
    names = ["h", "c_last"] + [f"grad {i}" for i in range(len(inputs))]
    for inp, a in zip(inputs, tri[2]):
        assert a.dtype == inp.dtype and a.shape == inp.shape
    got = [tri[0], tri[1], *tri[2]]
    fp32 = [ref[0], ref[1], *ref[2]]
    for name, a, b, e in zip(names, got, fp32, [exact[0], exact[1], *exact[2]]):
        scale = e.abs().max().item()
        err_kernel = (a.double() - e).abs().max().item()  # NaN (an unwritten element) fails
        err_ref = (b.double() - e).abs().max().item()
        assert err_kernel <= 4 * err_ref + 1e-5 * scale, (
            f"{name}: Triton is {err_kernel:.3g} from float64, the fp32 reference "
            f"{err_ref:.3g} (largest entry {scale:.3g})")


# k = 4 exists only with a skip term.
KSKIP = [(3, True), (3, False), (4, True)]
OPTIONS = list(itertools.product(KSKIP, [False, True], [False, True], [False, True]))


@pytest.mark.parametrize("kskip,bidir,pad,dropout", OPTIONS,
                         ids=[f"k{o[0][0]}{'' if o[0][1] else '-noskip'}"
                              f"{'-bidir' if o[1] else ''}{'-pad' if o[2] else ''}"
                              f"{'-drop' if o[3] else ''}" for o in OPTIONS])
def test_matches_reference_fp32(kskip, bidir, pad, dropout, device):
    k, skip = kskip
    # B = 3 with padding gives right-, left- and fully-padded rows.  D = 6 with
    # block 4: the last block is partial, and with bidir (d = 3) block 0 holds
    # both directions.
    B = 3 if pad else 2
    U, x, wc, bias, c0, mask, dm = make_inputs(B, 4, 6, k, skip, pad, dropout, device=device)
    tri, ref, inputs = run_both(U, x, wc, bias, c0, mask, dm, bidir=bidir)
    check(tri, ref, inputs)


SHAPES = [
    (1, 1, 5, 4, False),      # L = 1, B = 1
    (2, 1, 6, 4, True),       # L = 1 bidirectional: c_last = [c_fwd(0), c_bwd(0)]
    (1, 5, 5, 4, False),      # D = 5, two blocks, last one partial
    (2, 3, 37, 32, False),    # D = 37 with block 32
    (1, 3, 38, 16, True),     # bidir d = 19: block 1 straddles the halves
    (2, 6, 7, 8, False),      # single partial block, L = 6
    (2, 2, 37, None, False),  # default block size
]
# With --device cuda only (too slow for the interpreter): sizes layers run at, with the
# default launch configuration (triton_block None), checked against float64
# (check_against_fp64). B * D < 2^16: 32 units and 1 warp a program; B * D >= 2^16:
# 64 units and 2 warps.
CUDA_SHAPES = [
    (4, 64, 256, None, False),
    (4, 64, 256, None, True),      # d = 128: the halves split at a block boundary
    (4, 16, 16384, None, False),   # B * D = 2^16
]


def pytest_generate_tests(metafunc):
    """test_shapes: SHAPES, and with --device cuda also CUDA_SHAPES (plain pytest
    collects exactly SHAPES, as before)."""
    if metafunc.definition.name == "test_shapes":
        on_cuda = metafunc.config.getoption("device") == "cuda"
        metafunc.parametrize("B,L,D,block,bidir", SHAPES + (CUDA_SHAPES if on_cuda else []))


def test_shapes(B, L, D, block, bidir, device):
    U, x, wc, bias, c0, mask, dm = make_inputs(B, L, D, 3, True, pad=L > 1, dropout=True,
                                               seed=B + L + D, device=device)
    tri, ref, inputs = run_both(U, x, wc, bias, c0, mask, dm, bidir=bidir, block_size=block)
    if (B, L, D, block, bidir) in CUDA_SHAPES:
        exact = reference_fp64((U, x, wc, bias, c0), mask, dm, bidir=bidir)
        check_against_fp64(tri, ref, exact, inputs)
    else:
        check(tri, ref, inputs)


@pytest.mark.parametrize("stages,steps", [(2, None), (4, None), (None, 3), (2, 3)],
                         ids=["2s", "4s", "k3", "2s-k3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bidir,pad,k", [(False, False, 3), (True, True, 3), (False, True, 4)])
def test_pipelined_time_loop(stages, steps, dtype, bidir, pad, k, device):
    """tuning()'s triton_stages and triton_steps, through the dispatcher: the loads of later
    steps in flight while a step computes give the same results; L = 7 is not a
    multiple of the stages (the loop's prologue and epilogue) nor of the blocks (two
    blocks of 3 steps, then one step of the plain loop); a row's 6 units in one program
    (block 8: the interpreter runs half the programs of block 4). With --device cuda
    also a long fp32 run against float64, where the compiled pipeline really runs ahead."""
    tuning().triton_stages, tuning().triton_steps = stages, steps
    U, x, wc, bias, c0, mask, dm = make_inputs(3, 7, 6, k, True, pad=pad, dropout=True,
                                               dtype=dtype, seed=stages or 1, device=device)
    tri, ref, inputs = run_both(U, x, wc, bias, c0, mask, dm, bidir=bidir, block_size=8)
    check(tri, ref, inputs, dtype=dtype)
    if device.type == "cuda" and dtype == torch.float32:
        U, x, wc, bias, c0, mask, dm = make_inputs(4, 67, 300, k, True, pad=pad, dropout=True,
                                                   seed=stages or 1, device=device)
        tri, ref, inputs = run_both(U, x, wc, bias, c0, mask, dm, bidir=bidir, block_size=None)
        check_against_fp64(tri, ref, reference_fp64((U, x, wc, bias, c0), mask, dm,
                                                    bidir=bidir), inputs)


def low_level(config, U, x, wc, bias, c0, mask, dm, gh, gcl, bidir):
    """The forward (keeping c_all) and the backward in one launch configuration, on
    detached inputs: every output of both."""
    U, x, wc, bias, c0 = (None if t is None else t.detach() for t in (U, x, wc, bias, c0))
    args = (U, x, wc, bias, c0, mask, dm, 1.3, bidir)
    h, c_last, c_all = tk.sru_fwd(*args, True, config=config)
    grads = tk.sru_bwd(*args[:7], c_all, gh, gcl, 1.3, bidir, x is not None, config=config)
    return (h, c_last, c_all, *grads)


# (k, skip term, bidirectional, padding, dropout): together every feature of the kernels
CONFIG_CASES = {"k3-bidir-pad-drop": (3, True, True, True, True),
                "k4-pad": (4, True, False, True, False),
                "k3-noskip-bidir-drop": (3, False, True, False, True)}
# Each configuration in fp32 and bf16, each with another case (the interpreter takes a
# second a case); on CUDA only the first (each configuration compiles its own kernels).
SWEEP_CASES = [(config, dtype, list(CONFIG_CASES)[(i + n) % len(CONFIG_CASES)])
               for i, config in enumerate(tk.SWEEP_CONFIGS)
               for n, dtype in enumerate((torch.float32, torch.bfloat16))]


def sweep_length(config):
    """The L a configuration's test runs (the interpreter's time grows with it): a whole
    block of K steps and 3 more of the plain loop (two blocks of 4: K = 4 also carries
    from block to block), the pipelined loop's prologue, its steady state and an
    epilogue shorter than its stages, 5 steps for a plain loop."""
    if config.steps is not None:
        return (2 if config.steps < 8 else 1) * config.steps + 3
    return (config.stages or 2) + 3


@pytest.mark.parametrize("config,dtype,case", SWEEP_CASES,
                         ids=[f"{c.name}-{'fp32' if d == torch.float32 else 'bf16'}-{case}"
                              for c, d, case in SWEEP_CASES])
def test_sweep_configs(config, dtype, case, device, monkeypatch):
    """Every launch configuration of the GPU sweep (SWEEP_CONFIGS): through the
    dispatcher, the custom ops and autograd it matches the reference on every output
    and gradient, and at the low level it equals the plain loop to the last bit, every
    output (h, c_last, c_all, and all gradients), fp32 and bf16: every variant runs
    the same update code, the same operations in the same order, and only moves the
    loads. L (sweep_length) is not a multiple of the blocks or stages; D = 6 puts both
    directions in one program, in the plain loop too (block 8)."""
    if device.type == "cuda" and dtype != torch.float32:
        pytest.skip("on CUDA one case a configuration (each compiles its own kernels)")
    k, skip, bidir, pad, dropout = CONFIG_CASES[case]
    B, L, D = 3 if pad else 2, sweep_length(config), 6
    monkeypatch.setattr(tk, "_launch_config", lambda B, D: config)
    U, x, wc, bias, c0, mask, dm = make_inputs(B, L, D, k, skip, pad=pad, dropout=dropout,
                                               dtype=dtype, seed=L + k, device=device)
    tri, ref, inputs = run_both(U, x, wc, bias, c0, mask, dm, bidir=bidir)
    check(tri, ref, inputs, dtype=dtype)

    g = torch.Generator().manual_seed(2)
    gh = torch.randn(B, L, D, generator=g).to(device=device, dtype=dtype)
    gcl = torch.randn(B, D, generator=g).to(device)
    plain = low_level(tk.LaunchConfig(8, 1), U, x, wc, bias, c0, mask, dm, gh, gcl, bidir)
    got = low_level(config, U, x, wc, bias, c0, mask, dm, gh, gcl, bidir)
    names = ["h", "c_last", "c_all", "grad_U", "grad_x", "grad_weight_c", "grad_bias", "grad_c0"]
    for name, a, b in zip(names, got, plain):
        assert torch.equal(a, b), f"{name} differs from the plain loop's"


def test_config_argument(device):
    """config= takes a LaunchConfig or a plain tuple, and says what is wrong with a bad one."""
    U, x, wc, bias, c0, mask, dm = make_inputs(1, 2, 4, 3, True, device=device)
    U, x, wc, bias, c0 = (t.detach() for t in (U, x, wc, bias, c0))
    args = (U, x, wc, bias, c0, None, None, 1.0, False, False)
    h, _, _ = tk.sru_fwd(*args, config=tk.LaunchConfig(32, 1, None, 2))
    assert torch.equal(h, tk.sru_fwd(*args, config=(32, 1))[0])
    assert torch.equal(h, tk.sru_fwd(*args, config=(32, 1, None, 2))[0])
    for bad, error, words in [((48, 2), ValueError, "block must be a power of two"),
                              ((32, 3), ValueError, "num_warps must be a power of two"),
                              ((32, 1, 0), ValueError, "stages must be None"),
                              ((32, 1, None, 2.5), ValueError, "steps must be None"),
                              ((32,), TypeError, "LaunchConfig"), ("32/1w", TypeError, "tuple")]:
        with pytest.raises(error, match=words):
            tk.sru_fwd(*args, config=bad)
    assert tk.LaunchConfig(128, 4, 2, 8).name == "128/4w/2s/k8"
    assert tk.LaunchConfig(64, 2).name == "64/2w"


@pytest.mark.parametrize("scale_x", [1.0, 0.37, 2.5])
def test_scale_x(scale_x, device):
    U, x, wc, bias, c0, mask, dm = make_inputs(2, 3, 6, 3, True, device=device)
    tri, ref, inputs = run_both(U, x, wc, bias, c0, mask, dm, scale_x=scale_x)
    check(tri, ref, inputs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("k,bidir,param_half", [(3, False, False), (4, True, False), (3, True, True)])
def test_half_precision(dtype, k, bidir, param_half, device):
    # bf16 and fp16 on both devices: the interpreter computes fp16 too
    U, x, wc, bias, c0, mask, dm = make_inputs(
        3, 4, 6, k, True, pad=True, dropout=True, dtype=dtype,
        param_dtype=dtype if param_half else torch.float32, seed=7, device=device)
    tri, ref, inputs = run_both(U, x, wc, bias, c0, mask, dm, bidir=bidir)
    check(tri, ref, inputs, dtype=dtype)


@pytest.mark.parametrize("k,skip", KSKIP)
def test_strided_inputs(k, skip, device):
    """Time-major U / x views, transposed mask_pad and dropout_mask views."""
    B, L, D = 2, 4, 6
    U, x, wc, bias, c0, _, _ = make_inputs(B, L, D, k, skip, time_major=True, seed=3,
                                           device=device)
    assert not U.is_contiguous() and (x is None or not x.is_contiguous())
    mask = torch.zeros(L, B, dtype=torch.bool)
    mask[-1, 0] = True
    mask = mask.to(device).t()
    dm = ((torch.rand(D, B) > 0.4).float() / 0.6).to(device).t()
    assert not mask.is_contiguous() and not dm.is_contiguous()
    tri, ref, inputs = run_both(U, x, wc, bias, c0, mask, dm, bidir=True)
    check(tri, ref, inputs)


@pytest.mark.parametrize("loss", ["h_sum", "h_only", "c_only"])
def test_partial_upstream_grads(loss, device):
    U, x, wc, bias, c0, mask, dm = make_inputs(2, 3, 6, 3, True, pad=True, device=device)
    tri, ref, inputs = run_both(U, x, wc, bias, c0, mask, dm, bidir=True, loss=loss)
    check(tri, ref, inputs)


def test_c0_none_and_frozen_inputs(device):
    g = torch.Generator().manual_seed(5)
    U = torch.randn(2, 3, 4, 6, generator=g).to(device).requires_grad_()
    wc = torch.randn(2, 6, generator=g).to(device)          # no grad wanted
    bias = torch.randn(2, 6, generator=g).to(device).requires_grad_()
    kw = dict(dropout_mask=None, bidirectional=False)
    tuning().triton_block = 4
    h_t, c_t = sru_recurrence(U, None, wc, bias, **kw)
    h_r, c_r = sru_recurrence_reference(U, None, wc, bias, **kw)
    torch.testing.assert_close(h_t, h_r, **fp32_tol(device))
    torch.testing.assert_close(c_t, c_r, **fp32_tol(device))
    g_t = torch.autograd.grad(h_t.sum() + c_t.sum(), (U, bias))
    g_r = torch.autograd.grad(h_r.sum() + c_r.sum(), (U, bias))
    for a, b in zip(g_t, g_r):
        torch.testing.assert_close(a, b, **fp32_tol(device))
    assert calls == {"sru_fwd": 1, "sru_bwd": 1}


def test_no_grad_forward_and_integer_mask(device):
    U, x, wc, bias, c0, mask, dm = make_inputs(2, 3, 6, 3, True, pad=True, device=device)
    tuning().triton_block = 4
    with torch.no_grad():
        h_t, c_t = sru_recurrence(U, x, wc, bias, c0, mask_pad=mask.to(torch.uint8))
        h_r, c_r = sru_recurrence_reference(U, x, wc, bias, c0, mask_pad=mask)
    torch.testing.assert_close(h_t, h_r, **fp32_tol(device))
    torch.testing.assert_close(c_t, c_r, **fp32_tol(device))
    assert calls == {"sru_fwd": 1, "sru_bwd": 0}


def test_low_level_api(device):
    """The kernels in the custom ops' argument order: c_all is the per-step state;
    results are bitwise deterministic; grad_x is an empty tensor (never None) when
    not wanted; outputs never alias one another."""
    B, L, D = 3, 4, 6
    tuning().triton_block = 4
    U, x, wc, bias, c0, mask, dm = make_inputs(B, L, D, 3, True, pad=True, dropout=True,
                                               device=device)
    U, x, wc, bias, c0 = (t.detach() for t in (U, x, wc, bias, c0))
    args = (U, x, wc, bias, c0, mask, dm, 1.3, True)
    h, c_last, c_all = tk.sru_fwd(*args, True)
    h2, c_last2, empty = tk.sru_fwd(*args, False)
    assert empty.numel() == 0
    assert torch.equal(h, h2) and torch.equal(c_last, c_last2)
    assert c_all.shape == (B, L, D) and c_all.dtype == torch.float32
    assert not c_all.isnan().any()
    d = D // 2
    torch.testing.assert_close(c_last[:, :d], c_all[:, -1, :d], rtol=0, atol=0)
    torch.testing.assert_close(c_last[:, d:], c_all[:, 0, d:], rtol=0, atol=0)
    # padded steps hold the state: forward half of row 0 at t = L-1
    torch.testing.assert_close(c_all[0, -1, :d], c_all[0, -2, :d], rtol=0, atol=0)
    # fully padded row: state stays c0
    torch.testing.assert_close(c_all[2], c0[2].expand(L, D), rtol=0, atol=0)

    gh = torch.randn(B, L, D).to(device)
    gcl = torch.randn(B, D).to(device)
    bwd_args = (U, x, wc, bias, c0, mask, dm, c_all, gh, gcl, 1.3, True)
    out1 = tk.sru_bwd(*bwd_args, True)
    out2 = tk.sru_bwd(*bwd_args, True)
    gU, gx, gwc, gb, gc0 = out1
    assert gU.shape == U.shape and gx.shape == x.shape
    assert gwc.shape == (2, D) and gb.shape == (2, D) and gc0.shape == (B, D)
    assert gc0.dtype == torch.float32
    for a, b in zip(out1, out2):
        assert not a.isnan().any()
        assert torch.equal(a, b)
    # no gradient at padded steps; the fully padded row passes grad_c_last to c0
    assert (gU[2] == 0).all() and (gx[2] == 0).all()
    torch.testing.assert_close(gc0[2], gcl[2], rtol=0, atol=0)
    for U_, x_ in ((U, x), (U, None), (torch.cat([U, U[:, :, :1]], 2), None)):  # k = 3, 3, 4
        out = tk.sru_bwd(U_, x_, *bwd_args[2:], False)
        assert out[1].numel() == 0 and out[1].dtype == (x_ if x_ is not None else U_).dtype
        if x_ is x:
            assert all(torch.equal(out[i], out1[i]) for i in (0, 2, 3, 4))
        ptrs = [t.untyped_storage().data_ptr() for t in out if t.numel()]
        assert len(set(ptrs)) == len(ptrs)


def test_use_launch_config_launches_every_call_with_it(device, monkeypatch):
    """use_launch_config: every launch inside, through the dispatcher, takes the forced
    configuration whatever the shape; the previous choice returns on exit."""
    forced = tk.LaunchConfig(128, 4, steps=3)
    seen = []
    run = tk._run
    monkeypatch.setattr(tk, "_run", lambda launch: (seen.append(launch), run(launch))[1])
    U, x, wc, bias, c0, mask, dm = make_inputs(2, 7, 6, 3, True, device=device)
    plain = run_both(U, x, wc, bias, c0, mask, dm)[0]
    default = [(la.constexprs["BLOCK"], la.num_warps, la.constexprs.get("STEPS")) for la in seen]
    seen.clear()
    with tk.use_launch_config(forced):
        assert tk._launch_config(2, 6) == forced
        inside = run_both(U, x, wc, bias, c0, mask, dm, block_size=None)[0]
    assert tk._launch_config(2, 6) != forced
    assert {(la.constexprs["BLOCK"], la.num_warps, la.constexprs.get("STEPS")) for la in seen} \
        == {(128, 4, 3)} != set(default)
    for a, b in zip(plain, inside):  # the same arithmetic in the same order
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="power of two"):
        with tk.use_launch_config((96, 4)):
            pass
