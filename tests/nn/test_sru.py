"""Plain SRU stack and SRUCell: gradients, padding, packing, layouts, bad input.

The tests that compare two ways of computing the same thing take the ``device``
fixture (``pytest --device cuda`` runs them on the GPU): modules are built and
inputs drawn on the CPU (the same values on every device), then moved. float64
(gradcheck) runs the reference recurrence on either device; fp32 runs the fast
kernel of the device (the C++ kernel on CPU, Triton on CUDA).

fp32 tolerance: ``rtol=1e-5, atol=1e-6`` on CPU, as these tests always had; on CUDA
tests/tolerances.py's fp32 figure (``atol=1e-5``): cuBLAS picks other blockings
for other shapes (padded against single runs, chunks against the whole) and
compiled Triton's exp is an approximation of a few ulps.
"""

import pytest
import torch
from torch.autograd import gradcheck
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from tolerances import tol

from srupp.nn import SRU, SRUCell

TOL = dict(rtol=1e-5, atol=1e-6)
close = torch.testing.assert_close


def fp32_tol(device):
    return TOL if device.type == "cpu" else tol(torch.float32)


def make(device="cpu", **kw):
    """A randomised SRU stack (eval mode), built on the CPU and moved to ``device``."""
    torch.manual_seed(0)
    cfg = dict(input_size=6, hidden_size=3, num_layers=2)
    cfg.update(kw)
    m = SRU(**cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return m.to(device)


CASES = {
    "plain": {},
    "bidirectional": dict(bidirectional=True),
    "k3": dict(input_size=3),
    "no_skip": dict(has_skip_term=False),
    "rescale": dict(rescale=True, input_size=3, highway_bias=-1.0),
    "projection": dict(projection_size=2),
    "layer_norm_pre": dict(layer_norm=True),
    "layer_norm_post": dict(layer_norm=True, normalize_after=True),
    "input_to_hidden": dict(proj_input_to_hidden_first=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gradcheck(case, device):
    m = make(device, **CASES[case]).double()
    L, B = 4, 2
    x = torch.randn(L, B, m.input_size, dtype=torch.float64).to(device).requires_grad_()
    c0 = torch.randn(2, B, m.output_size, dtype=torch.float64).to(device).requires_grad_()
    mask = torch.zeros(L, B, dtype=torch.bool)
    mask[-1, 0] = True
    mask = mask.to(device)

    def fn(x, c0, *ps):
        return m(x, c0, mask_pad=mask)

    assert gradcheck(fn, (x, c0, *m.parameters()), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_padded_batch_matches_single_runs(bidirectional, device):
    m = make(device, bidirectional=bidirectional)
    lengths = [4, 2, 1]
    x = torch.randn(4, 3, 6).to(device)
    mask = (torch.arange(4).unsqueeze(1) >= torch.tensor(lengths).unsqueeze(0)).to(device)
    out, c = m(x, mask_pad=mask)
    for b, n in enumerate(lengths):
        alone, c_alone = m(x[:n, b:b + 1])
        close(out[:n, b], alone[:, 0], **fp32_tol(device))
        close(c[:, b], c_alone[:, 0], **fp32_tol(device))
        assert torch.all(out[n:, b] == 0)


def test_packed_sequence(device):
    m = make(device, bidirectional=True)
    lengths = torch.tensor([3, 4, 1])  # on the CPU, as pack_padded_sequence wants them
    x = torch.randn(4, 3, 6).to(device)
    mask = (torch.arange(4).unsqueeze(1) >= lengths.unsqueeze(0)).to(device)
    padded, c = m(x, mask_pad=mask)
    packed, pc = m(pack_padded_sequence(x, lengths, enforce_sorted=False))
    close(pad_packed_sequence(packed)[0], padded, **fp32_tol(device))
    close(pc, c, **fp32_tol(device))


def test_state_continues_a_sequence(device):
    m = make(device)
    x = torch.randn(7, 2, 6).to(device)
    full, c = m(x)
    a, ca = m(x[:3])
    b, cb = m(x[3:], ca)
    close(torch.cat([a, b]), full, **fp32_tol(device))
    close(cb, c, **fp32_tol(device))


def test_batch_first_and_cell(device):
    m = make(device)
    mb = make(device, batch_first=True)
    x = torch.randn(5, 2, 6).to(device)
    out, c = m(x)
    outb, cb = mb(x.transpose(0, 1))
    close(outb.transpose(0, 1), out, **fp32_tol(device))
    close(cb, c, **fp32_tol(device))
    # a cell is one layer over the whole sequence, returning c (B, D)
    cell = SRUCell(6, 3, normalize_after=False).to(device)
    cell.load_state_dict(m.layers[0].state_dict())
    h, c1 = cell(x)
    assert h.shape == (5, 2, 3) and c1.shape == (2, 3)
    stack1 = SRU(6, 3, num_layers=1).to(device)
    stack1.layers[0].load_state_dict(m.layers[0].state_dict())
    close(h, stack1(x)[0], **fp32_tol(device))


def test_nn_rnn_compatible_return(device):
    m = make(device, bidirectional=True, nn_rnn_compatible_return=True)
    ref = make(device, bidirectional=True)
    x = torch.randn(3, 2, 6).to(device)
    _, c = m(x)
    _, c_ref = ref(x)
    assert c.shape == (4, 2, 3)  # (num_layers * directions, B, d) as nn.LSTM
    close(c[1], c_ref[0, :, 3:], **fp32_tol(device))  # layer 0, backward direction


def test_dropout_only_in_training_and_not_last_layer(device):
    m = SRU(4, 4, num_layers=2, dropout=0.5).to(device)
    assert m.layers[0].highway_dropout == 0.5 and m.layers[1].highway_dropout == 0.0
    x = torch.randn(5, 3, 4).to(device)
    m.eval()
    a, _ = m(x)
    b, _ = m(x)
    close(a, b)
    m.train()
    torch.manual_seed(0)
    c, _ = m(x)
    assert not torch.allclose(a, c)


@pytest.mark.parametrize("call,match", [
    (lambda m: m(torch.randn(2, 6)), "3-D"),
    (lambda m: m(torch.randn(4, 2, 5)), "input_size=6"),
    (lambda m: m(torch.randn(4, 2, 6, dtype=torch.float64)), "dtype"),
    (lambda m: m(torch.randn(4, 2, 6), torch.zeros(2, 3, 3)), "c0"),
    (lambda m: m(torch.randn(4, 2, 6), torch.zeros(2, 2, 3, dtype=torch.int64)), "floating"),
    (lambda m: m(torch.randn(4, 2, 6), mask_pad=torch.zeros(4, 3, dtype=torch.bool)), "mask_pad"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call(make())


def test_bad_config():
    with pytest.raises(ValueError, match="num_layers"):
        SRU(4, 4, num_layers=0)
    with pytest.raises(ValueError, match="projection_size"):
        SRU(4, 4, num_layers=2, projection_size=[2])
    with pytest.raises(TypeError):
        SRU(4, 4, 2, 0.1)  # everything after num_layers is keyword-only
