"""The fast SRU++ layer against the paper-like reference (srupp.nn.reference).

Outputs, final state, carried memory, and the gradients of every parameter, of
the inputs and of c0 must agree, independently of sru==3.0.0.dev6. The recurrence
runs on the "reference" backend (fp64 and fp32) and on "auto" (fp32: the C++
kernel where it builds), so both are checked against the reference's own loop.
"""

import math

import pytest
import torch

import srupp.ops
from srupp.nn import SRUppCell, SRUppState
from srupp.nn.reference import srupp_layer_reference

# Relative tolerance, and absolute tolerance as a fraction of the tensor's largest
# entry (parameter gradients sum over batch and time, up to ~50 here): fp64 agrees
# to ~1e-14; fp32 was measured at ~2e-6 of the largest entry.
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def check(a, b, tol, what):
    scale = max(1.0, b.abs().max().item())
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * scale,
                               msg=lambda m: f"{what}: {m}")


# name: (cell arguments, padding in the segments, carry state and memory into a 2nd segment)
CASES = {
    "attn_k3_causal_memory_heads": (dict(input_size=8, hidden_size=8, num_heads=2, causal=True),
                                    False, True),
    "attn_k4_pad_heads": (dict(input_size=6, hidden_size=8, num_heads=2), True, False),
    "linear_k4_prenorm_pad": (dict(input_size=6, hidden_size=8, use_attention=False,
                                   layer_norm=True), True, False),
    "attn_k3_postnorm_rescale_causal_memory_pad": (
        dict(input_size=8, hidden_size=8, layer_norm=True, normalize_after=True, rescale=True,
             causal=True), True, True),
    "attn_k3_prenorm_memory_no_attn_ln": (
        dict(input_size=8, hidden_size=8, layer_norm=True, attn_layer_norm=False, causal=True),
        False, True),
    "bidirectional_k4_pad": (dict(input_size=6, hidden_size=4, bidirectional=True, num_heads=2),
                             True, False),
    "bidirectional_k3_rescale_heads": (dict(input_size=8, hidden_size=4, bidirectional=True,
                                            rescale=True, num_heads=4), False, False),
}
MODES = [(torch.float64, "reference"), (torch.float32, "reference"), (torch.float32, "auto")]


def make_cell(kw, dtype):
    torch.manual_seed(0)
    cell = SRUppCell(proj_size=4, dtype=dtype, **kw).train()  # train mode, dropout 0
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # off the initial values (α = 0, LN = 1/0) so every term matters
        for p in cell.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.5)
    return cell


@pytest.mark.parametrize("dtype,backend", MODES, ids=[f"{str(d)[6:]}-{b}" for d, b in MODES])
@pytest.mark.parametrize("case", list(CASES))
def test_fast_layer_matches_reference(case, dtype, backend):
    kw, padded, two_segments = CASES[case]
    cell = make_cell(kw, dtype)
    names, params = zip(*cell.named_parameters())
    P = dict(zip(names, params))
    B, D = 3, cell.output_size
    lengths = (7, 5) if two_segments else (7,)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(L, B, kw["input_size"], generator=g, dtype=dtype).requires_grad_()
          for L in lengths]
    c0 = torch.randn(B, D, generator=g, dtype=dtype).requires_grad_()
    masks = [None] * len(lengths)
    if padded:  # right padding of different lengths, and one left-padded sequence
        masks[0] = torch.zeros(7, B, dtype=torch.bool)
        masks[0][5:, 0] = True
        masks[0][:2, 2] = True
        if two_segments:
            masks[1] = torch.zeros(5, B, dtype=torch.bool)
            masks[1][3:, 1] = True
    w_h = [torch.randn(L, B, D, generator=g, dtype=dtype) for L in lengths]
    w_c = torch.randn(B, D, generator=g, dtype=dtype)
    no_pad = lambda n: torch.zeros(n, B, dtype=torch.bool)  # noqa: E731
    scale_x = math.sqrt(1 + 2 * math.exp(-2.0)) if kw.get("rescale") else 1.0
    opts = dict(num_heads=kw.get("num_heads", 1), bidirectional=kw.get("bidirectional", False),
                causal=kw.get("causal", False), normalize_after=kw.get("normalize_after", False),
                scale_x=scale_x)

    # fast layer: SRUppCell, state (c and memory) carried from one call to the next
    with srupp.ops.use_backend(backend):
        state = SRUppState(c=c0.unsqueeze(0))
        outs, mems = [], []
        for x, m in zip(xs, masks):
            out, state = cell(x, state, mask_pad=m)
            outs.append(out)
            mems.append(state.memory[0])
        c_fast = state.c[0]
    # reference: the same segments, memory = the previous segments' pre-normed inputs
    refs, c, memory, memory_mask = [], c0, None, None
    for x, m in zip(xs, masks):
        h, c, xn = srupp_layer_reference(x, P, c0=c, mask_pad=m, memory=memory,
                                         memory_mask_pad=memory_mask, **opts)
        refs.append(h)
        M = 0 if memory is None else len(memory)
        if m is not None or memory_mask is not None:  # padding stays marked in memory
            memory_mask = torch.cat([no_pad(M) if memory_mask is None else memory_mask,
                                     no_pad(len(x)) if m is None else m], 0)
        memory = xn if memory is None else torch.cat([memory, xn], 0)

    tol = TOL[dtype]
    for i, (a, b) in enumerate(zip(outs, refs)):
        check(a, b, tol, f"output of segment {i}")
    check(c_fast, c, tol, "final c")
    if "use_attention" not in kw:
        check(mems[-1].transpose(0, 1), memory, tol, "memory")

    # gradients of every parameter, every input and c0 (allow_unused=False: the
    # reference must read every parameter of the fast layer)
    wrt = [*params, *xs, c0]

    def grads(hs, c_last):
        loss = sum((h * w).sum() for h, w in zip(hs, w_h)) + (c_last * w_c).sum()
        return torch.autograd.grad(loss, wrt)

    with srupp.ops.use_backend(backend):
        g_fast = grads(outs, c_fast)
    g_ref = grads(refs, c)
    labels = [*names, *(f"x{i}" for i in range(len(xs))), "c0"]
    for label, a, b in zip(labels, g_fast, g_ref):
        check(a, b, tol, f"grad of {label}")
