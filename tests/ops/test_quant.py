"""int8 weights (srupp.ops.quant): quantization, the C++ kernel against the plain reference,
the dispatcher's paths, and its errors."""

import os

import pytest
import torch
import torch.nn.functional as F

from srupp.ops import cpu_kernels
from srupp.ops.quant import (INT8_FEW_ROWS, W8A8_MAX_K, dequantize, linear_int8,
                             linear_int8_reference, linear_int8_rows, linear_w8a8,
                             linear_w8a8_reference, linear_w8a8_rows, quantize_per_channel,
                             quantize_rows, w8a8_vnni)

needs_kernel = pytest.mark.skipif(not cpu_kernels.is_available(),
                                  reason="the C++ extension is not built")

# The kernel sums x · Wq in fp32 in another order than the reference (fp32: a few ulps of
# sums of up to ~200 terms of O(1)), and rounds its output to x's dtype once (bf16: one
# rounding, 2^-8 relative, of outputs of O(1..10)).
KERNEL_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5),
              torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


def _case(M, K, N, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    q, scale = quantize_per_channel(torch.randn(N, K, generator=g) / K ** 0.5)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, q, scale.to(dtype), b


def test_quantize_per_channel_is_symmetric_and_within_half_a_step():
    w = torch.randn(5, 37)
    w[2] = 0.0                                  # a zero row: scale 1, zeros
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (5,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert float(scale[2]) == 1.0 and not q[2].any()
    err = (dequantize(q, scale) - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())


def test_quantize_rejects_bad_weights():
    with pytest.raises(TypeError, match="floating-point weight"):
        quantize_per_channel(torch.ones(3, 4, dtype=torch.int8))
    with pytest.raises(TypeError, match=r"\(N, K\)"):
        quantize_per_channel(torch.ones(3))
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_per_channel(torch.tensor([[1.0, float("inf")]]))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("plain", [False, True])
@pytest.mark.parametrize("M,K,N", [(1, 64, 48), (2, 100, 33), (3, 16, 7), (8, 256, 40),
                                   (9, 7, 5), (17, 130, 19)])
def test_kernel_matches_reference(M, K, N, dtype, plain):
    for bias in (True, False):
        x, q, scale, b = _case(M, K, N, dtype, bias)
        y = linear_int8_rows(x, q, scale, b, plain)
        assert y.dtype == dtype and y.shape == (M, N)
        torch.testing.assert_close(y, linear_int8_reference(x, q, scale, b), **KERNEL_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_int8_both_paths_match_reference(dtype):
    # few rows: the kernel (where built); many rows: dequantize + GEMM
    for shape in [(3,), (2, 4), (4, INT8_FEW_ROWS)]:
        x, q, scale, b = _case(1, 24, 10, dtype)
        x = torch.randn(*shape, 24).to(dtype)
        y = linear_int8(x, q, scale, b)
        assert y.shape == (*shape, 10) and y.dtype == dtype
        # the GEMM path rounds the dequantized weight to bf16 once more
        torch.testing.assert_close(y, linear_int8_reference(x, q, scale, b),
                                   **KERNEL_TOL[dtype])


def test_reference_is_float_linear_of_the_dequantized_weight():
    x, q, scale, b = _case(4, 12, 6, torch.float32)
    torch.testing.assert_close(linear_int8_reference(x, q, scale, b),
                               F.linear(x, q.float() * scale[:, None], b))


def test_linear_int8_errors_name_the_fix():
    x, q, scale, b = _case(2, 8, 4, torch.float32)
    with pytest.raises(TypeError, match="quantize_per_channel"):
        linear_int8(x, q.float(), scale)
    with pytest.raises(ValueError, match=r"\(\.\.\., 8\)"):
        linear_int8(torch.randn(2, 9), q, scale)
    with pytest.raises(ValueError, match="one value per output feature"):
        linear_int8(x, q, scale[:3])
    with pytest.raises(ValueError, match="no_grad"):
        linear_int8(x.requires_grad_(), q, scale)


# w8a8: every path sums the same integers exactly (tested exactly below); what may differ
# is the final sum * (sx * scale) + bias in fp32 (a compiler may fuse it into one FMA:
# an ulp or two of outputs that sum many terms, hence 1e-6), and bf16's one rounding of
# the output.
W8A8_TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6),
            torch.bfloat16: dict(rtol=8e-3, atol=1e-5)}


def test_quantize_rows_is_symmetric_per_row_and_marks_non_finite_rows():
    x = torch.randn(4, 33)
    x[1] = 0.0
    x[2, 5] = float("nan")
    x[3, 0] = float("inf")
    q, s = quantize_rows(x)
    assert q.dtype == torch.int8 and s.shape == (4,)
    assert int(q[0].abs().max()) == 127 and float(s[1]) == 1.0 and not q[1].any()
    assert bool(torch.isnan(s[2:]).all()) and not q[2:].any()
    err = (q[0].float() * s[0] - x[0]).abs()
    assert bool((err <= s[0] / 2 + 1e-7).all())


def test_w8a8_reference_is_the_integer_product_scaled():
    x, q, scale, b = _case(3, 20, 6, torch.float32)
    xq, sx = quantize_rows(x)
    exact = xq.long() @ q.long().t()                                    # int64, exact
    want = exact.float() * (sx[:, None] * scale[None]) + b
    torch.testing.assert_close(linear_w8a8_reference(x, q, scale, b), want, rtol=0, atol=0)
    # within the two roundings of the float product
    torch.testing.assert_close(linear_w8a8_reference(x, q, scale, b),
                               linear_int8_reference(x, q, scale, b), rtol=0.05, atol=0.05)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("plain", [False, True])
@pytest.mark.parametrize("M,K,N", [(1, 64, 48), (2, 100, 33), (3, 16, 7), (4, 256, 40),
                                   (9, 7, 5), (17, 130, 19), (1, 385, 9), (2, 300, 9),
                                   (3, 200, 5), (5, 70, 3), (6, 130, 7), (7, 64, 4),
                                   (15, 260, 11)])
def test_w8a8_kernel_matches_reference(M, K, N, dtype, plain):
    for bias in (True, False):
        x, q, scale, b = _case(M, K, N, dtype, bias)
        y = linear_w8a8_rows(x, q, scale, b, plain)
        assert y.dtype == dtype and y.shape == (M, N)
        torch.testing.assert_close(y, linear_w8a8_reference(x, q, scale, b), **W8A8_TOL[dtype])


@needs_kernel
def test_w8a8_kernel_sums_integers_exactly():
    # x of integers with a 127 in every row: each row's scale is exactly 1 and xq == x;
    # weight scale 1: the output is the integer dot product, rounded to fp32 once. The
    # values are uneven and large, so that even 16 float lanes of 4096 products each
    # would pass 2^24 and round: only an integer sum gives the exact products here.
    g = torch.Generator().manual_seed(0)
    K = W8A8_MAX_K
    x = torch.randint(60, 128, (3, K), generator=g).float()
    x[:, 0] = 127.0
    q = torch.randint(60, 128, (5, K), generator=g).to(torch.int8)
    exact = x.long() @ q.long().t()                                     # (3, 5) int64
    assert int(exact.min()) > 16 * 2 ** 24
    for plain in (False, True):
        assert torch.equal(linear_w8a8_rows(x, q, torch.ones(5), None, plain), exact.float())


@needs_kernel
def test_w8a8_kernel_holds_the_largest_sums_of_its_widest_rows():
    # K = W8A8_MAX_K at the extremes: 65536 · 127 · 127 (and 65536 · 255 · 127 inside VNNI,
    # which offsets x by 128) stay below 2^31
    K = W8A8_MAX_K
    x = torch.full((2, K), 127.0)
    x[1, 1::2] = -127.0
    q = torch.full((3, K), 127, dtype=torch.int8)
    q[1] = -127
    want = torch.tensor([[K * 127 * 127, -K * 127 * 127, K * 127 * 127],
                         [0, 0, 0]], dtype=torch.float32)
    for plain in (False, True):
        torch.testing.assert_close(linear_w8a8_rows(x, q, torch.ones(3), None, plain), want,
                                   rtol=0, atol=0)


@needs_kernel
def test_w8a8_kernel_gives_nan_for_non_finite_rows():
    x, q, scale, b = _case(3, 40, 5, torch.float32)
    x[1, 3] = float("nan")
    x[2, 0] = float("-inf")
    for plain in (False, True):
        y = linear_w8a8_rows(x, q, scale, b, plain)
        assert bool(torch.isnan(y[1:]).all()) and bool(torch.isfinite(y[0]).all())
        torch.testing.assert_close(y[0], linear_w8a8_reference(x, q, scale, b)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_w8a8_every_path_matches_reference(dtype):
    # few rows: the kernel (where built); many rows: the reference itself (so that case
    # checks the dispatch and the shapes only)
    x, q, scale, b = _case(1, 24, 10, dtype)
    for shape in [(3,), (2, 4), (4, INT8_FEW_ROWS)]:
        x = torch.randn(*shape, 24).to(dtype)
        y = linear_w8a8(x, q, scale, b)
        assert y.shape == (*shape, 10) and y.dtype == dtype
        torch.testing.assert_close(y, linear_w8a8_reference(x, q, scale, b), **W8A8_TOL[dtype])


@needs_kernel
def test_w8a8_vnni_is_reported_as_built():
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    flags = open("/proc/cpuinfo").read()
    if cpu_kernels.capability() == "avx512" and " avx512_vnni" in flags \
            and " avx512bw" in flags:
        assert w8a8_vnni()
    print(f"w8a8 kernel: {'VNNI' if w8a8_vnni() else 'plain loop'}")


def test_linear_w8a8_errors_name_the_fix():
    x, q, scale, b = _case(2, 8, 4, torch.float32)
    with pytest.raises(TypeError, match="quantize_per_channel"):
        linear_w8a8(x, q.float(), scale)
    with pytest.raises(ValueError, match="no_grad"):
        linear_w8a8(x.requires_grad_(), q, scale)
    big = W8A8_MAX_K + 1
    with pytest.raises(ValueError, match="int8 \\(weight-only\\)"):
        linear_w8a8(torch.zeros(1, big), torch.zeros(1, big, dtype=torch.int8), torch.ones(1))
