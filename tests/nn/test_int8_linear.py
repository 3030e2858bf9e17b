"""Int8Linear and quantize_linears (srupp.nn.quant)."""

import pytest
import torch
from torch import nn

from srupp.nn import SRUpp
from srupp.nn.linear import Linear
from srupp.nn.quant import Int8Linear, quantize_linears
from srupp.ops.quant import linear_int8_reference


def test_from_linear_keeps_the_product_within_quantization_error():
    torch.manual_seed(0)
    lin = nn.Linear(32, 12)
    q = Int8Linear.from_linear(lin)
    assert q.weight.dtype == torch.int8 and q.scale.shape == (12,) and not q.training
    x = torch.randn(5, 32)
    with torch.no_grad():
        torch.testing.assert_close(q(x), linear_int8_reference(x, q.weight, q.scale, q.bias))
        # per weight at most scale / 2 off: |Δy| <= Σ|x| · max(scale) / 2
        bound = x.abs().sum(-1, keepdim=True) * q.scale.max() / 2
        assert bool(((q(x) - lin(x)).abs() <= bound).all())
    assert set(q.state_dict()) == {"weight", "scale", "bias"}


def test_to_bf16_keeps_the_weight_int8():
    q = Int8Linear.from_linear(Linear(16, 8, bias=False)).to(torch.bfloat16)
    assert q.weight.dtype == torch.int8 and q.scale.dtype == torch.float32 and q.bias is None
    with torch.no_grad():
        assert q(torch.randn(2, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_training_and_gradients_are_refused():
    q = Int8Linear.from_linear(nn.Linear(4, 3))
    with pytest.raises(ValueError, match="inference only"):
        q.train()
    with pytest.raises(ValueError, match="no_grad"):
        q(torch.randn(2, 4, requires_grad=True))
    with pytest.raises(TypeError, match="nn.Linear"):
        Int8Linear.from_linear(nn.Conv1d(1, 1, 1))


def test_quantize_linears_converts_every_linear_of_a_stack():
    torch.manual_seed(0)
    stack = SRUpp(16, 16, 8, num_layers=2, causal=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        ref, _ = stack(x)
        linears = sum(isinstance(m, nn.Linear) for m in stack.modules())
        assert quantize_linears(stack) is stack
        assert not any(isinstance(m, nn.Linear) for m in stack.modules())
        assert sum(isinstance(m, Int8Linear) for m in stack.modules()) == linears
        assert not any(p.requires_grad for p in stack.parameters())
        out, _ = stack(x)
    torch.testing.assert_close(out, ref, rtol=0.05, atol=0.05)


def test_quantize_linears_arguments():
    with pytest.raises(ValueError, match=r"unknown quantization 'int4'.*\('int8', 'w8a8'\)"):
        quantize_linears(nn.Sequential(nn.Linear(2, 2)), "int4")
    with pytest.raises(TypeError, match="Int8Linear.from_linear"):
        quantize_linears(nn.Linear(2, 2))
    seq = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    quantize_linears(seq, skip=seq[1])
    assert isinstance(seq[0], Int8Linear) and isinstance(seq[1][0], nn.Linear)


def test_w8a8_rounds_the_activations_too():
    torch.manual_seed(0)
    lin = nn.Linear(24, 10)
    x = torch.randn(3, 24)
    wonly, w8a8 = Int8Linear.from_linear(lin), Int8Linear.from_linear(lin, kind="w8a8")
    assert "kind=w8a8" in repr(w8a8) and "kind=int8" in repr(wonly)
    with torch.no_grad():
        ref, a, b = lin(x), wonly(x), w8a8(x)
    torch.testing.assert_close(b, ref, rtol=0.05, atol=0.05)
    assert not torch.equal(a, b)  # the activations' rounding shows
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        Int8Linear(2, 2, kind="int4")


def test_quantize_linears_w8a8_sets_every_layer():
    stack = SRUpp(16, 16, 8, num_layers=2, causal=True).eval()
    quantize_linears(stack, "w8a8")
    layers = [m for m in stack.modules() if isinstance(m, Int8Linear)]
    assert layers and all(m.kind == "w8a8" for m in layers)


def test_w8a8_refuses_layers_wider_than_its_int32_sums_at_quantize_time():
    from srupp.ops.quant import W8A8_MAX_K

    wide = nn.Sequential(nn.Linear(W8A8_MAX_K + 1, 1, bias=False))
    with pytest.raises(ValueError, match='quantize this model with "int8"'):
        quantize_linears(wide, "w8a8")
    assert isinstance(wide[0], nn.Linear)         # nothing was converted
