"""train.compile: compiled training takes the same steps as eager training.

``model`` compiles the whole training forward; ``layers`` each repeated layer
alone (:mod:`srupp.train.compile`), with the SRU recurrence one opaque custom
op inside it; ``layers-cudagraphs`` also replays the layers as CUDA graphs
(CUDA only). On ``--device`` (``pytest --device cuda`` runs them on the GPU),
where the recurrence is the custom op around srupp's kernel (C++ on the CPU,
Triton on CUDA).
"""

import importlib.util
import json
import shutil

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch.aot_autograd import make_boxed_func

from srupp.errors import UserError
from srupp.models import build_model, config_from_dict
from srupp.runs import read_run_config
from srupp.train import Trainer, build_config
from srupp.train.compile import compile_layers

from lm_helpers import baseline_config, config, metrics
from test_trainer import _signal_inside_a_step
from tolerances import tol


def _skip_without_a_compiler(device):
    """torch.compile's inductor writes C++ for the CPU and Triton for CUDA."""
    if device.type == "cpu" and shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("torch.compile on CPU needs a C++ compiler (g++ or c++ on PATH)")
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        pytest.skip("torch.compile on CUDA needs Triton (pip install triton)")


def _same_training(eager, compiled, runs, device):
    """The two trainers' weights and logged losses agree."""
    # on the CPU the same sums in the same order; CUDA's fused kernels may add in another
    close = dict(rtol=1e-5, atol=1e-6) if device.type == "cpu" else tol(torch.float32)
    for (n, a), (_, b) in zip(eager.model.named_parameters(), compiled.model.named_parameters()):
        torch.testing.assert_close(a, b, **close, msg=n)
    losses = [[r["train_loss"] for r in metrics(run) if "train_loss" in r] for run in runs]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5 if device.type == "cpu" else 1e-4)


@pytest.mark.parametrize("mode", ["model", "layers", "layers-cudagraphs"])
def test_compiled_training_equals_eager(tmp_path, corpus, device, mode):
    _skip_without_a_compiler(device)
    if mode == "layers-cudagraphs" and device.type != "cuda":
        pytest.skip("CUDA graphs run on CUDA only (test_cuda_graphs_are_refused_off_cuda "
                    "checks the CPU's refusal)")
    counters.clear()
    runs = {}
    for name, flag in (("eager", "false"), ("compiled", mode)):
        cfg = config(corpus, "model.dropout=0", "train.max_steps=4", f"train.compile={flag}",
                     f"train.device={device.type}")
        trainer = Trainer(cfg, tmp_path / name, progress=False)
        trainer.train()
        runs[name] = trainer
    eager, compiled = runs["eager"], runs["compiled"]
    if mode == "model":
        assert compiled.train_model is not compiled.model  # the forward really was compiled
    else:  # each layer in place
        assert compiled.train_model is compiled.model
        assert all(hasattr(layer.layer_forward, "compiled")
                   for layer in compiled.model.backbone.rnn.layers)
        assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    assert next(compiled.model.parameters()).device.type == device.type
    _same_training(eager, compiled, [tmp_path / n for n in runs], device)


def _graph_capture():
    """A backend that keeps AOT autograd's forward and backward graphs and runs them as they
    are (no Inductor: quick), and the lists it fills."""
    graphs = {"forward": [], "backward": []}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward")), graphs


def _calls(gm, op) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is op)


# attention in the last of three layers: layers with and without attention, and the
# last without highway dropout; a memory of one segment
LAYOUTS = {
    "srupp": dict(type="srupp", proj_size=8, attention_last_n_layers=1, mem_len=8),
    "sru": dict(type="sru"),
    "transformer": dict(type="transformer", num_heads=2, mem_len=8),
}


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_layers_compile_whole_with_the_recurrence_one_custom_op(kind):
    """Each layer is one graph (fullgraph: a graph break is an error), whose forward
    calls srupp::sru_fwd once and whose backward srupp::sru_bwd once; evaluation stays
    eager."""
    torch._dynamo.reset()  # graphs cached by other tests would not be captured again
    backend, graphs = _graph_capture()
    torch.manual_seed(0)
    cfg = config_from_dict({"task": "lm", "vocab_size": 11, "d_model": 16, "num_layers": 3,
                            "dropout": 0.1, **LAYOUTS[kind]})
    model = build_model(cfg)
    names = compile_layers(model, backend=backend, fullgraph=True)
    layers = "backbone.blocks" if kind == "transformer" else "backbone.rnn.layers"
    assert names == [f"{layers}.{i}" for i in range(3)]
    model.train()
    x = torch.randint(0, 11, (2, 8))
    state = None
    for _ in range(2):  # the second segment reads the first one's memory
        out = model(x, state, targets=x)
        out.loss.backward()
        state = out.state.detach()
    fw, bw = graphs["forward"], graphs["backward"]
    assert fw and len(bw) == len(fw)
    # the layers share graphs: fewer than the 6 layer calls
    assert len(fw) < 6, len(fw)
    ops = torch.ops.srupp
    per_graph = 0 if kind == "transformer" else 1
    assert [_calls(g, ops.sru_fwd.default) for g in fw] == [per_graph] * len(fw)
    assert [_calls(g, ops.sru_bwd.default) for g in bw] == [per_graph] * len(bw)
    compiled = len(fw)
    model.eval()
    with torch.no_grad():
        model(x)
    model.train()
    with torch.no_grad():
        model(x)
    assert len(fw) == compiled  # without gradients: eager


def test_layers_need_repeated_layers(tmp_path, corpus):
    cfg = baseline_config(corpus, "lstm", "train.compile=layers")
    with pytest.raises(UserError, match="model.type=lstm has none: use train.compile=model"):
        Trainer(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_cuda_graphs_are_refused_off_cuda():
    with pytest.raises(UserError, match="needs train.device=cuda, got train.device=cpu"):
        build_config(None, ["train.compile=layers-cudagraphs"])


def test_a_run_saved_with_compile_true_resumes(tmp_path, corpus, device):
    """Runs saved before train.compile was a choice say true (the whole model): their config
    still reads, and the run resumes, here compiled by layer, on the eager run's steps."""
    _skip_without_a_compiler(device)
    steps = ("model.dropout=0", f"train.device={device.type}", "train.max_steps=8")
    full = tmp_path / "full"
    eager = Trainer(config(corpus, *steps), full, progress=False)
    eager.train()

    part = tmp_path / "part"
    t = Trainer(config(corpus, *steps), part, progress=False)
    _signal_inside_a_step(t, at=[5])  # stops after step 5
    assert t.train() == {"interrupted": True, "step": 5}
    saved = json.loads((part / "config.json").read_text())
    saved["train"]["compile"] = True  # as srupp wrote it before
    (part / "config.json").write_text(json.dumps(saved))
    assert build_config(None, [], base=read_run_config(part)).train.compile == "model"
    # (the whole model compiles slowly: resume compiled by layer, a --set as on the CLI)
    cfg = build_config(None, ["train.compile=layers"], base=read_run_config(part))
    resumed = Trainer(cfg, part, resume=True, progress=False)
    assert resumed.step == 5
    resumed.train()
    _same_training(eager, resumed, [full, part], device)
