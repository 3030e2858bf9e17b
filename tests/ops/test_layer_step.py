"""srupp::layer_step, one SRU++ layer's decoding step as one C++ op, against its reference.

Outputs (h, c) and the rows the op writes in place (the new token's memory and
[K | V] rows) are compared with :func:`layer_step_reference`. Tolerances: fp32
to 1e-5 (sums in another order); bf16 to one bf16 rounding of the output
(rtol 1.6e-2), as both round the same intermediates and differ only in the
order of fp32 sums. The state c is fp32 in both dtypes.
"""

import re
from pathlib import Path

import pytest
import torch

from srupp.ops import cpu_kernels
from srupp.ops.layer_step import (layer_step, layer_step_applies, layer_step_reference,
                                  use_step_backend)
from srupp.ops.matmul import FEW_ROWS
from srupp.ops.settings import tuning

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not cpu_kernels.is_available(),
                                 reason=f"the C++ extension is unavailable "
                                        f"({cpu_kernels.build_error()})")]

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}

# B, n_in, D, d', heads, M (memory rows), attention, pre-norm, post-norm, padded memory
CASES = {
    "one_row": dict(B=1, n_in=64, D=64, dp=16, H=1, M=5),
    "no_memory_k4": dict(B=3, n_in=48, D=64, dp=16, H=2, M=0),
    "heads_padded": dict(B=4, n_in=64, D=64, dp=16, H=4, M=7, pad=True),
    "pre_norm": dict(B=2, n_in=64, D=64, dp=32, H=2, M=3, pre=True),
    "post_norm": dict(B=2, n_in=64, D=64, dp=16, H=1, M=3, post=True),
    "no_attention": dict(B=2, n_in=64, D=64, dp=16, H=1, M=0, attention=False, pre=True),
    "gemm_rows": dict(B=12, n_in=64, D=64, dp=32, H=2, M=9, pad=True),  # > FEW_ROWS: ATen
    "odd_widths": dict(B=1, n_in=40, D=40, dp=12, H=3, M=2),             # vector tails
}


def make_args(dtype, B, n_in, D, dp, H, M, attention=True, pre=False, post=False, pad=False,
              seed=0, few_rows=None):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.3):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    k = 3 if n_in == D else 4
    norm = pre or post
    width = (D if post else n_in)
    return dict(
        x=r(B, n_in, scale=1.0), c=torch.randn(B, D, generator=g), w1=r(dp, n_in),
        w2=r(2 * dp, dp) if attention else r(k * D, dp), w3=r(k * D, dp) if attention else None,
        alpha=r(1, scale=1.0) if attention else None,
        norm_weight=r(width).abs() + 0.5 if norm else None, norm_bias=r(width) if norm else None,
        attn_norm_weight=r(dp).abs() + 0.5, attn_norm_bias=r(dp),
        weight_c=r(2, D), bias=r(2, D),
        kv=r(B, M + 1, 2 * dp, scale=1.0) if attention else None,
        memory=r(B, M + 1, n_in, scale=1.0) if attention else None,
        memory_pad=(torch.rand(B, M, generator=g) < 0.4) if pad and attention else None,
        kv_start=0, memory_start=0, cached=M, norm_eps=1e-5, attn_norm_eps=1e-6, scale_x=1.3, num_heads=H, normalize_after=post,
        few_rows=FEW_ROWS[dtype] if few_rows is None else few_rows)


def clone(args):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_op_matches_reference(case, dtype):
    args = make_args(dtype, **CASES[case])
    mine, ref = clone(args), clone(args)
    h, c = layer_step(**mine)
    h_ref, c_ref = layer_step_reference(**ref)
    assert h.dtype == dtype and c.dtype == torch.float32
    torch.testing.assert_close(h, h_ref, **TOL[dtype])
    torch.testing.assert_close(c, c_ref, **TOL[torch.float32 if dtype == torch.float32
                                                 else torch.bfloat16])
    for name in ("kv", "memory"):
        if args[name] is None:
            continue
        # the new token's row is the op's; every earlier row is left as it was
        torch.testing.assert_close(mine[name][:, -1], ref[name][:, -1], **TOL[dtype])
        torch.testing.assert_close(mine[name][:, :-1], args[name][:, :-1], rtol=0, atol=0)
        assert not torch.equal(mine[name][:, -1], args[name][:, -1])  # it was written


def test_writes_one_row_of_a_larger_buffer_at_its_offset():
    """As the stack calls it: kv and memory are buffers with spare rows, the cached steps
    at an offset; the op writes row offset + M of each and reads nothing outside."""
    M = 4
    args = make_args(torch.float32, B=2, n_in=32, D=32, dp=8, H=1, M=M)
    kv_base, mem_base = torch.randn(2, 16, 16), torch.randn(2, 16, 32)
    kv_base[:, 3:3 + M] = args["kv"][:, :M]
    mem_base[:, 5:5 + M] = args["memory"][:, :M]
    kv_base[:, :3] = float("nan")  # rows outside the window: never read
    before = kv_base.clone(), mem_base.clone()
    ref = clone(args)
    mine = dict(args, kv=kv_base, memory=mem_base, kv_start=3, memory_start=5)
    h, _ = layer_step(**mine)
    h_ref, _ = layer_step_reference(**ref)
    torch.testing.assert_close(h, h_ref, **TOL[torch.float32])
    torch.testing.assert_close(kv_base[:, 3 + M], ref["kv"][:, M], **TOL[torch.float32])
    torch.testing.assert_close(mem_base[:, 5 + M], ref["memory"][:, M], **TOL[torch.float32])
    for base, old, row in ((kv_base, before[0], 3 + M), (mem_base, before[1], 5 + M)):
        rest = torch.ones(16, dtype=torch.bool)
        rest[row] = False
        torch.testing.assert_close(base[:, rest], old[:, rest], rtol=0, atol=0, equal_nan=True)


def test_rows_past_the_buffer_are_refused():
    args = make_args(torch.float32, B=1, n_in=32, D=32, dp=8, H=1, M=4)
    with pytest.raises(RuntimeError, match="kv_start"):
        layer_step(**dict(args, kv_start=1))  # row 1 + 4 is past the 5-row buffer


def test_every_memory_key_padded_but_the_token_itself():
    """The token's own key is never padding: with all memory padded it attends to itself."""
    args = make_args(torch.float32, B=1, n_in=32, D=32, dp=8, H=2, M=3, pad=True)
    args["memory_pad"] = torch.ones(1, 3, dtype=torch.bool)
    alone = clone(args)
    alone.update(kv=alone["kv"][:, -1:], memory=alone["memory"][:, -1:], memory_pad=None,
                 cached=0)
    torch.testing.assert_close(layer_step(**args)[0], layer_step(**alone)[0], rtol=0, atol=0)


@pytest.mark.parametrize("threads", [3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_keys_split_over_threads(threads, dtype):
    """One sequence, one head and more threads than that: the attention cuts its 601 keys
    into blocks of 256 from the newest (89, 256 and 256 keys), runs them on the threads and
    merges them. The first 200 keys are padding: the first block has no key left (it must
    weigh nothing), the second some (its merge with the third is weighed), and the result
    is the reference's."""
    args = make_args(dtype, B=1, n_in=64, D=64, dp=32, H=1, M=600, pad=True, seed=3)
    args["memory_pad"][:, :200] = True
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        h, c = layer_step(**clone(args))
    finally:
        torch.set_num_threads(before)
    h_ref, c_ref = layer_step_reference(**clone(args))
    torch.testing.assert_close(h, h_ref, **TOL[dtype])
    torch.testing.assert_close(c, c_ref, **TOL[dtype])


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", [c for c in CASES if c != "gemm_rows"]
                         + ["long_memory", "long_padded", "two_rows_heads_padded", "no_rows",
                            "rows_split_pre", "rows_split_post"])
def test_one_region_path_is_the_other_path_bit_for_bit(case, dtype, threads):
    """At few rows with float weights the op runs the layer in one parallel region; it
    must give what the op's other path (a parallel region per piece) gives, to the bit,
    at any thread count (the keys split over threads in both)."""
    shapes = dict(CASES, long_memory=dict(B=1, n_in=64, D=64, dp=32, H=1, M=150),
                  long_padded=dict(B=2, n_in=64, D=64, dp=32, H=1, M=90, pad=True),
                  # within bf16's few-rows limit (2), unlike heads_padded
                  two_rows_heads_padded=dict(B=2, n_in=64, D=64, dp=16, H=4, M=7, pad=True),
                  no_rows=dict(B=0, n_in=64, D=64, dp=16, H=2, M=3),
                  # more rows than threads, split unevenly over them (the norms, the memory's
                  # row and the residual go row by row), with the few-rows kernels at 16
                  rows_split_pre=dict(B=13, n_in=64, D=64, dp=32, H=2, M=9, pad=True, pre=True,
                                      few_rows=16),
                  rows_split_post=dict(B=7, n_in=48, D=64, dp=16, H=1, M=4, post=True,
                                       few_rows=16))[case]
    args = make_args(dtype, **shapes, seed=7)
    before = torch.get_num_threads()
    outs = []
    try:
        torch.set_num_threads(threads)
        for on in (True, False):
            with tuning().use(layer_step_team=on):
                mine = clone(args)
                outs.append((*layer_step(**mine), mine["kv"], mine["memory"]))
    finally:
        torch.set_num_threads(before)
    for got, other in zip(*outs):
        if got is not None:
            assert torch.equal(got, other)


def test_the_team_setting_reaches_the_extension():
    """tuning().layer_step_team is the C++ global the op reads: set and restored through
    the setting; a bad value is refused and changes nothing."""
    read = cpu_kernels.function("layer_step_team")
    assert read() is True
    with tuning().use(layer_step_team=False):
        assert read() is False
    assert read() is True
    with pytest.raises(ValueError, match="layer_step_team must be True or False"):
        tuning().layer_step_team = 0
    assert read() is True


def test_fake_kernel_and_schema():
    """torch.library's own checks: the schema's mutations, the fake kernel's shapes, and
    that the op behaves the same when traced."""
    args = make_args(torch.float32, **CASES["heads_padded"])
    torch.library.opcheck(torch.ops.srupp.layer_step.default, tuple(args.values()),
                          test_utils=("test_schema", "test_faketensor"))


def test_when_the_op_applies():
    x = torch.randn(1, 8)
    assert not layer_step_applies(x)                       # gradients are recorded
    with torch.no_grad():
        assert layer_step_applies(x)
        assert not layer_step_applies(x.double())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not layer_step_applies(x)
        with use_step_backend("modules"):
            assert not layer_step_applies(x)
        with use_step_backend("fused"), pytest.raises(RuntimeError, match="float32/bfloat16 CPU"):
            layer_step_applies(x.double())
    with pytest.raises(ValueError, match="unknown srupp step backend"):
        with use_step_backend("fast"):
            pass


WEIGHT_NAMES = ("w1", "w2", "w3", "alpha", "norm_weight", "norm_bias", "attn_norm_weight",
                "attn_norm_bias", "weight_c", "bias")
LAYER_SCALARS = ("norm_eps", "attn_norm_eps", "scale_x", "num_heads", "normalize_after")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_stack_step_is_layer_step_layer_after_layer(dtype):
    """stack_step runs layer_step's kernel per layer, h feeding the next: bit for bit the
    chained single-layer calls, the rows written included, with views of the rows kept."""
    from srupp.ops.layer_step import stack_step_kernel

    B, D, M, first, kept = 2, 64, 5, 2, 4
    layers = [make_args(dtype, B=B, n_in=D, D=D, dp=16, H=2, M=M, pre=True, seed=1),
              make_args(dtype, B=B, n_in=D, D=D, dp=16, H=1, M=M, attention=False, post=True,
                        seed=2),
              make_args(dtype, B=B, n_in=D, D=D, dp=32, H=4, M=M, pad=False, seed=3)]
    for a in layers:
        a["kv_start"] = a["memory_start"] = 0
    x = layers[0]["x"]
    c = torch.stack([a["c"] for a in layers])                            # (3, B, D)
    chained = [clone(a) for a in layers]
    h = x
    for a in chained:
        h, a["c_new"] = layer_step(**{**a, "x": h})
    mine = [clone(a) for a in layers]
    got_h, got_c, mems, kvs = stack_step_kernel()(
        x, c, [a[n] for a in mine for n in WEIGHT_NAMES], [a["kv"] for a in mine],
        [a["memory"] for a in mine], None, [0] * 3, [0] * 3, M, first, kept,
        *([a[n] for a in mine] for n in LAYER_SCALARS[:3]), [a["num_heads"] for a in mine],
        [int(a["normalize_after"]) for a in mine], FEW_ROWS[dtype], [None] * 9, [0] * 3)
    torch.testing.assert_close(got_h, h, rtol=0, atol=0)
    torch.testing.assert_close(got_c, torch.stack([a["c_new"] for a in chained]), rtol=0, atol=0)
    for a, b, mem, kv in zip(mine, chained, mems, kvs):
        if b["memory"] is None:
            assert mem is None and kv is None
            continue
        torch.testing.assert_close(a["memory"], b["memory"], rtol=0, atol=0)
        torch.testing.assert_close(a["kv"], b["kv"], rtol=0, atol=0)
        assert mem._base is a["memory"] and kv._base is a["kv"]
        torch.testing.assert_close(mem, a["memory"][:, first:first + kept], rtol=0, atol=0)
        torch.testing.assert_close(kv, a["kv"][:, first:first + kept], rtol=0, atol=0)


def test_stack_step_refuses_lists_of_the_wrong_length():
    from srupp.ops.layer_step import stack_step_kernel

    a = make_args(torch.float32, B=1, n_in=64, D=64, dp=16, H=1, M=0)
    c = a["c"][None]                                                     # one layer
    args = [[a[n] for n in WEIGHT_NAMES], [a["kv"]], [a["memory"]], None, [0], [0], 0, 0, 1,
            [1e-5], [1e-5], [1.0], [1], [0], FEW_ROWS[torch.float32], [None] * 3, [0]]
    stack_step_kernel()(a["x"], c, *args)                                # the right lengths run
    short = list(args)
    short[0] = short[0][:9]
    with pytest.raises(RuntimeError, match="10 weights, 3 extras and one of each"):
        stack_step_kernel()(a["x"], c, *short)
    short = list(args)
    short[-2] = [None] * 2
    with pytest.raises(RuntimeError, match="10 weights, 3 extras and one of each"):
        stack_step_kernel()(a["x"], c, *short)
    int8 = list(args)
    int8[-1] = [2]                                  # w8a8 with float weights, no scales
    with pytest.raises(RuntimeError, match="int8 weights with one scale per output"):
        stack_step_kernel()(a["x"], c, *int8)
    with pytest.raises(RuntimeError, match="c \\(layers, B, D\\)"):
        stack_step_kernel()(a["x"], a["c"], *args)


# --------------------------------------------------------------------------- the C++ interface

CSRC = Path(__file__).resolve().parents[2] / "src" / "srupp" / "ops" / "csrc"


def _cpp_params(source: str, function: str) -> tuple:
    """The parameter names of ``function``'s definition in a C++ source file."""
    text = (CSRC / source).read_text()
    start = text.index(f"\n{function}(") + len(function) + 2
    depth, end = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        end += 1
    params = re.sub(r"<[^<>]*(<[^<>]*>[^<>]*)*>", "", text[start:end - 1])  # drop templates
    return tuple(p.split()[-1].lstrip("&*") for p in params.split(","))


def _cpp_enum(source: str, name: str) -> dict:
    body = re.search(rf"enum {name}\b[^{{]*\{{([^}}]*)\}}", (CSRC / source).read_text()).group(1)
    return {k.strip(): int(v) for k, v in (e.split("=") for e in body.split(","))}


def test_the_python_side_of_the_cpp_interface_is_the_cpp():
    """ops/layer_step.py is the one place that knows stack_step's and decode_loop's
    signatures and enums: its parameter orders, QUANT and OUTPUT_ROUTES are the C++'s, and
    the C++'s int8 few-rows limit is srupp.ops.quant.INT8_FEW_ROWS."""
    from srupp.ops.layer_step import (DECODE_LOOP_PARAMS, OUTPUT_ROUTES, QUANT,
                                      STACK_STEP_PARAMS)
    from srupp.ops.quant import INT8_FEW_ROWS

    assert _cpp_params("layer_step.cpp", "stack_step_cpu") == STACK_STEP_PARAMS
    assert _cpp_params("decode_loop.cpp", "decode_loop_cpu") == DECODE_LOOP_PARAMS
    assert _cpp_enum("layer_step.cpp", "Quant") == {
        "kFloatWeights": QUANT["float"], "kInt8": QUANT["int8"], "kW8A8": QUANT["w8a8"],
        "kPairs": QUANT["pairs"]}
    assert _cpp_enum("decode_loop.cpp", "OutputRoute") == {
        "kRows": OUTPUT_ROUTES["rows"], "kAten": OUTPUT_ROUTES["aten"],
        "kInt8Rows": OUTPUT_ROUTES["int8"], "kW8A8Rows": OUTPUT_ROUTES["w8a8"]}
    limit = re.search(r"kInt8FewRows = (\d+);", (CSRC / "layer_step.cpp").read_text()).group(1)
    assert int(limit) == INT8_FEW_ROWS
