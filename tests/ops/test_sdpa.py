"""srupp.ops.sdpa's explicit-matmul path against its reference, SDPA.

Tolerances:
- fp32 and fp64: the same math in a different order, rtol=1e-5, atol=1e-6
  (fp64 also passes gradcheck).
- bf16: both paths in bf16 are compared with the fp32 reference; the bound is
  a few bf16 ulps of the O(1) outputs (atol=3e-2, rtol=2e-2): the scores are
  rounded to bf16 before the softmax, as in any bf16 matmul attention, and the
  fused kernel's own bf16 error is of the same order (checked below too).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import srupp.ops as ops
from srupp.nn import SRUpp
from srupp.ops import sdpa as attn_mod

FP32 = dict(rtol=1e-5, atol=1e-6)
BF16 = dict(rtol=2e-2, atol=3e-2)


def _qkv(B, H, L, S, hd, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, hd, generator=g).to(dtype).requires_grad_()
               for n in (L, S, S))
    go = torch.randn(B, H, L, hd, generator=g).to(dtype)
    return q, k, v, go


def _masks(B, L, S):
    """The kinds of mask the SRU++ stack builds: causal, bool with padding, additive."""
    M = S - L
    j, i = torch.arange(S), torch.arange(L)
    allowed = (j[None] <= i[:, None] + M).view(1, 1, L, S)
    pad = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    pad[0, ..., :2] = True                                    # padded keys in sequence 0
    bool_mask = (allowed & ~pad) | ~(allowed & ~pad).any(-1, keepdim=True)
    additive = torch.randn(1, 1, L, S, generator=torch.Generator().manual_seed(5))
    additive = additive.masked_fill(~allowed, float("-inf"))
    return {"none": (None, False), "bool": (bool_mask, False), "additive": (additive, False)}


def _run(fn, q, k, v, go, mask, causal):
    o = fn(q, k, v, mask, causal)
    return [o, *torch.autograd.grad(o, (q, k, v), go)]


CASES = [(2, 1, 7, 7), (3, 2, 5, 9), (1, 1, 1, 1), (2, 4, 1, 6), (2, 1, 16, 16)]


@pytest.mark.parametrize("B,H,L,S", CASES)
@pytest.mark.parametrize("kind", ["none", "bool", "additive", "causal"])
def test_matmul_path_matches_sdpa_fp32(B, H, L, S, kind):
    if kind == "causal":
        mask, causal = None, True
        S = L
    else:
        mask, causal = _masks(B, L, S)[kind]
    q, k, v, go = _qkv(B, H, L, S, 8)
    got = _run(ops.attention_matmul, q, k, v, go, mask, causal)
    ref = _run(ops.attention_reference, q, k, v, go, mask, causal)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **FP32)


def test_matmul_path_gradcheck_fp64():
    for mask, causal in [(None, True), _masks(2, 3, 5)["bool"], _masks(2, 3, 5)["additive"]]:
        L, S = (3, 3) if causal else (3, 5)
        q, k, v, _ = _qkv(2, 2, L, S, 4, dtype=torch.float64)
        assert torch.autograd.gradcheck(
            lambda q, k, v: ops.attention_matmul(q, k, v, mask, causal), (q, k, v))


@pytest.mark.parametrize("kind", ["causal", "bool", "additive"])
def test_bf16_path_within_bf16_error_of_fp32(kind):
    B, H, L, S, hd = 2, 2, 24, 24 if kind == "causal" else 30, 16
    mask, causal = (None, True) if kind == "causal" else _masks(B, L, S)[kind]
    q, k, v, go = _qkv(B, H, L, S, hd)
    ref = _run(ops.attention_reference, q, k, v, go, mask, causal)
    qb, kb, vb = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    got = _run(ops.attention_matmul, qb, kb, vb, go.bfloat16(), mask, causal)
    fused = _run(ops.attention_reference, qb, kb, vb, go.bfloat16(), mask, causal)
    for a, f, b in zip(got, fused, ref):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b, **BF16)
        torch.testing.assert_close(f.float(), b, **BF16)  # the fused kernel is no closer in kind


def test_dispatch_rule(monkeypatch):
    calls = []
    real = attn_mod._MatmulAttention.apply
    monkeypatch.setattr(attn_mod._MatmulAttention, "apply",
                        lambda *a: calls.append(a[0].dtype) or real(*a))
    q, k, v, _ = _qkv(2, 1, 8, 8, 4)
    ops.attention(q, k, v, is_causal=True)                          # fp32: SDPA
    assert calls == []
    qb, kb, vb = (t.detach().bfloat16() for t in (q, k, v))
    monkeypatch.setattr(attn_mod, "_native_bf16", True)              # as on this machine
    ops.attention(qb, kb, vb, is_causal=True)                       # bf16 CPU: matmul
    assert calls == [torch.bfloat16]
    ops.attention(qb, kb, vb, is_causal=True, dropout_p=0.1)        # dropout: SDPA
    ops.attention(*(t.half() for t in (qb, kb, vb)), is_causal=True)  # fp16: SDPA (faster)
    monkeypatch.setattr(attn_mod, "MAX_PROB_BYTES", 10)
    ops.attention(qb, kb, vb, is_causal=True)                       # P too big: SDPA
    assert len(calls) == 1
    monkeypatch.setattr(attn_mod, "MAX_PROB_BYTES", 2**28)
    monkeypatch.setattr(attn_mod, "_native_bf16", False)
    ops.attention(qb, kb, vb, is_causal=True)                       # emulated bf16: SDPA
    assert len(calls) == 1
    with ops.use_attention_backend("matmul"):
        ops.attention(q, k, v, is_causal=True)                      # forced, even fp32
    with ops.use_attention_backend("sdpa"):
        ops.attention(qb, kb, vb, is_causal=True)
    assert calls == [torch.bfloat16, torch.float32]
    with pytest.raises(ValueError, match="unknown srupp attention backend"):
        ops.set_attention_backend("flash")
    with pytest.raises(ValueError, match="is_causal needs"):
        ops.attention_matmul(q, k[:, :, :4], v[:, :, :4], is_causal=True)


def _stack_grads(m, x, bf16, chunks=1):
    """Output and all gradients of a stack run in ``chunks`` segments with memory."""
    out, state, outs = None, None, []
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for part in x.chunk(chunks, dim=0):
            out, state = m(part, state)
            outs.append(out)
    out = torch.cat(outs).float()
    loss = (out * torch.linspace(-1, 1, out.shape[-1])).sum()
    return [out, *torch.autograd.grad(loss, [x, *m.parameters()])]


@pytest.mark.parametrize("chunks", [1, 3])
def test_srupp_bf16_agrees_across_attention_backends(chunks):
    """Under bf16 autocast the layer's result barely depends on the attention path."""
    torch.manual_seed(0)
    m = SRUpp(32, 32, 16, num_layers=2, num_heads=2, causal=True)
    with torch.no_grad():
        for layer in m.layers:
            layer.transform.alpha.fill_(0.5)  # α starts at 0; make attention count
    x = torch.randn(24, 4, 32, requires_grad=True)
    with ops.use_attention_backend("sdpa"):
        ref = _stack_grads(m, x, True, chunks)
    with ops.use_attention_backend("matmul"):
        got = _stack_grads(m, x, True, chunks)
    with ops.use_attention_backend("sdpa"):
        exact = _stack_grads(m, x, False, chunks)
    for a, b, e in zip(got, ref, exact):
        scale = e.abs().max().clamp_min(1.0)
        # both bf16 runs are within bf16 error of fp32, measured relative to each tensor's size
        assert (a - e).abs().max() / scale < 5e-2
        assert (b - e).abs().max() / scale < 5e-2


def test_matmul_path_is_bitwise_repeatable():
    q, k, v, go = _qkv(2, 2, 12, 12, 8, dtype=torch.bfloat16)
    runs = [_run(ops.attention_matmul, q, k, v, go, None, True) for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
