"""train.tensorboard = true: the scalars of metrics.jsonl, also as TensorBoard events."""

import signal
import sys

import pytest

from srupp.errors import UserError
from srupp.train import Trainer

from lm_helpers import config, metrics, one_line_error

TB = ["train.tensorboard=true", "train.max_steps=8"]


def scalars(run):
    """{tag: [(step, value), ...]} of the run's TensorBoard events, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def from_metrics(run):
    """The same, from metrics.jsonl."""
    out = {}
    for r in metrics(run):
        for k, v in r.items():
            if k != "step":
                out.setdefault(k, []).append((r["step"], pytest.approx(v, rel=1e-6)))
    return out


def test_the_events_hold_the_scalars_of_metrics_jsonl(tmp_path, corpus):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    run = tmp_path / "run"
    Trainer(config(corpus, *TB), run, progress=False).train()
    assert {"train_loss", "lr", "valid_loss", "valid_bpc"} <= set(scalars(run))
    assert scalars(run) == from_metrics(run)


def test_a_resumed_run_hides_the_events_after_its_checkpoint(tmp_path, corpus):
    """Two signals inside step 7 stop at once: step 6's line is dropped on resume, and
    TensorBoard shows it no more."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    run = tmp_path / "run"
    t = Trainer(config(corpus, *TB), run, progress=False)
    original, calls = t._train_step, []

    def two_signals_in_step_7(it):
        calls.append(1)
        if len(calls) == 7:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
        return original(it)

    t._train_step = two_signals_in_step_7
    assert t.train() == {"interrupted": True, "step": 4}
    assert ("train_loss", 6) in {(k, s) for k, pts in scalars(run).items() for s, _ in pts}
    Trainer(config(corpus, *TB), run, resume=True, progress=False).train()
    assert scalars(run) == from_metrics(run)


def test_without_tensorboard_one_line_names_the_extra(tmp_path, corpus, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    run = tmp_path / "run"
    with pytest.raises(UserError, match=r"pip install 'srupp\[tensorboard\]'"):
        Trainer(config(corpus, *TB), run, progress=False)
    err = one_line_error(capsys, ["train", "--out", str(run), "--no-progress", "--set",
                                  f"data.corpus={corpus}", *TB])
    assert "pip install 'srupp[tensorboard]'" in err
    assert not run.exists()  # refused before anything was written
