"""Causal masks given to SDPA as an offset (is_causal, causal_lower_right), not a tensor.

On CUDA a dense mask keeps SDPA off its flash kernel; the offset forms must
give what the dense mask gives, outputs and gradients. On the CPU the forms
that reach a kernel are checked (``is_causal``, and the lower-right bias that
PyTorch builds out for the CPU); ``--device cuda`` runs the same tests on the
flash and memory-efficient kernels.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from srupp.nn import SRUpp
from srupp.ops import attention as attn_mod
from srupp.ops import use_attention_backend
from srupp.ops.attention import _offset_form, _sdpa_lower_right, attention_sdpa_causal, causal_mask

from tolerances import half_dtypes, tol


def _qkv(B, H, L, S, hd, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, hd, generator=g).to(device, dtype).requires_grad_()
               for n in (L, S, S))
    return q, k, v, torch.randn(B, H, L, hd, generator=g).to(device, dtype)


def _with_grads(fn, q, k, v, go):
    o = fn(q, k, v)
    return [o, *torch.autograd.grad(o, (q, k, v), go)]


def _dense(offset):
    return lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_mask(q.shape[-2], offset, q.device))


def _dtypes(device):
    return (torch.float32, *half_dtypes(device))


def test_causal_mask_is_query_i_sees_keys_up_to_offset_plus_i():
    i, j = torch.arange(3)[:, None], torch.arange(5)[None]
    assert torch.equal(causal_mask(3, 2), j <= i + 2)
    assert torch.equal(causal_mask(4), torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("B,H,L,M,hd", [(2, 1, 7, 0, 8), (2, 2, 5, 3, 8), (1, 1, 16, 16, 32),
                                        (2, 1, 1, 4, 8), (3, 2, 9, 0, 12)])
def test_the_offset_form_equals_the_dense_mask(device, B, H, L, M, hd):
    for dtype in _dtypes(device):
        q, k, v, go = _qkv(B, H, L, M + L, hd, dtype, device)
        got = _with_grads(lambda *a: attention_sdpa_causal(*a, offset=M), q, k, v, go)
        want = _with_grads(_dense(M), q, k, v, go)
        for a, b, name in zip(got, want, ("o", "dq", "dk", "dv")):
            torch.testing.assert_close(a, b, **tol(dtype), msg=f"{dtype} {name}")


@pytest.mark.filterwarnings("ignore::UserWarning")  # a CUDA build says why no kernel fits CPU tensors
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_lower_right_bias_is_the_memory_offset(dtype):
    """What CUDA's fused kernels are given with memory, run here through PyTorch's own
    fallback: causal_lower_right(L, S) is the causal mask over S - L memory keys."""
    from torch.nn.attention.bias import causal_lower_right

    for L, M in ((5, 3), (1, 6), (8, 8)):
        q, k, v, go = _qkv(2, 2, L, M + L, 8, dtype, "cpu")
        lower_right = lambda q, k, v: F.scaled_dot_product_attention(  # noqa: E731
            q, k, v, attn_mask=causal_lower_right(L, M + L))
        got = _with_grads(lower_right, q, k, v, go)
        want = _with_grads(_dense(M), q, k, v, go)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **tol(dtype))


def test_offset_needs_as_many_keys_as_memory_and_queries():
    q, k, v, _ = _qkv(1, 1, 4, 6, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="needs S = offset"):
        attention_sdpa_causal(q, k, v, offset=1)


def test_which_causal_masks_go_as_an_offset():
    # (device, offset, a dense mask is at hand, traced) -> offset form
    assert _offset_form("cuda", 0, False, False) and _offset_form("cpu", 0, True, False)
    assert _offset_form("cuda", 0, True, True)              # is_causal compiles too
    assert _offset_form("cuda", 3, True, False)             # memory on CUDA: lower right
    assert not _offset_form("cuda", 3, True, True)          # traced: the dense mask
    assert not _offset_form("cpu", 3, True, False)          # no CPU kernel takes the offset
    assert _offset_form("cpu", 3, False, False)             # nothing else to go by
    assert not _offset_form("cuda", None, True, False)      # not causal (padding, a bias)


@pytest.fixture
def sdpa_calls(monkeypatch):
    """The attn_mask kind and is_causal of each SDPA call srupp's dispatcher makes.

    The spy replaces SDPA in srupp's view of torch.nn.functional only. Replacing it
    in torch.nn.functional itself broke CausalBias, which dispatches only when the
    function it is handed *is* torch.nn.functional's SDPA: on CUDA it then went to
    the kernel as a tensor with no data on the CPU (the first GPU run, 2026-11-27).
    """
    calls, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        kind = (None if attn_mask is None else
                "lower_right" if type(attn_mask).__name__ == "CausalBias" else "dense")
        calls.append((kind, is_causal))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    **kw)

    functional = types.SimpleNamespace(**vars(F))
    functional.scaled_dot_product_attention = spy
    monkeypatch.setattr(attn_mod, "F", functional)
    return calls


@pytest.mark.filterwarnings("ignore::UserWarning")  # a CUDA build says why no kernel fits CPU tensors
def test_the_spy_leaves_the_lower_right_bias_working(sdpa_calls):
    """The lower-right bias under the spy: recorded as such, and still the memory
    offset (the spy must not break CausalBias's own dispatch)."""
    q, k, v, go = _qkv(2, 2, 5, 8, 8, torch.float32, "cpu")
    got = _with_grads(lambda *a: _sdpa_lower_right(*a, dropout_p=0.0), q, k, v, go)
    assert sdpa_calls == [("lower_right", False)]
    for a, b in zip(got, _with_grads(_dense(3), q, k, v, go)):
        torch.testing.assert_close(a, b, **tol(torch.float32))


def _two_segments(layer, x, dtype):
    """The layer's outputs over two segments (the second attends over the first as
    memory), and the gradients of the weights and input."""
    layer.zero_grad()
    x = x.detach().to(dtype).requires_grad_()
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
        h1, state = layer(x[:, :6])
        h2, _ = layer(x[:, 6:], state)
    out = torch.cat([h1, h2], 1).float()
    out.square().sum().backward()
    return [out, x.grad, *(p.grad for p in layer.parameters())]


def test_srupp_segments_attend_through_the_offset_form(device, sdpa_calls, monkeypatch):
    """SRU++ over memory: the offset form on CUDA, the dense mask on the CPU, same results."""
    torch.manual_seed(0)
    layer = SRUpp(16, 16, proj_size=8, num_layers=2, num_heads=2, causal=True, mem_len=8,
                  batch_first=True, device=device)
    x = torch.randn(2, 11, 16, device=device)
    for dtype in _dtypes(device):
        sdpa_calls.clear()
        with use_attention_backend("sdpa"):
            got = _two_segments(layer, x, dtype)
            memory_form = "lower_right" if device.type == "cuda" else "dense"
            assert sdpa_calls[:4] == [(None, True)] * 2 + [(memory_form, False)] * 2
            with monkeypatch.context() as m:  # as before: memory always as a dense mask
                m.setattr(attn_mod, "_offset_form", lambda *a: a[1] == 0)
                want = _two_segments(layer, x, dtype)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **tol(dtype))


def test_transformer_memory_without_padding_equals_an_all_real_padding_mask(device):
    """The baseline's causal-over-memory offset against its dense mask (padding that pads
    nothing), in training, where SDPA runs: outputs and gradients."""
    from srupp.models import build_model

    torch.manual_seed(0)
    model = build_model(dict(type="transformer", vocab_size=13, d_model=16, num_layers=2,
                             num_heads=2, dropout=0.0, mem_len=8), device=device).train()
    tokens = torch.randint(0, 13, (2, 12), device=device)
    no_pad = torch.zeros(2, 6, dtype=torch.bool, device=device)
    for dtype in _dtypes(device):
        runs = []
        for pad in (None, no_pad):
            model.zero_grad()
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                first = model(tokens[:, :6], mask_pad=pad)
                second = model(tokens[:, 6:], first.state, mask_pad=pad)
            logits = torch.cat([first.logits, second.logits], 1).float()
            logits.square().mean().backward()
            runs.append([logits, *(p.grad.clone() for p in model.parameters())])
        for a, b in zip(*runs):
            torch.testing.assert_close(a, b, **tol(dtype))
