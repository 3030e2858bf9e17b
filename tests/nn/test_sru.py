"""Plain SRU stack and SRUCell: gradients, padding, packing, layouts, bad input."""

import pytest
import torch
from torch.autograd import gradcheck
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from srupp.nn import SRU, SRUCell

TOL = dict(rtol=1e-5, atol=1e-6)
close = torch.testing.assert_close


def make(**kw):
    torch.manual_seed(0)
    cfg = dict(input_size=6, hidden_size=3, num_layers=2)
    cfg.update(kw)
    m = SRU(**cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return m


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
def test_gradcheck(case):
    m = make(**CASES[case]).double()
    L, B = 4, 2
    x = torch.randn(L, B, m.input_size, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(2, B, m.output_size, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(L, B, dtype=torch.bool)
    mask[-1, 0] = True

    def fn(x, c0, *ps):
        return m(x, c0, mask_pad=mask)

    assert gradcheck(fn, (x, c0, *m.parameters()), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_padded_batch_matches_single_runs(bidirectional):
    m = make(bidirectional=bidirectional)
    lengths = [4, 2, 1]
    x = torch.randn(4, 3, 6)
    mask = torch.arange(4).unsqueeze(1) >= torch.tensor(lengths).unsqueeze(0)
    out, c = m(x, mask_pad=mask)
    for b, n in enumerate(lengths):
        alone, c_alone = m(x[:n, b:b + 1])
        close(out[:n, b], alone[:, 0], **TOL)
        close(c[:, b], c_alone[:, 0], **TOL)
        assert torch.all(out[n:, b] == 0)


def test_packed_sequence():
    m = make(bidirectional=True)
    lengths = torch.tensor([3, 4, 1])
    x = torch.randn(4, 3, 6)
    mask = torch.arange(4).unsqueeze(1) >= lengths.unsqueeze(0)
    padded, c = m(x, mask_pad=mask)
    packed, pc = m(pack_padded_sequence(x, lengths, enforce_sorted=False))
    close(pad_packed_sequence(packed)[0], padded, **TOL)
    close(pc, c, **TOL)


def test_state_continues_a_sequence():
    m = make()
    x = torch.randn(7, 2, 6)
    full, c = m(x)
    a, ca = m(x[:3])
    b, cb = m(x[3:], ca)
    close(torch.cat([a, b]), full, **TOL)
    close(cb, c, **TOL)


def test_batch_first_and_cell():
    m = make()
    mb = make(batch_first=True)
    x = torch.randn(5, 2, 6)
    out, c = m(x)
    outb, cb = mb(x.transpose(0, 1))
    close(outb.transpose(0, 1), out, **TOL)
    close(cb, c, **TOL)
    # a cell is one layer over the whole sequence, returning c (B, D)
    cell = SRUCell(6, 3, normalize_after=False)
    cell.load_state_dict(m.layers[0].state_dict())
    h, c1 = cell(x)
    assert h.shape == (5, 2, 3) and c1.shape == (2, 3)
    stack1 = SRU(6, 3, num_layers=1)
    stack1.layers[0].load_state_dict(m.layers[0].state_dict())
    close(h, stack1(x)[0], **TOL)


def test_nn_rnn_compatible_return():
    m = make(bidirectional=True, nn_rnn_compatible_return=True)
    ref = make(bidirectional=True)
    x = torch.randn(3, 2, 6)
    _, c = m(x)
    _, c_ref = ref(x)
    assert c.shape == (4, 2, 3)  # (num_layers * directions, B, d) as nn.LSTM
    close(c[1], c_ref[0, :, 3:], **TOL)  # layer 0, backward direction


def test_dropout_only_in_training_and_not_last_layer():
    m = SRU(4, 4, num_layers=2, dropout=0.5)
    assert m.layers[0].highway_dropout == 0.5 and m.layers[1].highway_dropout == 0.0
    x = torch.randn(5, 3, 4)
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
