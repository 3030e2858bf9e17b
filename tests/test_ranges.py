"""Every number a user gives is finite and in its range, at every layer.

The run config (every key of [train], [eval], [data] and of each task's model
types) and every numeric flag of every command refuse nan, inf, -inf and a
value out of range with one line naming the key or flag, the value and the
range (the CLI: exit 2); the library (model configs, generate, sample, beam
search, translate_lines) raises ValueError. Temperature 0 is greedy.
"""

import argparse
import json
import math
import re
from dataclasses import fields

import pytest
import torch

from srupp._ranges import _numeric_fields, check, problem
from srupp.cli import build_parser, main
from srupp.errors import UserError
from srupp.models import SRUppConfig, build_model, config_from_dict
from srupp.models.registry import REGISTRY
from srupp.models.lm import sample
from srupp.train import build_config
from srupp.train.config import DataConfig, EvalConfig, TrainConfig

from lm_helpers import TINY, greedy_by_recomputing, one_line_error

NON_FINITE = ["nan", "inf", "-inf"]

# one value out of range for every number of the run config (as --set gives it)
OUT_OF_RANGE = {
    "train": {"max_steps": "0", "max_seconds": "0", "batch_size": "0", "unroll": "0",
              "max_tokens": "0", "label_smoothing": "1", "lr": "-1", "weight_decay": "-0.1",
              "warmup_steps": "-1", "warmup_fraction": "1", "min_lr_ratio": "1.5",
              "grad_clip": "-1", "grad_accum": "0", "seed": "-1", "log_every": "0",
              "eval_every": "0", "save_every": "0", "eval_max_batches": "0",
              "calibration_steps": "0", "threads": "0", "dist_timeout": "0"},
    "eval": {"unroll": "0", "mem_len": "-1", "batch_size": "0", "beam": "0", "lenpen": "-1",
             "max_len_a": "-0.5", "max_len_b": "-1", "no_repeat_ngram_size": "-1",
             "bleu_sentences": "0"},
    "data": {"max_oov": "1.5", "vocab_size": "0", "min_freq": "0", "test_size": "-1",
             "valid_size": "-1", "max_len": "0"},
}
# the same for the model fields, whatever the task and type; None: any finite number
MODEL_OUT_OF_RANGE = {
    "vocab_size": "0", "d_model": "0", "num_layers": "0", "dropout": "1", "emb_dropout": "-0.1",
    "mem_len": "-1", "div_val": "0", "emb_dim": "0", "proj_size": "0", "num_heads": "0",
    "attn_dropout": "1", "highway_bias": None, "attention_every_n_layers": "0",
    "attention_last_n_layers": "-2", "projection_size": "-1", "max_positions": "0",
    "ffn_mult": "0", "encoder_layers": "0", "decoder_layers": "0", "bos_id": "-1",
    "eos_id": "-1", "num_labels": "1",
}
SECTIONS = {"train": TrainConfig, "eval": EvalConfig, "data": DataConfig}


def _numbers(config_class):
    """The int and float fields of a config dataclass."""
    return [f.name for f in fields(config_class) if f.name in _numeric_fields(config_class)]


def _model_cases():
    """(task, type, field) for every number of every model config (vocab_size and
    num_labels come from the data, never from the run config)."""
    return [(task, mtype, name) for task, models in REGISTRY.items()
            for mtype, (config_class, _) in models.items()
            for name in _numbers(config_class) if name not in ("vocab_size", "num_labels")]


def _with_values(cases):
    """Each case with nan, inf, -inf and its value out of range (where it has a range)."""
    return [(*case, value) for case in cases
            for value in [*NON_FINITE, MODEL_OUT_OF_RANGE[case[-1]]] if value is not None]


def _model_sets(task, mtype):
    return [f"task={task}", f"model.type={mtype}"]


def _got(message):
    """The number after ``got`` in an error message."""
    return float(re.search(r"got '?([-\w.]+)'?$", message)[1])


def _assert_names(message, key, value):
    assert "\n" not in message
    assert message.startswith(f"{key} must be "), message
    got = _got(message)
    assert got == float(value) or (math.isnan(got) and value == "nan"), message


# --------------------------------------------------------------------------- run config

def test_every_number_of_the_run_config_has_an_out_of_range_case():
    for section, config_class in SECTIONS.items():
        assert set(_numbers(config_class)) == set(OUT_OF_RANGE[section]), section
    assert {name for _, _, name in _model_cases()} | {"vocab_size", "num_labels"} \
        == set(MODEL_OUT_OF_RANGE)


@pytest.mark.parametrize("value", [*NON_FINITE, "out of range"])
@pytest.mark.parametrize("key", [f"{s}.{k}" for s, keys in OUT_OF_RANGE.items() for k in keys])
def test_run_config_numbers_are_finite_and_in_range(key, value):
    section, name = key.split(".")
    if value == "out of range":
        value = OUT_OF_RANGE[section][name]
    extra = ["data.tokenizer=word"] if key == "data.vocab_size" else []
    with pytest.raises(UserError) as e:
        build_config(None, [*extra, f"{key}={value}"])
    _assert_names(str(e.value), key, value)


@pytest.mark.parametrize("task,mtype,name,value", _with_values(_model_cases()))
def test_model_numbers_are_finite_and_in_range(task, mtype, name, value):
    with pytest.raises(UserError) as e:
        build_config(None, [*_model_sets(task, mtype), f"model.{name}={value}"])
    message = str(e.value)
    if name in ("bos_id", "eos_id") and value == "-1":  # its range is the vocabulary's
        assert message.startswith(f"model.{name} must be a token id below "), message
    elif name.startswith("attention_") and value not in NON_FINITE:  # the layout's own check
        assert message.startswith(f"model.{name} must be"), message
    else:
        _assert_names(message, f"model.{name}", value)


def test_the_issue_cases_from_a_recipe(tmp_path):
    recipe = tmp_path / "r.toml"
    for text, key in (("[train]\nlr = inf\n", "train.lr"), ("[train]\ngrad_clip = nan\n",
                                                             "train.grad_clip"),
                      ("[model]\nhighway_bias = -inf\n", "model.highway_bias"),
                      ("[train]\nmax_steps = inf\n", "train.max_steps")):
        recipe.write_text(text)
        with pytest.raises(UserError, match=rf"^{re.escape(key)} must be .*, got (-?inf|nan)$"):
            build_config(recipe)


def test_an_issue_case_through_the_cli_is_one_line(tmp_path, capsys):
    err = one_line_error(capsys, ["train", "--out", str(tmp_path / "r"), "--no-progress",
                                  "--set", *TINY, "train.lr=inf"])
    assert "train.lr must be a finite number > 0, got inf" in err
    assert not (tmp_path / "r").exists()
    err = one_line_error(capsys, ["params", "--set", "train.grad_clip=nan"])
    assert "train.grad_clip must be a finite number >= 0, got nan" in err


# --------------------------------------------------------------------------- library

def _required(task):
    return {"vocab_size": 32, "num_labels": 2} if task == "classify" else {"vocab_size": 32}


@pytest.mark.parametrize("task,mtype,name,value", _with_values(
    [*_model_cases(), ("lm", "srupp", "vocab_size"), ("classify", "lstm", "num_labels")]))
def test_model_configs_raise_value_error(task, mtype, name, value):
    number = int(value) if value.lstrip("-").isdigit() else float(value)
    with pytest.raises(ValueError, match=rf"^{name} "):
        config_from_dict({"task": task, "type": mtype, **_required(task), name: number})


def test_model_configs_refuse_what_is_not_a_number():
    with pytest.raises(TypeError, match=r"^dropout must be a number in \[0, 1\), got 'x'$"):
        SRUppConfig(dropout="x")
    with pytest.raises(TypeError, match=r"^d_model must be an integer >= 1, got 16.5$"):
        SRUppConfig(d_model=16.5)


@pytest.fixture(scope="module")
def tiny_lm():
    torch.manual_seed(0)
    return build_model(SRUppConfig(vocab_size=32, d_model=16, num_layers=2, proj_size=8)).eval()


@pytest.mark.parametrize("kwargs,match", [
    *[({"temperature": float(v)}, "temperature") for v in [*NON_FINITE, "-1"]],
    *[({"top_p": float(v)}, "top_p") for v in [*NON_FINITE, "0", "1.5"]],
    *[({"top_k": v}, "top_k") for v in [math.nan, math.inf, -math.inf, 0]],
    *[({"max_new_tokens": v}, "max_new_tokens") for v in [math.nan, math.inf, -1]],
    *[({"mem_len": v}, "mem_len") for v in [math.nan, math.inf, -1]],
])
def test_generate_and_sample_raise_value_error(tiny_lm, kwargs, match):
    args = {"max_new_tokens": 3, **kwargs}
    n = args.pop("max_new_tokens")
    with pytest.raises(ValueError, match=rf"^{match} must be "):
        tiny_lm.generate([[1, 2]], n, **args)
    sampling = {k: v for k, v in kwargs.items() if k in ("temperature", "top_k", "top_p")}
    if sampling:
        with pytest.raises(ValueError, match=rf"^{match} must be "):
            sample(torch.zeros(1, 32), **sampling)


def test_temperature_zero_is_greedy(tiny_lm):
    prompt = [3, 1, 4]
    want = greedy_by_recomputing(tiny_lm, prompt, 8)
    for kwargs in ({}, {"top_k": 3}, {"top_p": 0.5}):
        for seed in (0, 1):
            g = torch.Generator().manual_seed(seed)
            assert tiny_lm.generate([prompt], 8, temperature=0, generator=g, **kwargs)[0] == want
    logits = torch.randn(4, 32)
    assert torch.equal(sample(logits, temperature=0), logits.argmax(-1))


@pytest.mark.parametrize("kwargs,match", [
    *[({"lenpen": float(v)}, "lenpen") for v in [*NON_FINITE, "-1"]],
    *[({"max_len_a": float(v)}, "max_len_a") for v in [*NON_FINITE, "-1"]],
    ({"beam": 0}, "beam"), ({"beam": math.inf}, "beam"),
    *[({"no_repeat_ngram_size": v}, "no_repeat_ngram_size") for v in [math.nan, math.inf, -1]],
])
def test_translation_decoding_raises_value_error(kwargs, match):
    from srupp.models.decoding import beam_search, greedy_decode
    from srupp.inference import translate_lines

    model = build_model(config_from_dict({"task": "translate", "type": "lstm", "vocab_size": 16,
                                          "d_model": 8, "encoder_layers": 1,
                                          "decoder_layers": 1}))
    src = torch.tensor([[2, 3]])
    with pytest.raises(ValueError, match=rf"^{match} must be "):
        beam_search(model, src, **{"beam": 2, **kwargs})
    if "beam" not in kwargs and "lenpen" not in kwargs:
        with pytest.raises(ValueError, match=rf"^{match} must be "):
            greedy_decode(model, src, **kwargs)
    if "lenpen" in kwargs or "no_repeat_ngram_size" in kwargs:  # before any decoding
        with pytest.raises(ValueError, match=rf"^{match} must be "):
            translate_lines(model, None, ["a"], beam=1, **kwargs)


# --------------------------------------------------------------------------- flags

# every numeric flag of every command: (command, flag, a value out of range)
FLAGS = [
    ("generate", "--max-new-tokens", "-1"), ("generate", "--temperature", "-1"),
    ("generate", "--top-k", "0"), ("generate", "--top-p", "1.5"), ("generate", "--seed", "-1"),
    ("generate", "--mem-len", "-1"),
    ("translate", "--beam", "0"), ("translate", "--lenpen", "-1"),
    ("translate", "--no-repeat-ngram-size", "-1"),
    ("translate", "--batch-size", "0"), ("translate", "--max-len", "0"),
    ("translate", "--threads", "0"),
    ("classify", "--top-k", "0"), ("classify", "--batch-size", "0"),
    ("classify", "--threads", "0"),
    ("export", "--mem-len", "-1"),
    ("compare", "--budget", "0"), ("compare", "--params", "0"),
    ("serve", "--port", "65536"), ("serve", "--max-streams", "0"), ("serve", "--max-queue", "-1"),
    ("serve", "--mem-len", "-1"), ("serve", "--grace", "-1"), ("serve", "--threads", "0"),
    ("serve", "--chunk-ms", "-1"),
]
REQUIRED = {"generate": ["--checkpoint", "/no/such/run", "--prompt", "a"],
            "translate": ["--checkpoint", "/no/such/run"],
            "classify": ["--checkpoint", "/no/such/run"],
            "export": ["--checkpoint", "/no/such/run", "--out", "/no/such/out"],
            "compare": ["--data", "shakespeare", "--budget", "1", "--params", "1000"],
            "serve": ["--checkpoint", "/no/such/run"]}


def _numeric_flags():
    """(command, flag) for every option of every command that takes a number."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = set()
    for command, p in sub.choices.items():
        for action in p._actions:
            assert action.type not in (int, float), (command, action.option_strings)
            if getattr(action.type, "__name__", "") in ("int", "float"):
                out.add((command, action.option_strings[-1]))
    return out


def test_every_numeric_flag_is_tested():
    assert _numeric_flags() == {(c, f) for c, f, _ in FLAGS}


@pytest.mark.parametrize("value", [*NON_FINITE, "out of range", "word"])
@pytest.mark.parametrize("command,flag,bad", FLAGS)
def test_numeric_flags_are_finite_and_in_range(command, flag, bad, value, capsys):
    value = bad if value == "out of range" else value
    err = one_line_error(capsys, [command, *REQUIRED[command], f"{flag}={value}"])
    message = err[len("srupp: error: "):].strip()
    if value == "word":  # not a number at all
        assert message.startswith(f"{flag} must be ") and message.endswith("got 'word'"), err
    else:
        _assert_names(message, flag, value)


def test_the_issue_flags_name_the_range(capsys):
    base = ["generate", "--checkpoint", "/no/such/run", "--prompt", "a"]
    err = one_line_error(capsys, [*base, "--temperature", "-1"])
    assert "--temperature must be >= 0, got -1.0" in err
    err = one_line_error(capsys, [*base, "--temperature", "nan"])
    assert "--temperature must be a finite number >= 0, got nan" in err
    err = one_line_error(capsys, [*base, "--top-p", "0"])
    assert "--top-p must be in (0, 1], got 0.0" in err


def test_argparse_errors_other_than_ranges_keep_its_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "a"])
    assert e.value.code == 2
    assert "usage:" in capsys.readouterr().err


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    from lm_helpers import TEXT

    root = tmp_path_factory.mktemp("lm")
    (root / "corpus.txt").write_text(TEXT * 40)
    assert main(["train", "--data", str(root / "corpus.txt"), "--out", str(root / "run"),
                 "--no-progress", "--set", *TINY, "train.max_steps=2",
                 "train.save_every=2"]) == 0
    return root / "run"


def test_cli_temperature_zero_is_greedy_whatever_the_seed(lm_run, capsys):
    from srupp.inference import load_run

    _, tokenizer, model, _ = load_run(lm_run)
    prompt = "When in"
    want = prompt + tokenizer.decode(greedy_by_recomputing(model, tokenizer.encode(prompt)
                                                           .tolist(), 12))
    capsys.readouterr()
    for extra in (["--seed", "1"], ["--seed", "2", "--top-k", "3"], ["--top-p", "0.5"]):
        assert main(["generate", "--checkpoint", str(lm_run), "--prompt", prompt,
                     "--max-new-tokens", "12", "--temperature", "0", *extra]) == 0
        out, err = capsys.readouterr()
        assert out == want + "\n"
        assert json.loads(err.strip().splitlines()[-1])["new_tokens"] == 12


# --------------------------------------------------------------------------- the helper

@pytest.mark.parametrize("value,rng,integer,message", [
    (math.nan, "> 0", False, "must be a finite number > 0, got nan"),
    (0.0, "> 0", False, "must be > 0, got 0.0"),
    (1.0, "[0, 1)", False, "must be in [0, 1), got 1.0"),
    (math.inf, "[0, 1)", False, "must be a number in [0, 1), got inf"),
    (-math.inf, "", False, "must be a finite number, got -inf"),
    (2 ** 63, "[0, 2**63)", True, "must be in [0, 2**63), got 9223372036854775808"),
    (1.5, ">= 1", True, "must be an integer >= 1, got 1.5"),
    (True, ">= 1", True, "must be an integer >= 1, got True"),
    (None, ">= 1", True, None), (1, "(0, 1]", False, None), (0, ">= 0", True, None),
])
def test_problem(value, rng, integer, message):
    assert problem(value, rng, integer=integer) == message


def test_check_raises_value_error_for_numbers_type_error_for_the_rest():
    with pytest.raises(ValueError, match="^k must be an integer >= 0, got nan$"):
        check("k", math.nan, ">= 0", integer=True)
    with pytest.raises(TypeError):
        check("k", "1", ">= 0")
    with pytest.raises(UserError):
        check("k", -1, ">= 0", error=UserError)
    assert check("k", 3, ">= 0") == 3
