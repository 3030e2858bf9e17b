"""An SRU++ stack's one-token step through srupp::layer_step (one stack_step call) against
the modules' path.

Under no_grad on CPU a one-token call runs each layer as one C++ op
(``_fused_step`` in srupp/nn/stack_step.py); the step backend "modules" runs the
same token module by module. Both must give the same outputs and the same
state (c, memory, cached keys and values, the padding mask), token by token,
in fp32 and bf16, and the op must actually have run (counted). Where the op
can't take the model (training, a stale K/V cache) the modules'
path runs and the result is still right. Quantized models (int8, w8a8) take the
op too, with the same int8 products as their modules. Tolerances: against the modules'
path as in tests/ops/test_layer_step.py (the same roundings, sums in another
order); against the full forward, whose GEMMs and kernels differ more, the
whole-model ones of tests/tolerances.py.
"""

import importlib

import pytest
import torch

from tolerances import tol

import srupp.nn.stack_step as srupp_module
from srupp.models import CausalLM, SRUppConfig
from srupp.nn import SRUpp
from srupp.ops import cpu_kernels
from srupp.ops.layer_step import use_step_backend
from srupp.ops.settings import tuning

# the module, not srupp.ops's function of the same name
layer_step_module = importlib.import_module("srupp.ops.layer_step")

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not cpu_kernels.is_available(),
                                 reason=f"the C++ extension is unavailable "
                                        f"({cpu_kernels.build_error()})")]

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])

CASES = {
    "plain": dict(),
    "heads": dict(num_heads=2),
    "k4": dict(input_size=5),
    "proj_first": dict(input_size=5, proj_input_to_hidden_first=True),
    "layer_norm_pre": dict(layer_norm=True),
    "layer_norm_post": dict(layer_norm=True, normalize_after=True),
    "attention_every_2": dict(num_layers=3, attention_every_n_layers=2),
    "no_attention": dict(attention_last_n_layers=0),
    "window_slides": dict(mem_len=3),
    "no_memory": dict(mem_len=0),
}


def make(dtype, input_size=6, num_layers=2, **kw):
    torch.manual_seed(0)
    m = SRUpp(input_size, 8, 4, num_layers, causal=True, batch_first=True, **kw).eval()
    with torch.no_grad():  # α and the biases start at 0: move everything off its init
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return m.to(dtype)


@pytest.fixture
def op_calls(monkeypatch):
    """How many layer steps the stack ran through the op (one entry per layer)."""
    calls = []
    real = layer_step_module.stack_step_kernel()

    def counted(x, c, *args):
        calls.extend([1] * c.shape[0])
        return real(x, c, *args)

    monkeypatch.setattr(layer_step_module, "stack_step_kernel", lambda: counted)
    return calls


def steps(m, x, state, backend):
    """Feed x (B, T, n_in) one token per call under a step backend; (B, T, D) and the state."""
    outs = []
    with torch.no_grad(), use_step_backend(backend):
        for t in range(x.shape[1]):
            h, state = m.step(x[:, t], state)
            outs.append(h)
    return torch.stack(outs, 1), state


def assert_same_state(a, b, tol):
    torch.testing.assert_close(a.c, b.c, **tol)
    assert a.mem_len == b.mem_len
    for ma, mb in zip(a.memory, b.memory):
        assert (ma is None) == (mb is None)
        if ma is not None:
            torch.testing.assert_close(ma, mb, **tol)
    for ka, kb in zip(a.kv_cache, b.kv_cache):
        assert (ka is None) == (kb is None)
        if ka is not None:
            torch.testing.assert_close(ka.kv, kb.kv, **tol)
    if a.memory_mask_pad is None or b.memory_mask_pad is None:
        for p in (a.memory_mask_pad, b.memory_mask_pad):
            assert p is None or not p.any()
    else:
        assert torch.equal(a.memory_mask_pad, b.memory_mask_pad)


@DTYPES
@pytest.mark.parametrize("case", list(CASES))
def test_fused_steps_equal_the_modules_and_the_full_forward(case, dtype, op_calls):
    cfg = dict(CASES[case])
    m = make(dtype, **cfg)
    x = torch.randn(3, 7, cfg.get("input_size", 6)).to(dtype)
    fused, st_fused = steps(m, x, None, "fused")
    assert len(op_calls) == 7 * m.num_layers
    modules, st_modules = steps(m, x, None, "modules")
    assert len(op_calls) == 7 * m.num_layers  # the modules' path never calls it
    torch.testing.assert_close(fused, modules, **TOL[dtype])
    assert_same_state(st_fused, st_modules, TOL[dtype])
    if "mem_len" not in cfg:  # a window (or none) differs from one call over everything
        with torch.no_grad():
            full, st_full = m(x)
        torch.testing.assert_close(fused, full, **tol(dtype))
        assert_same_state(st_fused, st_full, tol(dtype))


@DTYPES
def test_after_a_padded_prefix_and_at_a_batch_past_the_few_rows_kernel(dtype, op_calls):
    """Left-padded prompts (the memory's key mask) at B = 10: more rows than the few-rows
    kernel takes in either dtype, so the op's products go to ATen's GEMM."""
    m = make(dtype, num_heads=2)
    B = 10
    x = torch.randn(B, 9, 6).to(dtype)
    pad = torch.zeros(B, 4, dtype=torch.bool)
    pad[::2, :2] = True
    with torch.no_grad():
        _, st = m(x[:, :4], mask_pad=pad)
    fused, st_f = steps(m, x[:, 4:], st, "fused")
    modules, st_m = steps(m, x[:, 4:], st, "modules")
    assert len(op_calls) == 5 * m.num_layers
    torch.testing.assert_close(fused, modules, **TOL[dtype])
    assert_same_state(st_f, st_m, TOL[dtype])
    assert st_f.memory_mask_pad.shape == (B, 9)


def test_two_branches_from_one_state_leave_it_unchanged(op_calls):
    """Decoding two continuations of one prefix (sampling, beam search): the second
    branch must not see the first's in-place rows, and the prefix state stays as it was."""
    m = make(torch.float32, mem_len=4)
    x = torch.randn(2, 5, 6)
    _, root = steps(m, x[:, :3], None, "fused")
    saved = [t.clone() for t in root.memory] + [kv.kv.clone() for kv in root.kv_cache]
    a, _ = steps(m, x[:, 3:], root, "fused")
    b, _ = steps(m, x[:, 3:].flip(0), root, "fused")
    ref_a, _ = steps(m, x[:, 3:], root, "modules")
    ref_b, _ = steps(m, x[:, 3:].flip(0), root, "modules")
    torch.testing.assert_close(a, ref_a, **TOL[torch.float32])
    torch.testing.assert_close(b, ref_b, **TOL[torch.float32])
    now = [t for t in root.memory] + [kv.kv for kv in root.kv_cache]
    for before, after in zip(saved, now):
        torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_a_state_edited_between_steps_is_read_as_it_is_now(op_calls):
    """The fused step remembers where it left each layer's rows (state._rows); a state
    whose memory or cache was replaced since (reordered for beams, cloned, edited)
    must be read from its tensors, not from those records."""
    m = make(torch.float32, num_layers=3, mem_len=5)
    x = torch.randn(3, 6, 6)
    _, st = steps(m, x[:, :3], None, "fused")
    assert st._rows is not None
    order = torch.tensor([2, 0, 1])
    moved = st.index_select(order)
    assert moved._rows is None                           # replace() does not carry it
    edited = st.index_select(order)
    edited._rows = st._rows                              # stale: records of st's tensors
    for state in (moved, edited):
        calls = len(op_calls)
        got, got_state = steps(m, x[:, 3:], state, "fused")
        assert len(op_calls) > calls
        want, want_state = steps(m, x[:, 3:], state, "modules")
        torch.testing.assert_close(got, want, **TOL[torch.float32])
        assert_same_state(got_state, want_state, TOL[torch.float32])


def test_the_modules_run_where_the_op_cannot(op_calls):
    m = make(torch.float32, num_heads=2)
    x = torch.randn(2, 4, 6)
    want, st = steps(m, x, None, "modules")
    # training mode (dropout may be on): the modules' path
    m.train()
    steps(m, x, None, "auto")
    m.eval()
    assert not op_calls
    # a stale K/V cache (the weights changed in place after it was made): modules, and
    # the result is that of a fresh computation
    nxt = torch.randn(2, 1, 6)
    with torch.no_grad():
        m.layers[0].transform.linear2.weight.mul_(1.1)
    got, _ = steps(m, nxt, st, "auto")
    assert not op_calls
    fresh, _ = steps(m, nxt, st.drop_kv_cache(), "modules")
    torch.testing.assert_close(got, fresh, **TOL[torch.float32])
    # the next step has a valid cache again: the op
    steps(m, nxt, steps(m, nxt, st, "auto")[1], "auto")
    assert len(op_calls) == m.num_layers


def test_gradients_take_the_modules_path(op_calls):
    torch.manual_seed(0)
    lm = CausalLM(SRUppConfig(vocab_size=40, d_model=16, proj_size=8, num_layers=2)).eval()
    tokens = torch.randint(0, 40, (2, 5))
    out = lm(tokens)  # with gradients: the modules' path
    assert not op_calls and out.logits.requires_grad


# w8a8 through the op and through the modules computes the same integer sums, but a
# last-bit difference upstream (another summation order in fp32) can move an activation
# across a rounding boundary of its row's int8 scale: about 1% of a term. Weight-only
# int8 keeps the float tolerances.
QUANT_TOL = {"int8": TOL, "w8a8": {torch.float32: dict(rtol=3e-2, atol=3e-2),
                                   torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}}


@DTYPES
@pytest.mark.parametrize("kind", ["int8", "w8a8"])
@pytest.mark.parametrize("case", ["plain", "attention_every_2", "proj_first", "window_slides"])
def test_quantized_stacks_take_the_op_and_equal_the_modules(case, kind, dtype, op_calls):
    from srupp.nn.quant import quantize_linears

    m = make(torch.float32, **CASES[case])
    quantize_linears(m, kind)
    m.to(dtype)
    x = torch.randn(3, 7, m.input_size).to(dtype)
    fused, fs = steps(m, x, None, "auto")
    assert len(op_calls) == 7 * m.num_layers
    plain, ps = steps(m, x, None, "modules")
    tol = QUANT_TOL[kind][dtype]
    torch.testing.assert_close(fused, plain, **tol)
    assert_same_state(fs, ps, tol)
    # a batch past the int8 kernel's 32 rows: int8 dequantizes, w8a8 keeps its kernel
    xb = torch.randn(40, 2, m.input_size).to(dtype)
    torch.testing.assert_close(steps(m, xb, None, "auto")[0], steps(m, xb, None, "modules")[0],
                               **tol)


@DTYPES
def test_w8a8_step_is_tight_where_both_paths_round_the_same_inputs(dtype, op_calls):
    # without attention or layer norms each projection's input is the same tensor on both
    # paths (x, then q), so both round the same activations: the float tolerances hold,
    # and w8a8 differs from weight-only int8 (the mode reached the op)
    from srupp.nn.quant import quantize_linears

    outs = {}
    for kind in ("int8", "w8a8"):
        m = make(torch.float32, num_layers=1, attention_last_n_layers=0)
        quantize_linears(m, kind)
        m.to(dtype)
        x = torch.randn(3, 5, m.input_size, generator=torch.Generator().manual_seed(0))
        outs[kind], _ = steps(m, x.to(dtype), None, "auto")
        plain, _ = steps(m, x.to(dtype), None, "modules")
        torch.testing.assert_close(outs[kind], plain, **TOL[dtype])
    assert len(op_calls) == 2 * 5
    assert not torch.equal(outs["int8"], outs["w8a8"])


def test_changing_the_activations_of_a_layer_reaches_the_op(op_calls):
    from srupp.nn.quant import Int8Linear, quantize_linears

    m = make(torch.float32, num_layers=1, attention_last_n_layers=0)
    quantize_linears(m, "int8")
    x = torch.randn(2, 3, m.input_size)
    steps(m, x, None, "auto")                     # the plan is made (weight-only)
    for layer in m.modules():
        if isinstance(layer, Int8Linear):
            layer.kind = "w8a8"
    fused, _ = steps(m, x, None, "auto")
    plain, _ = steps(m, x, None, "modules")
    torch.testing.assert_close(fused, plain, **TOL[torch.float32])


def test_a_mixed_quantized_layer_takes_the_modules_path(op_calls):
    from srupp.nn.quant import Int8Linear

    m = make(torch.float32)
    t = m.layers[0].transform
    t.linear1 = Int8Linear.from_linear(t.linear1)  # one projection int8, the others float
    x = torch.randn(2, 3, m.input_size)
    fused, _ = steps(m, x, None, "auto")
    plain, _ = steps(m, x, None, "modules")
    torch.testing.assert_close(fused, plain, **TOL[torch.float32])
    assert len(op_calls) == 0


@DTYPES
def test_generate_gives_the_same_tokens(dtype, op_calls):
    torch.manual_seed(0)
    lm = CausalLM(SRUppConfig(vocab_size=50, d_model=32, proj_size=8, num_layers=3,
                              attention_every_n_layers=1, mem_len=6)).eval()
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    lm.to(dtype)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]  # unequal: left padding
    # one model.step per token (the C++ token loop has its own tests)
    with tuning().use(decode_chunk=0), use_step_backend("fused"):
        fused = lm.generate(prompts, 12, temperature=0)
    assert op_calls
    with tuning().use(decode_chunk=0), use_step_backend("modules"):
        modules = lm.generate(prompts, 12, temperature=0)
    assert fused == modules


def test_swapped_parameters_and_a_new_dtype_reach_the_op(op_calls):
    """Each layer's weights are looked up once (a plan); swapping a Parameter or a
    submodule, or converting the model, must still step with the current weights."""
    m = make(torch.float32, layer_norm=True)
    x = torch.randn(2, 3, 6)
    steps(m, x, None, "fused")
    layer = m.layers[1]
    layer.weight_c = torch.nn.Parameter(layer.weight_c.detach() * -1.5)
    layer.transform.layer_norm = torch.nn.LayerNorm(layer.transform.layer_norm.normalized_shape)
    with torch.no_grad():
        layer.transform.layer_norm.weight.mul_(0.5)
    got, st = steps(m, x, None, "fused")
    want, _ = steps(m, x, None, "modules")
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    m.to(torch.bfloat16)
    calls = len(op_calls)
    got, _ = steps(m, x.to(torch.bfloat16), None, "fused")
    want, _ = steps(m, x.to(torch.bfloat16), None, "modules")
    assert len(op_calls) == calls + 3 * m.num_layers
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])


@pytest.mark.skipif(not (cpu_kernels.is_available()
                         and cpu_kernels.load().linear_rows_bf16_native()),
                    reason="pair-packed weights need a CPU with AVX512-BF16")
@pytest.mark.parametrize("B", [2, 6])  # the one-region path (up to 4 rows) and by pieces
def test_bf16_steps_multiply_by_pair_packed_copies_that_follow_the_weights(monkeypatch, B):
    """bf16 layers step with pair-packed copies of W1, W2, W3 (quant 3) where the few-rows
    kernels run. A copy is made once per plan, so writing a weight in place, or giving it
    new data, must make the next step pack again: it equals the modules' path with the new
    weights (and not the old ones)."""
    from srupp.ops.layer_step import QUANT
    from srupp.ops.matmul import batch_invariant

    seen = []
    real = layer_step_module.stack_step_kernel()

    def recorded(x, c, *args):
        seen.append(list(args[-1]))                                      # quant per layer
        return real(x, c, *args)

    monkeypatch.setattr(layer_step_module, "stack_step_kernel", lambda: recorded)
    m = make(torch.bfloat16, layer_norm=True)
    x = torch.randn(B, 4, 6).bfloat16()
    with batch_invariant(8):  # the few-rows kernels up to 8 rows (2 by default in bf16)
        before, _ = steps(m, x, None, "fused")
        assert seen[-1] == [QUANT["pairs"]] * m.num_layers
        torch.testing.assert_close(before, steps(m, x, None, "modules")[0], **TOL[torch.bfloat16])
        with torch.no_grad():
            m.layers[0].transform.linear1.weight.mul_(-1.5)             # in place
        w3 = m.layers[1].transform.linear3.weight
        w3.data = w3.data.flip(0).contiguous()                          # new data, same Parameter
        got, _ = steps(m, x, None, "fused")
        want, _ = steps(m, x, None, "modules")
        torch.testing.assert_close(got, want, **TOL[torch.bfloat16])
        assert (want - before).abs().max() > 0.1                        # the change shows
        # the rows' own layout (tuning().pair_packed off) for plans made from then on
        with tuning().use(pair_packed=False):
            srupp_module._PLANS.clear()
            plain, _ = steps(m, x, None, "fused")
        assert seen[-1] == [QUANT["float"]] * m.num_layers
        torch.testing.assert_close(plain, want, **TOL[torch.bfloat16])
    srupp_module._PLANS.clear()
