"""Which SDPA kernel runs on CUDA (cuda_sdpa_backend), srupp's way round the math
fallback (cuda_attention_route), and the backend of every recipe's attention.

The rule is a pure function, so its table runs on the CPU. Each row's expected
backends come from PyTorch's constraints as the comment above
``cuda_sdpa_backend`` states them (its sources are cited there); the reason
column says which ones decide the row. ``pytest --device cuda`` checks the rule
against torch's own ``can_use_*_attention`` and ``_fused_sdp_choice`` on real
tensors, and runs SRU++'s attention at enwik8's head dim with the math kernel
switched off.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from srupp.ops import attention as attn_mod
from srupp.ops.attention import (CUDNN_OF_TORCH_2_11, SDPA_MASKS, attention_backend_for,
                                 attention_calls, attention_reference, cuda_attention_route,
                                 cuda_sdpa_backend)

from tolerances import tol

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
HEAD_DIMS = (64, 128, 256, 264, 768, 1024)
SM75, SM80, SM90 = (7, 5), (8, 0), (9, 0)
FUSED = ("cudnn", "flash", "efficient")
CU, FL, EF, MA = "cudnn", "flash", "efficient", "math"

# (capability, dtype, mask, expected for HEAD_DIMS, the constraints that decide it).
# Every head dim here is a multiple of 8, so alignment never refuses; rows below do.
TABLE = [
    (SM90, F32, "none", (EF,) * 6, "fp32: cuDNN and flash take 16-bit only; efficient: 4-aligned"),
    (SM90, F32, "causal", (EF,) * 6, "as none"),
    (SM90, F32, "causal_lower_right", (EF,) * 6, "lower right: flash (no: fp32), then efficient"),
    (SM90, F32, "dense", (EF,) * 6, "efficient takes a mask"),
    (SM90, BF16, "none", (CU, CU, CU, EF, EF, EF),
     "cuDNN first on sm90 (cuDNN 9.17 > 9.15), <= 256 on sm90 (>= 9.10); past 256: efficient"),
    (SM90, BF16, "causal", (CU, CU, CU, EF, EF, EF), "as none (L == S)"),
    (SM90, BF16, "causal_lower_right", (FL, FL, FL, EF, EF, EF),
     "CausalBias asks flash (<= 256), then efficient; never cuDNN"),
    (SM90, BF16, "dense", (CU, CU, CU, EF, EF, EF), "cuDNN takes a mask; flash does not"),
    (SM90, F16, "none", (CU, CU, CU, EF, EF, EF), "fp16 as bf16"),
    (SM90, F16, "causal", (CU, CU, CU, EF, EF, EF), "fp16 as bf16"),
    (SM90, F16, "causal_lower_right", (FL, FL, FL, EF, EF, EF), "fp16 as bf16"),
    (SM90, F16, "dense", (CU, CU, CU, EF, EF, EF), "fp16 as bf16"),
    (SM80, F32, "none", (EF,) * 6, "fp32: efficient, 4-aligned from sm80"),
    (SM80, F32, "causal", (EF,) * 6, "as none"),
    (SM80, F32, "causal_lower_right", (EF,) * 6, "as none"),
    (SM80, F32, "dense", (EF,) * 6, "as none"),
    (SM80, BF16, "none", (FL, FL, FL, EF, EF, EF),
     "sm80: cuDNN is not preferred (it comes after math); flash <= 256, then efficient"),
    (SM80, BF16, "causal", (FL, FL, FL, EF, EF, EF), "as none"),
    (SM80, BF16, "causal_lower_right", (FL, FL, FL, EF, EF, EF), "flash, then efficient"),
    (SM80, BF16, "dense", (EF,) * 6, "flash takes no mask; efficient does"),
    (SM80, F16, "none", (FL, FL, FL, EF, EF, EF), "fp16 as bf16"),
    (SM80, F16, "causal", (FL, FL, FL, EF, EF, EF), "fp16 as bf16"),
    (SM80, F16, "causal_lower_right", (FL, FL, FL, EF, EF, EF), "fp16 as bf16"),
    (SM80, F16, "dense", (EF,) * 6, "fp16 as bf16"),
    (SM75, F32, "none", (EF,) * 6, "flash and cuDNN need sm80; fp32 on sm75 needs no alignment"),
    (SM75, F32, "causal", (EF,) * 6, "as none"),
    (SM75, F32, "causal_lower_right", (EF,) * 6, "as none"),
    (SM75, F32, "dense", (EF,) * 6, "as none"),
    (SM75, BF16, "none", (MA,) * 6, "bf16 before sm80: no fused kernel (efficient: fp16/fp32)"),
    (SM75, BF16, "causal", (MA,) * 6, "as none"),
    (SM75, BF16, "causal_lower_right", (MA,) * 6, "as none"),
    (SM75, BF16, "dense", (MA,) * 6, "as none"),
    (SM75, F16, "none", (EF,) * 6, "fp16 on sm75: efficient, 8-aligned (tensor cores)"),
    (SM75, F16, "causal", (EF,) * 6, "as none"),
    (SM75, F16, "causal_lower_right", (EF,) * 6, "as none"),
    (SM75, F16, "dense", (EF,) * 6, "as none"),
]


def _id(row):
    cap, dtype, mask = row[:3]
    return f"sm{cap[0]}{cap[1]}-{str(dtype)[6:]}-{mask}"


@pytest.mark.parametrize("row", TABLE, ids=_id)
@pytest.mark.parametrize("dropout", [False, True], ids=["p0", "p>0"])
def test_the_rule_over_head_dims(row, dropout):
    """Dropout changes nothing on these rows: flash and the efficient kernel take it, and
    cuDNN 9.17 (torch 2.11) does too (only 9.11-9.13 refuse it)."""
    cap, dtype, mask, want, why = row
    got = tuple(cuda_sdpa_backend(hd, dtype, mask, dropout, cap) for hd in HEAD_DIMS)
    assert got == want, why


# (head dim, dtype, mask, dropout, capability, cudnn version, expected, why)
EDGES = [
    (260, BF16, "none", False, SM90, CUDNN_OF_TORCH_2_11, MA,
     "past flash's 256 and not 8-aligned for cuDNN or the efficient kernel"),
    (260, BF16, "causal_lower_right", False, SM90, CUDNN_OF_TORCH_2_11, MA,
     "neither asked kernel takes it, and the materialised mask finds none either"),
    (92, BF16, "none", False, SM90, CUDNN_OF_TORCH_2_11, FL,
     "cuDNN needs a multiple of 8; flash pads any head dim <= 256 itself"),
    (92, BF16, "dense", False, SM90, CUDNN_OF_TORCH_2_11, MA,
     "a mask keeps flash off; cuDNN and the efficient kernel need 8-alignment"),
    (156, BF16, "dense", False, SM80, CUDNN_OF_TORCH_2_11, MA, "as 92"),
    (258, F32, "dense", False, SM80, CUDNN_OF_TORCH_2_11, MA, "fp32 needs 4-alignment from sm80"),
    (258, F32, "dense", False, SM75, CUDNN_OF_TORCH_2_11, EF, "but none on sm75"),
    (256, BF16, "none", False, (10, 0), CUDNN_OF_TORCH_2_11, FL,
     "cuDNN first on sm100 too, but there <= 128 in the 2.11 line"),
    (128, BF16, "none", False, (10, 0), CUDNN_OF_TORCH_2_11, CU, "cuDNN first on sm100"),
    (128, BF16, "none", False, (12, 0), CUDNN_OF_TORCH_2_11, FL, "cuDNN not preferred on sm120"),
    (128, BF16, "none", False, SM90, None, FL, "no cuDNN: flash first"),
    (128, BF16, "none", False, SM90, 91500, FL, "cuDNN 9.15.0 is not preferred (> 9.15 is)"),
    (128, BF16, "none", True, SM90, 91200, FL, "cuDNN 9.11-9.13 take no dropout"),
    (192, BF16, "none", False, SM90, CUDNN_OF_TORCH_2_11, CU, "2.11 line: <= 256, trained too"),
    (192, BF16, "none", False, SM90, 92400, FL,
     "newer cuDNN SDPA trains only <= 128 or exactly 256"),
    (256, BF16, "none", False, SM90, 92400, CU, "d = 256 with cuDNN > 9.22"),
    (128, BF16, "none", True, SM90, 92400, FL, "newer: dropout not known to be a 1/16 step"),
    (128, BF16, "none", 0.25, SM90, 92400, CU, "newer: 0.25 is 4/16"),
    (128, BF16, "none", 0.1, SM90, 92400, FL, "newer: 0.1 is not a 1/16 step"),
    (200, BF16, "causal", False, (8, 6), CUDNN_OF_TORCH_2_11, EF,
     "flash on sm86 trains no head dim in (192, 224]"),
    (240, BF16, "causal", False, (8, 6), CUDNN_OF_TORCH_2_11, FL, "(224, 256] without dropout"),
    (240, BF16, "causal", True, (8, 6), CUDNN_OF_TORCH_2_11, EF, "but not with dropout"),
    (64, F16, "none", False, (5, 2), CUDNN_OF_TORCH_2_11, EF, "efficient from sm50"),
    (64, F16, "none", False, (4, 0), CUDNN_OF_TORCH_2_11, MA, "nothing fused before sm50"),
    (64, BF16, "none", False, (12, 2), CUDNN_OF_TORCH_2_11, MA, "nothing fused past sm121"),
]


@pytest.mark.parametrize("hd,dtype,mask,dropout,cap,cudnn,want,why", EDGES,
                         ids=[f"{e[0]}-{e[-1][:24]}" for e in EDGES])
def test_the_rule_at_its_edges(hd, dtype, mask, dropout, cap, cudnn, want, why):
    assert cuda_sdpa_backend(hd, dtype, mask, dropout, cap, cudnn_version=cudnn) == want, why


def test_the_rule_names_its_problem():
    with pytest.raises(ValueError, match="mask must be one of"):
        cuda_sdpa_backend(64, BF16, "lower_right")
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        cuda_sdpa_backend(0, BF16, "none")
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        cuda_sdpa_backend(64, "bf16", "none")
    with pytest.raises(ValueError, match="capability must be"):
        cuda_sdpa_backend(64, BF16, "none", False, 9)


# (head dim, dtype, mask, dropout, capability, expected route, why)
ROUTES = [
    (768, BF16, "causal_lower_right", False, SM90, (EF, 768), "fused already: kept"),
    (260, BF16, "none", False, SM90, (EF, 264), "padded to 8: efficient takes it"),
    (260, BF16, "causal_lower_right", False, SM80, (EF, 264), "lower right, padded"),
    (92, BF16, "dense", False, SM90, (CU, 96), "padded to 96: cuDNN (first on sm90) takes it"),
    (92, BF16, "dense", False, SM80, (EF, 96), "padded to 96: efficient on sm80"),
    (258, F32, "dense", False, SM80, (EF, 260), "fp32, padded to 4"),
    (128, BF16, "none", False, SM75, ("matmul", 128), "no fused bf16 kernel: bf16 products"),
    (128, BF16, "none", True, SM75, (MA, 128), "the explicit paths take no dropout"),
    (64, F32, "none", False, (12, 2), (MA, 64), "nothing fused: padding cannot help"),
]


@pytest.mark.parametrize("hd,dtype,mask,dropout,cap,want,why", ROUTES,
                         ids=[f"{r[0]}-{r[-1][:20]}" for r in ROUTES])
def test_the_route_round_the_math_fallback(hd, dtype, mask, dropout, cap, want, why):
    assert cuda_attention_route(hd, dtype, mask, dropout, cap) == want, why


@pytest.mark.parametrize("cap", [SM80, SM90, (8, 6), (10, 0)], ids=str)
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
def test_no_head_dim_falls_to_math_on_ampere_or_newer(cap, dtype):
    for mask in SDPA_MASKS:
        for dropout in (False, True):
            for hd in range(1, 1100):
                name, run_hd = cuda_attention_route(hd, dtype, mask, dropout, cap)
                assert name in FUSED and 0 <= run_hd - hd < 8, (mask, dropout, hd, name)


# --------------------------------------------------------------------------- the recipes

RECIPES = sorted(p for p in (Path(__file__).parents[2] / "recipes").glob("*.toml")
                 # its own header: "This is not a training recipe" (srupp compare's tuning table)
                 if p.name != "compare-tuned.toml")


def _model_config(path):
    from srupp.train.config import build_config

    run = build_config(path)
    # the vocabulary comes from data; one past every adaptive cut-off fits all recipes
    return run.model_config(vocab_size=1_000_000,
                            num_labels=2 if run.task == "classify" else None), run


def test_the_recipes_are_found():
    assert len(RECIPES) >= 10, RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_attends_on_a_fused_kernel(path):
    """bf16, fp16 and fp32 on sm80 and sm90: every call through srupp's attend is fused."""
    model, run = _model_config(path)
    for cap in (SM80, SM90):
        for precision in ("bf16", "fp16", "fp32", run.train.precision):
            calls = attention_calls(model, precision, cap)
            assert calls and calls[0].backend == attention_backend_for(model, precision, cap)
            for call in calls:  # the decoders' cross-attention included
                assert call.routed and call.backend in FUSED, (cap, precision, call)


def test_what_the_paper_recipes_run_on_an_h200():
    base, _ = _model_config(Path(__file__).parents[2] / "recipes" / "enwik8-base.toml")
    over_memory, first = attention_calls(base, "bf16", SM90)
    assert (over_memory.head_dim, over_memory.mask) == (768, "causal_lower_right")
    assert (over_memory.backend, first.backend) == (EF, EF)   # one head of 768: past 256
    long, _ = _model_config(Path(__file__).parents[2] / "recipes" / "shakespeare-cpu-long.toml")
    call = attention_calls(long, "bf16", SM90)[0]
    assert (call.head_dim, call.pytorch, call.backend, call.run_head_dim) == (260, MA, EF, 264)


def test_attention_calls_reads_a_mapping_and_names_its_problem():
    calls = attention_calls({"task": "lm", "proj_size": 256, "num_heads": 2, "mem_len": 0})
    assert [(c.mask, c.head_dim) for c in calls] == [("causal", 128)]
    with pytest.raises(ValueError, match="SRU[+][+] models"):
        attention_calls({"type": "transformer", "proj_size": 64})
    with pytest.raises(ValueError, match="divisible by num_heads"):
        attention_calls({"proj_size": 100, "num_heads": 3})
    with pytest.raises(ValueError, match="precision must be one of"):
        attention_calls({"proj_size": 64}, "int8")


# --------------------------------------------------------------------------- the route, run

@pytest.fixture
def sdpa_head_dims(monkeypatch):
    """The head dim of each SDPA call that srupp's attention module makes (a spy in its
    view of torch.nn.functional only, so that CausalBias keeps dispatching)."""
    dims, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kw):
        dims.append(q.shape[-1])
        return real(q, k, v, *args, **kw)

    functional = types.SimpleNamespace(**vars(F))
    functional.scaled_dot_product_attention = spy
    monkeypatch.setattr(attn_mod, "F", functional)
    return dims


def _qkv(L, S, hd, dtype, H=2, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, hd, generator=g).to(dtype).requires_grad_()
               for n in (L, S, S))
    return q, k, v, torch.randn(B, H, L, hd, generator=g).to(dtype)


def _with_grads(fn, q, k, v, go):
    o = fn(q, k, v)
    return [o, *torch.autograd.grad(o, (q, k, v), go)]


@pytest.mark.filterwarnings("ignore::UserWarning")  # a CUDA build says why no kernel fits CPU tensors
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("form", ["none", "dense", "causal", "lower_right"])
def test_the_padded_call_is_the_same_attention(monkeypatch, sdpa_head_dims, dtype, form):
    """The CUDA route run on CPU tensors, as an sm80 GPU would route them (head dims 258
    and 260 pad to 260 and 264): the same outputs and gradients as plain SDPA."""
    monkeypatch.setattr(attn_mod, "_cuda_facts", lambda index: (SM80, CUDNN_OF_TORCH_2_11))
    hd = 258 if dtype == F32 else 260
    L, M = 5, (3 if form == "lower_right" else 0)
    q, k, v, go = _qkv(L, L + M, hd, dtype)
    mask = attn_mod.causal_mask(L, M) if form in ("dense", "lower_right") else None
    offset = M if form in ("causal", "lower_right") else None
    as_offset = offset is not None

    def routed(q, k, v):
        return attn_mod._sdpa_cuda(q, k, v, mask, False, 0.0, offset, as_offset)

    got = _with_grads(routed, q, k, v, go)
    assert sdpa_head_dims == [hd + (2 if dtype == F32 else 4)]
    causal = form == "causal"
    want = _with_grads(lambda q, k, v: attention_reference(q, k, v, mask, is_causal=causal),
                       q, k, v, go)
    for a, b, name in zip(got, want, ("o", "dq", "dk", "dv")):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, **tol(dtype), msg=name)


def test_bf16_without_a_fused_kernel_takes_the_bf16_products(monkeypatch, sdpa_head_dims):
    """As on sm75: bf16 goes to the explicit products, not to SDPA's math kernel."""
    monkeypatch.setattr(attn_mod, "_cuda_facts", lambda index: (SM75, CUDNN_OF_TORCH_2_11))
    q, k, v, go = _qkv(6, 6, 16, BF16)
    got = _with_grads(lambda q, k, v: attn_mod._sdpa_cuda(q, k, v, None, True, 0.0, 0, True),
                      q, k, v, go)
    assert sdpa_head_dims == []
    want = _with_grads(lambda q, k, v: attention_reference(q, k, v, is_causal=True), q, k, v, go)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol(BF16))
    sdpa_head_dims.clear()                                          # (the reference's call)
    attn_mod._sdpa_cuda(q, k, v, None, True, 0.1, 0, True)        # dropout: SDPA
    assert sdpa_head_dims == [16]


def test_attention_sdpa_is_sdpa_off_cuda():
    q, k, v, _ = _qkv(4, 6, 12, F32)
    mask = torch.rand(1, 1, 4, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 0] = True
    assert torch.equal(attn_mod.attention_sdpa(q, k, v, mask),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


# --------------------------------------------------------------------------- on a GPU

def _needs_cuda(device):
    if device.type != "cuda":
        pytest.skip("checks the rule against torch's own kernel choice on a GPU: "
                    "run with pytest --device cuda")


def _torch_names():
    from torch.nn.attention import SDPBackend

    return {SDPBackend.CUDNN_ATTENTION.value: CU, SDPBackend.FLASH_ATTENTION.value: FL,
            SDPBackend.EFFICIENT_ATTENTION.value: EF, SDPBackend.MATH.value: MA}


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_rule_is_torchs_choice_on_this_gpu(device):
    _needs_cuda(device)
    from torch.backends.cuda import (SDPAParams, can_use_cudnn_attention,
                                     can_use_efficient_attention, can_use_flash_attention)

    cap = torch.cuda.get_device_capability(device)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    names = _torch_names()
    checked = 0
    for hd in (*HEAD_DIMS, 92, 156, 260, 752, 744):
        for dtype in (F32, BF16, F16):
            for dropout in (0.0, 0.25):
                L = S = 16
                q, k, v, _ = _qkv(L, S, hd, dtype)
                q, k, v = (t.detach().to(device).requires_grad_() for t in (q, k, v))
                dense = torch.ones(1, 1, L, S, dtype=torch.bool, device=device).tril_()
                for mask, attn, causal in (("none", None, False), ("causal", None, True),
                                           ("dense", dense, False)):
                    rule = cuda_sdpa_backend(hd, dtype, mask, dropout, cap, cudnn_version=cudnn)
                    torch_says = names[torch._fused_sdp_choice(q, k, v, attn, dropout, causal)]
                    where = (hd, dtype, mask, dropout, cap, cudnn)
                    assert rule == torch_says, where
                    params = SDPAParams(q, k, v, attn, dropout, causal, False)
                    assert (rule == FL) <= can_use_flash_attention(params), where
                    assert (rule == CU) <= can_use_cudnn_attention(params), where
                    assert attn_mod._efficient_admits(hd, dtype, cap) == \
                        can_use_efficient_attention(params), where
                    checked += 1
                # the lower-right bias: flash, then efficient, asked without a mask (L != S)
                qm = q[:, :, :8].detach().requires_grad_()
                params = SDPAParams(qm, k, v, None, dropout, False, False)
                want = (FL if can_use_flash_attention(params) else
                        EF if can_use_efficient_attention(params) else
                        names[torch._fused_sdp_choice(qm, k, v, dense[..., 8:, :], dropout)])
                assert cuda_sdpa_backend(hd, dtype, "causal_lower_right", dropout, cap,
                                         cudnn_version=cudnn) == want, (hd, dtype, dropout)
    print(f"{checked} calls: the rule agrees with torch {torch.__version__} on sm{cap}, "
          f"cuDNN {cudnn}")


@pytest.mark.parametrize("proj_size", [768, 260], ids=["enwik8-768", "padded-260"])
def test_srupp_attention_runs_without_the_math_kernel(device, proj_size):
    """SRU++ over two segments (the second attends over the first as memory) in bf16,
    forward and backward, with SDPA limited to its fused kernels: it must not raise."""
    _needs_cuda(device)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from srupp.nn import SRUpp

    torch.manual_seed(0)
    layer = SRUpp(64, 64, proj_size=proj_size, num_layers=1, num_heads=1, causal=True,
                  mem_len=16, batch_first=True, device=device)
    x = torch.randn(2, 32, 64, device=device, requires_grad=True)
    fused = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(fused), torch.autocast("cuda", dtype=torch.bfloat16):
        h1, state = layer(x[:, :16])
        h2, _ = layer(x[:, 16:], state)
    torch.cat([h1, h2], 1).float().square().mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
