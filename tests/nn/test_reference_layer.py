"""The fast SRU++ layer against the paper-like reference (srupp.nn.reference).

Outputs, final state, carried memory, and the gradients of every parameter, of
the inputs and of c0 must agree, independently of sru==3.0.0.dev6. The recurrence
runs on the "reference" backend (fp64 and fp32: the loop the reference layer steps
with too, srupp.ops.reference, whose equations tests/ops/test_reference.py checks;
here that checks everything around the recurrence) and on "auto" (fp32: the C++
kernel where it builds, checked against that loop).

The test takes the ``device`` fixture: ``pytest --device cuda`` runs it on the GPU
(fp32 "auto" is then the Triton recurrence, with cuBLAS and SDPA around it), and
adds bf16 and fp16 (tests/tolerances.py's ``half_dtypes``) through the fast paths.
The cell is built and the inputs drawn on the CPU, then moved (and, for the half
precisions, rounded), so every device and dtype starts from the same values.
A half-precision layer is compared with the reference run in fp32 on fp32 copies
of its very (rounded) weights and inputs: the difference is the fast layer's own
rounding.
"""

import math

import pytest
import torch
from tolerances import half_dtypes, tol as layer_tol

import srupp.ops
from srupp.nn import SRUppLayer, SRUppState
from srupp.nn.reference import srupp_layer_reference

# Relative tolerance, and absolute tolerance as a fraction of the tensor's largest
# entry (parameter gradients sum over batch and time, up to ~50 here): fp64 agrees
# to ~1e-14; fp32 was measured at ~2e-6 of the largest entry. The half precisions
# (CUDA only) take tests/tolerances.py's figures for the outputs, final state and
# memory (rounded several times between the GEMMs; simulated on the CPU, up to 0.73x
# of them for fp16 and 0.35x for bf16), and HALF_GRAD_FACTOR times those for the
# gradients: the parameters' sum half-rounded products over batch and time with
# cancellation (grad of α is one such sum), the inputs' flow back through every
# rounding; simulated on the CPU they reached 3.3x (fp16, grad of α) and 1.04x
# (bf16, grad of x) of tol(dtype).
TOL = {torch.float64: 1e-10, torch.float32: 1e-5,
       **{d: layer_tol(d)["rtol"] for d in (torch.bfloat16, torch.float16)}}
HALF_GRAD_FACTOR = 8


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


def pytest_generate_tests(metafunc):
    """Every case in every mode; with --device cuda also the half precisions on "auto"
    (plain pytest collects exactly CASES x MODES, as before)."""
    if metafunc.definition.name == "test_fast_layer_matches_reference":
        modes = list(MODES)
        if metafunc.config.getoption("device") == "cuda":
            modes += [(d, "auto") for d in half_dtypes(torch.device("cuda"))]
        metafunc.parametrize("case", list(CASES))
        metafunc.parametrize("dtype,backend", modes, ids=[f"{str(d)[6:]}-{b}" for d, b in modes])


def make_cell(kw, dtype):
    torch.manual_seed(0)
    cell = SRUppLayer(proj_size=4, dtype=dtype, **kw).train()  # train mode, dropout 0
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # off the initial values (α = 0, LN = 1/0) so every term matters
        for p in cell.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.5)
    return cell


def test_fast_layer_matches_reference(case, dtype, backend, device):
    kw, padded, two_segments = CASES[case]
    half = dtype in (torch.bfloat16, torch.float16)
    wide = torch.float32 if half else dtype          # what values are drawn (and referenced) in
    cell = make_cell(kw, wide).to(device=device, dtype=dtype)
    names, params = zip(*cell.named_parameters())
    # the reference reads the fast layer's parameters; in fp32 copies for a half layer
    P = {n: (p.detach().float().requires_grad_() if half else p) for n, p in zip(names, params)}
    B, D = 3, cell.output_size
    lengths = (7, 5) if two_segments else (7,)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(L, B, kw["input_size"], generator=g, dtype=wide)
          .to(device=device, dtype=dtype).requires_grad_() for L in lengths]
    xs_ref = [x.detach().float().requires_grad_() for x in xs] if half else xs
    c0 = torch.randn(B, D, generator=g, dtype=wide).to(device).requires_grad_()  # state: wide
    masks = [None] * len(lengths)
    if padded:  # right padding of different lengths, and one left-padded sequence
        masks[0] = torch.zeros(7, B, dtype=torch.bool)
        masks[0][5:, 0] = True
        masks[0][:2, 2] = True
        if two_segments:
            masks[1] = torch.zeros(5, B, dtype=torch.bool)
            masks[1][3:, 1] = True
        masks = [None if m is None else m.to(device) for m in masks]
    w_h = [torch.randn(L, B, D, generator=g, dtype=wide).to(device) for L in lengths]
    w_c = torch.randn(B, D, generator=g, dtype=wide).to(device)
    no_pad = lambda n: torch.zeros(n, B, dtype=torch.bool, device=device)  # noqa: E731
    scale_x = math.sqrt(1 + 2 * math.exp(-2.0)) if kw.get("rescale") else 1.0
    opts = dict(num_heads=kw.get("num_heads", 1), bidirectional=kw.get("bidirectional", False),
                causal=kw.get("causal", False), normalize_after=kw.get("normalize_after", False),
                scale_x=scale_x)

    # fast layer: SRUppLayer, state (c and memory) carried from one call to the next
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
    for x, m in zip(xs_ref, masks):
        M = 0 if memory is None else len(memory)
        pads = {}
        if m is not None or memory_mask is not None:
            # both masks, on the device: the reference would make a missing one on the CPU
            pads = dict(mask_pad=no_pad(len(x)) if m is None else m,
                        memory_mask_pad=no_pad(M) if memory_mask is None else memory_mask)
        h, c, xn = srupp_layer_reference(x, P, c0=c, memory=memory, **pads, **opts)
        refs.append(h)
        if pads:  # padding stays marked in memory
            memory_mask = torch.cat([pads["memory_mask_pad"], pads["mask_pad"]], 0)
        memory = xn if memory is None else torch.cat([memory, xn], 0)

    tol = TOL[dtype]
    for i, (a, b) in enumerate(zip(outs, refs)):
        check(a.to(b.dtype), b, tol, f"output of segment {i}")
    check(c_fast, c, tol, "final c")
    if "use_attention" not in kw:
        check(mems[-1].transpose(0, 1).to(memory.dtype), memory, tol, "memory")

    # gradients of every parameter, every input and c0 (allow_unused=False: the
    # reference must read every parameter of the fast layer)
    def grads(hs, c_last, wrt):
        loss = sum((h.to(w.dtype) * w).sum() for h, w in zip(hs, w_h)) + (c_last * w_c).sum()
        return torch.autograd.grad(loss, wrt)

    with srupp.ops.use_backend(backend):
        g_fast = grads(outs, c_fast, [*params, *xs, c0])
    g_ref = grads(refs, c, [*P.values(), *xs_ref, c0])
    labels = [*names, *(f"x{i}" for i in range(len(xs))), "c0"]
    grad_tol = tol * HALF_GRAD_FACTOR if half else tol
    for label, a, b in zip(labels, g_fast, g_ref):
        assert a.dtype == (wide if label == "c0" else dtype), label
        check(a.to(b.dtype), b, grad_tol, f"grad of {label}")
