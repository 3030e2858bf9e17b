"""srupp.ops.linear (oneDNN fp32 path, few-rows decoding kernel) against its reference, F.linear.

Both are IEEE fp32 GEMMs that differ only in summation order, so fp32 agreement
is checked at the issue's tolerance (rtol=1e-5, atol=1e-6) on inputs scaled so
outputs are O(1).

oneDNN and the few-rows kernel are CPU code: those tests don't take the ``device``
fixture, so ``--device cuda`` doesn't collect them. Two tests do: srupp's
``Linear`` against ``nn.Linear``, and torch.export of an SRU++ stack (on CUDA,
``ops.linear`` is F.linear and attention is SDPA; the exported graph must still
hold plain aten ops and agree with eager). Their CUDA tolerance is
tests/tolerances.py's fp32 figure (cuBLAS may block the two products differently).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import srupp.ops as ops
from srupp.nn import SRUpp
from srupp.nn.linear import Linear
from srupp.ops import matmul, settings
from tolerances import tol

FP32 = dict(rtol=1e-5, atol=1e-6)


def fp32_tol(device):
    return FP32 if device.type == "cpu" else tol(torch.float32)

needs_onednn = pytest.mark.skipif(not matmul.onednn_available(),
                                  reason="this torch build has no oneDNN fp32 linear op")


def _pair(shape, K, N, seed=0, x_transposed=False):
    g = torch.Generator().manual_seed(seed)
    if x_transposed:  # a (B, L, K) view of a time-major (L, B, K) tensor, as layers see it
        x = torch.randn(shape[1], shape[0], *shape[2:], K, generator=g).transpose(0, 1)
    else:
        x = torch.randn(*shape, K, generator=g)
    x = (x / K ** 0.5).requires_grad_()
    w = (torch.randn(N, K, generator=g) / K ** 0.5).requires_grad_()
    return x, w


@needs_onednn
@pytest.mark.parametrize("shape,K,N,x_transposed", [
    ((300,), 17, 5, False), ((1,), 8, 8, False),
    ((2, 130), 64, 48, False), ((2, 130), 64, 48, True),
    ((3, 7, 11), 33, 129, False), ((3, 7, 11), 33, 129, True),
    ((4, 64), 512, 384, False), ((4, 64), 512, 384, True)])
def test_onednn_matches_reference_outputs_and_grads(shape, K, N, x_transposed):
    x, w = _pair(shape, K, N, x_transposed=x_transposed)
    gout = torch.randn(*shape, N, generator=torch.Generator().manual_seed(1))
    y = ops.linear_onednn(x, w)
    gx, gw = torch.autograd.grad(y, (x, w), gout)
    y_ref = F.linear(x, w)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x, w), gout)
    torch.testing.assert_close(y, y_ref, **FP32)
    torch.testing.assert_close(gx, gx_ref, **FP32)
    torch.testing.assert_close(gw, gw_ref, **FP32)
    assert gx.shape == x.shape and gw.shape == w.shape


@needs_onednn
def test_onednn_only_the_grads_asked_for():
    x, w = _pair((256,), 32, 16)
    (gw,) = torch.autograd.grad(ops.linear_onednn(x.detach(), w).sum(), (w,))
    torch.testing.assert_close(gw, torch.autograd.grad(F.linear(x.detach(), w).sum(), (w,))[0],
                               **FP32)
    (gx,) = torch.autograd.grad(ops.linear_onednn(x, w.detach()).sum(), (x,))
    torch.testing.assert_close(gx, torch.autograd.grad(F.linear(x, w.detach()).sum(), (x,))[0],
                               **FP32)
    with torch.no_grad():
        torch.testing.assert_close(ops.linear_onednn(x, w), F.linear(x, w), **FP32)


@needs_onednn
def test_onednn_rejects_what_it_cannot_run():
    x, w = _pair((4,), 8, 8)
    with pytest.raises(RuntimeError, match="float32 CPU"):
        ops.linear_onednn(x.double(), w.double())


@needs_onednn
def test_dispatch_rule(monkeypatch):
    calls = []
    real = matmul._onednn_mm
    monkeypatch.setattr(matmul, "_onednn_mm", lambda a, w: calls.append(a.shape) or real(a, w))
    w = torch.randn(16, 32)
    ops.linear(torch.randn(matmul.MIN_ROWS, 32), w)               # large fp32: oneDNN
    assert len(calls) == 1
    ops.linear(torch.randn(matmul.MIN_ROWS - 1, 32), w)           # small: F.linear
    ops.linear(torch.randn(512, 32).double(), w.double())         # fp64 (gradcheck): F.linear
    with torch.autocast("cpu", dtype=torch.bfloat16):             # autocast casts: F.linear
        out = ops.linear(torch.randn(512, 32), w)
    assert out.dtype == torch.bfloat16
    with ops.use_matmul_backend("aten"):
        ops.linear(torch.randn(512, 32), w)
    assert len(calls) == 1
    with ops.use_matmul_backend("onednn"):
        ops.linear(torch.randn(2, 32), w)                         # forced: even when small
    assert len(calls) == 2


def test_backend_setting_and_env(monkeypatch):
    with pytest.raises(ValueError, match="unknown srupp matmul backend"):
        ops.set_matmul_backend("mkl")
    monkeypatch.setattr(settings, "_backends", None)
    monkeypatch.setenv("SRUPP_MATMUL", "aten")
    assert ops.get_matmul_backend() == "aten"
    monkeypatch.setattr(settings, "_backends", None)
    monkeypatch.setenv("SRUPP_MATMUL", "bogus")
    with pytest.raises(ValueError, match="SRUPP_MATMUL"):
        ops.get_matmul_backend()
    monkeypatch.setattr(settings, "_backends", None)


def test_linear_module_is_a_drop_in_nn_linear(device):
    torch.manual_seed(0)
    lin = Linear(32, 16, bias=False).to(device)
    ref = torch.nn.Linear(32, 16, bias=False).to(device)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(200, 32).to(device)
    torch.testing.assert_close(lin(x), ref(x), **fp32_tol(device))
    biased = Linear(32, 16).to(device)
    assert set(biased.state_dict()) == {"weight", "bias"}
    torch.testing.assert_close(biased(x), F.linear(x, biased.weight, biased.bias),
                               **fp32_tol(device))


@needs_onednn
def test_srupp_stack_agrees_across_matmul_backends():
    """The whole layer (fwd and every parameter and input gradient) with and without oneDNN."""
    torch.manual_seed(0)
    m = SRUpp(48, 48, 16, num_layers=2, causal=True)
    x = torch.randn(40, 8, 48, requires_grad=True)   # 320 rows: above MIN_ROWS

    def run():
        out, state = m(x)
        loss = (out * torch.linspace(-1, 1, out.shape[-1])).sum() + state.c.sum()
        return [out, state.c, *torch.autograd.grad(loss, [x, *m.parameters()])]

    with ops.use_matmul_backend("aten"):
        ref = run()
    with ops.use_matmul_backend("auto"):
        got = run()
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_onednn_is_bitwise_repeatable():
    """Exact resume needs the same bits from the same inputs (fixed thread count)."""
    x, w = _pair((3, 100), 96, 80)
    g = torch.randn(3, 100, 80)
    runs = []
    for _ in range(3):
        y = ops.linear_onednn(x, w)
        runs.append([y, *torch.autograd.grad(y, (x, w), g)])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


def test_export_sees_plain_aten_ops(device):
    """torch.export (and compile) trace F.linear and SDPA, never the eager fast paths."""
    torch.manual_seed(0)
    m = SRUpp(32, 32, 8, num_layers=1, batch_first=True).eval().to(device)

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x)[0]

    x = torch.randn(2, 100, 32).to(device)  # 200 rows: eager would take the oneDNN path on CPU
    ep = torch.export.export(Wrap(), (x,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "aten.linear.default" in targets
    assert "aten.scaled_dot_product_attention.default" in targets
    assert not any("mkldnn" in t for t in targets)
    torch.testing.assert_close(ep.module()(x), Wrap()(x), **fp32_tol(device))


@needs_onednn
def test_onednn_double_backward_matches_reference():
    """create_graph=True (gradient penalties) works and agrees with F.linear."""
    x, w = _pair((3, 70), 24, 16)

    def penalty(fn):
        y = fn(x, w)
        gx, = torch.autograd.grad((y * y).sum(), x, create_graph=True)
        return torch.autograd.grad(gx.square().sum(), (x, w))

    for a, b in zip(penalty(ops.linear_onednn), penalty(F.linear)):
        torch.testing.assert_close(a, b, **FP32)


# ------------------------------------------------------------- few-rows kernel (decoding)

needs_extension = pytest.mark.skipif(not ops.cpu_kernels.is_available(),
                                     reason="the C++ CPU extension could not be built")
# bf16 operands, fp32 sums: the result is rounded to bf16 once (8 bits of mantissa),
# as F.linear's bf16 result is; both are compared with the fp64 product
FEW_ROWS_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


@needs_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,K,N", [(1, 1, 1), (1, 7, 3), (1, 256, 3072), (2, 1000, 129),
                                      (3, 33, 64), (8, 512, 40), (1, 64 + 15, 17),
                                      (1, 248, 13), (3, 96, 10), (33, 100, 70), (40, 24, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_kernel_matches_reference(dtype, rows, K, N, bias):
    g = torch.Generator().manual_seed(rows * 1000 + K + N)
    x = (torch.randn(rows, K, generator=g) / K ** 0.5).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    got = matmul.linear_few_rows(x, w, b)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == dtype and got.shape == (rows, N)
    torch.testing.assert_close(got.double(), exact, **FEW_ROWS_TOL[dtype])
    # no worse than PyTorch's own product in this dtype, to within one rounding
    ref_err = (F.linear(x, w, b).double() - exact).abs().max()
    bound = ref_err + (exact.abs().max() * 2 ** -8 if dtype == torch.bfloat16 else 1e-5)
    assert (got.double() - exact).abs().max() <= bound


@needs_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,N,strided", [(1000, 5, False), (1000, 256, False), (24, 256, False),
                                         (7, 5, False), (24, 6, True)])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_kernel_rows_are_batch_invariant(dtype, K, N, strided, bias):
    """A row of x gets the same bits alone as in a batch of any size (1 to 40 rows), at any
    place in it: the kernel shares each load of W between blocks of rows, and the serving
    engine relies on a stream's logits not depending on the others. K covers the main
    loop's tails (1000 = 15 x 64 + 40 at AVX-512) and rows shorter than a vector (7)."""
    g = torch.Generator().manual_seed(K + N)
    x = (torch.randn(40, K, generator=g) / K ** 0.5).to(dtype)
    w = torch.randn(N, 2 * K if strided else K, generator=g).to(dtype)
    w = w[:, :K] if strided else w           # rows read in place at their stride
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    alone = torch.cat([matmul.linear_few_rows(x[r:r + 1], w, b) for r in range(40)])  # (40, N)
    for R in range(1, 41):
        for rows in (slice(0, R), slice(40 - R, 40)):  # first and last rows: other places
            got = matmul.linear_few_rows(x[rows], w, b)
            assert torch.equal(got, alone[rows]), f"a batch of {R} rows ({rows}) differs"


@needs_extension
def test_few_rows_kernel_reads_strided_rows_in_place():
    # keys inside a [K | V] cache: rows of stride 2d, read without a copy
    kv = torch.randn(1, 50, 2 * 24)
    k = kv[0, :, :24]
    q = torch.randn(1, 24)
    torch.testing.assert_close(matmul.linear_few_rows(q, k), q @ k.t(), **FP32)
    # a weight whose inner stride is not 1 is copied first, same result
    wt = torch.randn(24, 30).t()
    torch.testing.assert_close(matmul.linear_few_rows(q.new_ones(2, 24), wt),
                               F.linear(q.new_ones(2, 24), wt), **FP32)


@needs_extension
def test_few_rows_kernel_reads_strided_bf16_rows_in_place():
    # the bf16 dot-product path reads rows at their stride too, tails of odd length included
    kv = torch.randn(2, 50, 2 * 40).bfloat16()
    k = kv[1, :, :40]
    q = torch.randn(2, 40).bfloat16()
    exact = q.double() @ k.double().t()
    torch.testing.assert_close(matmul.linear_few_rows(q, k).double(), exact,
                               **FEW_ROWS_TOL[torch.bfloat16])


@needs_extension
def test_few_rows_bf16_uses_dot_product_instructions_where_the_cpu_has_them():
    # the extension is built with -march=native: on a CPU with AVX512-BF16 its bf16
    # products must come out of vdpbf16ps, not widen every weight to fp32
    mod = ops.cpu_kernels.load()
    native = settings.cpu_has_native_bf16() and ops.cpu_kernels.capability() == "avx512" \
        and torch.cpu._is_avx512_bf16_supported()
    print(f"AVX512-BF16: {native}; bf16 few-rows path native: {mod.linear_rows_bf16_native()}")
    assert mod.linear_rows_bf16_native() == native


needs_pairs = pytest.mark.skipif(
    not (ops.cpu_kernels.is_available() and ops.cpu_kernels.load().linear_rows_bf16_native()),
    reason="the pair-packed bf16 kernel needs a CPU with AVX512-BF16 (and the C++ extension)")


def _pairs(x, w, b=None):
    mod = ops.cpu_kernels.load()
    return mod.linear_pairs_bf16(x, mod.pack_pairs_bf16(w), w.shape[0], b)


@needs_pairs
@pytest.mark.parametrize("rows,K,N", [(1, 2, 1), (1, 256, 3072), (3, 6, 17), (2, 1024, 129),
                                      (8, 512, 48), (9, 30, 100), (33, 100, 70), (40, 24, 257),
                                      (0, 8, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_pair_packed_kernel_matches_reference(rows, K, N, bias):
    # tiles of 48 outputs with the last one partial (17, 70, 100, 129, 257), 1 to 40 rows
    # (blocks of 8, 4, 2 and 1 rows; 3, 2 or 1 vectors of 16, 12 at once under 4 rows)
    g = torch.Generator().manual_seed(rows * 1000 + K + N)
    x = (torch.randn(rows, K, generator=g) / K ** 0.5).bfloat16()
    w = torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    got = _pairs(x, w, b)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, N)
    torch.testing.assert_close(got.double(), exact, **FEW_ROWS_TOL[torch.bfloat16])
    if rows:  # no worse than PyTorch's own bf16 product, to within one rounding
        ref_err = (F.linear(x, w, b).double() - exact).abs().max()
        assert (got.double() - exact).abs().max() <= ref_err + exact.abs().max() * 2 ** -8


@needs_pairs
@pytest.mark.parametrize("K,N", [(1000, 5), (256, 3072), (24, 100)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_pair_packed_rows_are_batch_invariant(K, N, threads):
    """A row gets the same bits alone as in a batch of any size and place, and on any
    number of threads: each output is one lane's chain over the pairs in order."""
    g = torch.Generator().manual_seed(K + N)
    x = (torch.randn(40, K, generator=g) / K ** 0.5).bfloat16()
    w = torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16()
    alone = torch.cat([_pairs(x[r:r + 1], w, b) for r in range(40)])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for R in (1, 2, 3, 4, 5, 8, 9, 16, 31, 40):
            for rows in (slice(0, R), slice(40 - R, 40)):
                assert torch.equal(_pairs(x[rows], w, b), alone[rows]), f"{R} rows ({rows})"
    finally:
        torch.set_num_threads(before)


@needs_extension
def test_pair_packing_refuses_what_it_cannot_hold():
    mod = ops.cpu_kernels.load()
    with pytest.raises(RuntimeError, match="I even"):
        mod.pack_pairs_bf16(torch.randn(4, 5).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16 weight"):
        mod.pack_pairs_bf16(torch.randn(4, 6))
    if not mod.linear_rows_bf16_native():
        return
    w = torch.randn(50, 6).bfloat16()
    wp = mod.pack_pairs_bf16(w)
    assert wp.shape == (2, 3, 48, 2)  # (tiles, pairs, 48 outputs, 2)
    with pytest.raises(RuntimeError, match="x \\(R, I\\) bfloat16 contiguous with I = 6"):
        mod.linear_pairs_bf16(torch.randn(2, 8).bfloat16(), wp, 50, None)
    with pytest.raises(RuntimeError, match="for 97 outputs"):  # 2 tiles hold 49 to 96
        mod.linear_pairs_bf16(torch.randn(2, 6).bfloat16(), wp, 97, None)


@needs_extension
def test_few_rows_dispatch_rule(monkeypatch):
    calls = []
    real = matmul.linear_few_rows
    monkeypatch.setattr(matmul, "linear_few_rows", lambda *a: calls.append(a[0].shape) or real(*a))
    w, b = torch.randn(16, 32), torch.randn(16)
    with torch.no_grad():
        ops.linear(torch.randn(1, 32), w, b)                           # decoding: few rows
        ops.linear(torch.randn(2, 1, 32), w)                           # (B, 1, K): 2 rows
        ops.linear(torch.randn(8, 32), w)                              # fp32 up to 8 rows
        n = len(calls)
        ops.linear(torch.randn(9, 32), w)                              # 9 rows: BLAS
        ops.linear(torch.randn(3, 32).bfloat16(), w.bfloat16())        # bf16: up to 2 rows
        ops.linear(torch.randn(1, 32).double(), w.double())            # fp64: F.linear
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ops.linear(torch.randn(1, 32), w)                          # autocast: F.linear
        with ops.use_matmul_backend("aten"):
            ops.linear(torch.randn(1, 32), w)
    assert len(calls) == n == 3
    x = torch.randn(1, 32, requires_grad=True)
    y = ops.linear(x, w)                                               # a gradient is wanted
    assert len(calls) == 3 and y.requires_grad
    y.sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0, keepdim=True))
    with torch.no_grad():
        ops.linear(torch.randn(2, 32).bfloat16(), w.bfloat16())
    assert len(calls) == 4
