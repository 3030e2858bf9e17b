"""Baselines (model.type): training, carried state, generation, saving, resume, CLI."""

import json

import pytest
import torch

from srupp.cli import main
from srupp.models import CausalLM, TensorState, build_model, config_from_dict, load_model
from srupp.models.config import TransformerConfig
from srupp.models.state import state_from_dict
from srupp.train import Trainer

from lm_helpers import baseline_config, greedy_by_recomputing, metrics
from models_on_device import across_shapes

TOL = dict(rtol=1e-5, atol=1e-5)
BASELINES = ["sru", "lstm", "gru", "transformer"]
CLASSES = ["srupp", "sru", "lstm", "gru", "transformer"]
OWN = {"srupp": dict(proj_size=4), "transformer": dict(num_heads=2)}  # fields of one type


def make(kind, device=None, **kw):
    """A tiny model built on the CPU (the same weights whatever the device), moved to device."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=11, d_model=8, num_layers=2, dropout=0.0, mem_len=64, type=kind,
               **OWN.get(kind, {}))
    cfg.update(kw)
    return build_model(cfg).eval().to(device)


def tokens(*shape, device):
    return torch.randint(0, 11, shape).to(device)


# ---------------------------------------------------------------- the models
@pytest.mark.parametrize("kind", list(CLASSES))
def test_build_model_dispatches_and_counts(kind, device):
    m = make(kind, device)
    assert type(m) is CausalLM and m.config.type == kind
    out = m(tokens(3, 6, device=device), targets=tokens(3, 6, device=device))
    assert out.logits.shape == (3, 6, 11) and torch.isfinite(out.loss)
    tied = make(kind, device, tie_embeddings=True)
    assert tied.output.weight is tied.embedding.weight
    assert tied.num_parameters() == m.num_parameters() - 11 * 8


@pytest.mark.parametrize("kind", BASELINES)
def test_segments_with_state_match_one_pass(kind, device):
    m = make(kind, device)  # transformer: mem_len 64 >= the 12 tokens
    t = tokens(2, 12, device=device)
    full = m(t).logits
    a = m(t[:, :5])
    b = m(t[:, 5:], a.state.detach())
    torch.testing.assert_close(torch.cat([a.logits, b.logits], 1), full, **TOL)


@pytest.mark.parametrize("kind", BASELINES)
def test_greedy_generation_matches_recomputation(kind, device):
    m = make(kind, device)
    prompt = [1, 5, 2, 7]
    assert m.generate([prompt], 8, temperature=0)[0] == greedy_by_recomputing(m, prompt, 8)


@pytest.mark.parametrize("kind", BASELINES)
def test_batched_left_padded_generation_matches_single(kind, device):
    m = make(kind, device)
    prompts = [[3, 1, 4, 1, 5], [9], [2, 6]]
    batched = m.generate(prompts, 6, temperature=0)
    for p, got in zip(prompts, batched):
        assert got == m.generate([p], 6, temperature=0)[0]


def test_transformer_without_memory_restarts_segments_and_learned_positions(device):
    m = make("transformer", device, mem_len=0)
    assert m.backbone.positions == "learned" and m.backbone.pos_embedding is not None
    t = tokens(2, 10, device=device)
    a = m(t[:, :4])
    assert "k.0" not in a.state and int(a.state["pos"].sum()) == 0
    torch.testing.assert_close(m(t[:, 4:], a.state).logits, m(t[:, 4:]).logits, **TOL)
    prompt = [1, 5, 2, 7]  # generation keeps a KV cache all the same
    assert m.generate([prompt], 6, temperature=0)[0] == greedy_by_recomputing(m, prompt, 6)
    with pytest.raises(ValueError, match="mem_len=0"):
        TransformerConfig(positions="learned", mem_len=8)


def test_transformer_memory_is_a_window(device):
    m = make("transformer", device, mem_len=3)
    assert m.backbone.positions == "sinusoidal"
    s = m(tokens(2, 5, device=device)).state
    assert s["k.0"].shape == (2, 2, 3, 4) and s["pos"].tolist() == [5, 5]
    s = m(tokens(2, 2, device=device), s).state
    assert s["v.1"].shape == (2, 2, 3, 4) and s["pos"].tolist() == [7, 7]


def decode_steps(m, state, prompt, steps):
    """Read ``prompt`` (B, L) into ``state``, then ``steps`` greedy tokens one at a time:
    (logits of each step (steps + 1, B, V), the final state)."""
    with torch.no_grad():
        out = m(prompt, state)
        logits, state = [out.logits[:, -1]], out.state
        for _ in range(steps):
            step, state = m.step(logits[-1].argmax(-1), state)
            logits.append(step)
    return torch.stack(logits), state


@pytest.mark.parametrize("kind", list(CLASSES))
def test_padded_state_decodes_as_the_generation_state(kind, device):
    """A window of padding from the start (a serving engine's slot) is never attended to:
    the same logits as the generation state with that window, as the window slides."""
    m = make(kind, device, mem_len=4)
    prompt = tokens(2, 3, device=device)
    want, _ = decode_steps(m, m.generation_state(2, 4), prompt, 6)
    got, state = decode_steps(m, m.backbone.padded_state(2, 4), prompt, 6)
    torch.testing.assert_close(got, want, **TOL)
    if kind == "srupp":
        assert state.memory_length == 4 and state.memory_mask_pad.shape == (2, 4)
    elif kind == "transformer":
        assert state["k.0"].shape[2] == state["v.1"].shape[2] == 4


@pytest.mark.parametrize("kind", CLASSES)
def test_padded_states_at_different_points_join(kind, device):
    """Two streams' states, one past its padding and one just started, keep the same
    tensors and sizes, join into one batch, and each row decodes as it would alone."""
    m = make(kind, device, mem_len=4)
    _, old = decode_steps(m, m.backbone.padded_state(1, 4), tokens(1, 3, device=device), 5)
    _, new = decode_steps(m, m.backbone.padded_state(1, 4), tokens(1, 1, device=device), 0)
    joined = type(old).cat([old, new])
    assert old.nbytes() == new.nbytes()
    nxt = torch.tensor([3, 8], device=device)
    with torch.no_grad():
        both, _ = m.step(nxt, joined)
        for i, alone in enumerate((old, new)):
            torch.testing.assert_close(both[i], m.step(nxt[i:i + 1], alone)[0][0], **TOL)


@pytest.mark.parametrize("kind", BASELINES)
def test_state_dict_round_trip_and_index_select(kind, device):
    m = make(kind, device)
    s = m(tokens(3, 4, device=device)).state
    assert isinstance(s, TensorState) and s.batch_size == 3 and s.nbytes() > 0
    back = state_from_dict(s.to_dict())
    assert isinstance(back, TensorState) and back.batch_dims == s.batch_dims
    for k in s.tensors:
        assert torch.equal(back[k], s[k])
    sel = s.index_select(torch.tensor([2, 0]))  # a CPU index selects on any device
    assert sel.batch_size == 2
    assert all(t.device == s[k].device for k, t in sel.tensors.items())
    t = tokens(3, 3, device=device)
    torch.testing.assert_close(m(t[[2, 0]], sel).logits, m(t, s).logits[[2, 0]],
                               **across_shapes(device, **TOL))
    # SRU++ states still load as SRUppState
    from srupp.nn import SRUppState
    assert isinstance(state_from_dict(make("srupp", device)(t).state.to_dict()), SRUppState)


@pytest.mark.parametrize("kind", list(CLASSES))
def test_save_load_round_trip_gives_the_saved_type(tmp_path, kind, device):
    m = make(kind, device)
    m.save_pretrained(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["type"] == kind
    for loader in (CausalLM.from_pretrained, type(m).from_pretrained, load_model):
        back = loader(tmp_path / "m", device=device)
        assert type(back) is CausalLM and back.config == m.config
        assert not back.training and back.device == m.device
        t = tokens(2, 7, device=device)
        torch.testing.assert_close(back(t).logits, m(t).logits)


def test_unknown_type_is_an_error(capsys):
    with pytest.raises(ValueError, match="srupp, sru, lstm, gru, transformer"):
        config_from_dict({"type": "rnn"})
    assert main(["params", "--set", "model.type=rnn"]) == 2
    err = capsys.readouterr().err
    assert "model.type" in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("kind", BASELINES)
def test_cli_params(kind, capsys):
    heads = ["model.num_heads=2"] if kind == "transformer" else []
    assert main(["params", "--set", f"model.type={kind}", "model.d_model=16",
                 "model.num_layers=2", *heads]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["type"] == kind and p["layers"] > 0
    assert p["params"] == p["embedding"] + p["layers"] + p["output"]


# ---------------------------------------------------------------- the trainer
@pytest.mark.parametrize("kind,steps", [("sru", 160), ("lstm", 80), ("gru", 80),
                                        ("transformer", 80)])
def test_training_lowers_the_loss(tmp_path, corpus, kind, steps):
    run = tmp_path / kind
    # RAdam's rectifier keeps early steps small, hence a high lr for a short run (plain
    # SRU, without attention, needs more steps on this tiny corpus)
    Trainer(baseline_config(corpus, kind, f"train.max_steps={steps}", "train.lr=3e-2",
                            "train.eval_every=40", "train.save_every=40"),
            run, progress=False).train()
    train = [r["train_loss"] for r in metrics(run) if "train_loss" in r]
    assert train[-1] < train[0] - 0.5, train
    model = load_model(next(run.glob("ckpt-*")))
    assert type(model) is CausalLM and model.config.type == kind


@pytest.mark.parametrize("kind", ["lstm", "transformer"])
def test_interrupt_and_resume_gives_identical_losses(tmp_path, corpus, kind):
    full = tmp_path / "full"
    Trainer(baseline_config(corpus, kind, "train.max_steps=12"), full, progress=False).train()
    part = tmp_path / "part"
    t = Trainer(baseline_config(corpus, kind, "train.max_steps=12"), part, progress=False)
    original = t._train_step

    def step_then_interrupt(it):
        loss = original(it)
        if t.step == 7:
            raise KeyboardInterrupt
        return loss

    t._train_step = step_then_interrupt
    assert t.train()["interrupted"]
    resumed = Trainer(baseline_config(corpus, kind, "train.max_steps=12"), part, resume=True,
                      progress=False)
    assert resumed.step == 7 and isinstance(resumed.carried, TensorState)
    resumed.train()
    keys = ("step", "train_loss", "lr", "valid_bpc", "valid_loss")
    strip = lambda rows: [{k: r[k] for k in keys if k in r} for r in rows]  # noqa: E731
    assert strip(metrics(part)) == strip(metrics(full))
