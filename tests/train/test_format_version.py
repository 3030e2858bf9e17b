"""A saved run whose format_version this srupp does not read: one line and exit 2.

The run config (``config.json``), the pointers (``last.json``, ``best.json``),
each checkpoint's ``trainer.pt`` and its model's ``config.json`` carry
``format_version``; ``srupp train --resume``, ``srupp eval`` and ``srupp
generate`` check what they read.
"""

import json

import pytest
import torch

from srupp._format import FORMAT_VERSION
from srupp.cli import main

from lm_helpers import TINY, one_line_error

COMMANDS = {
    "train --resume": lambda run: ["train", "--out", str(run), "--resume", "--no-progress",
                                   "--set", "train.max_steps=8"],
    "eval": lambda run: ["eval", "--checkpoint", str(run)],
    "generate": lambda run: ["generate", "--checkpoint", str(run), "--prompt", "When",
                             "--max-new-tokens", "3"],
}


def tiny_run(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), "--no-progress", "--set", *TINY,
                 f"data.corpus={corpus}", "train.max_steps=4"]) == 0
    capsys.readouterr()
    return run


def set_version(run, what, version):
    """Write ``version`` (None: no version at all) into the run's ``what`` file(s)."""
    def edit(d):
        d.pop("format_version")
        return d if version is None else {**d, "format_version": version}

    if what == "trainer.pt":
        for f in run.glob("ckpt-*/trainer.pt"):
            torch.save(edit(torch.load(f, weights_only=True)), f)
        return
    files = {"config.json": [run / "config.json"],
             "pointers": [run / "last.json", run / "best.json"],
             "model config": list(run.glob("ckpt-*/config.json"))}[what]
    for f in files:
        f.write_text(json.dumps(edit(json.loads(f.read_text()))))


def test_a_run_records_its_format_version(tmp_path, corpus, capsys):
    run = tiny_run(tmp_path, corpus, capsys)
    for f in ("config.json", "last.json", "best.json"):
        assert json.loads((run / f).read_text())["format_version"] == FORMAT_VERSION
    for f in run.glob("ckpt-*/trainer.pt"):
        assert torch.load(f, weights_only=True)["format_version"] == FORMAT_VERSION
    for f in run.glob("ckpt-*/config.json"):
        assert json.loads(f.read_text())["format_version"] == FORMAT_VERSION


@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, None], ids=["newer", "missing"])
@pytest.mark.parametrize("what, commands", [
    ("config.json", ["train --resume", "eval", "generate"]),
    ("pointers", ["train --resume", "eval", "generate"]),
    ("trainer.pt", ["train --resume"]),  # only a resumed run reads it
    ("model config", ["train --resume", "eval", "generate"]),
])
def test_an_unknown_format_version_is_one_line_and_exit_2(tmp_path, corpus, capsys, what,
                                                          commands, version):
    run = tiny_run(tmp_path, corpus, capsys)
    set_version(run, what, version)
    for command in commands:
        err = one_line_error(capsys, COMMANDS[command](run))
        assert "format_version" in err, (command, err)
        assert (str(version) if version is not None else "no format_version") in err
    # nothing was trained on
    assert json.loads((run / "last.json").read_text())["step"] == 4
