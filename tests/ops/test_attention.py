"""srupp.ops.attention's explicit-matmul paths (full and causal-blocked) against SDPA.

Tolerances:
- fp32 and fp64: the same math in a different order, rtol=1e-5, atol=1e-6
  (fp64 also passes gradcheck).
- bf16: both paths in bf16 are compared with the fp32 reference; the bound is
  a few bf16 ulps of the O(1) outputs (atol=3e-2, rtol=2e-2): the scores are
  rounded to bf16 before the softmax, as in any bf16 matmul attention, and the
  fused kernel's own bf16 error is of the same order (checked below too).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import srupp.ops as ops
from srupp.nn import SRUpp
from srupp.ops import attention as attn_mod

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
    if causal:  # the causal path with several blocks
        blocked = _run(lambda q, k, v, *_: ops.attention_causal_matmul(q, k, v, 0, 7),
                       qb, kb, vb, go.bfloat16(), None, None)
        for a, b in zip(blocked, ref):
            torch.testing.assert_close(a.float(), b, **BF16)
    fused = _run(ops.attention_reference, qb, kb, vb, go.bfloat16(), mask, causal)
    for a, f, b in zip(got, fused, ref):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b, **BF16)
        torch.testing.assert_close(f.float(), b, **BF16)  # the fused kernel is no closer in kind


def _spy(monkeypatch):
    """Record (path, dtype) for each call of the explicit paths."""
    calls = []
    for name, cls in (("full", attn_mod._MatmulAttention),
                      ("causal", attn_mod._CausalMatmulAttention)):
        real = cls.apply
        monkeypatch.setattr(cls, "apply",
                            lambda *a, _n=name, _r=real: calls.append((_n, a[0].dtype)) or _r(*a))
    return calls


def test_dispatch_rule(monkeypatch):
    calls = _spy(monkeypatch)
    monkeypatch.setattr(attn_mod, "cpu_has_native_bf16", lambda: True)              # as on this machine
    q, k, v, _ = _qkv(2, 1, 8, 8, 4)
    bool_mask = _masks(2, 8, 8)["bool"][0]
    f32, bf16 = torch.float32, torch.bfloat16
    ops.attend(q, k, v, is_causal=True)                          # fp32 causal: blocks
    ops.attend(q, k, v, attn_mask=bool_mask)                     # fp32 masked: SDPA
    assert calls == [("causal", f32)]
    qb, kb, vb = (t.detach().bfloat16() for t in (q, k, v))
    ops.attend(qb, kb, vb, is_causal=True)                       # bf16 causal: blocks
    ops.attend(qb, kb, vb, attn_mask=bool_mask)                  # bf16 masked: matmul
    assert calls[1:] == [("causal", bf16), ("full", bf16)]
    calls.clear()
    ops.attend(qb, kb, vb, is_causal=True, dropout_p=0.1)        # dropout: SDPA
    ops.attend(*(t.half() for t in (qb, kb, vb)), is_causal=True)  # fp16: SDPA (faster)
    monkeypatch.setattr(attn_mod, "MAX_PROB_BYTES", 10)
    ops.attend(qb, kb, vb, is_causal=True)                       # P too big: SDPA
    ops.attend(q, k, v, is_causal=True)
    monkeypatch.setattr(attn_mod, "MAX_PROB_BYTES", 2**28)
    monkeypatch.setattr(attn_mod, "cpu_has_native_bf16", lambda: False)
    ops.attend(qb, kb, vb, is_causal=True)                       # emulated bf16: SDPA
    assert calls == []
    ops.attend(q, k, v, is_causal=True)                          # fp32 needs no bf16 units
    assert calls == [("causal", f32)]
    calls.clear()
    # a causal mask over memory keys, promised through causal_offset
    M = 3
    qm, km, vm, _ = _qkv(2, 1, 5, 5 + M, 4)
    causal_mem = (torch.arange(5 + M)[None] <= torch.arange(5)[:, None] + M).view(1, 1, 5, 8)
    ops.attend(qm, km, vm, attn_mask=causal_mem, causal_offset=M)
    assert calls == [("causal", f32)]
    calls.clear()
    # is_causal with L != S means SDPA's top-left alignment: left to SDPA
    qs, ks, vs, _ = _qkv(2, 1, 3, 5, 4)
    torch.testing.assert_close(ops.attend(qs, ks, vs, is_causal=True),
                               ops.attention_reference(qs, ks, vs, is_causal=True))
    assert calls == []
    with ops.use_attention_backend("matmul"):
        ops.attend(q, k, v, attn_mask=bool_mask)                 # forced, even fp32
    with ops.use_attention_backend("sdpa"):
        ops.attend(qb, kb, vb, is_causal=True)
        ops.attend(qm, km, vm, attn_mask=causal_mem, causal_offset=M)
    assert calls == [("full", f32)]
    with pytest.raises(ValueError, match="unknown srupp attention backend"):
        ops.set_attention_backend("flash")
    with pytest.raises(ValueError, match="is_causal needs"):
        ops.attention_matmul(q, k[:, :, :4], v[:, :, :4], is_causal=True)
    with pytest.raises(ValueError, match="needs S = offset"):
        ops.attention_causal_matmul(q, k, v, offset=2)


def _causal_mask(L, M):
    return (torch.arange(M + L)[None] <= torch.arange(L)[:, None] + M).view(1, 1, L, M + L)


@pytest.mark.parametrize("B,H,L,M,block", [
    (2, 1, 16, 0, 4),    # blocks that divide L
    (2, 2, 13, 0, 5),    # a short last block
    (3, 1, 9, 4, 4),     # memory keys before the queries' own
    (1, 2, 7, 6, 64),    # one block
    (2, 1, 1, 5, 4),     # one query (decoding a segment of one)
    (2, 1, 6, 0, 1),     # one row per block
])
def test_causal_path_matches_sdpa_fp32(B, H, L, M, block):
    q, k, v, go = _qkv(B, H, L, M + L, 8)
    got = _run(lambda q, k, v, *_: ops.attention_causal_matmul(q, k, v, M, block),
               q, k, v, go, None, None)
    ref = _run(ops.attention_reference, q, k, v, go, _causal_mask(L, M), False)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **FP32)


def test_causal_path_with_no_queries():
    q, k, v, _ = _qkv(2, 1, 0, 3, 4)
    o = ops.attention_causal_matmul(q, k, v, offset=3)
    assert o.shape == (2, 1, 0, 4)
    o.sum().backward()
    assert q.grad.shape == q.shape and k.grad.abs().sum() == 0


def test_causal_path_gradcheck_fp64():
    for L, M, block in [(5, 0, 2), (4, 3, 3), (6, 2, 6)]:
        q, k, v, _ = _qkv(2, 2, L, M + L, 4, dtype=torch.float64)
        assert torch.autograd.gradcheck(
            lambda q, k, v: ops.attention_causal_matmul(q, k, v, M, block), (q, k, v))


def _rel_rms(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_causal_blocks_add_little_bf16_error():
    """Accumulating dK and dV over blocks rounds to bf16 once per block; bound its cost.

    Measured at B=16, L=256, d′=128 (2 blocks): +5% / +9% relative RMS error of
    dK / dV against one block. Here, with 4 blocks, it must stay under +50%.
    """
    B, H, L, hd = 4, 1, 128, 32
    q, k, v, go = _qkv(B, H, L, L, hd, dtype=torch.float64, seed=3)
    exact = _run(ops.attention_reference, q, k, v, go, None, True)
    qb, kb, vb = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    err = {}
    for block in (L, 32):
        got = _run(lambda q, k, v, *_: ops.attention_causal_matmul(q, k, v, 0, block),
                   qb, kb, vb, go.bfloat16(), None, None)
        err[block] = [_rel_rms(a, e) for a, e in zip(got, exact)]
    for one, blocked in zip(err[L], err[32]):
        assert 0 < blocked < 1.5 * one, err
    for a in err[32]:
        assert a < 1e-2  # a few bf16 ulps (2^-8 = 3.9e-3) in relative RMS


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


def _causal_stack():
    """A small causal 2-head SRU++ stack whose attention counts, and its input (L, B, d)."""
    torch.manual_seed(0)
    m = SRUpp(32, 32, 16, num_layers=2, num_heads=2, causal=True)
    with torch.no_grad():
        for layer in m.layers:
            layer.transform.alpha.fill_(0.5)  # α starts at 0; make attention count
    return m, torch.randn(24, 4, 32, requires_grad=True)


@pytest.mark.parametrize("chunks", [1, 3])
def test_srupp_bf16_agrees_across_attention_backends(chunks):
    """Under bf16 autocast the layer's result barely depends on the attention path."""
    m, x = _causal_stack()
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


@pytest.mark.parametrize("chunks", [1, 3])
def test_srupp_fp32_same_on_every_attention_backend(chunks):
    """fp32: the stack (segments with memory included) matches SDPA to rounding."""
    m, x = _causal_stack()
    with ops.use_attention_backend("sdpa"):
        ref = _stack_grads(m, x, False, chunks)
    got = _stack_grads(m, x, False, chunks)                  # auto: the causal blocks
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_causal_mask_over_memory_promises_its_offset():
    from srupp.nn.srupp import build_attention_mask
    m = build_attention_mask(4, 3, causal=True, attn_mask=None, key_padding=None, device="cpu")
    assert m.causal_offset == 3 and m.dead_rows is None
    torch.testing.assert_close(m.mask, _causal_mask(4, 3), rtol=0, atol=0)
    padded = build_attention_mask(4, 3, causal=True, attn_mask=None,
                                  key_padding=torch.zeros(2, 7, dtype=torch.bool), device="cpu")
    assert padded.causal_offset is None                        # padding: the mask is more
    assert build_attention_mask(4, 0, causal=True, attn_mask=None, key_padding=None,
                                device="cpu").is_causal


# ------------------------------------------------------------- one query (decoding)

@pytest.mark.parametrize("B,H,S", [(1, 1, 1), (1, 1, 129), (3, 2, 9), (2, 4, 6)])
@pytest.mark.parametrize("kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hd", [16, 64])  # 64: bf16 takes the AVX512-BF16 walk where it can
def test_one_query_path_matches_sdpa(B, H, S, kind, dtype, hd):
    mask, _ = _masks(B, 1, S)[kind]
    q, k, v, _ = _qkv(B, H, 1, S, hd)
    ref = ops.attention_reference(q, k, v, mask)
    with torch.no_grad():
        got = attn_mod.attention_one_query(*(t.to(dtype) for t in (q, k, v)), mask)
    assert got.dtype == dtype and got.shape == ref.shape
    torch.testing.assert_close(got.float(), ref.detach(), **(FP32 if dtype == torch.float32
                                                             else BF16))


def test_one_query_reads_keys_of_a_cache_in_place():
    kv = torch.randn(1, 40, 2 * 16)                       # [K | V], as the SRU++ state holds it
    q = torch.randn(1, 1, 1, 16)
    k, v = (t.unsqueeze(1) for t in (kv[..., :16], kv[..., 16:]))   # (1, 1, S, hd) views
    with torch.no_grad():
        got = attn_mod.attention_one_query(q, k, v)
    torch.testing.assert_close(got, ops.attention_reference(q, k, v), **FP32)


@pytest.mark.skipif(not ops.cpu_kernels.is_available(),
                    reason="the C++ CPU extension could not be built")
# hd 256 and 500: the weighted rows' register blocks of every size (16, 8, 4, 2 and 1
# vectors, then a part-vector). bf16 heads a multiple of 32 wide up to 512 take the
# AVX512-BF16 walk where the CPU has it (32 to 512: its blocks of 8, 4, 2 and 1 pairs of
# vectors; 300 keys: two blocks); 544 does not.
@pytest.mark.parametrize("B,H,S,hd", [(1, 1, 1, 1), (1, 1, 200, 156), (2, 3, 5, 7),
                                      (1, 2, 33, 40), (3, 1, 17, 16), (0, 2, 70, 8),
                                      (2, 1, 129, 256), (1, 1, 45, 500), (1, 1, 20, 32),
                                      (2, 2, 40, 96), (1, 1, 300, 64), (1, 1, 10, 480),
                                      (1, 1, 10, 512), (1, 1, 10, 544)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_query_kernel_against_fp64(B, H, S, hd, dtype):
    # keys and values as views of one [K | V] cache (B, H, S, 2 hd), read in place;
    # q scaled so that the softmax is not flat
    g = torch.Generator().manual_seed(B * 100 + S + hd)
    kv = torch.randn(B, H, S, 2 * hd, generator=g).to(dtype)
    k, v = kv[..., :hd], kv[..., hd:]
    q = (torch.randn(B, H, 1, hd, generator=g) * 2).to(dtype)
    got = ops.cpu_kernels.function("attend_one_query")(q, k, v, hd ** -0.5)
    exact = ops.attention_reference(q.double(), k.double(), v.double())
    assert got.dtype == dtype and got.shape == (B, H, 1, hd) and got.is_contiguous()
    # fp32: sums in another order; bf16: inputs exact in fp32, one rounding of the output
    tol = FP32 if dtype == torch.float32 else dict(rtol=2 ** -8, atol=2 ** -8)
    torch.testing.assert_close(got.double(), exact, **tol)


@pytest.mark.skipif(not ops.cpu_kernels.is_available(),
                    reason="the C++ CPU extension could not be built")
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hd", [40, 64])
def test_one_query_kernel_splits_keys_over_threads(threads, dtype, hd):
    # 300 keys are two blocks (44 and 256 keys), run on the threads and merged;
    # the result is the fp64 softmax's at any count
    g = torch.Generator().manual_seed(threads)
    q = (torch.randn(1, 1, 1, hd, generator=g) * 2).to(dtype)
    k, v = (torch.randn(1, 1, 300, hd, generator=g).to(dtype) for _ in range(2))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = ops.cpu_kernels.function("attend_one_query")(q, k, v, hd ** -0.5)
    finally:
        torch.set_num_threads(before)
    exact = ops.attention_reference(q.double(), k.double(), v.double())
    tol = FP32 if dtype == torch.float32 else dict(rtol=2 ** -8, atol=2 ** -8)
    torch.testing.assert_close(got.double(), exact, **tol)


@contextlib.contextmanager
def _threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _one_query_inputs(B, S, dtype, hd=40, seed=0):
    # keys and values as views of one [K | V] cache, as decoding reads them
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(B, 1, S, 2 * hd, generator=g).to(dtype)
    q = (torch.randn(B, 1, 1, hd, generator=g) * 2).to(dtype)
    return q, kv[..., :hd], kv[..., hd:]


_needs_kernel = pytest.mark.skipif(not ops.cpu_kernels.is_available(),
                                   reason="the C++ CPU extension could not be built")


@_needs_kernel
@pytest.mark.parametrize("S", [7, 100, 300, 700])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hd", [40, 64])
def test_one_query_kernel_row_alone_is_the_row_in_a_batch(S, dtype, hd):
    """A served stream's output may not depend on who shares its step: each row alone
    (one pair, fewer than the threads) is the same bits as inside a batch of 5."""
    kernel = ops.cpu_kernels.function("attend_one_query")
    q, k, v = _one_query_inputs(5, S, dtype, hd)
    with _threads(2):
        batched = kernel(q, k, v, hd ** -0.5)
        for b in range(5):
            alone = kernel(q[b:b + 1], k[b:b + 1], v[b:b + 1], hd ** -0.5)
            assert torch.equal(alone, batched[b:b + 1]), b


@_needs_kernel
@pytest.mark.parametrize("S", [7, 100, 300, 700])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hd", [40, 64])
def test_one_query_kernel_is_the_same_at_any_thread_count(S, dtype, hd):
    kernel = ops.cpu_kernels.function("attend_one_query")
    q, k, v = _one_query_inputs(5, S, dtype, hd, seed=1)
    outs = []
    for n in (1, 2, 3):
        with _threads(n):
            outs.append((kernel(q[:1], k[:1], v[:1], hd ** -0.5), kernel(q, k, v, hd ** -0.5)))
    for one, five in outs[1:]:
        assert torch.equal(one, outs[0][0]) and torch.equal(five, outs[0][1])


def _step_args(dtype, B, M, seed, dp=40):
    """One SRU++ layer's decoding step (srupp::layer_step, the op that reads a padded
    memory) with one head of dp dims over M cached keys plus the token's own."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.3):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    from srupp.ops.matmul import FEW_ROWS
    d = 32
    return dict(x=r(B, d, scale=1.0), c=torch.randn(B, d, generator=g), w1=r(dp, d),
                w2=r(2 * dp, dp), w3=r(3 * d, dp), alpha=r(1, scale=1.0), norm_weight=None,
                norm_bias=None, attn_norm_weight=None, attn_norm_bias=None,
                weight_c=r(2, d), bias=r(2, d), kv=r(B, M + 1, 2 * dp, scale=1.0),
                memory=r(B, M + 1, d, scale=1.0), memory_pad=None, kv_start=0,
                memory_start=0, cached=M, norm_eps=1e-5, attn_norm_eps=1e-5, scale_x=1.0,
                num_heads=1, normalize_after=False, few_rows=FEW_ROWS[dtype])


def _left_pad(args, P, seed):
    """The same step with P more cached rows on the left, masked (their keys random)."""
    g = torch.Generator().manual_seed(seed)
    B, M = args["kv"].shape[0], args["cached"]
    grow = {name: torch.cat([torch.randn(B, P, args[name].shape[-1], generator=g)
                             .to(args[name].dtype), args[name]], 1)
            for name in ("kv", "memory")}
    old = (args["memory_pad"] if args["memory_pad"] is not None
           else torch.zeros(B, M, dtype=torch.bool))
    pad = torch.cat([torch.ones(B, P, dtype=torch.bool), old], 1)
    return dict(args, **grow, memory_pad=pad, cached=M + P)


@_needs_kernel
@pytest.mark.parametrize("P", [1, 50, 200, 300])
@pytest.mark.parametrize("M", [6, 99, 299])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dp", [40, 64])
def test_one_query_left_padding_changes_no_bit(M, P, dtype, dp):
    """A stream batched with longer ones has its memory left-padded: P masked keys
    before its M + 1 real ones (through layer_step, whose attention is this kernel)
    must give the same bits as none, whether the extra keys fill the first block or
    add blocks before it."""
    from srupp.ops.layer_step import layer_step
    args = _step_args(dtype, 1, M, seed=M, dp=dp)
    with _threads(2):
        h, c = layer_step(**{k: t.clone() if torch.is_tensor(t) else t
                             for k, t in args.items()})
        h_pad, c_pad = layer_step(**_left_pad(args, P, seed=P))
    assert torch.equal(h_pad, h) and torch.equal(c_pad, c)


@_needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dp", [40, 64])
def test_one_query_padded_keys_may_hold_anything(dtype, dp):
    """A batched memory's padded rows are never written (a new buffer is empty, not
    zeroed): NaN keys and infinite values there change no bit of the step."""
    from srupp.ops.layer_step import layer_step
    padded = _left_pad(_step_args(dtype, 2, 20, seed=5, dp=dp), 30, seed=6)
    garbage = dict(padded, kv=padded["kv"].clone())
    garbage["kv"][:, :30, :dp] = float("nan")
    garbage["kv"][:, :30, dp:] = float("inf")

    def step(args):
        return layer_step(**{k: t.clone() if torch.is_tensor(t) else t for k, t in args.items()})

    with _threads(2):
        (h, c), (h_bad, c_bad) = step(padded), step(garbage)
    assert torch.isfinite(h).all() and torch.equal(h_bad, h) and torch.equal(c_bad, c)


@_needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_streams_of_different_lengths_batched_as_alone(dtype):
    """The serving case: two streams of 40 and 260 cached steps, the shorter one
    left-padded to the longer, in one step of B = 2: each row is its step alone."""
    from srupp.ops.layer_step import layer_step
    long = _step_args(dtype, 1, 260, seed=2)
    own = _step_args(dtype, 1, 40, seed=1)             # the same layer, another stream
    short = dict(long, **{name: own[name] for name in ("x", "c", "kv", "memory")}, cached=40)
    short_padded = _left_pad(short, 220, seed=3)
    batch = {name: torch.cat([short_padded[name], long[name]])
             for name in ("x", "c", "kv", "memory")}
    batch = dict(long, **batch, memory_pad=torch.cat(
        [short_padded["memory_pad"], torch.zeros(1, 260, dtype=torch.bool)]))
    with _threads(2):
        h, c = layer_step(**batch)
        for row, alone in enumerate((short, long)):
            h1, c1 = layer_step(**alone)
            assert torch.equal(h[row:row + 1], h1) and torch.equal(c[row:row + 1], c1), row


def test_one_query_dispatch(monkeypatch):
    calls = []
    real = attn_mod.attention_one_query
    monkeypatch.setattr(attn_mod, "attention_one_query",
                        lambda *a: calls.append((a[0].dtype, a[0].shape[:2])) or real(*a))
    q, k, v, _ = _qkv(1, 1, 1, 5, 8)
    bf = torch.bfloat16
    kernel = ops.cpu_kernels.function("attend_one_query") is not None
    with torch.no_grad():
        ops.attend(q.bfloat16(), k.bfloat16(), v.bfloat16())      # decoding in bf16: taken
        ops.attend(q, k, v)                                      # fp32, one row: SDPA
        qb, kb, vb = (t.bfloat16() for t in _qkv(2, 3, 1, 5, 8)[:3])
        ops.attend(qb, kb, vb)                                   # bf16, 6 rows: the kernel
        ops.attend(*(t.detach() for t in _qkv(2, 3, 1, 5, 8)[:3]))  # fp32, 6 rows: the kernel
        mask = torch.ones(1, 1, 1, 5, dtype=torch.bool)
        ops.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)  # a mask: SDPA
        qb, kb, vb = (t.bfloat16() for t in _qkv(2, 1, 3, 5, 8)[:3])
        ops.attend(qb, kb, vb)                                   # 3 queries: not decoding
        ops.attend(q.double(), k.double(), v.double())           # fp64: SDPA
        with ops.use_attention_backend("sdpa"):
            ops.attend(q.bfloat16(), k.bfloat16(), v.bfloat16())
    ops.attend(q.bfloat16(), k.bfloat16(), v.bfloat16())         # a gradient is wanted
    # without the extension nothing is taken: the plain products lose to SDPA
    want = [(bf, (1, 1)), (bf, (2, 3)), (torch.float32, (2, 3))] if kernel else []
    assert calls == want
