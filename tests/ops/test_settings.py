"""The settings objects (backends and tuning), and the recurrence's routing rule."""

import pytest
import torch

import srupp.ops as ops
from srupp.ops import recurrence, settings

# Not collected with --device cuda: the settings object and its environment variables,
# the CPU's bf16 feature probe, and a routing table written for CPU and meta tensors
# (CUDA tensors' routing runs in every --device cuda test of tests/ops/test_triton_kernel.py).
pytestmark = pytest.mark.cpu_only


def test_one_typed_settings_object(monkeypatch):
    monkeypatch.setattr(settings, "_backends", None)  # read the environment again
    monkeypatch.setenv("SRUPP_BACKEND", "Reference ")
    monkeypatch.delenv("SRUPP_MATMUL", raising=False)
    monkeypatch.setenv("SRUPP_ATTENTION", "")
    b = ops.backends()
    assert b == settings.Backends(recurrence="reference", matmul="auto", attention="auto")
    assert ops.backends() is b
    with ops.use_matmul_backend("aten"), ops.use_attention_backend("sdpa"):
        assert (b.matmul, ops.get_matmul_backend(), ops.get_attention_backend()) == (
            "aten", "aten", "sdpa")
        b.recurrence = "cpu"
        assert ops.get_backend() == "cpu"
    assert (b.matmul, b.attention) == ("auto", "auto")
    with pytest.raises(ValueError, match=r"unknown srupp matmul backend 'mkl' .*SRUPP_MATMUL"):
        b.matmul = "mkl"
    with pytest.raises(AttributeError, match="no op 'conv'"):
        b.conv = "auto"
    monkeypatch.setattr(settings, "_backends", None)
    monkeypatch.setenv("SRUPP_ATTENTION", "flash")
    with pytest.raises(ValueError, match="SRUPP_ATTENTION"):
        ops.get_backend()


def test_tuning_fields_are_checked_and_restored(monkeypatch):
    monkeypatch.setattr(settings, "_tuning", None)  # a fresh object: the defaults
    t = ops.tuning()
    assert t == settings.Tuning(decode_chunk=64, decode_row_group=16, layer_step_team=True,
                                triton_block=None, triton_warps=None, triton_stages=None,
                                triton_steps=None)
    assert ops.tuning() is t
    with t.use(decode_chunk=0, triton_block=8, triton_steps=4):
        assert (t.decode_chunk, t.triton_block, t.triton_steps) == (0, 8, 4)
        t.triton_warps = 2  # not named by use: stays after it
    assert (t.decode_chunk, t.triton_block, t.triton_steps, t.triton_warps) == (64, None, None, 2)
    with pytest.raises(RuntimeError, match="inside"):
        with t.use(triton_stages=3):
            raise RuntimeError("inside")
    assert t.triton_stages is None
    for field, bad, words in [("decode_chunk", -1, "decode_chunk must be an integer >= 0"),
                              ("decode_chunk", True, "decode_chunk must be"),
                              ("layer_step_team", 1, "True or False"),
                              ("decode_row_group", -2, "decode_row_group must be an integer >= 0"),
                              ("decode_row_group", 1.0, "decode_row_group must be"),
                              ("triton_block", 48, "triton_block must be None or a power of two"),
                              ("triton_warps", 0, "power of two"),
                              ("triton_stages", 0, "triton_stages must be None .off. or"),
                              ("triton_steps", 2.5, "triton_steps must be")]:
        with pytest.raises(ValueError, match=words):
            setattr(t, field, bad)
    with pytest.raises(ValueError, match="triton_block"):  # a bad field in use: all restored
        with t.use(decode_chunk=5, triton_block=3):
            pass
    assert (t.decode_chunk, t.triton_block) == (64, None)
    with pytest.raises(AttributeError, match="no tuning field 'block'"):
        t.block = 4


def test_debug_nan_fill_reads_the_environment_each_time(monkeypatch):
    monkeypatch.delenv("SRUPP_DEBUG_NAN_FILL", raising=False)
    assert not settings.debug_nan_fill()
    monkeypatch.setenv("SRUPP_DEBUG_NAN_FILL", "1")
    assert settings.debug_nan_fill()
    monkeypatch.setenv("SRUPP_DEBUG_NAN_FILL", "0")
    assert not settings.debug_nan_fill()


def test_cpu_has_native_bf16_is_the_torch_probe():
    want = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert ops.cpu_has_native_bf16() is bool(want)


def _args(dtype=torch.float32, device="cpu"):
    return (torch.ones(1, 2, 3, 4, dtype=dtype, device=device), None,
            torch.ones(2, 4, device=device), torch.ones(2, 4, device=device), None, None)


@pytest.mark.parametrize("backend,interpreting,dtype,device,want", [
    ("auto", True, torch.float32, "cpu", "cpu"),         # the interpreter changes nothing for auto
    ("auto", False, torch.float64, "cpu", "reference"),  # gradcheck
    ("auto", False, torch.float16, "cpu", "reference"),  # the C++ kernel has no fp16
    ("auto", False, torch.float32, "meta", "reference"),
    ("cpu", False, torch.float64, "cpu", "reference"),   # even when forced
    ("triton", True, torch.float32, "cpu", "triton"),    # CPU tensors under the interpreter
    ("triton", True, torch.float16, "cpu", "triton"),
    ("triton", True, torch.float64, "cpu", "reference"),
    ("triton", False, torch.float32, "cpu", RuntimeError),
    ("cpu", False, torch.float32, "meta", RuntimeError),
    ("reference", False, torch.float32, "cpu", "reference"),
])
def test_route(monkeypatch, backend, interpreting, dtype, device, want):
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpreting else "0")
    if want == "cpu" and not ops.cpu_kernels.is_available():
        pytest.skip(f"CPU kernel unavailable: {ops.cpu_kernels.build_error()}")
    if want == "triton":
        pytest.importorskip("triton", reason="triton not installed")
    with ops.use_backend(backend):
        if want is RuntimeError:
            with pytest.raises(RuntimeError, match=f"backend '{backend}' runs"):
                recurrence.route(*_args(dtype, device))
        else:
            assert recurrence.route(*_args(dtype, device)) == want
