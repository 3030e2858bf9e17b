"""The task registry: a task by its name or by the command that applies its models, found
without importing the training loop."""

import subprocess
import sys

import pytest

from srupp.errors import UserError
from srupp.train import TASKS
from srupp.train.registry import task_named, task_of_command


def test_each_command_finds_its_task():
    assert {c: task_of_command(c).name for c in ("generate", "translate", "classify")} == {
        "generate": "lm", "translate": "translate", "classify": "classify"}
    with pytest.raises(ValueError, match="commands: generate, translate, classify"):
        task_of_command("export")


def test_an_unknown_task_names_the_tasks():
    assert task_named("classify") is TASKS["classify"]
    with pytest.raises(UserError, match="task must be one of lm, translate, classify, got 'lmm'"):
        task_named("lmm")


def test_the_cli_finds_a_checkpoints_task_without_the_trainer():
    """srupp generate (translate, classify) checks the checkpoint's task: that imports the
    tasks, not the trainer (in a fresh process, with load_run replaced by a stub)."""
    code = """if True:
        import sys, types
        import srupp.cli as cli
        import srupp.inference as inference

        def load_run(path):
            return types.SimpleNamespace(model=types.SimpleNamespace(
                config=types.SimpleNamespace(task="lm")))

        inference.load_run = load_run
        cli._load_for(types.SimpleNamespace(checkpoint="runs/x"), "generate")
        assert "srupp.train.registry" in sys.modules
        assert "srupp.train.trainer" not in sys.modules, "finding the task imported the trainer"
        from srupp.train import Trainer  # still there, when asked for
        assert Trainer.__module__ == "srupp.train.trainer"
    """
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
