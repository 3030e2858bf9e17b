"""train.optimizer and train.betas: RAdam (the default) or AdamW (GPT recipes'), the same
parameter groups and decoupled decay for both, exact resume, and a resume that changes
the optimiser refused."""

import json

import pytest
import torch
from safetensors.torch import load_file

from srupp.cli import main
from srupp.errors import UserError
from srupp.train import Trainer, build_config
from srupp.train.config import has_fused
from srupp.train.trainer import build_optimizer, optimizer_impl

from lm_helpers import TINY, baseline_config, config, metrics, one_line_error
from test_trainer import _same_losses, _signal_inside_a_step

ADAMW = ("train.optimizer=adamw", "train.betas=0.9,0.95")


def _weights(run):
    """The weights of a run's last checkpoint."""
    ckpt = run / json.loads((run / "last.json").read_text())["dir"]
    return load_file(str(ckpt / "model.safetensors"))


@pytest.mark.parametrize("value", ["[0.9,0.95]", "0.9, 0.95", "[0.9, 0.95]"])
def test_betas_from_the_command_line(value):
    cfg = build_config(None, [f"train.betas={value}", "train.optimizer=adamw"])
    assert cfg.train.betas == [0.9, 0.95] and cfg.train.optimizer == "adamw"


def test_betas_from_a_recipe(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[train]\noptimizer = "adamw"\nbetas = [0.9, 0.95]\n')
    assert build_config(recipe).train.betas == [0.9, 0.95]
    default = build_config(None).train
    assert default.optimizer == "radam" and default.betas == [0.9, 0.999]


@pytest.mark.parametrize("item, words", [
    ("train.optimizer=sgd", "train.optimizer must be radam or adamw, got 'sgd'"),
    ("train.betas=0.9,1.0", r"train.betas\[1\] must be in \[0, 1\), got 1.0"),
    ("train.betas=-0.1,0.9", r"train.betas\[0\] must be in \[0, 1\), got -0.1"),
    ("train.betas=0.9,nan", r"train.betas\[1\] must be a number in \[0, 1\), got nan"),
    ("train.betas=0.9", r"train.betas must be two numbers \(β1, β2\)"),
    ("train.betas=0.9,0.95,0.99", r"train.betas must be two numbers"),
    ("train.betas=0.9,x", r"train.betas\[1\] must be float, got 'x'"),
])
def test_a_bad_optimizer_or_betas_is_a_user_error(item, words):
    with pytest.raises(UserError, match=words):
        build_config(None, [item])


def test_a_bad_optimizer_is_one_line_on_the_command_line(tmp_path, capsys):
    err = one_line_error(capsys, ["train", "--out", str(tmp_path / "run"),
                                  "--set", "train.optimizer=adam"])
    assert "train.optimizer must be radam or adamw, got 'adam'" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, cls", [("radam", torch.optim.RAdam),
                                       ("adamw", torch.optim.AdamW)])
@pytest.mark.parametrize("no_decay", [False, True])
def test_both_optimizers_take_the_same_groups_and_decoupled_decay(corpus, name, cls, no_decay):
    cfg = config(corpus, f"train.optimizer={name}", "train.betas=0.8,0.9",
                 "train.weight_decay=0.05", f"train.no_decay_bias_norm={no_decay}")
    t = Trainer(cfg, corpus.parent / "run", progress=False)
    try:
        opt = t.optimizer
        assert type(opt) is cls
        groups = [[id(p) for p in g["params"]] for g in opt.param_groups]
        assert groups == [[id(p) for p in g["params"]] for g in t._param_groups()]
        assert len(groups) == (2 if no_decay else 1)
        assert [g["weight_decay"] for g in opt.param_groups] == ([0.05, 0.0] if no_decay
                                                                  else [0.05])
        assert all(g["betas"] == (0.8, 0.9) and g["initial_lr"] == cfg.train.lr
                   for g in opt.param_groups)
        # RAdam decays the gradient (L2) unless told to decouple; AdamW always decouples
        assert all(g.get("decoupled_weight_decay", cls is torch.optim.AdamW)
                   for g in opt.param_groups)
    finally:
        t.close()


def test_decoupled_decay_shrinks_weights_without_a_gradient():
    """Decoupled decay multiplies the weight by 1 - lr·wd even where the gradient is 0
    (L2 decay through Adam's moments would move it by about lr instead)."""
    cfg = build_config(None, ["train.lr=0.1", "train.weight_decay=0.5"])
    for name in ("radam", "adamw"):
        cfg.train.optimizer = name
        w = torch.nn.Parameter(torch.full((2, 2), 2.0))
        opt = build_optimizer([{"params": [w]}], cfg.train)
        w.grad = torch.zeros_like(w)
        opt.step()
        torch.testing.assert_close(w.detach(), torch.full((2, 2), 2.0 * (1 - 0.1 * 0.5)))


def test_adamw_trains_the_transformer_baseline(tmp_path, corpus):
    run = tmp_path / "run"
    cfg = baseline_config(corpus, "transformer", *ADAMW, "train.max_steps=24",
                          "train.no_decay_bias_norm=true", "train.eval_every=24",
                          "train.save_every=24")
    Trainer(cfg, run, progress=False).train()
    train = [r["train_loss"] for r in metrics(run) if "train_loss" in r]
    assert len(train) == 12
    assert train[-1] < train[0] - 0.3, train
    saved = json.loads((run / "config.json").read_text())["train"]
    assert saved["optimizer"] == "adamw" and saved["betas"] == [0.9, 0.95]


def test_adamw_resumes_bit_for_bit(tmp_path, corpus):
    steps = (*ADAMW, "train.max_steps=12", "train.grad_accum=2")
    full = tmp_path / "full"
    Trainer(config(corpus, *steps), full, progress=False).train()

    part = tmp_path / "part"
    t = Trainer(config(corpus, *steps), part, progress=False)
    _signal_inside_a_step(t, at=[14])  # step 7's second segment: stops after step 7
    assert t.train() == {"interrupted": True, "step": 7}
    resumed = Trainer(config(corpus, *steps), part, resume=True, progress=False)
    assert type(resumed.optimizer) is torch.optim.AdamW and resumed.step == 7
    resumed.train()
    _same_losses(metrics(part), metrics(full))
    a, b = _weights(part), _weights(full)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_with_another_optimizer_is_refused(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    # saved with RAdam (the default), resumed asking for AdamW
    assert main(["train", "--out", str(run), "--no-progress", "--set", *TINY,
                 f"data.corpus={corpus}", "train.max_steps=4"]) == 0
    capsys.readouterr()
    before = json.loads((run / "last.json").read_text())
    err = one_line_error(capsys, ["train", "--out", str(run), "--resume", "--no-progress",
                                  "--set", "train.optimizer=adamw", "train.max_steps=8"])
    assert f"{run} was trained with train.optimizer=radam; resume it with the same" in err
    assert json.loads((run / "last.json").read_text()) == before  # nothing trained
    # and the other way round, through the Python API
    other = tmp_path / "other"
    Trainer(config(corpus, *ADAMW, "train.max_steps=4"), other, progress=False).train()
    with pytest.raises(UserError, match="was trained with train.optimizer=adamw"):
        Trainer(config(corpus, "train.max_steps=8"), other, resume=True, progress=False)


# ---------------------------------------------------------------- train.optimizer_impl

def _flags(opt):
    return {k: opt.defaults[k] for k in ("foreach", "fused") if k in opt.defaults}


@pytest.mark.parametrize("name, impl, flags", [
    ("adamw", "fused", {"foreach": None, "fused": True}),
    ("adamw", "foreach", {"foreach": True, "fused": None}),
    ("adamw", "loop", {"foreach": False, "fused": None}),
    ("adamw", "auto", {"foreach": None, "fused": None}),  # on the CPU: torch's default
    ("radam", "foreach", {"foreach": True}),
    ("radam", "loop", {"foreach": False}),
    ("radam", "auto", {"foreach": None}),
])
def test_optimizer_impl_sets_torchs_flags(name, impl, flags):
    cfg = build_config(None, [f"train.optimizer={name}", f"train.optimizer_impl={impl}"])
    opt = build_optimizer([{"params": [torch.nn.Parameter(torch.zeros(2))]}], cfg.train)
    assert _flags(opt) == flags


def test_auto_is_fused_on_cuda_where_torch_has_it():
    """auto on CUDA: AdamW fused (one kernel; under fp16, no wait in GradScaler.step),
    RAdam foreach (torch has no fused RAdam); explicit choices are kept."""
    t = build_config(None, ["train.optimizer=adamw"]).train
    assert optimizer_impl(t, "cuda") == "fused" and optimizer_impl(t, "cpu") == "default"
    assert has_fused("adamw") and not has_fused("radam")
    t = build_config(None, ["train.optimizer=radam"]).train
    assert optimizer_impl(t, torch.device("cuda", 0)) == "foreach"
    t = build_config(None, ["train.optimizer=adamw", "train.optimizer_impl=loop"]).train
    assert optimizer_impl(t, "cuda") == "loop"


def test_fused_adamw_trains_as_the_loop(tmp_path, corpus):
    """Fused AdamW (torch runs it on the CPU too) takes the for-loop's steps: the same
    update, rounded in another order, so the weights agree to rounding after 8 steps."""
    runs = {}
    for impl in ("loop", "fused"):
        cfg = config(corpus, *ADAMW, f"train.optimizer_impl={impl}", "train.max_steps=8",
                     "model.dropout=0")
        runs[impl] = Trainer(cfg, tmp_path / impl, progress=False)
        runs[impl].train()
    assert runs["fused"].optimizer.defaults["fused"] is True
    for (n, a), (_, b) in zip(runs["loop"].model.named_parameters(),
                              runs["fused"].model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)  # 3e-8 seen


def test_a_foreach_checkpoint_resumes_fused(tmp_path, corpus):
    """The implementations keep the same state: a run saved with foreach resumes fused
    (not, silently, foreach again: a state dict carries its groups' flags), with the step
    counts where fused keeps them (on the parameters' device, fp32)."""
    steps = (*ADAMW, "train.max_steps=8", "model.dropout=0")
    full = tmp_path / "full"
    Trainer(config(corpus, *steps, "train.optimizer_impl=foreach"), full,
            progress=False).train()
    part = tmp_path / "part"
    t = Trainer(config(corpus, *steps, "train.optimizer_impl=foreach"), part, progress=False)
    _signal_inside_a_step(t, at=[5])
    assert t.train() == {"interrupted": True, "step": 5}
    resumed = Trainer(config(corpus, *steps, "train.optimizer_impl=fused"), part, resume=True,
                      progress=False)
    assert resumed.step == 5
    assert all(g["fused"] is True and not g["foreach"] for g in resumed.optimizer.param_groups)
    state = next(iter(resumed.optimizer.state.values()))
    assert state["step"].dtype == torch.float32 and state["step"].item() == 5
    resumed.train()
    a, b = _weights(part), _weights(full)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
