"""The paper recipes: valid configs whose parameter counts match the paper's (within 3%)."""

import json
from pathlib import Path

import pytest

from srupp.cli import main
from srupp.train import build_config

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
PAPER = {"enwik8-base": 108e6, "enwik8-large": 195e6, "wt103-base": 148e6,
         "wt103-large": 234e6, "lm1b-large": 465e6}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_params_match_the_paper(name, capsys):
    assert main(["params", str(RECIPES / f"{name}.toml")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert abs(out["params"] / PAPER[name] - 1) < 0.03, out


@pytest.mark.parametrize("name", sorted(PAPER))
def test_recipe_settings_shared_by_the_paper(name):
    cfg = build_config(RECIPES / f"{name}.toml")
    m, t = cfg.model, cfg.train
    assert m["num_layers"] == 10 and m["num_heads"] == 1 and m["highway_bias"] == -2.0
    assert (t.weight_decay, t.grad_clip, t.warmup_steps) == (0.1, 1.0, 16000)
    assert m.get("attention_every_n_layers", 1) == (5 if name.startswith("lm1b") else 1)
    if name.startswith("enwik8"):
        assert cfg.data.tokenizer == "byte" and "adaptive_cutoffs" not in m
    else:
        assert m["tie_embeddings"] and m["div_val"] == 4 and m["emb_dim"] == 1024
        assert m["tie_projections"] == name.startswith("wt103")


def test_word_params_need_a_vocab_size(capsys):
    assert main(["params", "--set", "data.tokenizer=word", "data.corpus=nowhere"]) == 2
    err = capsys.readouterr().err
    assert "data.vocab_size" in err and len(err.strip().splitlines()) == 1
