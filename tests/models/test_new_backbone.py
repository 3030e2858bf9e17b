"""A new backbone is one class and one registry line, and then trains for every task via the CLI."""

import json
import random
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import nn

from srupp.cli import main
from srupp.models import BACKBONES, Backbone, build_model, load_model, register_backbone
from srupp.models.state import TensorState
from srupp.train import build_config  # imported before the registration, as a program would

WORDS = "house cat dog tree car book table chair window door".split()


@dataclass
class ToyFields:
    bidirectional: ClassVar[bool] = False  # the encoder keeps the full width

    mix: float = 0.5                      # how much of the running mean each position adds


class ToyBackbone(Backbone):
    """h_t = tanh(W x_t + mix · U mean(x_≤t)): a running mean as the only memory; an encoder
    takes the mean of the whole row, a decoder adds the mean of the source."""

    label = "Toy"
    fields = ToyFields

    def __init__(self, config, *, role, device=None, dtype=None):
        super().__init__(config, role=role, device=device, dtype=dtype)
        d = config.d_model
        self.w, self.u = nn.Linear(d, d, **self.factory), nn.Linear(d, d, **self.factory)

    def reset_parameters(self):
        self.w.reset_parameters()
        self.u.reset_parameters()

    def initial_state(self, batch_size, mem_len=None):
        return TensorState({"sum": torch.zeros(batch_size, self.config.d_model,
                                               device=self.device),
                            "n": torch.zeros(batch_size, device=self.device)},
                           {"sum": 0, "n": 0})

    def init_decoder(self, enc, *, steps=True):
        state = self.initial_state(enc.states.shape[0])
        states = enc.states                                                       # (B, S, d)
        real = (torch.ones_like(states[..., 0]) if enc.pad is None
                else (~enc.pad).to(states.dtype))                                 # (B, S)
        src = (states * real[..., None]).sum(1) / real.sum(1, keepdim=True)       # (B, d)
        return TensorState({**state.tensors, "src": src}, {**state.batch_dims, "src": 0})

    def forward(self, x, state=None, mask_pad=None):
        real = torch.ones_like(x[..., 0]) if mask_pad is None else (~mask_pad).to(x.dtype)
        if self.role == "encoder":
            mean = (x * real[..., None]).sum(1, True) / real.sum(1)[:, None, None]
            return torch.tanh(self.w(x) + self.config.mix * self.u(mean)), None
        state = state if state is not None else self.initial_state(x.shape[0])
        sums = state["sum"][:, None] + (x * real[..., None]).cumsum(1)           # (B, L, d)
        n = state["n"][:, None] + real.cumsum(1)                                  # (B, L)
        h = self.w(x) + self.config.mix * self.u(sums / n.clamp_min(1)[..., None])
        if "src" in state:
            h = h + state["src"][:, None]
        new = {**state.tensors, "sum": sums[:, -1], "n": n[:, -1]}
        return torch.tanh(h), TensorState(new, dict(state.batch_dims))


@pytest.fixture
def toy():
    register_backbone("toy", ToyBackbone)  # the registry line
    yield
    del BACKBONES["toy"]


def _tsv(path, header, rows):
    path.write_text("\t".join(header) + "\n" + "".join("\t".join(r) + "\n" for r in rows))
    return path


def _train(capsys, tmp_path, task, data, *extra):
    run = tmp_path / task
    common = ["model.type=toy", "model.d_model=16", "model.mix=0.25", "train.max_steps=4",
              "train.warmup_steps=1", "train.log_every=2", "train.save_every=4",
              "train.eval_every=4", "train.eval_max_batches=1", "train.threads=1"]
    capsys.readouterr()
    rc = main(["train", "--data", str(data), "--out", str(run), "--no-progress", "--set",
               f"task={task}", *common, *extra])
    assert rc == 0, capsys.readouterr().err
    model = load_model(next(run.glob("ckpt-*")))
    assert model.config.type == "toy" and model.config.mix == 0.25
    return run


def test_a_backbone_registered_here_trains_for_every_task(toy, tmp_path, capsys):
    assert build_config(None, ["model.type=toy", "model.mix=0.25"]).model["mix"] == 0.25
    rng = random.Random(0)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))
                 for _ in range(60)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(sentences * 4) + "\n")
    _train(capsys, tmp_path, "lm", corpus, "train.batch_size=2", "train.unroll=16",
           "eval.batch_size=2", "model.num_layers=1")
    pairs = _tsv(tmp_path / "pairs.tsv", ("de", "en"), [(s, s) for s in sentences])
    run = _train(capsys, tmp_path, "translate", pairs, "data.vocab_size=40",
                 "data.byte_fallback=false",
                 "model.encoder_layers=1", "model.decoder_layers=1", "train.max_tokens=128",
                 "eval.bleu_sentences=2", "eval.max_len_b=2", "data.test_size=4",
                 "data.valid_size=4")
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--split", "test"]) == 0
    assert "bleu" in json.loads(capsys.readouterr().out)
    texts = _tsv(tmp_path / "texts.tsv", ("text", "label"),
                 [(s, "cat" if "cat" in s else "other") for s in sentences])
    _train(capsys, tmp_path, "classify", texts, "model.num_layers=1", "train.max_tokens=128",
           "data.test_size=6", "data.valid_size=6", "data.text=text", "data.label=label")


def test_a_backbone_without_a_role_is_refused_in_one_line(toy):
    class CausalOnly(ToyBackbone):
        roles = ("causal",)

    BACKBONES["toy"] = CausalOnly
    build_model({"type": "toy", "d_model": 8})
    with pytest.raises(ValueError, match=r"type must be one of .* for task classify; got "
                                         r"'toy' \(CausalOnly has no encoder role\)"):
        build_model({"task": "classify", "type": "toy", "vocab_size": 5, "num_labels": 2})
