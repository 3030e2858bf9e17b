"""The reference recurrence: gradients in float64, and the spec's equations.

Every test takes the ``device`` fixture (``pytest --device cuda`` runs them on the
GPU, where float64 and every ``use_backend("reference")`` run this loop): inputs
are drawn on the CPU from a seeded generator and then moved, so both devices see
the same values.
"""

import itertools

import pytest
import torch
from torch.autograd import gradcheck
from tolerances import half_dtypes

from srupp.ops import sru_recurrence_reference

B, L, D = 2, 4, 6


def make_inputs(k=3, skip=True, bidir=False, pad=False, dropout=False, dtype=torch.float64,
                seed=0, device="cpu"):
    """Leaf tensors on ``device``, drawn on the CPU (the same values on every device)."""
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=dtype).to(device).requires_grad_()

    U = r(B, L, k, D)
    x = r(B, L, D) if (skip and k == 3) else None
    wc = r(2, D)
    bias = r(2, D)
    c0 = r(B, D)
    mask = None
    if pad:
        mask = torch.zeros(B, L, dtype=torch.bool)
        mask[0, -1] = True          # right padding
        mask[1, 0] = True           # left padding
        mask = mask.to(device)
    dm = (torch.rand(B, D, generator=g) > 0.3).to(dtype).div(0.7).to(device) if dropout else None
    return U, x, wc, bias, c0, mask, dm


# k = 4 exists only with a skip term, so (k=4, skip=False) is not a combination.
OPTIONS = [o for o in itertools.product([3, 4], [True, False], [False, True], [False, True],
                                        [False, True]) if not (o[0] == 4 and not o[1])]


@pytest.mark.parametrize("k,skip,bidir,pad,dropout", OPTIONS)
def test_gradcheck(k, skip, bidir, pad, dropout, device):
    U, x, wc, bias, c0, mask, dm = make_inputs(k, skip, bidir, pad, dropout, device=device)
    inputs = [t for t in (U, x, wc, bias, c0) if t is not None]

    def fn(*ts):
        it = iter(ts)
        U_, x_ = next(it), (next(it) if x is not None else None)
        wc_, b_, c0_ = next(it), next(it), next(it)
        return sru_recurrence_reference(U_, x_, wc_, b_, c0_, scale_x=1.3, mask_pad=mask,
                                        dropout_mask=dm, bidirectional=bidir)

    assert gradcheck(fn, inputs, eps=1e-6, atol=1e-5)


def direct_step(U, x, wc, bias, c, scale_x=1.0):
    """One step of the spec's equations, written out independently of the loop."""
    u0, u1, u2 = U[:, 0], U[:, 1], U[:, 2]
    f = 1 / (1 + torch.exp(-(u1 + wc[0] * c + bias[0])))
    r = 1 / (1 + torch.exp(-(u2 + wc[1] * c + bias[1])))
    c_new = f * c + (1 - f) * u0
    s = U[:, 3] if U.shape[1] == 4 else scale_x * x
    return r * c_new + (1 - r) * s, c_new


@pytest.mark.parametrize("k", [3, 4])
def test_matches_equations(k, device):
    U, x, wc, bias, c0, _, _ = make_inputs(k, device=device)
    h, c = sru_recurrence_reference(U, x, wc, bias, c0, scale_x=1.7)
    c_t = c0
    for t in range(L):
        h_t, c_t = direct_step(U[:, t], None if x is None else x[:, t], wc, bias, c_t, 1.7)
        torch.testing.assert_close(h[:, t], h_t)
    torch.testing.assert_close(c, c_t)


def test_padding_holds_state_and_zeroes_output(device):
    U, x, wc, bias, c0, _, _ = make_inputs(device=device)
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[:, 1] = True
    mask = mask.to(device)
    h, c = sru_recurrence_reference(U, x, wc, bias, c0, mask_pad=mask)
    assert torch.all(h[:, 1] == 0)
    # dropping step 1 entirely gives the same state and the same other outputs
    keep = [0, 2, 3]
    h2, c2 = sru_recurrence_reference(U[:, keep], x[:, keep], wc, bias, c0)
    torch.testing.assert_close(h[:, keep], h2)
    torch.testing.assert_close(c, c2)
    # no gradient reaches padded steps
    h.sum().backward()
    assert torch.all(U.grad[:, 1] == 0) and torch.all(x.grad[:, 1] == 0)


def test_bidirectional_is_forward_on_flipped_time(device):
    U, x, wc, bias, c0, _, _ = make_inputs(bidir=True, device=device)
    h, c = sru_recurrence_reference(U, x, wc, bias, c0, bidirectional=True)
    d = D // 2
    bw = slice(d, D)
    hb, cb = sru_recurrence_reference(U[..., bw].flip(1), x[..., bw].flip(1), wc[:, bw],
                                      bias[:, bw], c0[:, bw])
    torch.testing.assert_close(h[..., bw], hb.flip(1))
    torch.testing.assert_close(c[:, bw], cb)
    hf, cf = sru_recurrence_reference(U[..., :d], x[..., :d], wc[:, :d], bias[:, :d], c0[:, :d])
    torch.testing.assert_close(h[..., :d], hf)
    torch.testing.assert_close(c[:, :d], cf)


def test_no_skip_term_and_dropout_mask(device):
    U, _, wc, bias, c0, _, _ = make_inputs(device=device)
    dm = torch.tensor([[0.0] * 3 + [2.0] * 3, [2.0] * 6], dtype=torch.float64, device=device)
    h, _ = sru_recurrence_reference(U, None, wc, bias, c0, dropout_mask=dm)
    assert torch.all(h[0, :, :3] == 0)  # m = 0 and no skip term: nothing passes
    # with a skip term, m = 0 passes the skip through unchanged
    x = torch.randn(B, L, D, dtype=torch.float64).to(device)
    h, _ = sru_recurrence_reference(U, x, wc, bias, c0, dropout_mask=dm, scale_x=2.0)
    torch.testing.assert_close(h[0, :, :3], 2.0 * x[0, :, :3])


def test_half_inputs_keep_fp32_state(device):
    U, x, wc, bias, c0, _, _ = make_inputs(dtype=torch.float32, device=device)
    for half in half_dtypes(device):  # bf16; fp16 too on CUDA
        h, c = sru_recurrence_reference(U.to(half), x.to(half), wc, bias, c0)
        assert h.dtype == half and c.dtype == torch.float32


def test_rejects_bad_k(device):
    U = torch.randn(B, L, 2, D).to(device)
    with pytest.raises(ValueError, match="k = 3 or 4"):
        sru_recurrence_reference(U, None, torch.randn(2, D).to(device),
                                 torch.randn(2, D).to(device))
