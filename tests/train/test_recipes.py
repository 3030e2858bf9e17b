"""The recipes: the paper's are valid configs whose parameter counts match the paper's (within 3%);
the CPU ones are the configurations their published figures were measured with."""

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


def test_the_long_byte_recipe_is_the_crossover_cell_it_was_measured_in():
    """shakespeare-cpu-long is what `srupp compare --data shakespeare --budget 1920
    --params 5000000 --models srupp-attn-last-1 --set srupp-attn-last-1:train.lr=5e-3`
    trained (docs/results.md), so its published bpc is this recipe's."""
    from srupp.train.compare import size_model

    long = build_config(RECIPES / "shakespeare-cpu-long.toml")
    base = build_config(RECIPES / "shakespeare-cpu.toml", ["train.max_seconds=1920"])
    sized = size_model("srupp-attn-last-1", base, 256, 5_000_000, ["train.lr=5e-3"])
    assert {**sized.cfg.model, "type": "srupp"} == {**long.model, "type": "srupp"}
    same = ("max_seconds", "lr", "batch_size", "unroll", "precision", "weight_decay",
            "warmup_steps", "grad_clip", "optimizer", "schedule", "label_smoothing")
    assert {k: getattr(long.train, k) for k in same} == {k: getattr(sized.cfg.train, k) for k in same}
    assert long.model["attention_last_n_layers"] == 1 and long.train.max_seconds == 1920
