"""The run config is plain data: building one applies no task's defaults and runs no
task's checks; build_config does both and names the task's class."""

import pytest

from srupp.train import TASKS, build_config
from srupp.train.run_config import DataConfig, RunConfig


def test_a_run_config_is_what_it_is_given():
    cfg = RunConfig(data=DataConfig(tokenizer="byte"), task="translate")
    # translate's defaults (sentencepiece, its corpus) and its check (it refuses byte
    # tokens) belong to build_config
    assert (cfg.data.tokenizer, cfg.data.corpus, cfg.task_class) == ("byte", None, None)
    with pytest.raises(TypeError, match="build_config"):
        cfg.model_config(256)  # the task sets model fields: it needs the task's class
    given = RunConfig(task="translate", task_class=TASKS["translate"])
    assert given.model_config(256).task == "translate"


def test_build_config_applies_the_tasks_defaults_and_names_its_class():
    built = build_config(None, ["task=translate"])
    assert built.task_class is TASKS["translate"]
    assert (built.data.tokenizer, built.data.corpus) == ("sentencepiece", "iwslt14-de-en")
    saved = built.to_dict()
    assert "task_class" not in saved and saved["task"] == "translate"
    again = build_config(None, base=saved)
    assert again == built and again.task_class is TASKS["translate"]
