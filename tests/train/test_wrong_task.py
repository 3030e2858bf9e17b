"""A run given another task's recipe or command: one line that names both tasks.

Resuming (``srupp train RECIPE --out RUN --resume``) checks the run's task
against the recipe's (a recipe without ``task`` is a language model's) or
``--set task=``'s before reading any of their keys; ``generate``,
``translate`` and ``classify`` check the checkpoint's task.
"""

import random
import sys
from pathlib import Path

import pytest

from srupp.cli import main
from srupp.errors import UserError
from srupp.train import build_config

from lm_helpers import TEXT, TINY, one_line_error

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
RECIPE_TASK = {"shakespeare-cpu.toml": "lm", "translate-cpu.toml": "translate",
               "classify-cpu.toml": "classify"}
NAMES = {"lm": "language-model", "translate": "translation", "classify": "classification"}
CLASSIFY = ["task=classify", "model.d_model=16", "model.proj_size=8", "model.num_layers=1",
            "train.max_tokens=128", "train.warmup_steps=1", "train.log_every=2",
            "train.save_every=2", "train.eval_every=2", "train.eval_max_batches=1",
            "train.threads=1", "data.test_size=10", "data.valid_size=10", "train.max_steps=2"]


def _saved(task):
    """A saved run's config.json of ``task``, as its recipe wrote it."""
    recipe = next(r for r, t in RECIPE_TASK.items() if t == task)
    return build_config(RECIPES / recipe).to_dict()


@pytest.mark.parametrize("have", ["lm", "translate", "classify"])
@pytest.mark.parametrize("recipe", sorted(RECIPE_TASK))
def test_resuming_with_a_recipe_of_another_task_names_both(have, recipe):
    want = RECIPE_TASK[recipe]
    if want == have:
        assert build_config(RECIPES / recipe, base=_saved(have)).task == have
        return
    with pytest.raises(UserError) as e:
        build_config(RECIPES / recipe, base=_saved(have), base_name="runs/x")
    message = str(e.value)
    assert message.startswith(f"runs/x is a {NAMES[have]} run (task={have}); "
                              f"recipe {RECIPES / recipe} is a {NAMES[want]} recipe "
                              f"(task={want}"), message
    assert message.endswith("resume with the run's own recipe, or train into a new --out")
    assert ("as it names no task" in message) == (want == "lm")


def test_set_task_of_another_task_names_both():
    with pytest.raises(UserError, match=r"^the saved run is a classification run "
                                        r"\(task=classify\); --set task=lm asks for a "
                                        r"language-model run: drop --set task=lm to resume"):
        build_config(None, ["task=lm"], base=_saved("classify"))
    # without a recipe or --set task=, the run keeps its task
    assert build_config(None, ["train.lr=1e-3"], base=_saved("classify")).task == "classify"
    assert build_config(None, ["task=translate"], base=_saved("translate")).task == "translate"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A language-model run and a classification run, 2 steps each at tiny shapes."""
    root = tmp_path_factory.mktemp("runs")
    (root / "corpus.txt").write_text(TEXT * 40)
    words = "house cat dog tree car book table chair window door".split()
    rng = random.Random(2)
    rows = ["text\tlabel"]
    for _ in range(80):
        idx = [rng.randrange(10) for _ in range(rng.randint(2, 5))]
        rows.append(" ".join(words[i] for i in idx) + "\t"
                    + ("animal" if {1, 2} & set(idx) else "thing"))
    (root / "texts.tsv").write_text("\n".join(rows) + "\n")
    assert main(["train", "--data", str(root / "corpus.txt"), "--out", str(root / "lm"),
                 "--no-progress", "--set", *TINY, "train.max_steps=2",
                 "train.save_every=2"]) == 0
    assert main(["train", "--data", str(root / "texts.tsv"), "--out", str(root / "cls"),
                 "--no-progress", "--set", *CLASSIFY]) == 0
    return root


def _listing(run):
    return sorted((str(p.relative_to(run)), p.stat().st_mtime_ns) for p in run.rglob("*"))


def test_lm_run_resumed_with_the_classify_recipe(runs, capsys):
    run = runs / "lm"
    before = _listing(run)
    capsys.readouterr()
    err = one_line_error(capsys, ["train", str(RECIPES / "classify-cpu.toml"), "--out", str(run),
                                  "--resume", "--no-progress"])
    assert "is a language-model run (task=lm)" in err
    assert "classify-cpu.toml is a classification recipe (task=classify)" in err
    assert "unknown config key" not in err
    assert _listing(run) == before  # refused before anything was touched


def test_classify_run_resumed_with_an_lm_recipe(runs, capsys):
    capsys.readouterr()
    err = one_line_error(capsys, ["train", str(RECIPES / "shakespeare-cpu.toml"),
                                  "--out", str(runs / "cls"), "--resume", "--no-progress"])
    assert "is a classification run (task=classify)" in err
    assert "is a language-model recipe (task=lm, as it names no task)" in err


@pytest.mark.parametrize("run,argv,need", [
    ("cls", ["generate", "--prompt", "a"], "lm"),
    ("cls", ["translate"], "translate"),
    ("lm", ["classify"], "classify"),
    ("lm", ["translate"], "translate"),
])
def test_a_command_of_another_task_names_both(runs, capsys, monkeypatch, tmp_path, run, argv,
                                              need):
    have = {"lm": "lm", "cls": "classify"}[run]
    stdin = tmp_path / "stdin.txt"
    stdin.write_text("a line\n")
    capsys.readouterr()
    with open(stdin) as handle:
        monkeypatch.setattr(sys, "stdin", handle)
        err = one_line_error(capsys, [argv[0], "--checkpoint", str(runs / run), *argv[1:]])
    assert f"srupp {argv[0]} needs a {NAMES[need]} checkpoint (task={need})" in err
    assert f"holds a {NAMES[have]} model (task={have})" in err


def test_eval_with_another_task_set_names_both(runs, capsys):
    capsys.readouterr()
    err = one_line_error(capsys, ["eval", "--checkpoint", str(runs / "lm"),
                                  "--set", "task=classify"])
    assert "is a language-model run (task=lm)" in err
    assert "--set task=classify asks for a classification run" in err
