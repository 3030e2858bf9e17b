"""SRU++ stack: gradients, execution modes that must agree, autocast, bad input.

The tests that compare two ways of computing the same thing (gradcheck, chunks,
steps and the K/V cache against one pass, padded against single runs, layouts,
compiled against eager) take the ``device`` fixture: ``pytest --device cuda``
runs them on the GPU. Modules are built and inputs drawn on the CPU (the same
values on every device), then moved. float64 (gradcheck) runs the reference
recurrence and SDPA's math kernel on either device; fp32 runs the device's fast
paths (on CUDA: cuBLAS, SDPA's kernels, the Triton recurrence).

fp32 tolerance: ``rtol=1e-5, atol=1e-6`` on CPU, as these tests always had; on CUDA
tests/tolerances.py's fp32 figure (``atol=1e-5``): cuBLAS and SDPA pick other
kernels for other shapes (a chunk against the whole sequence, one step against
a prefix) and compiled Triton's exp is an approximation of a few ulps.
"""

import pytest
import torch
from torch import nn
from torch.autograd import gradcheck
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from tolerances import half_dtypes, tol

from srupp.nn import SRUpp, SRUppLayer, SRUppState

close = torch.testing.assert_close  # fp32 defaults overridden per call: rtol=1e-5, atol=1e-6
TOL = dict(rtol=1e-5, atol=1e-6)


def fp32_tol(device):
    return TOL if device.type == "cpu" else tol(torch.float32)


def randomize(module, seed=0):
    """Move every parameter off its initial value, α included, so attention matters.
    The offsets are drawn on the CPU, so a module on any device gets the same ones."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device) * 0.3)
    return module


def make(device="cpu", **kw):
    """A randomised SRU++ stack (eval mode), built on the CPU and moved to ``device``."""
    torch.manual_seed(0)
    cfg = dict(input_size=6, hidden_size=4, proj_size=4, num_layers=2)
    cfg.update(kw)
    return randomize(SRUpp(**cfg).eval()).to(device)


# ------------------------------------------------------------------ gradcheck

GRAD_CASES = {
    "plain": {},
    "bidirectional": dict(bidirectional=True),
    "k4": dict(input_size=5),
    "rescale": dict(rescale=True, input_size=4),
    "heads": dict(num_heads=2),
    "layer_norm_pre": dict(layer_norm=True),
    "layer_norm_post": dict(layer_norm=True, normalize_after=True),
    "attention_every_2": dict(attention_every_n_layers=2),
    "causal": dict(causal=True),
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
@pytest.mark.parametrize("with_pad", [False, True])
def test_gradcheck_stack(case, with_pad, device):
    m = make(device, **GRAD_CASES[case]).double()
    L, B = 4, 2
    x = torch.randn(L, B, m.input_size, dtype=torch.float64).to(device).requires_grad_()
    c0 = torch.randn(m.num_layers, B, m.output_size,
                     dtype=torch.float64).to(device).requires_grad_()
    mask = None
    if with_pad:
        mask = torch.zeros(L, B, dtype=torch.bool)
        mask[-1, 1] = True
        mask = mask.to(device)
    params = list(m.parameters())

    def fn(x, c0, *ps):
        # the parameters are read by m in place; gradcheck perturbs them through ps
        out, state = m(x, c0, mask_pad=mask)
        return out, state.c

    assert gradcheck(fn, (x, c0, *params), eps=1e-6, atol=1e-5)


def test_gradcheck_with_memory(device):
    m = make(device, causal=True, num_heads=2).double()
    B = 2
    x = torch.randn(3, B, m.input_size, dtype=torch.float64).to(device).requires_grad_()
    mem = [torch.randn(B, 2, m.input_size if i == 0 else m.output_size,
                       dtype=torch.float64).to(device).requires_grad_()
           for i in range(m.num_layers)]
    c0 = torch.randn(m.num_layers, B, m.output_size,
                     dtype=torch.float64).to(device).requires_grad_()
    mmask = torch.tensor([[True, False], [False, False]]).to(device)

    def fn(x, c0, m0, m1, *ps):
        out, st = m(x, SRUppState(c=c0, memory=[m0, m1], memory_mask_pad=mmask))
        return out, st.c

    assert gradcheck(fn, (x, c0, *mem, *m.parameters()), eps=1e-6, atol=1e-5)


# ---------------------------------------------------------- chunked and stepwise

def run_chunks(m, x, sizes, state=None):
    outs, t = [], 0
    i = 0
    while t < x.shape[0]:
        n = sizes[i % len(sizes)]
        o, state = m(x[t:t + n], state)
        outs.append(o)
        t += n
        i += 1
    return torch.cat(outs), state


@pytest.mark.parametrize("chunk", [1, 3, 7, 12])
@pytest.mark.parametrize("mem_len", [None, 12, 20])
def test_chunks_match_one_pass(chunk, mem_len, device):
    m = make(device, causal=True, num_layers=3, num_heads=2, mem_len=mem_len, layer_norm=True)
    x = torch.randn(12, 2, 6).to(device)
    full, full_state = m(x)
    out, state = run_chunks(m, x, [chunk])
    close(out, full, **fp32_tol(device))
    close(state.c, full_state.c, **fp32_tol(device))


def test_irregular_chunks_match_one_pass(device):
    m = make(device, causal=True, num_layers=2, attention_last_n_layers=1)
    x = torch.randn(15, 3, 6).to(device)
    full, _ = m(x)
    out, _ = run_chunks(m, x, [1, 4, 2, 7])
    close(out, full, **fp32_tol(device))


def window_mask(L, allowed_from):
    """Additive (L, L) mask: query p sees keys allowed_from[p] .. p."""
    mask = torch.full((L, L), float("-inf"))
    for p in range(L):
        mask[p, allowed_from[p]:p + 1] = 0.0
    return mask


@pytest.mark.parametrize("mem_len", [0, 2, 5])
def test_token_by_token_is_a_sliding_window(mem_len, device):
    m = make(device, causal=True, num_heads=2, mem_len=mem_len)
    L = 10
    x = torch.randn(L, 2, 6).to(device)
    stepped, _ = run_chunks(m, x, [1])
    ref = make(device, num_heads=2)  # same weights, not causal: the window mask does it all
    mask = window_mask(L, [max(0, p - mem_len) for p in range(L)]).to(device)
    expected, _ = ref(x, attn_mask=mask)
    close(stepped, expected, **fp32_tol(device))


@pytest.mark.parametrize("chunk,mem_len", [(3, 2), (4, 4), (5, 3)])
def test_chunks_follow_transformer_xl(chunk, mem_len, device):
    """A chunk sees at most mem_len earlier tokens plus its own causal prefix."""
    m = make(device, causal=True, mem_len=mem_len)
    L = 11
    x = torch.randn(L, 2, 6).to(device)
    out, _ = run_chunks(m, x, [chunk])
    starts = [(p // chunk) * chunk for p in range(L)]
    mask = window_mask(L, [max(0, s - mem_len) for s in starts]).to(device)
    expected, _ = make(device)(x, attn_mask=mask)
    close(out, expected, **fp32_tol(device))


def test_user_attn_mask_is_added_to_causal(device):
    m = make(device, causal=True)
    x = torch.randn(5, 2, 6).to(device)
    extra = torch.zeros(5, 5)
    extra[:, 0] = float("-inf")  # nobody may look at position 0, except... nobody
    out, _ = m(x, attn_mask=extra.to(device))
    causal = torch.triu(torch.full((5, 5), float("-inf")), diagonal=1)
    expected, _ = make(device)(x, attn_mask=(causal + extra).to(device))
    # row 0 is fully masked: its attention output is zeros, not NaN, in both paths
    assert torch.isfinite(out).all()
    close(out, expected, **fp32_tol(device))


# ------------------------------------------------------------------ padding

@pytest.mark.parametrize("cfg", [dict(), dict(bidirectional=True), dict(causal=True),
                                 dict(input_size=5, num_heads=2, layer_norm=True)])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_matches_single_runs(cfg, side, device):
    m = make(device, **cfg)
    lengths = [5, 3, 1]
    L = max(lengths)
    seqs = [torch.randn(n, 1, m.input_size) for n in lengths]
    x = torch.zeros(L, len(lengths), m.input_size)
    mask = torch.ones(L, len(lengths), dtype=torch.bool)
    spans = []
    for b, (s, n) in enumerate(zip(seqs, lengths)):
        span = slice(0, n) if side == "right" else slice(L - n, L)
        x[span, b] = s[:, 0]
        mask[span, b] = False
        spans.append(span)
    x, mask, seqs = x.to(device), mask.to(device), [s.to(device) for s in seqs]
    out, state = m(x, mask_pad=mask)
    for b, (s, span) in enumerate(zip(seqs, spans)):
        alone, alone_state = m(s)
        close(out[span, b], alone[:, 0], **fp32_tol(device))
        close(state.c[:, b], alone_state.c[:, 0], **fp32_tol(device))
        pad = mask[:, b]
        assert torch.all(out[pad, b] == 0)


def test_packed_sequence_matches_padded(device):
    m = make(device, bidirectional=True)
    lengths = torch.tensor([2, 4, 3])  # on the CPU, as pack_padded_sequence wants them
    x = torch.randn(4, 3, 6).to(device)
    mask = (torch.arange(4).unsqueeze(1) >= lengths.unsqueeze(0)).to(device)
    padded, st = m(x, mask_pad=mask)
    packed, pst = m(pack_padded_sequence(x, lengths, enforce_sorted=False))
    unpacked, _ = pad_packed_sequence(packed)
    close(unpacked, padded, **fp32_tol(device))
    close(pst.c, st.c, **fp32_tol(device))


def test_fully_padded_sequence_gives_zeros_not_nan(device):
    m = make(device, causal=True)
    x = torch.randn(3, 2, 6).to(device)
    mask = torch.zeros(3, 2, dtype=torch.bool)
    mask[:, 1] = True
    mask = mask.to(device)
    out, state = m(x, mask_pad=mask)
    assert torch.isfinite(out).all() and torch.all(out[:, 1] == 0)
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


# ------------------------------------------------------------- layouts, state

def test_batch_first_matches_time_major(device):
    m = make(device, num_heads=2)
    mb = make(device, num_heads=2, batch_first=True)
    x = torch.randn(5, 3, 6).to(device)
    mask = torch.zeros(5, 3, dtype=torch.bool)
    mask[4, 0] = True
    mask = mask.to(device)
    out, st = m(x, mask_pad=mask)
    outb, stb = mb(x.transpose(0, 1), mask_pad=mask.T)
    close(outb.transpose(0, 1), out, **fp32_tol(device))
    close(stb.c, st.c, **fp32_tol(device))


def test_cell_is_a_one_layer_stack(device):
    torch.manual_seed(1)
    cell = randomize(SRUppLayer(6, 4, 4, causal=True, num_heads=2)).to(device)
    stack = SRUpp(6, 4, 4, num_layers=1, causal=True, num_heads=2).to(device)
    stack.layers[0].load_state_dict(cell.state_dict())
    x = torch.randn(5, 2, 6).to(device)
    a, sa = cell(x)
    b, sb = stack(x)
    close(a, b, **fp32_tol(device))
    c, _ = cell(x[3:], cell(x[:3])[1])
    close(c, a[3:], **fp32_tol(device))


def test_state_round_trip_detach_and_size(device):
    m = make(device, causal=True, mem_len=4)
    x = torch.randn(6, 2, 6).to(device).requires_grad_()
    mask = torch.zeros(6, 2, dtype=torch.bool)
    mask[0, 1] = True
    mask = mask.to(device)
    _, st = m(x, mask_pad=mask)
    assert st.memory_length == 4 and st.memory_mask_pad.shape == (2, 4)
    d = st.to_dict()
    back = SRUppState.from_dict(d)
    for k, v in back.to_dict().items():
        assert torch.equal(v, d[k])
    det = st.detach()
    assert not det.c.requires_grad and all(not t.requires_grad for t in det.memory if t is not None)
    expected = sum(t.numel() * t.element_size() for t in d.values())
    assert st.nbytes() == expected
    y1, _ = m(torch.randn(2, 2, 6).to(device), back)  # usable as a state
    assert y1.shape == (2, 2, 4)


def test_index_select_follows_sequences(device):
    m = make(device, causal=True)
    x = torch.randn(7, 3, 6).to(device)
    _, st = m(x[:4])
    idx = torch.tensor([2, 0, 0]).to(device)
    out, _ = m(x[4:, idx], st.index_select(idx))
    full, _ = m(x[:, idx])
    close(out, full[4:], **fp32_tol(device))


def test_state_mem_len_overrides_layer(device):
    m = make(device, causal=True, mem_len=2)
    st = m.initial_state(2, mem_len=5)
    assert st.c.device == m.layers[0].weight_c.device
    _, st = m(torch.randn(6, 2, 6).to(device), st)
    assert st.memory_length == 5 and st.mem_len == 5


def test_bare_c0_tensor_is_accepted(device):
    m = make(device)
    c0 = torch.randn(2, 3, 4).to(device)
    a, _ = m(torch.randn(4, 3, 6).to(device), c0)
    b, st = m(torch.randn(4, 3, 6).to(device), SRUppState(c=c0))
    assert a.shape == b.shape


# ----------------------------------------------------------------- autocast

# against the fp32 run: bf16 has 8 bits of mantissa, fp16 11 (8x finer)
AUTOCAST_TOL = {torch.bfloat16: dict(rtol=0.05, atol=0.05),
                torch.float16: dict(rtol=0.05 / 8, atol=0.05 / 8)}


def test_bf16_autocast_dtypes(device):
    """Autocast to bf16 (and on CUDA to fp16 too, tests/tolerances.py's half_dtypes)."""
    m = make(device, causal=True, layer_norm=True, normalize_after=True, num_layers=3)
    x = torch.randn(5, 2, 6).to(device)
    ref, _ = m(x)
    for half in half_dtypes(device):
        with torch.autocast(device.type, dtype=half):
            out, st = m(x)
            out2, st2 = m(x, st)
        assert out.dtype == half and out2.dtype == half
        assert st.c.dtype == torch.float32
        assert st.memory[0].dtype == torch.float32          # layer 0's input is the fp32 x
        assert st.memory[1].dtype == half                   # later layers get half h
        close(out.float(), ref, **AUTOCAST_TOL[half])


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("call,match", [
    (lambda m: m(torch.randn(5, 6)), "3-D"),
    (lambda m: m(torch.randn(5, 2, 7)), "input_size=6"),
    (lambda m: m(torch.randn(5, 2, 6).double()), "dtype"),
    (lambda m: m(torch.randn(5, 2, 6), torch.zeros(2, 3, 4)), r"\(2, 2, 4\)"),
    (lambda m: m(torch.randn(5, 2, 6), torch.zeros(2, 2, 4, dtype=torch.float64)), "dtype"),
    (lambda m: m(torch.randn(5, 2, 6), SRUppState(c=torch.zeros(3, 2, 4))), "3 layers"),
    (lambda m: m(torch.randn(5, 2, 6), mask_pad=torch.zeros(2, 5, dtype=torch.bool)), r"\(5, 2\)"),
    (lambda m: m(torch.randn(5, 2, 6), mask_pad=torch.zeros(5, 2)), "bool"),
    (lambda m: m(torch.randn(5, 2, 6), attn_mask=torch.zeros(5, 6)), r"\(5, 5\)"),
    (lambda m: m(torch.randn(5, 2, 6), "state"), "SRUppState"),
])
def test_bad_input_is_a_clear_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call(make())


def test_state_from_another_batch_or_config():
    m = make(causal=True)
    _, st = m(torch.randn(3, 2, 6))
    with pytest.raises(ValueError, match="B, D"):
        m(torch.randn(3, 4, 6), st)
    other = make(causal=True, input_size=5)
    with pytest.raises(ValueError, match="input_size"):
        other(torch.randn(3, 2, 5), st)


@pytest.mark.parametrize("kw,match", [
    (dict(causal=True, bidirectional=True), "causal"),
    (dict(num_heads=3), "num_heads"),
    (dict(attention_every_n_layers=2, attention_last_n_layers=1), "not both"),
    (dict(attention_every_n_layers=0), "attention_every_n_layers must be >= 1"),
    (dict(num_layers=2, attention_last_n_layers=3), r"0..num_layers \(2\), got 3"),
    (dict(mem_len=-1), "mem_len"),
    (dict(dropout=1.0), "dropout"),
])
def test_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        SRUpp(6, 4, 4, **kw)


def test_attention_layout():
    m = SRUpp(4, 4, 4, num_layers=4, attention_every_n_layers=2)
    assert [layer.use_attention for layer in m.layers] == [False, True, False, True]
    m = SRUpp(4, 4, 4, num_layers=4, attention_last_n_layers=1)
    assert [layer.use_attention for layer in m.layers] == [False, False, False, True]


def test_device_dtype_factory_kwargs(device):
    m = SRUpp(6, 4, 4, dtype=torch.float64, device=device)
    assert all(p.dtype == torch.float64 and p.device.type == device.type
               for p in m.parameters())
    out, st = m(torch.randn(3, 2, 6, dtype=torch.float64).to(device))
    assert out.dtype == torch.float64 and st.c.dtype == torch.float64
    assert out.device.type == st.c.device.type == device.type


# ------------------------------------------------------------- the K/V cache

def test_kv_cache_gives_the_same_decoding(device):
    m = make(device, causal=True, num_heads=2, mem_len=4)
    x = torch.randn(9, 2, 6).to(device)
    with torch.no_grad():
        cached, st = run_chunks(m, x, [1])
        assert any(kv is not None for kv in st.kv_cache)
        with torch.enable_grad():
            uncached, st2 = run_chunks(m, x, [1])  # grad mode: no cache is kept
        assert all(kv is None for kv in st2.kv_cache)
        close(cached, uncached.detach(), **fp32_tol(device))


def _fresh_parameter(w):
    """A new Parameter (version 0) over the same storage as w: same address."""
    return nn.Parameter(w.data, requires_grad=w.requires_grad)


def _old_cache_key(attention):
    """The key the K/V cache used to be checked by: (address, version) of W1 and W2."""
    w1, w2 = attention.linear1.weight, attention.linear2.weight
    return (w1.data_ptr(), w1._version, w2.data_ptr(), w2._version)


def _swap_same_address(m):
    """New weights at the old address, version 0: an (address, version) key cannot tell."""
    t = m.layers[0].transform
    before = _old_cache_key(t)
    t.linear2.weight = _fresh_parameter(t.linear2.weight)
    t.linear2.weight.data.mul_(1.5)  # through .data: no version bump
    assert _old_cache_key(t) == before  # the old check would have reused stale K and V


def _in_place(m):
    m.layers[0].transform.linear2.weight.mul_(1.5)


def _load_state_dict(m):
    other = make(causal=True, num_heads=2, mem_len=4)  # on the CPU: copied into m's device
    randomize(other, seed=5)
    m.load_state_dict(other.state_dict())


def _assign_data(m):
    w = m.layers[0].transform.linear1.weight
    w.data = w.data * 1.5


@pytest.mark.parametrize("change", [_swap_same_address, _in_place, _load_state_dict,
                                    _assign_data])
def test_kv_cache_is_dropped_when_the_weights_change(change, device):
    """After any change of W1 or W2, decoding on gives what a fresh computation gives."""
    m = make(device, causal=True, num_heads=2, mem_len=4)
    for layer in m.layers:  # fresh Parameters: every weight at version 0
        t = layer.transform
        t.linear1.weight = _fresh_parameter(t.linear1.weight)
        t.linear2.weight = _fresh_parameter(t.linear2.weight)
    x = torch.randn(5, 2, 6).to(device)
    with torch.no_grad():
        _, st = run_chunks(m, x, [1])
        assert all(kv.valid_for(layer.transform.kv_weights, 4)
                   for kv, layer in zip(st.kv_cache, m.layers))
        change(m)
        nxt = torch.randn(2, 6).to(device)
        a, st_a = m.step(nxt, st)
        b, st_b = m.step(nxt, st.drop_kv_cache())
        close(a, b, **fp32_tol(device))
        full, _ = m(nxt.unsqueeze(0), SRUppState(c=st.c, memory=st.memory, mem_len=st.mem_len))
        close(a, full[0], **fp32_tol(device))
        assert all(kv.valid_for(layer.transform.kv_weights, 4)
                   for kv, layer in zip(st_a.kv_cache, m.layers))


def test_kv_cache_follows_detach_index_select_and_to(device):
    m = make(device, causal=True, num_heads=2, mem_len=4)
    with torch.no_grad():
        _, st = run_chunks(m, torch.randn(5, 3, 6).to(device), [1])
        idx = torch.tensor([2, 0]).to(device)
        for moved in (st.detach(), st.to(device), st.index_select(idx)):
            for kv, layer in zip(moved.kv_cache, m.layers):
                assert kv.valid_for(layer.transform.kv_weights, 4)
        picked = st.index_select(idx)
        assert torch.equal(picked.kv_cache[0].kv, st.kv_cache[0].kv[idx])
        nxt = torch.randn(2, 6).to(device)
        a, _ = m.step(nxt, picked)
        b, _ = m.step(nxt, picked.drop_kv_cache())
        close(a, b, **fp32_tol(device))


# ----------------------------------------------------------------- compiled

def test_compiled_stack_matches_eager_without_graph_breaks(device):
    """torch.compile(fullgraph=True) traces the whole stack, memory and state included."""
    import torch._dynamo

    torch._dynamo.reset()
    m = make(device, causal=True, num_heads=2, mem_len=4, layer_norm=True)
    x = torch.randn(5, 2, 6).to(device)
    _, st0 = m(torch.randn(3, 2, 6).to(device))
    st0 = st0.detach()

    def f(x, c0, m0, m1):
        out, st = m(x, SRUppState(c=c0, memory=[m0, m1], mem_len=4))
        return out.square().sum() + st.c.sum()

    def value_and_grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (x, st0.c, *st0.memory)]
        params = list(m.parameters())
        out = fn(*leaves)
        return [out.detach(), *torch.autograd.grad(out, leaves + params)]

    # aot_eager: dynamo with fullgraph (any graph break raises) and AOT autograd,
    # without inductor's slow cold C++ compile
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for a, b in zip(value_and_grads(compiled), value_and_grads(f)):
        close(a, b, **fp32_tol(device))


# ------------------------------------------------------------ step (decoding)

STEP_CASES = {
    "plain": dict(causal=True),
    "heads_mem2": dict(causal=True, num_heads=2, mem_len=2),
    "mem0": dict(causal=True, mem_len=0),
    "k4": dict(causal=True, input_size=5),
    "proj_first": dict(causal=True, input_size=5, proj_input_to_hidden_first=True),
    "layer_norm_pre": dict(causal=True, layer_norm=True),
    "layer_norm_post": dict(causal=True, layer_norm=True, normalize_after=True),
    "attention_every_2": dict(causal=True, num_layers=3, attention_every_n_layers=2),
    "no_attention": dict(causal=True, attention_last_n_layers=0),
}


@pytest.mark.parametrize("case", list(STEP_CASES))
def test_step_matches_forward_token_by_token(case, device):
    cfg = STEP_CASES[case]
    m = make(device, **cfg)
    n_in = cfg.get("input_size", 6)
    x = torch.randn(8, 3, n_in).to(device)
    with torch.no_grad():
        # a 3-token prefix by forward, then one token per call
        expected, exp_state = run_chunks(m, x, [3, 1, 1, 1, 1, 1])
        prefix, state = m(x[:3])
        outs = [prefix]
        for t in range(3, 8):
            h, state = m.step(x[t], state)
            assert h.shape == (3, m.output_size)
            outs.append(h.unsqueeze(0))
    close(torch.cat(outs), expected, **fp32_tol(device))
    close(state.c, exp_state.c, **fp32_tol(device))
    for a, b in zip(state.memory, exp_state.memory):
        assert (a is None) == (b is None)
        if a is not None:
            close(a, b, **fp32_tol(device))


def test_step_from_no_state_and_after_left_padding(device):
    m = make(device, causal=True, num_heads=2, batch_first=True)
    x = torch.randn(2, 6, 6).to(device)
    pad = torch.tensor([[True, True, False, False, False, False],
                        [False] * 6]).to(device)
    with torch.no_grad():
        # row 0 alone (its 4 real tokens), stepped from no state after the first
        alone, _ = m(x[:1, 2:])
        h0, st0 = m.step(x[0, 2:3], None)
        close(h0, alone[0, :1], **fp32_tol(device))
        # the padded batch: prefix by forward with padding, then steps keep the key mask
        out, st = m(x[:, :4], mask_pad=pad[:, :4])
        assert st.memory_mask_pad is not None
        steps = []
        for t in range(4, 6):
            h, st = m.step(x[:, t], st)
            steps.append(h)
        assert st.memory_mask_pad.shape == (2, 6)
        close(torch.stack(steps, 1)[0], alone[0, 2:], **fp32_tol(device))
        full, _ = m(x[1:])
        close(torch.stack(steps, 1)[1], full[0, 4:], **fp32_tol(device))


def test_step_bad_input():
    m = make(causal=True)
    with pytest.raises(ValueError, match="input_size=6"):
        m.step(torch.randn(2, 5))
    with pytest.raises(ValueError, match="batch"):
        m.step(torch.randn(3, 6), m.initial_state(2))
    with pytest.raises(ValueError, match="unidirectional"):
        make(bidirectional=True).step(torch.randn(2, 6))


# ------------------------------------------------------ padded states and joins

def assert_same_state_bits(a: SRUppState, b: SRUppState):
    """Equal tensors (c, memory, mask, cached K/V) and mem_len."""
    assert a.mem_len == b.mem_len and torch.equal(a.c, b.c)
    for x, y in zip(a.memory + [a.memory_mask_pad], b.memory + [b.memory_mask_pad]):
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y))
    for x, y in zip(a.kv_cache, b.kv_cache):
        assert (x is None) == (y is None) and (x is None or torch.equal(x.kv, y.kv))


@pytest.mark.parametrize("case", ["plain", "heads_mem2", "attention_every_2"])
def test_padded_state_decodes_as_the_initial_state_and_keeps_its_window(case, device):
    m = make(device, **STEP_CASES[case])  # the layers' mem_len: the padded state's overrides
    x = torch.randn(7, 2, 6).to(device)
    with torch.no_grad():
        padded = m.padded_state(2, 5)
        assert padded.memory_length == 5 and padded.mem_len == 5
        assert padded.memory_mask_pad.shape == (2, 5) and bool(padded.memory_mask_pad.all())
        assert not padded.c.any() and padded.c.dtype == torch.float32
        assert [mem is not None for mem in padded.memory] == [la.use_attention for la in m.layers]
        want, st_want = run_chunks(m, x, [3, 1], m.initial_state(2, mem_len=5))
        outs, st = [], padded
        for t, n in ((0, 3), (3, 1), (4, 1), (5, 2)):  # chunks, then steps
            if n == 1:
                h, st = m.step(x[t], st)
                outs.append(h.unsqueeze(0))
            else:
                o, st = m(x[t:t + n], st)
                outs.append(o)
            assert st.memory_length == 5 and st.memory_mask_pad.shape == (2, 5)  # always
        close(torch.cat(outs), want, **fp32_tol(device))
        close(st.c, st_want.c, **fp32_tol(device))
        assert not st.memory_mask_pad.any()  # 7 tokens: the padding has slid out
        for a, b in zip(st.memory, st_want.memory):
            assert (a is None) == (b is None)
            if a is not None:
                close(a, b, **fp32_tol(device))


def test_padded_state_without_memory_is_the_initial_state(device):
    m = make(device, causal=True)
    for state in (m.padded_state(3, 0), make(device, causal=True, attention_last_n_layers=0)
                  .padded_state(3, 4)):
        assert state.memory_length == 0 and state.memory_mask_pad is None
        assert state.c.shape == (2, 3, 4) and not state.c.any()
    half = m.padded_state(1, 4, dtype=torch.bfloat16)
    assert half.memory[0].dtype == torch.bfloat16 and half.c.dtype == torch.float32
    assert half.memory[0].device == half.c.device == m.layers[0].weight_c.device


def test_state_cat_joins_rows_as_index_select_splits_them(device):
    m = make(device, causal=True, num_heads=2, mem_len=4)
    x = torch.randn(6, 3, 6).to(device)
    with torch.no_grad():
        _, st = m(x, m.padded_state(3, 4))  # under no_grad: with cached keys and values
        assert all(kv is not None for kv in st.kv_cache)
        order = [0, 2, 1]
        joined = SRUppState.cat([st.index_select([0, 2]), st.index_select([1])])
        assert_same_state_bits(joined, st.index_select(order))
        assert all(kv.valid_for(layer.transform.kv_weights, 4)  # kept: same weights
                   for kv, layer in zip(joined.kv_cache, m.layers))
        assert SRUppState.cat([st]) is st
        nxt = torch.randn(3, 6).to(device)
        h, _ = m.step(nxt, joined)
        for i, row in enumerate(order):  # each row decodes as it would alone
            alone, _ = m.step(nxt[i:i + 1], st.index_select([row]))
            close(h[i], alone[0], **fp32_tol(device))
        # a state without cached keys: the join keeps none (the next call recomputes them)
        bare = SRUppState.cat([st.index_select([0]), st.index_select([1]).drop_kv_cache()])
        assert all(kv is None for kv in bare.kv_cache)
        close(m.step(nxt[:2], bare)[0], m.step(nxt[:2], st.index_select([0, 1]))[0],
              **fp32_tol(device))


def test_state_cat_with_room_appends_in_place(device):
    """``room=True`` (a serving engine's batch): the same state, in buffers the next
    step appends to in place (a plain cat's next step copies it into a new buffer)."""
    m = make(device, causal=True, mem_len=4)
    x = torch.randn(6, 3, 6).to(device)
    with torch.no_grad():
        _, st = m(x, m.padded_state(3, 4))
        parts = [st.index_select([0, 2]), st.index_select([1])]
        for roomy, plain in ((SRUppState.cat(parts, room=True), SRUppState.cat(parts)),
                             (SRUppState.cat([st], room=True), st)):
            assert_same_state_bits(roomy, plain)
            nxt = torch.randn(roomy.batch_size, 6).to(device)
            (h1, after), (h2, _) = m.step(nxt, roomy), m.step(nxt, plain)
            assert torch.equal(h1, h2)
            for before, now in zip(roomy.memory + [kv.kv for kv in roomy.kv_cache],
                                   after.memory + [kv.kv for kv in after.kv_cache]):
                assert now.untyped_storage().data_ptr() == before.untyped_storage().data_ptr()
        assert SRUppState.cat([st], room=True) is not st


def test_state_keep_rows_moves_rows_to_the_front_in_place(device):
    """keep_rows (a serving engine dropping finished streams): the state index_select gives,
    in the same buffers (no second batch allocated), decoding on to the same results and
    appending in place; rows out of order or out of range are a ValueError."""
    m = make(device, causal=True, mem_len=4)
    x = torch.randn(6, 4, 6).to(device)
    with torch.no_grad():
        _, st = m(x, m.padded_state(4, 4))
        st = SRUppState.cat([st], room=True)  # the engine's batch: buffers with room
        want = st.index_select([1, 3])
        storage = [t.untyped_storage().data_ptr() for t in st.memory]
        kept = st.keep_rows([1, 3])
        assert_same_state_bits(kept, want)
        assert [t.untyped_storage().data_ptr() for t in kept.memory] == storage
        nxt = torch.randn(2, 6).to(device)
        (h1, after), (h2, _) = m.step(nxt, kept), m.step(nxt, want)
        assert torch.equal(h1, h2)
        assert [t.untyped_storage().data_ptr() for t in after.memory] == storage
        for bad in ([3, 1], [1, 1], [0, 4]):
            with pytest.raises(ValueError, match="keep_rows: rows must be ascending"):
                st.keep_rows(bad)


def test_state_put_row_writes_one_row_in_place(device):
    """put_row overwrites one row with another state's (a freed slot of a serving batch):
    that row is then bit for bit the new state, the other rows and the tensors' identity
    are untouched, and the row decodes as the new state would alone."""
    m = make(device, causal=True, num_heads=2, mem_len=4)
    with torch.no_grad():
        _, batch = m(torch.randn(5, 3, 6).to(device), m.padded_state(3, 4))
        _, new = m(torch.randn(2, 1, 6).to(device), m.padded_state(1, 4))
    before = batch.index_select([0, 2])
    tensors = [batch.c, *batch.memory, batch.memory_mask_pad, *(kv.kv for kv in batch.kv_cache)]
    batch.put_row(1, new)
    assert_same_state_bits(batch.index_select([1]), new)
    assert_same_state_bits(batch.index_select([0, 2]), before)
    assert [batch.c, *batch.memory, batch.memory_mask_pad,
            *(kv.kv for kv in batch.kv_cache)] == tensors  # in place: the same objects
    nxt = torch.randn(3, 6).to(device)
    with torch.no_grad():
        h, _ = m.step(nxt, batch)
        alone, _ = m.step(nxt[1:2], new)
    close(h[1], alone[0], **fp32_tol(device))
    with pytest.raises(ValueError, match="keys and values are cached"):
        batch.put_row(0, new.drop_kv_cache())
    with pytest.raises(ValueError, match="batch size 1"):
        batch.put_row(0, batch)


def test_state_cat_fills_a_missing_padding_mask_and_refuses_other_lengths():
    g = torch.Generator().manual_seed(0)
    mem = lambda b, n: [torch.randn(b, n, 6, generator=g), None]  # noqa: E731
    masked = SRUppState(c=torch.randn(2, 1, 4, generator=g), memory=mem(1, 3),
                        memory_mask_pad=torch.tensor([[True, False, False]]), mem_len=3)
    plain = SRUppState(c=torch.randn(2, 2, 4, generator=g), memory=mem(2, 3), mem_len=3)
    joined = SRUppState.cat([plain, masked])
    assert joined.batch_size == 3 and joined.memory[1] is None
    assert joined.memory_mask_pad.tolist() == [[False] * 3, [False] * 3, [True, False, False]]
    assert torch.equal(joined.memory[0], torch.cat([plain.memory[0], masked.memory[0]]))
    assert torch.equal(joined.c, torch.cat([plain.c, masked.c], 1))
    longer = SRUppState(c=torch.randn(2, 1, 4), memory=mem(1, 4), mem_len=3)
    other_len = SRUppState(c=torch.randn(2, 1, 4), memory=mem(1, 3), mem_len=5)
    for states in ([plain, longer], [plain, other_len]):
        with pytest.raises(ValueError, match="memory length"):
            SRUppState.cat(states)
    with pytest.raises(ValueError, match="at least one"):
        SRUppState.cat([])
