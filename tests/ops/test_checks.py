"""The recurrence's argument checks: every backend rejects the same bad input with
the same error, naming the argument, before any kernel runs.

Each case is run through ``sru_recurrence`` on each backend ("reference", "cpu",
and "triton", which runs CPU tensors under TRITON_INTERPRET=1), and through
``sru_recurrence_reference`` called directly. No kernel is built or run: the
check comes first, on any device: with ``--device cuda`` the good arguments are
CUDA tensors (the forced "cpu" backend still rejects bad ones with the same error,
before it would refuse the device).
"""

import pytest
import torch
from tolerances import tol

import srupp.ops as ops
from srupp.ops import sru_recurrence, sru_recurrence_reference

B, L, D = 2, 3, 4


def good(device="cpu"):
    args = dict(U=torch.randn(B, L, 3, D), x=torch.randn(B, L, D), weight_c=torch.randn(2, D),
                bias=torch.randn(2, D), c0=torch.randn(B, D),
                mask_pad=torch.zeros(B, L, dtype=torch.bool), dropout_mask=torch.ones(B, D))
    return {k: v.to(device) for k, v in args.items()}


def on(device, value):
    """A case's bad value on ``device``; values on the meta device (the wrong-device
    cases) and non-tensors stay as they are."""
    if isinstance(value, torch.Tensor) and value.device.type != "meta":
        return value.to(device)
    return value


# (argument, bad value, error, message); every other argument is good()
CASES = [
    ("U", [[1.0]], TypeError, "U must be a Tensor, got list"),
    ("U", torch.randn(B, L, 3 * D), ValueError, r"U must have shape \(B, L, k, D\) with k = 3 or 4, got \(2, 3, 12\)"),
    ("U", torch.randn(B, L, 2, D), ValueError, r"U must have shape \(B, L, k, D\) with k = 3 or 4, got \(2, 3, 2, 4\)"),
    ("U", torch.ones(B, L, 3, D, dtype=torch.int64), TypeError, "U must be floating point, got torch.int64"),
    ("x", torch.randn(L, B, D), ValueError, r"x must have shape \(B, L, D\) = \(2, 3, 4\), got \(3, 2, 4\)"),
    ("x", torch.randn(B, L, D + 1), ValueError, r"x must have shape \(B, L, D\) = \(2, 3, 4\), got \(2, 3, 5\)"),
    ("x", torch.ones(B, L, D, dtype=torch.int32), TypeError, "x must be floating point, got torch.int32"),
    ("x", torch.randn(B, L, D, device="meta"), ValueError, "x is on meta but U is on cpu"),
    ("weight_c", None, TypeError, "weight_c must be a Tensor, got NoneType"),
    ("weight_c", torch.randn(2 * D), ValueError, r"weight_c must have shape \(2, D\) = \(2, 4\), got \(8,\)"),
    ("weight_c", torch.randn(D, 2), ValueError, r"weight_c must have shape \(2, D\) = \(2, 4\), got \(4, 2\)"),
    ("bias", torch.randn(2, D + 1), ValueError, r"bias must have shape \(2, D\) = \(2, 4\), got \(2, 5\)"),
    ("bias", torch.ones(2, D, dtype=torch.bool), TypeError, "bias must be floating point, got torch.bool"),
    ("c0", torch.randn(D), ValueError, r"c0 must have shape \(B, D\) = \(2, 4\), got \(4,\)"),
    ("c0", torch.randn(1, D), ValueError, r"c0 must have shape \(B, D\) = \(2, 4\), got \(1, 4\)"),
    ("c0", torch.randn(B, D, device="meta"), ValueError, "c0 is on meta but U is on cpu"),
    # the defect: a time-major mask was read transposed by the C++ kernel
    ("mask_pad", torch.zeros(L, B, dtype=torch.bool), ValueError, r"mask_pad must have shape \(B, L\) = \(2, 3\), got \(3, 2\)"),
    ("mask_pad", torch.zeros(B * L, dtype=torch.bool), ValueError, r"mask_pad must have shape \(B, L\) = \(2, 3\), got \(6,\)"),
    ("mask_pad", torch.zeros(B, L), TypeError, r"mask_pad must be bool \(True marks padding\) or integer, got torch.float32"),
    ("mask_pad", torch.zeros(B, L, dtype=torch.bool, device="meta"), ValueError, "mask_pad is on meta but U is on cpu"),
    ("dropout_mask", torch.ones(D), ValueError, r"dropout_mask must have shape \(B, D\) = \(2, 4\), got \(4,\)"),
    ("dropout_mask", torch.ones(B, L, D), ValueError, r"dropout_mask must have shape \(B, D\) = \(2, 4\), got \(2, 3, 4\)"),
    ("dropout_mask", torch.ones(B, D, dtype=torch.bool), TypeError, "dropout_mask must be floating point, got torch.bool"),
]
IDS = [f"{c[0]}-{i}" for i, c in enumerate(CASES)]
BACKENDS = ["reference", "cpu", "triton", "sru_recurrence_reference"]


def call(backend, args, **kw):
    U, x, wc, bias, c0, mask_pad, dm = args.values()
    if backend == "sru_recurrence_reference":
        return sru_recurrence_reference(U, x, wc, bias, c0, mask_pad=mask_pad, dropout_mask=dm,
                                        **kw)
    with ops.use_backend(backend):
        return sru_recurrence(U, x, wc, bias, c0, mask_pad=mask_pad, dropout_mask=dm, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,value,error,message", CASES, ids=IDS)
def test_bad_argument(backend, name, value, error, message, monkeypatch, device):
    monkeypatch.setattr(ops.recurrence, "route", lambda *a: pytest.fail("the check came late"))
    args = good(device)
    message = message.replace("but U is on cpu", f"but U is on {args['U'].device}")
    args[name] = on(device, value)
    with pytest.raises(error, match=f"^{message}$"):
        call(backend, args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_k4_takes_no_x_and_bidirectional_takes_even_units(backend, monkeypatch, device):
    monkeypatch.setattr(ops.recurrence, "route", lambda *a: pytest.fail("the check came late"))
    args = good(device)
    args["U"] = torch.randn(B, L, 4, D).to(device)
    with pytest.raises(ValueError, match=r"with k = 4 the skip term is U\[:, :, 3\]; pass x=None"):
        call(backend, args)
    args = good(device)
    for name, shape in (("U", (B, L, 3, D + 1)), ("x", (B, L, D + 1)), ("weight_c", (2, D + 1)),
                        ("bias", (2, D + 1)), ("c0", (B, D + 1)), ("dropout_mask", (B, D + 1))):
        args[name] = torch.randn(shape).to(device)
    with pytest.raises(ValueError, match="bidirectional needs an even number of units D, got D = 5"):
        call(backend, args, bidirectional=True)


# the C++ kernel runs CPU tensors only: not collected with --device cuda
@pytest.mark.parametrize("backend", ["reference", pytest.param("cpu", marks=pytest.mark.cpu_only),
                                     "triton"])
def test_good_arguments_pass_and_integer_masks_count_nonzero_as_padding(backend, device):
    """Integer masks are accepted (nonzero = padding), like bool ones; the optional
    arguments may be None."""
    if backend == "cpu" and not ops.cpu_kernels.is_available():
        pytest.skip(f"CPU kernel unavailable: {ops.cpu_kernels.build_error()}")
    if backend == "triton":
        pytest.importorskip("triton", reason="triton not installed")
    args = good(device)
    args["mask_pad"] = torch.tensor([[0, 1, 0], [2, 0, 0]], dtype=torch.int32).to(device)
    # fp32 on CPU; on CUDA tests/tolerances.py's fp32 figure (compiled Triton's exp is
    # an approximation: see tests/ops/test_triton_kernel.py)
    fp32 = dict(rtol=1e-5, atol=1e-6) if device.type == "cpu" else tol(torch.float32)
    with torch.no_grad():
        h, c = call(backend, args)
        h_ref, c_ref = sru_recurrence_reference(*list(args.values())[:5],
                                                mask_pad=args["mask_pad"] != 0,
                                                dropout_mask=args["dropout_mask"])
        torch.testing.assert_close(h, h_ref, **fp32)
        torch.testing.assert_close(c, c_ref, **fp32)
        assert (h[0, 1] == 0).all() and (h[1, 0] == 0).all()
        call(backend, dict(good(device), x=None, c0=None, mask_pad=None, dropout_mask=None))
