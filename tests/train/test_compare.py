"""srupp compare: matched sizes, results files, per-model resume/skip, input errors,
its own directories only, settings recorded with each result, packaged recipes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from srupp._extras import MissingExtra
from srupp.cli import main
from srupp.models.registry import parameter_counts
from srupp.train import compare as compare_mod

ROOT = Path(__file__).resolve().parents[2]

FAST = ["train.batch_size=2", "train.unroll=16", "train.eval_every=20", "train.save_every=20",
        "train.log_every=10", "train.eval_max_batches=2", "eval.batch_size=2",
        "train.threads=1", "train.calibration_steps=5"]
KEYS = {"name", "params", "tokens", "tokens_per_s", "train_seconds", "final",
        "time_to_best_baseline", "time_to_transformer_final", "generate_tokens_per_s", "lr"}


def run(corpus, out, *extra, models="srupp,lstm,transformer", budget="1", params="20000",
        sets=()):
    return main(["compare", "--data", str(corpus), "--budget", budget, "--params", params,
                 "--models", models, "--out", str(out), "--no-progress", *extra,
                 "--set", *FAST, *sets])


def test_compare_writes_results_and_skips_finished_models(tmp_path, corpus, monkeypatch, capsys):
    out = tmp_path / "cmp"
    assert run(corpus, out, sets=["lstm:train.lr=1e-3"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert {m["name"]: m["lr"] for m in res["models"]} == {
        "srupp": 8e-3, "lstm": 1e-3, "transformer": 8e-3}
    assert set(res) == {"task", "metric", "models"} and res["metric"] == "bpc"
    assert [m["name"] for m in res["models"]] == ["srupp", "lstm", "transformer"]
    for m in res["models"]:
        assert set(m) == KEYS
        assert abs(m["params"] - 20000) <= 2000
        assert m["tokens"] > 0 and m["tokens_per_s"] > 0 and m["generate_tokens_per_s"] > 0
        assert m["final"] > 0
        t = m["time_to_best_baseline"]
        assert t is None or t >= 0
    # the best baseline reaches its own final metric
    baselines = [m for m in res["models"] if m["name"] != "srupp"]
    best = min(baselines, key=lambda m: m["final"])
    assert best["time_to_best_baseline"] is not None
    tf = next(m for m in res["models"] if m["name"] == "transformer")
    assert tf["time_to_transformer_final"] is not None
    assert tf["time_to_transformer_final"] <= tf["train_seconds"] + 1e-6
    md = (out / "results.md").read_text()
    assert "| name | params | tokens |" in md and md.count("\n| ") >= 4
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"

    mtimes = {n: (out / n / "summary.json").stat().st_mtime_ns for n in ("srupp", "lstm")}

    def no_training(*a, **k):
        raise AssertionError("a finished model was trained again")

    monkeypatch.setattr("srupp.train.trainer.Trainer.__init__", no_training)
    assert run(corpus, out, models="srupp,lstm", sets=["lstm:train.lr=1e-3"]) == 0
    assert {n: (out / n / "summary.json").stat().st_mtime_ns for n in mtimes} == mtimes
    again = json.loads((out / "results.json").read_text())
    assert [m["name"] for m in again["models"]] == ["srupp", "lstm"]


def test_sizing_hits_the_target_for_every_model(corpus):
    base = compare_mod.build_config(compare_mod.default_recipe("x"), [f"data.corpus={corpus}"])
    for name in compare_mod.MODELS:
        s = compare_mod.size_model(name, base, 256, 50_000)
        assert abs(s.params - 50_000) <= 5_000, name
        if name == "transformer":
            assert s.cfg.model["d_model"] % s.cfg.model["num_heads"] == 0
        if name.startswith("srupp"):
            assert s.cfg.model["proj_size"] == s.cfg.model["d_model"] // 4
    ab = compare_mod.size_model("srupp-attn-every-2", base, 256, 50_000)
    assert ab.cfg.model["attention_every_n_layers"] == 2


@pytest.mark.parametrize("args, words", [
    ({"models": "srupp,mamba"}, "unknown model 'mamba'"),
    ({"budget": "0"}, "--budget must be > 0"),
    ({"params": "0"}, "--params must be > 0"),
    ({"params": "10"}, "no shape of srupp reaches 10 parameters"),
    ({"sets": ["gru:train.lr=1e-3"]}, "'gru' is not one of the compared models"),
    ({"sets": ["lstm:train.lrr=1e-3"]}, "train.lr"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, corpus, capsys, args, words):
    assert run(corpus, tmp_path / "bad", **args) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err
    assert not (tmp_path / "bad").exists()  # nothing trained before the error


def test_unfinished_model_is_resumed(tmp_path, corpus, monkeypatch):
    out = tmp_path / "cmp"
    assert run(corpus, out, models="lstm", budget="0.25") == 0
    (out / "lstm" / "summary.json").unlink()  # as if killed after training, before the summary
    seen = []
    from srupp.train import trainer as trainer_mod
    init = trainer_mod.Trainer.__init__

    def spy(self, cfg, run_dir, *, resume=False, progress=True):
        seen.append(resume)
        init(self, cfg, run_dir, resume=resume, progress=progress)

    monkeypatch.setattr(trainer_mod.Trainer, "__init__", spy)
    assert run(corpus, out, models="lstm", budget="0.25") == 0
    assert seen == [True]
    assert (out / "lstm" / "summary.json").exists()


def test_per_model_overrides_apply_to_that_model_only(corpus):
    shared, per = compare_mod.split_overrides(
        ["train.batch_size=4", "lstm:train.lr=2e-3", "sru:model.dropout=0.1"], ["srupp", "lstm", "sru"])
    assert shared == ["train.batch_size=4"]
    assert per == {"srupp": [], "lstm": ["train.lr=2e-3"], "sru": ["model.dropout=0.1"]}
    base = compare_mod.build_config(compare_mod.default_recipe("x"), [f"data.corpus={corpus}"])
    lstm = compare_mod.size_model("lstm", base, 256, 50_000, per["lstm"])
    srupp = compare_mod.size_model("srupp", base, 256, 50_000, per["srupp"])
    assert lstm.cfg.train.lr == 2e-3 and srupp.cfg.train.lr == base.train.lr


def test_tuned_learning_rates_apply_unless_overridden(tmp_path, corpus, monkeypatch):
    monkeypatch.setattr(compare_mod, "load_tuned",
                        lambda: {str(corpus): {"srupp": {"train.lr": 2e-3},
                                               "lstm": {"train.lr": 4e-3}}})
    out = tmp_path / "tuned"
    # srupp-attn-last-1 inherits srupp's rate; lstm's own --set wins over the table
    # (a quarter of a second each: only the rates they trained with are read)
    assert run(corpus, out, models="srupp,srupp-attn-last-1,lstm", budget="0.25",
               sets=["lstm:train.lr=1e-3"]) == 0
    lrs = {m["name"]: m["lr"] for m in json.loads((out / "results.json").read_text())["models"]}
    assert lrs == {"srupp": 2e-3, "srupp-attn-last-1": 2e-3, "lstm": 1e-3}
    # a shared train.lr turns the table off for every model
    out2 = tmp_path / "shared"
    assert run(corpus, out2, models="srupp,lstm", budget="0.25", sets=["train.lr=5e-3"]) == 0
    lrs = {m["name"]: m["lr"] for m in json.loads((out2 / "results.json").read_text())["models"]}
    assert lrs == {"srupp": 5e-3, "lstm": 5e-3}


class _Resolved(Exception):
    """Raised once every model's run config is resolved, before anything is trained."""


def resolved_configs(monkeypatch, tmp_path, corpus, table, models, sets=()):
    """{name: run config} that compare resolves with ``table`` as its tuned settings for
    ``corpus``; nothing is trained."""
    monkeypatch.setattr(compare_mod, "load_tuned", lambda: {str(corpus): table})
    seen, settings = {}, compare_mod.run_settings

    def record(sized, target, overrides):
        seen[sized.name] = sized.cfg
        return settings(sized, target, overrides)

    def stop(*a, **k):
        raise _Resolved

    monkeypatch.setattr(compare_mod, "run_settings", record)
    monkeypatch.setattr(compare_mod, "plan_run_dir", stop)
    with pytest.raises(_Resolved):
        compare_mod.compare(str(corpus), 1, 20000, models=models, out=tmp_path / "cmp",
                            overrides=[*FAST, *sets], progress=False)
    return seen


def test_tuned_settings_beyond_the_learning_rate_reach_their_model_only(
        tmp_path, corpus, monkeypatch):
    table = {"lstm": {"train.optimizer": "adamw", "train.betas": [0.9, 0.95],
                      "model.dropout": 0.3},
             "srupp": {"train.lr": 2e-3}}
    base = compare_mod.build_config(compare_mod.default_recipe("x"), [f"data.corpus={corpus}"])

    def settings(*sets):
        cfgs = resolved_configs(monkeypatch, tmp_path, corpus, table, "srupp,lstm", sets)
        lstm, srupp = cfgs["lstm"], cfgs["srupp"]
        return ((lstm.train.optimizer, lstm.train.betas, lstm.model["dropout"], lstm.train.lr),
                (srupp.train.optimizer, srupp.train.betas, srupp.model.get("dropout"),
                 srupp.train.lr))

    srupp_default = ("radam", [0.9, 0.999], base.model.get("dropout"))
    assert settings() == (("adamw", [0.9, 0.95], 0.3, base.train.lr), (*srupp_default, 2e-3))
    # a shared --set turns that key of the table off for every model, and only that key
    assert settings("train.optimizer=radam") == (
        ("radam", [0.9, 0.95], 0.3, base.train.lr), (*srupp_default, 2e-3))
    assert settings("train.lr=5e-3", "model.dropout=0.2") == (
        ("adamw", [0.9, 0.95], 0.2, 5e-3), ("radam", [0.9, 0.999], 0.2, 5e-3))
    # a model's own --set overrides the table for that model
    assert settings("lstm:train.betas=0.8,0.9", "srupp:train.optimizer=adamw") == (
        ("adamw", [0.8, 0.9], 0.3, base.train.lr), ("adamw", [0.9, 0.999], srupp_default[2],
                                                    2e-3))


def test_a_variant_takes_its_types_tuned_settings_and_its_own_over_them(
        tmp_path, corpus, monkeypatch):
    table = {"srupp": {"train.lr": 2e-3, "train.optimizer": "adamw"},
             "srupp-attn-last-1": {"train.optimizer": "radam", "train.betas": [0.9, 0.95]}}
    cfgs = resolved_configs(monkeypatch, tmp_path, corpus, table, "srupp,srupp-attn-last-1")
    got = {n: (c.train.lr, c.train.optimizer, c.train.betas) for n, c in cfgs.items()}
    assert got == {"srupp": (2e-3, "adamw", [0.9, 0.999]),
                   "srupp-attn-last-1": (2e-3, "radam", [0.9, 0.95])}


def no_training(*a, **k):
    raise AssertionError("compare trained a model")


def test_a_directory_compare_did_not_create_is_never_removed(tmp_path, corpus, monkeypatch, capsys):
    out = tmp_path / "cmp"
    mine = out / "lstm"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("my own work")
    monkeypatch.setattr("srupp.train.trainer.Trainer.__init__", no_training)
    assert run(corpus, out, models="srupp,lstm") == 2
    err = capsys.readouterr().err.strip()
    assert str(mine) in err and "not created by srupp compare" in err and "--out" in err
    assert "\n" not in err
    assert (mine / "notes.txt").read_text() == "my own work"
    assert sorted(p.name for p in out.iterdir()) == ["lstm"]  # srupp was not started either


def test_compare_restarts_its_own_directory_that_never_reached_a_checkpoint(
        tmp_path, corpus, monkeypatch):
    out = tmp_path / "cmp"
    seen = []

    def interrupted(self, cfg, run_dir, *, resume=False, progress=True):
        seen.append(resume)
        raise KeyboardInterrupt

    monkeypatch.setattr("srupp.train.trainer.Trainer.__init__", interrupted)
    assert run(corpus, out, models="lstm") == 130
    settings = json.loads((out / "lstm" / "compare.json").read_text())
    assert settings["params_target"] == 20000 and settings["config"]["train"]["max_seconds"] == 1
    (out / "lstm" / "partial.txt").write_text("left by the interrupted start")
    assert run(corpus, out, models="lstm") == 130
    assert seen == [False, False]
    # the partial file is gone; the lock file stays (srupp.train.lock)
    assert sorted(p.name for p in (out / "lstm").iterdir()) == [".lock", "compare.json"]


def test_compare_refuses_a_model_directory_another_process_writes(tmp_path, corpus,
                                                                monkeypatch, capsys):
    """One writer per run directory (srupp.train.lock): compare locks each one it trains."""
    out = tmp_path / "cmp"

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("srupp.train.trainer.Trainer.__init__", interrupted)
    assert run(corpus, out, models="lstm") == 130  # compare's own directory, no checkpoint
    settings = (out / "lstm" / "compare.json").read_bytes()
    monkeypatch.setattr("srupp.train.trainer.Trainer.__init__", no_training)
    code = ("import sys, time; from srupp.train.lock import lock_run_dir; "
            "lock = lock_run_dir(sys.argv[1]); print('locked', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out / "lstm")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        capsys.readouterr()
        assert run(corpus, out, models="lstm") == 2
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"is in use by another process (PID {holder.pid};" in err, err
    # not restarted under the holder's feet
    assert (out / "lstm" / "compare.json").read_bytes() == settings


def test_a_result_made_with_other_settings_is_not_reported_as_new(
        tmp_path, corpus, monkeypatch, capsys):
    out = tmp_path / "cmp"
    assert run(corpus, out, models="lstm", budget="0.25") == 0
    summary = out / "lstm" / "summary.json"
    before = summary.read_bytes()
    capsys.readouterr()
    monkeypatch.setattr("srupp.train.trainer.Trainer.__init__", no_training)
    for args, words in [({"params": "30000"}, "--params 20000 -> 30000"),
                        ({"budget": "2"}, "--budget 0.25 -> 2.0"),
                        ({"sets": ["lstm:train.lr=1e-3"]}, "train.lr 0.008 -> 0.001")]:
        assert run(corpus, out, models="lstm", **{"budget": "0.25", **args}) == 2, args
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and words in err, err
        assert f"{out / 'lstm'} holds lstm's result made with other settings" in err
        assert "another --out" in err and f"delete {out / 'lstm'}" in err
    assert summary.read_bytes() == before
    # an unfinished run is not resumed under other settings either
    summary.unlink()
    assert run(corpus, out, models="lstm", budget="2") == 2
    assert "lstm's unfinished run made with other settings" in capsys.readouterr().err


def test_missing_matplotlib_names_the_extra_before_training(tmp_path, corpus, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr("srupp.train.trainer.Trainer.__init__", no_training)
    with pytest.raises(MissingExtra, match=r"needs matplotlib: pip install 'srupp\[plots\]'"):
        compare_mod.compare(str(corpus), 1, 20000, models="lstm", out=tmp_path / "cmp")
    assert not (tmp_path / "cmp").exists()
    with pytest.raises(ValueError, match=r"pip install 'srupp\[plots\]'"):
        compare_mod.plot_curves(tmp_path / "c.png", {}, "bpc", {})


def test_recipes_and_tuned_rates_are_package_data():
    # one copy: the packaged recipe is the repository's recipes/ file
    for data, name in [("shakespeare", "shakespeare-cpu.toml"), ("brown", "brown-cpu.toml")]:
        path = compare_mod.default_recipe(data)
        assert path.name == name and path.samefile(ROOT / "recipes" / name)
    tuned = compare_mod.load_tuned()
    # the rates chosen by the sweeps and 8-minute checks in docs/results.md
    rates = {"srupp": 1e-2, "sru": 1.5e-2, "lstm": 5e-2, "gru": 1.5e-2, "transformer": 8e-3}
    brown = {"srupp": 1e-2, "sru": 1e-2, "transformer": 2e-2}
    assert tuned == {"shakespeare": {n: {"train.lr": lr} for n, lr in rates.items()},
                     "brown": {n: {"train.lr": lr} for n, lr in brown.items()}}
    with pytest.raises(Exception, match="no packaged recipe 'nope.toml'"):
        compare_mod.packaged_recipe("nope.toml")


def test_tuned_keys_are_written_dotted_or_quoted(tmp_path):
    path = tmp_path / "tuned.toml"
    path.write_text('[shakespeare.lstm]\ntrain.lr = 1e-3\n"train.optimizer" = "adamw"\n'
                    '[shakespeare.transformer]\nmodel.num_heads = 2\n'
                    '[brown.srupp]\ntrain.no_decay_bias_norm = true\n')
    assert compare_mod.load_tuned(path) == {
        "shakespeare": {"lstm": {"train.lr": 1e-3, "train.optimizer": "adamw"},
                        "transformer": {"model.num_heads": 2}},
        "brown": {"srupp": {"train.no_decay_bias_norm": True}}}


@pytest.mark.parametrize("text, words", [
    ("[shakespeare.mamba]\ntrain.lr = 1e-3\n", r"\[shakespeare.mamba\] names unknown model "
                                                r"'mamba'"),
    ("[shakespeare.lstm]\ntrain.lrr = 1e-3\n", r"\[shakespeare.lstm\]: unknown config key "
                                                r"'train.lrr'; did you mean 'train.lr'\?"),
    ("[shakespeare.lstm]\ndata.corpus = 'x'\n", r"\[shakespeare.lstm\]: 'data.corpus' is not "
                                                 r"a train.\* or model.\* config key"),
    ("[shakespeare.lstm]\nmodel.proj_size = 8\n", "model.proj_size applies to model.type=srupp, "
                                                   "not lstm"),
    ("[shakespeare.lstm]\nmodel.d_model = 64\n", r"model.d_model cannot be tuned per model "
                                                  r"\(--params sizes it\)"),
    ("[shakespeare.lstm]\ntrain.lr = -1\n", r"\[shakespeare.lstm\]: train.lr must be > 0"),
    ("[shakespeare.lstm]\ntrain.optimizer = 'sgd'\n", "train.optimizer must be radam or adamw"),
    ("[shakespeare]\nlstm = 5e-2\n", r"\[shakespeare.lstm\] must be a table of config keys"),
    ("shakespeare = 1\n", r"shakespeare must be tables \[shakespeare.MODEL\]"),
    ("[shakespeare\n", "not valid TOML"),
])
def test_a_bad_tuned_table_is_a_value_error_naming_the_file_and_key(tmp_path, text, words):
    path = tmp_path / "tuned.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=words) as e:
        compare_mod.load_tuned(path)
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)


# --------------------------------------------------------------------------- translate, classify

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
# everything tiny: a few seconds per model, a short validation, BLEU on a few sentences
SENTENCE_FAST = ["train.max_tokens=256", "train.eval_every=10", "train.save_every=10",
                 "train.log_every=5", "train.threads=1", "train.calibration_steps=5",
                 "train.warmup_steps=5", "train.max_steps=400"]


def translation_table(path: Path) -> Path:
    """200 pairs of a word-for-word mapping: each word spelt backwards."""
    import random

    r = random.Random(0)
    rows = ["de\ten"]
    for _ in range(200):
        s = [r.choice(WORDS) for _ in range(r.randint(2, 6))]
        rows.append(" ".join(s) + "\t" + " ".join(w[::-1] for w in s))
    path.write_text("\n".join(rows) + "\n")
    return path


def classification_table(path: Path) -> Path:
    """200 texts of 3 labels, each text holding its label's key word among noise."""
    import random

    r = random.Random(0)
    rows = ["text\tlabel"]
    for _ in range(200):
        label = r.choice(["pos", "neg", "neu"])
        s = [r.choice(WORDS) for _ in range(r.randint(2, 6))]
        s.insert(r.randint(0, len(s)), {"pos": "good", "neg": "bad", "neu": "okay"}[label])
        rows.append(" ".join(s) + "\t" + label)
    path.write_text("\n".join(rows) + "\n")
    return path


def run_sentence(data, out, *extra, models="srupp,lstm", budget="1.5", params="8000", sets=()):
    return main(["compare", *extra, "--data", str(data), "--budget", budget, "--params", params,
                 "--models", models, "--out", str(out), "--no-progress",
                 "--set", *SENTENCE_FAST, *sets])


COMMON = {"name", "params", "tokens", "tokens_per_s", "train_seconds", "final",
          "time_to_best_baseline", "time_to_transformer_final", "lr"}


def check_common(res, out, metric):
    assert set(res) == {"task", "metric", "models"} and res["metric"] == metric
    assert [m["name"] for m in res["models"]] == ["srupp", "lstm"]
    for m in res["models"]:
        summary = json.loads((out / m["name"] / "summary.json").read_text())
        assert m["final"] == summary[f"valid_{metric}"]  # the final evaluation's
        assert m["tokens"] == summary["tokens"] > 0 and m["tokens_per_s"] > 0
        assert abs(m["params"] - 8000) <= 800
    # the best baseline's curve reaches its own final value (>=: higher is better)
    lstm = res["models"][1]
    assert lstm["time_to_best_baseline"] is not None
    assert lstm["time_to_best_baseline"] <= lstm["train_seconds"] + 1e-6
    assert all(m["time_to_transformer_final"] is None for m in res["models"])  # none compared
    md = (out / "results.md").read_text()
    assert f"**{metric}** (higher is better)" in md and "(>=)" in md
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"


def eval_json(capsys, run_dir, *sets):
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run_dir), *(("--set", *sets) if sets else ())]) == 0
    return json.loads(capsys.readouterr().out)


def test_compare_translation(tmp_path, capsys):
    data = translation_table(tmp_path / "pairs.tsv")
    recipe = tmp_path / "mt.toml"  # the task comes from the recipe (the positional RECIPE)
    recipe.write_text('task = "translate"\n[data]\nvocab_size = 60\nbyte_fallback = false\n'
                      '[eval]\nbeam = 2\n'
                      'bleu_sentences = 5\n[model]\nencoder_layers = 1\ndecoder_layers = 1\n')
    out = tmp_path / "cmp"
    assert run_sentence(data, out, str(recipe)) == 0
    res = json.loads((out / "results.json").read_text())
    check_common(res, out, "bleu")
    for m in res["models"]:
        assert set(m) == COMMON | {"bleu", "chrf", "sentences_per_s_beam1",
                                   "sentences_per_s_beam5"}
        assert m["bleu"] == m["final"] and 0 <= m["chrf"] <= 100
        assert m["sentences_per_s_beam1"] > 0 and m["sentences_per_s_beam5"] > 0
    models = {n: json.loads((out / n / "summary.json").read_text())["model"]
              for n in ("srupp", "lstm")}
    # SRU++ keeps the recipe's depth with d' = d/4; the LSTM its classic 2 + 2 layers
    assert models["srupp"]["encoder_layers"] == models["srupp"]["decoder_layers"] == 1
    assert models["srupp"]["proj_size"] == models["srupp"]["d_model"] // 4
    assert models["lstm"]["encoder_layers"] == models["lstm"]["decoder_layers"] == 2
    assert models["lstm"]["d_model"] % 2 == 0  # its encoder is bidirectional
    assert "greedy BLEU on the first 5" in (out / "results.md").read_text()
    assert "bleu" in eval_json(capsys, out / "srupp", "eval.beam=1")


def test_compare_classification_and_skipping_finished_models(tmp_path, capsys, monkeypatch):
    data = classification_table(tmp_path / "texts.tsv")
    out = tmp_path / "cmp"
    # no recipe: --set task=classify on the built-in defaults
    assert run_sentence(data, out, sets=["task=classify", "model.num_layers=1"]) == 0
    res = json.loads((out / "results.json").read_text())
    check_common(res, out, "macro_f1")
    for m in res["models"]:
        assert set(m) == COMMON | {"accuracy", "macro_f1", "texts_per_s"}
        assert m["macro_f1"] == m["final"] and 0 <= m["accuracy"] <= 1
        assert m["texts_per_s"] > 0
    # eval reads the run's best checkpoint (by validation loss), not always the final one
    assert 0 <= eval_json(capsys, out / "srupp")["macro_f1"] <= 1
    # the same settings again: nothing is trained, the results are the same
    monkeypatch.setattr("srupp.train.trainer.Trainer.__init__", no_training)
    assert run_sentence(data, out, sets=["task=classify", "model.num_layers=1"]) == 0
    assert json.loads((out / "results.json").read_text()) == res


@pytest.mark.parametrize("extra, words", [
    ({"models": "srupp,gru"}, "model 'gru' does not apply to task translate; valid ones for "
                              "translate: srupp, sru, lstm, transformer"),
    ({"models": "srupp-attn-every-2"}, "does not apply to task translate"),
    ({"models": "mamba"}, "unknown model 'mamba' in --models; valid ones for translate"),
    ({"recipe": "both"}, "give the recipe once: as RECIPE or as --recipe, not both"),
])
def test_a_model_of_another_task_is_a_one_line_error(tmp_path, capsys, monkeypatch, extra,
                                                      words):
    recipe = tmp_path / "mt.toml"
    recipe.write_text('task = "translate"\n')
    monkeypatch.setattr("srupp.train.trainer.Trainer.__init__", no_training)
    args = [str(recipe), "--recipe", str(recipe)] if extra.get("recipe") else [str(recipe)]
    assert run_sentence(translation_table(tmp_path / "p.tsv"), tmp_path / "bad", *args,
                        models=extra.get("models", "srupp")) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err, err
    assert not (tmp_path / "bad").exists()


def test_the_recipe_option_is_the_positional_recipe(tmp_path, corpus, monkeypatch):
    seen = {}
    monkeypatch.setattr("srupp.train.compare.compare", lambda *a, **k: seen.update(k) or {})
    recipe = str(compare_mod.default_recipe("x"))
    for args in (["--recipe", recipe], [recipe]):
        assert main(["compare", *args, "--data", str(corpus), "--budget", "1",
                     "--params", "1000"]) == 0
        assert seen.pop("recipe") == recipe


@pytest.mark.parametrize("task", ["translate", "classify"])
def test_sizing_hits_the_target_for_every_sentence_model(task):
    base = compare_mod.build_config(None, [f"task={task}", "data.corpus=x.tsv"])
    labels = 3 if task == "classify" else None
    for name in compare_mod.TASK_MODELS[task]:
        s = compare_mod.size_model(name, base, 500, 60_000, num_labels=labels)
        assert abs(s.params - 60_000) <= 6_000, name
        m = s.cfg.model
        assert s.params == parameter_counts(s.cfg.model_config(500, labels))["params"]
        if name == "transformer":
            assert m["d_model"] % m["num_heads"] == 0
        else:  # bidirectional encoders split d over two directions
            assert m["d_model"] % 2 == 0
        if name == "srupp":
            assert m["proj_size"] == m["d_model"] // 4
        if name in ("sru", "lstm"):
            depth = ((m["encoder_layers"], m["decoder_layers"]) if task == "translate"
                     else m["num_layers"])
            assert depth == ((2, 2) if task == "translate" else 2)


def test_time_to_a_level_knows_which_way_is_better(tmp_path):
    curve = [(1.0, 10, 5.0), (2.0, 20, 12.0), (3.0, 30, 9.0), (4.0, 40, 15.0)]
    # higher is better (BLEU, macro-F1): the first point at or above the level
    assert compare_mod.first_time_at(curve, 12.0, higher_is_better=True) == 2.0
    assert compare_mod.first_time_at(curve, 13.0, higher_is_better=True) == 4.0
    assert compare_mod.first_time_at(curve, 16.0, higher_is_better=True) is None
    # lower is better (bpc, perplexity): at or below
    assert compare_mod.first_time_at(curve, 9.0) == 1.0
    assert compare_mod.first_time_at(curve, 4.0) is None
    assert compare_mod.first_time_at(curve, None, higher_is_better=True) is None
    assert compare_mod.best_value([3.0, None, 7.0], higher_is_better=True) == 7.0
    assert compare_mod.best_value([3.0, None, 7.0]) == 3.0
    assert compare_mod.best_value([None]) is None
    row = {"name": "srupp", "params": 1, "tokens": 2, "tokens_per_s": 3.0, "train_seconds": 4.0,
           "final": 30.0, "time_to_best_baseline": None, "time_to_transformer_final": 1.0,
           "bleu": 30.0, "chrf": 50.0, "sentences_per_s_beam1": 9.0,
           "sentences_per_s_beam5": 3.0, "lr": 1e-3}
    compare_mod.write_markdown(tmp_path / "r.md",
                               {"task": "translate", "metric": "bleu", "models": [row]})
    md = (tmp_path / "r.md").read_text()
    assert "**bleu** (higher is better)" in md and "greedy" in md and "(>=)" in md
    assert "| sentences_per_s_beam1 | sentences_per_s_beam5 |" in md
