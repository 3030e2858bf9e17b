"""Decoding one token at a time equals the full forward, in fp32 and in bf16 weights
(and, on CUDA, fp16 weights: ``half_dtypes(device)``).

``step`` takes the decoding fast paths (few-rows products, cached keys and
values, the Transformer's KV cache); the full forward over the whole sequence
takes the training paths. They must give the same logits at every position.

Tolerances per dtype:
- fp32: rtol 1e-5, atol 1e-5 (summation order only);
- bf16: |Δ| <= 0.05 + 0.05·|logit|. Both paths round every product and
  activation to bf16 (8 bits of mantissa, relative error 2^-9 per rounding)
  but in different places; over two layers that stays within a few percent of
  O(1) logits. The bf16 logits are also held to the fp32 model's within 0.15.
- fp16 (CUDA): tolerances.tol(float16), 4e-3 (11 bits of mantissa, 2^-12 per
  rounding); held to the fp32 model's within 0.02, bf16's 0.15 scaled by the
  8× finer rounding. On the CPU (the reference's fp16) the two paths differ by
  at most 4e-4 and fp16 from fp32 by 2.5e-3 on these models.
"""

import pytest
import torch

from srupp.models import build_model
from srupp.ops.settings import cpu_has_native_bf16

from tolerances import half_dtypes, tol

KINDS = ["srupp", "sru", "lstm", "gru", "transformer"]
OWN = {"srupp": dict(proj_size=8, num_heads=2), "transformer": dict(num_heads=2)}
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=0.05, atol=0.05),
       torch.float16: tol(torch.float16)}
TO_FP32 = {torch.bfloat16: 0.15, torch.float16: 0.02}  # |half logits - fp32 logits|
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def pytest_generate_tests(metafunc):
    """``kind`` and ``dtype`` (test ids kind-dtype-batch): the dtypes are fp32 and the half
    precisions worth testing on --device (bf16; fp16 too on CUDA), so the CPU runs the tests
    it always ran. A mark could not read --device, hence this hook."""
    if "dtype" in metafunc.fixturenames:
        device = torch.device(metafunc.config.getoption("device"))
        dtypes = [torch.float32, *half_dtypes(device)]
        metafunc.parametrize("kind", KINDS)
        metafunc.parametrize("dtype", dtypes, ids=[NAMES[d] for d in dtypes])


def make(kind, dtype, device=None):
    """Built in fp32 on the CPU (the same weights whatever the device), then moved."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=13, d_model=16, num_layers=2, dropout=0.0, mem_len=64, type=kind,
               **OWN.get(kind, {}))
    m = build_model(cfg).eval()
    if kind == "srupp":
        with torch.no_grad():  # give attention a say (α starts at 0)
            for layer in m.backbone.rnn.layers:
                layer.transform.alpha.fill_(0.7)
    return m.to(device, dtype)


def stepped_logits(m, tokens, prefix):
    """Logits (B, L, V) of ``tokens`` (B, L): the first ``prefix`` by forward, then by step."""
    with torch.no_grad():
        out = m(tokens[:, :prefix], m.generation_state(tokens.shape[0]))
        logits, state = [out.logits], out.state
        for t in range(prefix, tokens.shape[1]):
            step, state = m.step(tokens[:, t], state)
            logits.append(step.unsqueeze(1))
    return torch.cat(logits, 1).float()


@pytest.mark.parametrize("batch", [1, 3])
def test_step_equals_forward_token_by_token(kind, dtype, batch, device):
    m = make(kind, dtype, device)
    tokens = torch.randint(0, 13, (batch, 24), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)
    with torch.no_grad():
        full = m(tokens).logits.float()                             # (B, L, V)
    torch.testing.assert_close(stepped_logits(m, tokens, 4), full, **TOL[dtype])
    if dtype != torch.float32:
        with torch.no_grad():
            exact = make(kind, torch.float32, device)(tokens).logits
        torch.testing.assert_close(full, exact, rtol=0, atol=TO_FP32[dtype])


def test_generate_in_bf16_repeats_and_reads_half_the_bytes(device):
    m32 = make("srupp", torch.float32, device)
    nbytes = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    for dtype in half_dtypes(device):  # bf16; fp16 too on CUDA
        m16 = make("srupp", dtype, device)
        assert nbytes(m16) * 2 == nbytes(m32)
        a = m16.generate([[1, 2, 3]], 12, temperature=0)[0]
        assert a == m16.generate([[1, 2, 3]], 12, temperature=0)[0]
        assert len(a) == 12
        # the recurrent state stays fp32 whatever the weights
        state = m16(torch.tensor([[1, 2]], device=device), m16.generation_state(1)).state
        assert state.c.dtype == torch.float32


def test_cli_generate_dtype(tmp_path, corpus, capsys):
    import json

    from lm_helpers import TINY, one_line_error
    from srupp.cli import main

    run = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--out", str(run), "--no-progress",
                 "--set", *TINY, "train.max_steps=2"]) == 0
    capsys.readouterr()
    gen = ["generate", "--checkpoint", str(run), "--prompt", "The", "--max-new-tokens", "5",
           "--temperature", "0"]
    if cpu_has_native_bf16():
        assert main(gen + ["--dtype", "bf16"]) == 0
        out, err = capsys.readouterr()
        assert out.startswith("The") and json.loads(err.splitlines()[-1])["dtype"] == "bf16"
    else:
        one_line_error(capsys, gen + ["--dtype", "bf16"])
    assert main(gen) == 0
    assert json.loads(capsys.readouterr().err.splitlines()[-1])["dtype"] == "fp32"
