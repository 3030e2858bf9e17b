"""Run config: list-valued fields from TOML and --set, data.vocab_size, model keys per type."""

from pathlib import Path

import pytest

from srupp.errors import UserError
from srupp.train import build_config

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_cutoffs_from_toml_list(tmp_path):
    r = tmp_path / "r.toml"
    r.write_text('[data]\ntokenizer = "word"\nvocab_size = 1000\n'
                 '[model]\nadaptive_cutoffs = [100, 200, 500]\n')
    cfg = build_config(r)
    assert cfg.model["adaptive_cutoffs"] == [100, 200, 500]
    assert cfg.model_config(1000).adaptive_cutoffs == [100, 200, 500]


@pytest.mark.parametrize("text", ["19997,39997,199997", "[19997, 39997, 199997]",
                                  " 19997 , 39997,199997 "])
def test_cutoffs_from_set_string(text):
    cfg = build_config(None, [f"model.adaptive_cutoffs={text}"])
    assert cfg.model["adaptive_cutoffs"] == [19997, 39997, 199997]
    assert all(type(c) is int for c in cfg.model["adaptive_cutoffs"])


def test_set_overrides_toml_list_and_none_clears_it(tmp_path):
    r = tmp_path / "r.toml"
    r.write_text("[model]\nadaptive_cutoffs = [10, 20]\n")
    assert build_config(r, ["model.adaptive_cutoffs=5,7"]).model["adaptive_cutoffs"] == [5, 7]
    assert build_config(r, ["model.adaptive_cutoffs=none"]).model["adaptive_cutoffs"] is None


def test_saved_config_round_trips():
    cfg = build_config(None, ["model.adaptive_cutoffs=10,20"])
    again = build_config(None, base=cfg.to_dict())
    assert again.model == cfg.model


@pytest.mark.parametrize("overrides,match", [
    (["model.adaptive_cutoffs=10,x"], r"adaptive_cutoffs\[1\] must be int"),
    (["model.adaptive_cutoffs=20,10"], "increasing"),
    (["data.tokenizer=word", "data.vocab_size=100", "model.adaptive_cutoffs=10,100"],
     "vocabulary size"),
    (["data.vocab_size=100"], "word and sentencepiece"),
    (["data.tokenizer=word", "data.vocab_size=0"], ">= 1"),
])
def test_bad_values_are_user_errors(overrides, match):
    with pytest.raises(UserError, match=match):
        build_config(None, overrides)


def test_toml_list_of_wrong_type_is_a_user_error(tmp_path):
    r = tmp_path / "r.toml"
    r.write_text('[model]\nadaptive_cutoffs = "many"\n')
    with pytest.raises(UserError, match="adaptive_cutoffs"):
        build_config(r)


def test_an_adaptive_run_trains_and_evaluates(tmp_path):
    from srupp.train import Trainer

    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 60)
    cfg = build_config(None, [
        f"data.corpus={corpus}", "data.tokenizer=char", "model.d_model=16",
        "model.proj_size=8", "model.num_layers=2", "model.adaptive_cutoffs=4,12",
        "model.div_val=2", "model.tie_embeddings=true", "train.batch_size=2",
        "train.unroll=16", "train.max_steps=6", "train.warmup_steps=2", "train.log_every=2",
        "train.save_every=6", "train.eval_every=6", "train.threads=1", "eval.batch_size=2"])
    t = Trainer(cfg, tmp_path / "run", progress=False)
    assert t.model.adaptive
    summary = t.train()
    assert summary["step"] == 6 and summary["valid_bpc"] > 0
    res = t.validate()
    assert 0 < res["loss"] < 10


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.toml")
                                          if "[model]" in p.read_text()))
def test_every_recipe_builds_and_its_srupp_keys_yield_to_a_set_type(recipe):
    """--set model.type=lstm on an SRU++ recipe drops the recipe's SRU++-only keys."""
    cfg = build_config(RECIPES / recipe)
    assert cfg.model_config(cfg.data.vocab_size or 256).type == "srupp"
    lstm = build_config(RECIPES / recipe, ["model.type=lstm"])
    assert lstm.model_config(cfg.data.vocab_size or 256).type == "lstm"
    assert "proj_size" not in lstm.model
    assert lstm.model.get("d_model") == cfg.model.get("d_model")  # shared keys stay


def test_a_recipe_that_names_its_type_keeps_keys_of_another_type_errors(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[model]\ntype = "lstm"\nproj_size = 8\n')
    with pytest.raises(UserError, match=r"^model\.proj_size applies to model\.type=srupp, not lstm$"):
        build_config(recipe)
    with pytest.raises(UserError, match=r"model\.proj_size applies"):  # given with --set too
        build_config(RECIPES / "shakespeare-cpu.toml", ["model.type=lstm", "model.proj_size=8"])


@pytest.mark.parametrize("overrides,match", [
    (["model.ffn_mult=3"], r"^model\.ffn_mult applies to model\.type=transformer, not srupp$"),
    (["model.type=gru", "model.num_heads=2"],
     r"^model\.num_heads applies to model\.type=srupp or transformer, not gru$"),
    (["model.proj_size=8", "model.num_heads=3"],
     r"^model\.num_heads \(3\) must divide model\.proj_size \(8\)$"),
    (["model.type=transformer", "model.positions=learned"], r"model\.mem_len=0"),
    (["model.type=rnn"], "model.type must be one of srupp, sru, lstm, gru, transformer"),
])
def test_model_errors_name_config_keys(overrides, match):
    with pytest.raises(UserError, match=match):
        build_config(None, overrides)


def test_a_saved_run_config_is_read_as_saved():
    """A saved gru run holds only gru keys; one naming another type's key is an error."""
    saved = build_config(None, ["model.type=gru", "model.d_model=16"]).to_dict()
    cfg = build_config(None, ["train.max_steps=5"], base=saved)
    assert cfg.model == {"type": "gru", "d_model": 16}
    assert cfg.model_config(256).d_model == 16
    with pytest.raises(UserError, match="model.num_heads applies"):
        build_config(None, base={**saved, "model": {**saved["model"], "num_heads": 2}})
    with pytest.raises(UserError, match="unknown config key 'model.d_modle'"):
        build_config(None, base={"task": "lm", "model": {"type": "gru", "d_modle": 16}})
    with pytest.raises(UserError, match="names no task"):
        build_config(None, base={"model": {"type": "gru"}})


# train.compile was a bool before it was a choice: true (and the words _coerce reads as
# true) is "model", false "off", in a recipe, on the command line and in a saved run
@pytest.mark.parametrize("value, mode", [
    ("true", "model"), ("True", "model"), ("1", "model"), ("yes", "model"),
    ("false", "off"), ("0", "off"), ("no", "off"),
    ("off", "off"), ("model", "model"), ("layers", "layers")])
def test_compile_is_a_choice_that_reads_old_booleans(value, mode):
    assert build_config(None, [f"train.compile={value}"]).train.compile == mode


def test_compile_from_toml_and_a_saved_config(tmp_path):
    r = tmp_path / "r.toml"
    r.write_text("[train]\ncompile = true\n")
    assert build_config(r).train.compile == "model"
    assert build_config(None).train.compile == "off"  # the default
    saved = build_config(None).to_dict()
    saved["train"]["compile"] = True  # a run's config.json from before (a JSON bool)
    assert build_config(None, base=saved).train.compile == "model"
    saved["train"]["compile"] = False
    assert build_config(None, base=saved).train.compile == "off"
    saved["train"]["compile"] = "layers"  # and what this version writes
    assert build_config(None, base=saved).train.compile == "layers"


@pytest.mark.parametrize("item, match", [
    ("train.compile=fast", r"train.compile must be off, model, layers or layers-cudagraphs "
                           r"\(true and false read as model and off\), got 'fast'"),
    ("train.compile=layers-cudagraphs", r"records CUDA graphs: it needs train.device=cuda, "
                                        r"got train.device=cpu; on the CPU use "
                                        r"train.compile=layers"),
    ("train.optimizer_impl=fastest", r"train.optimizer_impl must be auto, fused, foreach "
                                     r"or loop, got 'fastest'"),
    ("train.optimizer_impl=fused", r"train.optimizer_impl=fused: torch .* has no fused RAdam; "
                                   r"use train.optimizer_impl=foreach \(or auto\), or "
                                   r"train.optimizer=adamw")])
def test_bad_compile_or_optimizer_impl_is_a_user_error(item, match):
    with pytest.raises(UserError, match=match):
        build_config(None, [item])


def test_optimizer_impl_choices():
    assert build_config(None).train.optimizer_impl == "auto"
    for impl in ("auto", "foreach", "loop"):
        assert build_config(None, [f"train.optimizer_impl={impl}"]).train.optimizer_impl == impl
    cfg = build_config(None, ["train.optimizer=adamw", "train.optimizer_impl=fused"])
    assert cfg.train.optimizer_impl == "fused"
