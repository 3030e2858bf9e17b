"""ONNX export: the graphs' PyTorch modules equal the model, onnxruntime equals PyTorch,
the example generates srupp generate's greedy text without torch, and the CLI's errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from srupp.cli import main
from srupp.models import build_model
from srupp.onnx import MIN_EXPORT_TORCH, ForwardGraph, StepGraph, export_onnx

from lm_helpers import config, one_line_error

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "onnx_generate.py"
TOL = dict(rtol=1e-5, atol=1e-5)   # the graphs' modules against the model, fp32
ORT_TOL = 1e-4                     # onnxruntime against the model

VARIANTS = {
    "srupp": dict(type="srupp", proj_size=4, mem_len=5),
    "srupp-heads-prenorm-mixed": dict(type="srupp", proj_size=4, num_heads=2, num_layers=3,
                                      layer_norm=True, attention_every_n_layers=2, mem_len=6),
    "srupp-postnorm-no-memory": dict(type="srupp", proj_size=4, layer_norm=True,
                                     normalize_after=True, mem_len=0),
    "sru": dict(type="sru"),
    "sru-projected-layernorm": dict(type="sru", projection_size=4, layer_norm=True),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes (tests/conftest.py)


def make(device=None, **kw):
    """A tiny language model whose attention has a say (α starts at 0), built on the CPU
    (the same weights whatever the device) and moved to ``device``."""
    torch.manual_seed(0)
    fields = dict(vocab_size=11, d_model=8, num_layers=2, dropout=0.0)
    fields.update(kw)
    m = build_model(fields).eval()
    with torch.no_grad():
        for layer in m.backbone.rnn.layers:
            if getattr(layer.transform, "alpha", None) is not None:
                layer.transform.alpha.fill_(0.7)
            layer.bias.uniform_(-0.5, 0.5)  # gates away from their initial values
    return m.to(device)


def step_args(state):
    """The step graph's arguments after tokens, from the state a graph returned."""
    c, *rest = state
    return (c,) if not rest else (c, rest[0], tuple(rest[1:]))


def assert_memory_matches(graph, ours, theirs):
    """Our right-aligned window buffers hold the model's memory in their last slots."""
    if not graph.attention:
        return
    lengths, buffers = ours[1], ours[2:]
    M = theirs.memory_length
    assert lengths.tolist() == [min(M, graph.window)] * lengths.shape[0]
    for i, buf in zip(graph.attention, buffers):
        assert buf.shape[1] == graph.slots
        if M:
            torch.testing.assert_close(buf[:, graph.slots - M:], theirs.memory[i], **TOL)


# ----------------------------------------------------------------- the graphs' modules

# The graphs' modules are plain PyTorch: they run on the model's device.
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_graph_modules_equal_the_model_forward_and_step(variant, device):
    m = make(device, **VARIANTS[variant])
    forward, step = ForwardGraph(m), StepGraph(m)
    W = forward.window
    prompt = torch.randint(0, 11, (2, 9)).to(device)
    with torch.no_grad():
        ours = forward(prompt)
        out = m(prompt, m.initial_state(2, mem_len=W))
    torch.testing.assert_close(ours[0], out.logits, **TOL)
    state, theirs = ours[1:], out.state
    tokens = torch.randint(0, 11, (25, 2)).to(device)  # more steps than the window: it wraps
    for t in tokens:
        with torch.no_grad():
            logits, *state = step(t, *step_args(state))
        want, theirs = m.step(t, theirs)
        torch.testing.assert_close(logits, want, **TOL)
        c_theirs = theirs.c if hasattr(theirs, "c") else theirs["c"]
        torch.testing.assert_close(state[0], c_theirs, **TOL)
        if hasattr(theirs, "memory"):
            assert_memory_matches(step, state, theirs)


def test_a_window_other_than_the_model_mem_len(device):
    m = make(device, type="srupp", proj_size=4, mem_len=50)
    forward, step = ForwardGraph(m, 3), StepGraph(m, 3)
    prompt = torch.randint(0, 11, (1, 6)).to(device)
    with torch.no_grad():
        ours = forward(prompt)
    out = m(prompt, m.initial_state(1, mem_len=3))
    state, theirs = ours[1:], out.state
    for t in torch.randint(0, 11, (10, 1)).to(device):
        with torch.no_grad():
            logits, *state = step(t, *step_args(state))
        want, theirs = m.step(t, theirs)
        torch.testing.assert_close(logits, want, **TOL)


@pytest.mark.parametrize("fields,match", [
    (dict(type="lstm"), "model.type=lstm"),
    (dict(type="transformer"), "model.type=transformer"),
    (dict(type="srupp", proj_size=4, adaptive_cutoffs=[5]), "adaptive"),
    (dict(type="srupp", proj_size=4, mem_len=None), "unbounded"),
])
def test_models_the_graphs_do_not_cover_are_refused(fields, match):
    m = make(**fields) if fields["type"] in ("srupp", "sru") else build_model(
        dict(vocab_size=11, d_model=8, num_layers=2, **fields))
    with pytest.raises(ValueError, match=match):
        ForwardGraph(m)


# ----------------------------------------------------------------- onnxruntime

def _runtime():
    if torch.torch_version.TorchVersion(torch.__version__) < MIN_EXPORT_TORCH:
        pytest.skip(f"torch {torch.__version__}: ONNX export needs torch >= {MIN_EXPORT_TORCH}")
    for name in ("onnx", "onnxscript"):
        pytest.importorskip(name, reason=f"{name} is not installed (pip install 'srupp[onnx]')")
    return pytest.importorskip(
        "onnxruntime", reason="onnxruntime is not installed (pip install 'srupp[onnx]')")


def _sessions(ort, folder):
    description = json.loads((folder / "srupp-onnx.json").read_text())
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return description, {name: ort.InferenceSession(str(folder / f), options,
                                                    providers=["CPUExecutionProvider"])
                         for name, f in description["graphs"].items()}


def _run(session, feeds):
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


def _max_error(a, b) -> float:
    """max |a - b|: a an onnxruntime output (NumPy, on the CPU), b the model's (any device)."""
    return float((torch.as_tensor(a) - b.detach().cpu()).abs().max())


# onnxruntime runs on the CPU (CPUExecutionProvider): the model is on the device, exported
# from there (export_onnx copies it to the CPU), and its outputs are compared on the CPU.
# The tokens are drawn on the CPU, fed to onnxruntime as they are and to the model moved.
@pytest.mark.parametrize("variant,steps", [("srupp-heads-prenorm-mixed", 300), ("sru", 40)])
def test_onnxruntime_matches_pytorch_over_many_steps(tmp_path, variant, steps, device):
    ort = _runtime()
    m = make(device, **VARIANTS[variant])
    description = export_onnx(m, tmp_path, tokenizer={"type": "byte"})
    assert next(m.parameters()).device.type == device.type  # exporting left the model there
    W = description["window"]
    meta, sessions = _sessions(ort, tmp_path)
    assert meta == description and set(os.listdir(tmp_path)) == {
        "forward.onnx", "step.onnx", "srupp-onnx.json", "tokenizer.json"}

    # the full-sequence graph: other batch sizes and lengths than the export's example
    for B, L in ((1, 1), (3, 17)):
        tokens = torch.randint(0, 11, (B, L))
        got = _run(sessions["forward"], {"tokens": tokens.numpy()})
        assert _max_error(got["logits"], m(tokens.to(device)).logits) < ORT_TOL

    # prefill, then many steps, each graph fed back its own state
    prompt = torch.randint(0, 11, (2, 9))
    outs = _run(sessions["forward"], {"tokens": prompt.numpy()})
    state = {n: outs[f"new_{n}"] for n in meta["state"]}
    theirs = m(prompt.to(device), m.initial_state(2, mem_len=W)).state
    worst = 0.0
    for t in torch.randint(0, 11, (steps, 2)):
        outs = _run(sessions["step"], {"tokens": t.numpy(), **state})
        state = {n: outs[f"new_{n}"] for n in meta["state"]}
        want, theirs = m.step(t.to(device), theirs)
        worst = max(worst, _max_error(outs["logits"], want))
    assert worst < ORT_TOL, worst
    if W:
        assert steps > W and state["lengths"].tolist() == [W, W]  # the window wrapped


def test_an_older_torch_is_refused_before_exporting(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    with pytest.raises(ValueError, match=r"ONNX export needs torch >= 2\.13.*upgrade torch"):
        export_onnx(make(type="sru"), tmp_path)
    assert not any(tmp_path.iterdir())  # refused before writing anything


# ----------------------------------------------------------------- the example and the CLI

@pytest.mark.parametrize("tokenizer", ["byte", "char"])
def test_example_generates_the_greedy_text_of_srupp_generate(tmp_path, corpus, capsys,
                                                            tokenizer):
    _runtime()
    from srupp.train import Trainer

    run, out = tmp_path / "run", tmp_path / "onnx"
    Trainer(config(corpus, "train.max_steps=8", f"data.tokenizer={tokenizer}"), run,
            progress=False).train()
    assert main(["export", "--checkpoint", str(run), "--format", "onnx",
                 "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["window"] == 16 and Path(printed["out"]) == out  # model.mem_len = unroll
    prompt = "When in the"  # then 60 tokens: the window of 16 wraps
    assert main(["generate", "--checkpoint", str(run), "--prompt", prompt,
                 "--max-new-tokens", "60", "--temperature", "0"]) == 0
    want = capsys.readouterr().out
    # the example in a process of its own, which must never import torch
    script = ("import runpy, sys\n"
              "sys.argv = sys.argv[1:]\n"
              "try:\n"
              "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
              "except SystemExit as e:\n"
              "    assert not e.code, e.code\n"
              "assert 'torch' not in sys.modules, 'the example imported torch'\n")
    done = subprocess.run([sys.executable, "-c", script, str(EXAMPLE), str(out),
                           "--prompt", prompt, "--max-new-tokens", "60", "--temperature", "0",
                           "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == want
    assert json.loads(done.stderr.splitlines()[-1])["new_tokens"] == 60


def _saved(tmp_path, **fields):
    """A checkpoint folder (model and byte tokenizer) of an untrained model."""
    folder = tmp_path / "ckpt"
    make(vocab_size=256, **fields).save_pretrained(folder) if fields["type"] in (
        "srupp", "sru") else build_model(dict(vocab_size=256, d_model=8, num_layers=2,
                                              **fields)).save_pretrained(folder)
    (folder / "tokenizer.json").write_text(json.dumps({"type": "byte"}))
    return folder


def test_cli_export_errors_are_one_line(tmp_path, capsys):
    out = str(tmp_path / "out")
    err = one_line_error(capsys, ["export", "--checkpoint", str(tmp_path / "missing"),
                                  "--out", out])
    assert "does not exist" in err
    lstm = _saved(tmp_path, type="lstm")
    err = one_line_error(capsys, ["export", "--checkpoint", str(lstm), "--out", out])
    assert "model.type=lstm" in err and "torch.nn.LSTM" in err
    err = one_line_error(capsys, ["export", "--checkpoint", str(lstm), "--format", "hf",
                                  "--out", out, "--mem-len", "4"])
    assert "--mem-len applies to --format onnx" in err
    assert not Path(out).exists()


def test_cli_export_format_hf_writes_a_transformers_folder(tmp_path, capsys):
    pytest.importorskip("transformers", reason="transformers is not installed "
                                                "(pip install 'srupp[hf]')")
    folder, out = _saved(tmp_path, type="sru"), tmp_path / "hf"
    assert main(["export", "--checkpoint", str(folder), "--format", "hf",
                 "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out) == {"format": "hf", "out": str(out)}
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()


def test_cli_export_needs_a_window_for_an_unbounded_memory(tmp_path, capsys):
    _runtime()
    folder = _saved(tmp_path, type="srupp", proj_size=4, mem_len=None)
    err = one_line_error(capsys, ["export", "--checkpoint", str(folder),
                                  "--out", str(tmp_path / "out")])
    assert "unbounded" in err and "--mem-len" in err
    afile = tmp_path / "afile"
    afile.write_text("mine")
    err = one_line_error(capsys, ["export", "--checkpoint", str(folder), "--out", str(afile),
                                  "--mem-len", "4"])
    assert "is a file" in err and afile.read_text() == "mine"
    assert main(["export", "--checkpoint", str(folder), "--out", str(tmp_path / "out"),
                 "--mem-len", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["window"] == 4


# ----------------------------------------------------------------- int8 graphs

# onnxruntime's dynamic quantization rounds each weight to int8 (one scale per output
# channel) and each product's input to uint8 (one scale per call): on this tiny model's
# logits, of size ~1, that moves them by a few hundredths
INT8_ORT_TOL = 0.15


def test_quantized_graphs_run_in_onnxruntime_close_to_float(tmp_path):
    """The int8 graphs against the float model itself, whose float graphs
    test_onnxruntime_matches_pytorch_over_many_steps holds to 1e-4 (exporting them here
    too would double this test's time)."""
    ort = _runtime()
    import onnx

    m = make(**VARIANTS["srupp-heads-prenorm-mixed"])
    description = export_onnx(m, tmp_path, quantize="int8")
    assert description["weights"] == "int8"
    ops = {n.op_type for n in onnx.load(str(tmp_path / "step.onnx")).graph.node}
    assert "DynamicQuantizeLinear" in ops or "MatMulInteger" in ops, ops
    meta, int8 = _sessions(ort, tmp_path)
    prompt = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(0))
    outs = _run(int8["forward"], {"tokens": prompt.numpy()})
    with torch.no_grad():
        want = m(prompt, m.initial_state(2, mem_len=meta["window"]))
    assert _max_error(outs["logits"], want.logits) < INT8_ORT_TOL
    state, theirs = {n: outs[f"new_{n}"] for n in meta["state"]}, want.state
    for t in torch.randint(0, 11, (20, 2), generator=torch.Generator().manual_seed(1)):
        outs = _run(int8["step"], {"tokens": t.numpy(), **state})
        state = {n: outs[f"new_{n}"] for n in meta["state"]}
        with torch.no_grad():
            logits, theirs = m.step(t, theirs)
        assert _max_error(outs["logits"], logits) < INT8_ORT_TOL


def test_quantize_arguments_of_the_export(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"unknown quantization 'int4'"):
        export_onnx(make(mem_len=4), tmp_path / "a", quantize="int4")
    with pytest.raises(ValueError, match="quantize_dynamic applies"):
        export_onnx(make(mem_len=4), tmp_path / "w", quantize="w8a8")
    with pytest.raises(ValueError, match="export the float model"):
        export_onnx(make(mem_len=4).quantize(), tmp_path / "b")
    ckpt = _saved(tmp_path, type="srupp")
    err = one_line_error(capsys, ["export", "--checkpoint", str(ckpt), "--format", "hf",
                                  "--out", str(tmp_path / "c"), "--quantize", "int8"])
    assert "--quantize applies to --format onnx" in err
