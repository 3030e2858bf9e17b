"""The fused C++ CPU kernel against the reference recurrence (the oracle).

Every test runs with SRUPP_DEBUG_NAN_FILL=1, so the kernel fills its output
buffers with NaN before writing them: an element it forgets to write shows up as
a mismatch.
"""

from __future__ import annotations

import itertools
import os
import shutil
import warnings

import pytest
import torch
from torch.utils import cpp_extension

import srupp.ops as ops
from srupp.ops import cpu_kernels, recurrence, settings, sru_recurrence, sru_recurrence_reference

# Not collected with --device cuda: the C++ kernel runs CPU tensors only.
pytestmark = pytest.mark.cpu_only

FP32 = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True)
def _nan_fill(monkeypatch):
    monkeypatch.setenv("SRUPP_DEBUG_NAN_FILL", "1")


@pytest.fixture
def kernel():
    if not cpu_kernels.is_available():
        pytest.skip(f"CPU kernel unavailable: {cpu_kernels.build_error()}")
    with ops.use_backend("cpu"):
        yield


def make_inputs(B, L, D, *, k=3, skip=True, bidirectional=False, mask=None, dropout=False,
                dtype=torch.float32, x_dtype=None, param_dtype=torch.float32, c0=True,
                seed=0):
    """Inputs laid out as the layers produce them: U a view of a (B, L, k*D) linear
    output, x a transposed view of a time-major (L, B, D) tensor."""
    g = torch.Generator().manual_seed(seed)
    U = torch.randn(B, L, k * D, generator=g).to(dtype).view(B, L, k, D)
    x = None
    if skip and k == 3:
        x = torch.randn(L, B, D, generator=g).to(x_dtype or dtype).transpose(0, 1)
    wc = (torch.rand(2, D, generator=g) * 2 - 1).to(param_dtype)
    bias = torch.randn(2, D, generator=g).to(param_dtype)
    c0_ = torch.randn(B, D, generator=g) if c0 else None
    mask_pad = None
    if mask == "mixed":
        mask_pad = torch.zeros(B, L, dtype=torch.bool)
        pattern = [(0, 2), (1, 1), (None, None), (2, 0)]  # (pad at start, pad at end)
        for b in range(B):
            lo, hi = pattern[b % len(pattern)]
            if lo is None:
                mask_pad[b] = True  # a fully padded sequence
            else:
                mask_pad[b, :lo] = True
                if hi:
                    mask_pad[b, L - hi:] = True
    dm = None
    if dropout:
        dm = (torch.rand(B, D, generator=g) > 0.3).float() / 0.7
    return U, x, wc, bias, c0_, mask_pad, dm


def run(fn, U, x, wc, bias, c0, mask_pad, dm, *, scale_x=1.0, bidirectional=False, seed=1):
    """Outputs and the gradients of a random linear function of (h, c_last)."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None
              for t in (U, x, wc, bias, c0)]
    h, c = fn(*leaves, scale_x=scale_x, mask_pad=mask_pad, dropout_mask=dm,
              bidirectional=bidirectional)
    g = torch.Generator().manual_seed(seed)
    gh = torch.randn(h.shape, generator=g).to(h.dtype)
    gc = torch.randn(c.shape, generator=g).to(c.dtype)
    loss = (h.float() * gh.float()).sum() + (c * gc).sum()
    present = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(loss, present))
    return h, c, [next(grads) if t is not None else None for t in leaves]


def compare(got, want, h_tol=FP32, c_tol=FP32, grad_tol=FP32, names=("U", "x", "weight_c", "bias", "c0")):
    (h1, c1, g1), (h2, c2, g2) = got, want
    assert h1.dtype == h2.dtype and h1.shape == h2.shape
    assert c1.dtype == c2.dtype == torch.float32
    torch.testing.assert_close(h1, h2, **h_tol, msg=lambda m: f"h: {m}")
    torch.testing.assert_close(c1, c2, **c_tol, msg=lambda m: f"c_last: {m}")
    for name, a, b in zip(names, g1, g2):
        assert (a is None) == (b is None), name
        if a is None:
            continue
        tol = grad_tol[name] if name in grad_tol else grad_tol
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, **tol, msg=lambda m, n=name: f"grad {n}: {m}")


# ----------------------------------------------------------------- fp32, every option

SKIPS = ["x", "none", "u3"]  # k=3 with x, k=3 without skip term, k=4


@pytest.mark.parametrize("skip,bidirectional,mask,dropout", list(itertools.product(
    SKIPS, [False, True], [None, "mixed"], [False, True])))
def test_fp32_all_options(kernel, skip, bidirectional, mask, dropout):
    k = 4 if skip == "u3" else 3
    D = 38 if bidirectional else 35  # not multiples of the vector width (d = 19 per direction)
    inputs = make_inputs(4, 7, D, k=k, skip=skip != "none", mask=mask, dropout=dropout)
    scale_x = 1.7 if skip == "x" else 1.0
    got = run(sru_recurrence, *inputs, scale_x=scale_x, bidirectional=bidirectional)
    want = run(sru_recurrence_reference, *inputs, scale_x=scale_x, bidirectional=bidirectional)
    compare(got, want)


@pytest.mark.parametrize("B,L,D,bidirectional", [
    (1, 1, 5, False), (1, 1, 10, True), (1, 9, 19, False), (3, 1, 35, False),
    (2, 6, 16, False), (2, 5, 66, True), (1, 4, 1100, False), (5, 3, 2, True),
])
def test_fp32_shapes(kernel, B, L, D, bidirectional):
    for k in (3, 4):
        inputs = make_inputs(B, L, D, k=k, mask="mixed" if B >= 3 else None, dropout=True)
        got = run(sru_recurrence, *inputs, scale_x=1.3, bidirectional=bidirectional)
        want = run(sru_recurrence_reference, *inputs, scale_x=1.3, bidirectional=bidirectional)
        compare(got, want)


@pytest.mark.parametrize("used", ["h", "c"])
def test_loss_of_one_output_only(kernel, used):
    """Autograd passes None (not zeros) for the unused output; gradients still match."""
    inputs = make_inputs(3, 6, 21, mask="mixed", dropout=True)

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in inputs[:5]]
        h, c = fn(*leaves, scale_x=1.2, mask_pad=inputs[5], dropout_mask=inputs[6])
        loss = (h * torch.linspace(-1, 1, h.shape[-1])).sum() if used == "h" else (c * c).sum()
        # x does not reach c: the reference leaves its gradient out, the kernel gives zeros
        gs = torch.autograd.grad(loss, leaves, allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for g, t in zip(gs, leaves)]

    for a, b in zip(grads(sru_recurrence), grads(sru_recurrence_reference)):
        torch.testing.assert_close(a, b, **FP32)


def test_fp32_no_c0_and_frozen_params(kernel):
    U, x, wc, bias, _, mask, dm = make_inputs(3, 5, 21, mask="mixed", c0=False)
    Ul, xl = U.clone().requires_grad_(), x.clone().requires_grad_()
    outs = []
    for fn in (sru_recurrence, sru_recurrence_reference):
        h, c = fn(Ul, xl, wc, bias, None, mask_pad=mask)
        outs.append((h, c) + torch.autograd.grad((h * h).sum() + c.sum(), [Ul, xl]))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, **FP32)


def test_fp32_strided_inputs(kernel):
    """U with padded rows (last-dim stride 1, others not), U with a non-unit last-dim
    stride (copied), x and grad_h with arbitrary batch/time strides."""
    B, L, D = 3, 6, 24
    base = torch.randn(L, B, 5 * D)
    U1 = base.transpose(0, 1)[..., : 3 * D].unflatten(-1, (3, D))  # strides (5D, 5BD, D, 1)
    U2 = torch.randn(B, L, D, 3).transpose(-1, -2)                 # last-dim stride 3
    x = torch.randn(B, 2 * L, D)[:, ::2]
    wc, bias, c0 = torch.rand(2, D) - 0.5, torch.randn(2, D), torch.randn(B, D)
    for U in (U1, U2):
        inputs = (U, x, wc, bias, c0, None, None)
        compare(run(sru_recurrence, *inputs, scale_x=0.5), run(sru_recurrence_reference, *inputs, scale_x=0.5))


def test_grad_layout_follows_input(kernel):
    """grad_x of a transposed time-major x comes back time-major (no extra copy)."""
    U, x, wc, bias, c0, _, _ = make_inputs(3, 5, 16)
    x = x.detach().requires_grad_()
    h, _ = sru_recurrence(U, x, wc, bias, c0)
    (gx,) = torch.autograd.grad(h.sum(), [x])
    assert gx.stride() == x.stride()


@pytest.mark.parametrize("D,bidirectional,dtype", [
    (4096, False, torch.float32), (4100, True, torch.float32), (4096, True, torch.bfloat16)])
def test_large_outputs(kernel, D, bidirectional, dtype):
    """Outputs of >= 4 MiB take the huge-page / recycled-block path, and >= 16 MiB of
    them the streaming stores (D = 4100 leaves half the rows unaligned for those)."""
    cpu_kernels.set_cache_limit(512 << 20)
    inputs = make_inputs(4, 128, D, bidirectional=bidirectional, mask="mixed", dropout=True,
                         dtype=dtype)
    want = run(sru_recurrence_reference, *inputs, scale_x=1.1, bidirectional=bidirectional)
    # Longer sequences than the other tests (L = 128), so looser than FP32: per-step
    # rounding differences (the kernel's sigmoid is within 5 ulp, torch's within 2)
    # compound over the steps, and weight_c / bias gradients are sums of B*L = 512
    # terms taken in a different order (~sqrt(512) * 6e-8 * sum|terms|).
    f32 = dict(rtol=1e-4, atol=1e-5)
    bf16 = dict(rtol=1.6e-2, atol=1e-2)  # see test_bf16
    if dtype == torch.float32:
        tols = dict(h_tol=f32, c_tol=f32, grad_tol=f32)
    else:
        tols = dict(h_tol=bf16, c_tol=f32, grad_tol={"U": bf16, "x": bf16, "weight_c": f32,
                                                      "bias": f32, "c0": f32})
    for _ in range(2):  # the second pass reuses the first one's freed blocks
        got = run(sru_recurrence, *inputs, scale_x=1.1, bidirectional=bidirectional)
        compare(got, want, **tols)
        del got
    assert cpu_kernels.cached_bytes() > 0
    assert cpu_kernels.empty_cache() > 0 and cpu_kernels.cached_bytes() == 0


# ----------------------------------------------------------------- bf16

# The kernel and the reference see the same bf16 U / x values and both compute in
# fp32; they differ by fp32 rounding (~1e-7 relative), which moves a bf16-rounded
# output by at most one bf16 ulp (2^-8 = 3.9e-3 relative) when it sits on a rounding
# boundary. rtol 1.6e-2 (4 ulps) / atol 1e-2 covers that with margin. c_last and
# the weight / bias / c0 gradients stay fp32 end to end and must agree tightly;
# those gradients accumulate over B*L steps in different orders, hence 1e-4.
BF16_OUT = dict(rtol=1.6e-2, atol=1e-2)
FP32_ACC = dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("skip,bidirectional,mask,dropout,x_dtype,param_dtype", [
    ("x", False, None, False, torch.bfloat16, torch.float32),
    ("x", True, "mixed", True, torch.bfloat16, torch.float32),
    ("x", False, "mixed", True, torch.float32, torch.float32),    # autocast: U bf16, x fp32
    ("x", True, None, False, torch.bfloat16, torch.bfloat16),     # bf16 module
    ("none", False, "mixed", True, None, torch.float32),
    ("u3", True, "mixed", True, None, torch.float32),
    ("u3", False, None, False, None, torch.bfloat16),
])
def test_bf16(kernel, skip, bidirectional, mask, dropout, x_dtype, param_dtype):
    k = 4 if skip == "u3" else 3
    inputs = make_inputs(4, 9, 38, k=k, skip=skip != "none", bidirectional=bidirectional,
                         mask=mask, dropout=dropout, dtype=torch.bfloat16, x_dtype=x_dtype,
                         param_dtype=param_dtype)
    got = run(sru_recurrence, *inputs, scale_x=1.3, bidirectional=bidirectional)
    want = run(sru_recurrence_reference, *inputs, scale_x=1.3, bidirectional=bidirectional)
    param_tol = BF16_OUT if param_dtype == torch.bfloat16 else FP32_ACC
    compare(got, want, h_tol=BF16_OUT, c_tol=FP32,
            grad_tol={"U": BF16_OUT, "x": BF16_OUT if x_dtype == torch.bfloat16 else FP32_ACC,
                      "weight_c": param_tol, "bias": param_tol, "c0": FP32_ACC})


# ----------------------------------------------------------------- determinism

def test_backward_is_bit_reproducible(kernel):
    inputs = make_inputs(6, 16, 300, bidirectional=True, mask="mixed", dropout=True)
    threads = torch.get_num_threads()
    try:
        runs = [run(sru_recurrence, *inputs, scale_x=1.2, bidirectional=True) for _ in range(2)]
        torch.set_num_threads(1)  # by design the result doesn't depend on the thread count
        runs.append(run(sru_recurrence, *inputs, scale_x=1.2, bidirectional=True))
    finally:
        torch.set_num_threads(threads)
    first = runs[0]
    for other in runs[1:]:
        assert torch.equal(first[0], other[0]) and torch.equal(first[1], other[1])
        for a, b in zip(first[2], other[2]):
            assert torch.equal(a, b)


# ----------------------------------------------------------------- inference mode

def test_no_grad_stores_no_state(kernel, monkeypatch):
    seen = []
    real = recurrence.kernels

    class Spy:  # the kernel module, recording store_c and the size of c_all
        def __init__(self, module):
            self.module = module

        def sru_fwd(self, *args):
            out = self.module.sru_fwd(*args)
            seen.append((args[-1], out[2].numel()))
            return out

    monkeypatch.setattr(recurrence, "kernels", lambda *a: Spy(real(*a)))
    U, x, wc, bias, c0, mask, dm = make_inputs(2, 5, 19, mask="mixed")
    wc.requires_grad_()
    with torch.no_grad():
        h, c = sru_recurrence(U, x, wc, bias, c0, mask_pad=mask)
    assert seen[-1] == (False, 0)  # store_c False, empty c_all
    h_ref, c_ref = sru_recurrence_reference(U, x, wc, bias, c0, mask_pad=mask)
    torch.testing.assert_close(h, h_ref, **FP32)
    torch.testing.assert_close(c, c_ref, **FP32)
    h, c = sru_recurrence(U, x, wc, bias, c0, mask_pad=mask)  # grad mode: state kept, custom op
    assert seen[-1] == (True, 2 * 5 * 19)
    assert h.requires_grad


def test_backward_without_stored_state_raises(kernel):
    U, x, wc, bias, c0, _, _ = make_inputs(2, 3, 8)
    U.requires_grad_()
    h, _, c_all = torch.ops.srupp.sru_fwd(U, x, wc, bias, c0, None, None, 1.0, False, False)
    assert c_all.numel() == 0
    with pytest.raises(RuntimeError, match="store_c=False"):
        h.sum().backward()


# ----------------------------------------------------------------- torch.library / compile

def test_opcheck(kernel):
    U, x, wc, bias, c0, mask, dm = make_inputs(3, 4, 6, mask="mixed", dropout=True)
    args = (U.requires_grad_(), x.requires_grad_(), wc.requires_grad_(), bias.requires_grad_(),
            c0.requires_grad_(), mask, dm, 1.5, True, True)
    torch.library.opcheck(torch.ops.srupp.sru_fwd.default, args,
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))


def test_torch_compile_fullgraph(kernel):
    import torch._dynamo

    torch._dynamo.reset()
    U, x, wc, bias, c0, mask, dm = make_inputs(2, 3, 5, mask="mixed", dropout=True)

    def f(U, x, wc, bias, c0):
        h, c = sru_recurrence(U, x, wc, bias, c0, scale_x=1.5, mask_pad=mask, dropout_mask=dm)
        return (h * h).sum() + c.sum()

    def value_and_grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (U, x, wc, bias, c0)]
        out = fn(*leaves)
        return [out.detach()] + list(torch.autograd.grad(out, leaves))

    # aot_eager runs dynamo (fullgraph), the fake kernels and AOT autograd around the
    # op -- everything the op must support -- without inductor's C++ codegen, whose
    # cold compile takes ~35 s on 2 cores (it passes too: backend="inductor").
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for a, b in zip(value_and_grads(compiled), value_and_grads(f)):
        torch.testing.assert_close(a, b, **FP32)


# ----------------------------------------------------------------- dispatch and fallback

def test_build_failure_warns_once_and_falls_back(monkeypatch):
    def broken():
        raise RuntimeError("simulated: no C++ compiler")

    monkeypatch.setattr(cpu_kernels, "build", broken)
    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setattr(cpu_kernels, "_error", None)
    inputs = make_inputs(2, 4, 7)
    with ops.use_backend("auto"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h1, c1 = sru_recurrence(*inputs[:5])
        h2, c2 = sru_recurrence(*inputs[:5])
    ours = [w for w in caught if "srupp" in str(w.message)]
    assert len(ours) == 1
    assert "simulated: no C++ compiler" in str(ours[0].message)
    assert "reference" in str(ours[0].message)
    assert not cpu_kernels.is_available() and "simulated" in cpu_kernels.build_error()
    h_ref, c_ref = sru_recurrence_reference(*inputs[:5])
    assert torch.equal(h1, h_ref) and torch.equal(c2, c_ref)
    with ops.use_backend("cpu"), pytest.raises(RuntimeError, match="unavailable"):
        sru_recurrence(*inputs[:5])


def test_the_build_is_named_after_every_source(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    shutil.copytree(cpu_kernels.CSRC, csrc)
    files = {p.name for p in csrc.iterdir()}
    assert "common.h" in files and len(files) > 2  # a header and several sources
    assert {p.name for p in cpu_kernels.source_files(csrc)} == files
    first = cpu_kernels.source_hash(csrc)
    assert first == cpu_kernels.source_hash(cpu_kernels.CSRC)  # contents, not the folder
    assert cpu_kernels.extension_name(csrc).endswith("_" + first)
    seen = {first}
    for name in sorted(files):  # a change to any file, the header included, names another build
        original = (csrc / name).read_bytes()
        (csrc / name).write_bytes(original + b"\n")
        seen.add(cpu_kernels.source_hash(csrc))
        (csrc / name).write_bytes(original)
    assert len(seen) == len(files) + 1 and cpu_kernels.source_hash(csrc) == first
    (csrc / "extra.cpp").write_text("")  # and so does a new file
    assert cpu_kernels.source_hash(csrc) not in seen

    calls = []  # what build() asks torch to compile: every .cpp, under that name
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    cpu_kernels.build(csrc=csrc)
    (call,) = calls
    assert call["name"] == cpu_kernels.extension_name(csrc)
    assert sorted(os.path.basename(f) for f in call["sources"]) == sorted(
        name for name in files | {"extra.cpp"} if name.endswith(".cpp"))


def test_first_build_says_so_once_on_stderr(tmp_path, monkeypatch, capfd):
    built = []

    def fake_load(name, sources, **kw):  # what torch's load leaves in its build folder
        directory = tmp_path / "extensions" / name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "build.ninja").write_text(
            "".join(f"build {i}.o: compile {os.path.abspath(s)}\n" for i, s in enumerate(sources)))
        (directory / (name + cpp_extension.LIB_EXT)).write_bytes(b"")
        built.append(name)

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    csrc = tmp_path / "csrc"
    shutil.copytree(cpu_kernels.CSRC, csrc)

    def messages():
        out, err = capfd.readouterr()
        assert "srupp:" not in out  # stdout stays for results (the benchmarks' JSON)
        return [line for line in err.splitlines() if "compiling the CPU kernels" in line]

    cpu_kernels.build(csrc=csrc)  # a fresh cache: the first build
    (line,) = messages()
    assert "once" in line and "minute" in line
    cpu_kernels.build(csrc=csrc)  # later loads find it in the cache: no message
    assert messages() == []
    moved = tmp_path / "elsewhere"  # the same files at another path are compiled again
    shutil.copytree(csrc, moved)
    cpu_kernels.build(csrc=moved)
    assert len(messages()) == 1 and len(set(built)) == 1


def test_the_cache_check_finds_the_real_build(kernel):
    # the check above reads torch's build folder as torch writes it; the package's own
    # build, loaded by now, is where it looks and compiles nothing on the next load
    name = cpu_kernels.extension_name()
    assert cpu_kernels._is_built(name, cpu_kernels._compiled(cpu_kernels.CSRC))
    assert not cpu_kernels._is_built(name + "_missing", cpu_kernels._compiled(cpu_kernels.CSRC))


def test_backend_switches(monkeypatch):
    with pytest.raises(ValueError):
        ops.set_backend("fortran")
    monkeypatch.setattr(settings, "_backends", None)  # read the environment again
    monkeypatch.setenv("SRUPP_BACKEND", "reference")
    assert ops.get_backend() == "reference"
    with ops.use_backend("cpu"):
        assert ops.get_backend() == "cpu"
    assert ops.get_backend() == "reference"
    ops.set_backend("auto")
    assert ops.get_backend() == "auto"


def test_float64_and_reference_backend_skip_the_kernel(monkeypatch):
    called = []
    monkeypatch.setattr(recurrence, "kernels", lambda *a: called.append(a))
    inputs = [t.double() if t is not None and t.is_floating_point() else t
              for t in make_inputs(2, 3, 6)]
    with ops.use_backend("cpu"):
        sru_recurrence(*inputs[:5])  # float64 always runs the reference
    with ops.use_backend("reference"):
        sru_recurrence(*make_inputs(2, 3, 6)[:5])
    assert not called


def test_bidirectional_needs_even_units():
    with pytest.raises(ValueError, match="even"):
        sru_recurrence(*make_inputs(1, 2, 5)[:5], bidirectional=True)


def test_forced_backend_wrong_device(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # (with the interpreter, triton runs CPU tensors)
    with ops.use_backend("triton"), pytest.raises(RuntimeError, match="runs cuda tensors"):
        sru_recurrence(*make_inputs(1, 2, 4)[:5])


def test_the_extension_builds_where_a_compiler_is():
    """Every kernel test skips, with the reason, where the extension cannot build (no C++
    compiler): a build that breaks where one is present must fail the suite instead of
    turning it into skips."""
    import shutil

    if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        pytest.skip("no C++ compiler here: the kernels' tests skip, each with its reason")
    assert cpu_kernels.is_available(), cpu_kernels.build_error()
