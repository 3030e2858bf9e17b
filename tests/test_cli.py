"""The srupp command's errors: bad input is one line on stderr and exit code 2; a bug keeps
its traceback; --debug (or SRUPP_DEBUG=1) shows the traceback of bad input too."""

from pathlib import Path

import pytest

from srupp import cli
from srupp._extras import MissingExtra
from srupp.cli import main
from srupp.errors import UserError

from lm_helpers import TINY, one_line_error


def train(corpus, out, *sets):
    return ["train", "--data", str(corpus), "--out", str(out), "--no-progress",
            "--set", *TINY, "train.max_steps=4", *sets]


def test_out_is_an_existing_file(tmp_path, corpus, capsys):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    err = one_line_error(capsys, train(corpus, afile))
    assert str(afile) in err and "not a run directory" in err
    assert afile.read_text() == "mine"


@pytest.mark.parametrize("where", ["under_a_file", "under_proc"])
def test_out_that_cannot_be_created(tmp_path, corpus, capsys, where):
    if where == "under_a_file":
        (tmp_path / "afile").write_text("")
        out = tmp_path / "afile" / "run"  # NotADirectoryError
    else:
        if not Path("/proc/self").is_dir():
            pytest.skip("needs Linux /proc")
        out = Path("/proc/srupp-test-no-such-dir/run")  # FileNotFoundError, even for root
    err = one_line_error(capsys, train(corpus, out))
    assert "cannot create the run directory" in err and str(out) in err


def test_resume_refuses_a_new_model_shape_naming_the_key(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert main(train(corpus, run)) == 0  # trained at model.d_model=16
    capsys.readouterr()
    err = one_line_error(capsys, ["train", "--out", str(run), "--resume", "--no-progress",
                                  "--set", "model.d_model=32"])
    assert "model.d_model=16, not 32" in err and "corrupt" not in err
    # several keys: each one that changes a shape is named; dropout changes none
    err = one_line_error(capsys, ["train", "--out", str(run), "--resume", "--no-progress",
                                  "--set", "model.num_layers=3", "model.proj_size=4",
                                  "model.dropout=0.2"])
    assert "model.num_layers=2, not 3" in err and "model.proj_size=8, not 4" in err
    assert "dropout" not in err
    # a change that keeps every shape resumes
    assert main(["train", "--out", str(run), "--resume", "--no-progress",
                 "--set", "model.dropout=0.2"]) == 0


@pytest.mark.parametrize("exc,expected", [
    (UserError("mask_pad must be (B, L)\nsecond line"), "mask_pad must be (B, L); second line"),
    (PermissionError(13, "Permission denied", "/some/file"), "/some/file: Permission denied"),
    (ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib"),
     "pip install 'srupp[plots]'"),
    (ModuleNotFoundError("No module named 'sentencepiece'", name="sentencepiece"),
     "pip install 'srupp[subword]'"),
    (MissingExtra("srupp compare's curves.png needs matplotlib: pip install 'srupp[plots]'",
                  name="matplotlib"), "needs matplotlib: pip install 'srupp[plots]'"),
])
def test_user_errors_become_one_line(monkeypatch, capsys, exc, expected):
    def fail(args):
        raise exc

    monkeypatch.setattr(cli, "cmd_params", fail)
    err = one_line_error(capsys, ["params"])
    assert expected in err and err.rstrip().endswith("(--debug shows the traceback)")


@pytest.mark.parametrize("exc", [ValueError("bug"), TypeError("bug")])
def test_a_library_bug_keeps_its_traceback(monkeypatch, exc):
    """A ValueError or TypeError the user's input did not cause is a bug, not exit code 2."""
    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr("srupp.train.build_config", fail)  # what srupp params calls first
    with pytest.raises(type(exc), match="^bug$"):
        main(["params"])


def test_bad_input_is_one_line_and_debug_shows_its_traceback(monkeypatch, capsys):
    err = one_line_error(capsys, ["params", "--set", "model.d_modle=16"])
    assert "unknown config key 'model.d_modle'" in err and "(--debug shows" in err
    for argv, env in ((["--debug", "params"], None), (["params", "--debug"], None),
                      (["params"], "1")):
        if env:
            monkeypatch.setenv("SRUPP_DEBUG", env)
        assert main([*argv, "--set", "model.d_modle=16"]) == 2
        err = capsys.readouterr().err
        assert "Traceback" in err and "UserError" in err, argv
        assert err.strip().splitlines()[-1] == ("srupp: error: unknown config key "
                                                "'model.d_modle'; did you mean 'model.d_model'?")


def test_a_missing_required_module_is_a_bug_with_its_traceback(monkeypatch):
    def fail(args):
        raise ModuleNotFoundError("No module named 'numpy'", name="numpy")

    monkeypatch.setattr(cli, "cmd_params", fail)
    with pytest.raises(ModuleNotFoundError):
        main(["params"])


def test_ctrl_c_exits_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_params", interrupted)
    assert main(["params"]) == 130
    assert "interrupted" in capsys.readouterr().err

