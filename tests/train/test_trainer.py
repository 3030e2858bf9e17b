"""Trainer: exact resume (in process and after SIGKILL), metrics, schedule, CLI errors."""

import json
import math
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from srupp.cli import main
from srupp.train import Trainer
from srupp.train.schedule import CALIBRATION_SKIP, REFIT_AT, StepSchedule, lr_factor

from lm_helpers import TINY, config, metrics


class _SignalOnBatch:
    """The batch iterator, sending this process ``sig`` as batches ``at`` are asked for
    (once per time a batch's number is listed)."""

    def __init__(self, it, calls, at, sig=signal.SIGINT):
        self.it, self.calls, self.at, self.sig = it, calls, at, sig

    def __next__(self):
        self.calls.append(1)
        for _ in range(self.at.count(len(self.calls))):
            signal.raise_signal(self.sig)  # inside the step: after a backward, before a batch
        return next(self.it)


def _signal_inside_a_step(t, at, sig=signal.SIGINT):
    original, calls = t._train_step, []
    t._train_step = lambda it: original(_SignalOnBatch(it, calls, at, sig))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_inside_gradient_accumulation_stops_at_the_step_boundary(tmp_path, corpus, sig):
    steps = ("train.max_steps=12", "train.grad_accum=2")
    full = tmp_path / "full"
    Trainer(config(corpus, *steps), full, progress=False).train()

    part = tmp_path / "part"
    t = Trainer(config(corpus, *steps), part, progress=False)
    _signal_inside_a_step(t, at=[14], sig=sig)  # step 7's second segment, mid log interval
    before = signal.getsignal(sig)
    assert t.train() == {"interrupted": True, "step": 7}
    assert signal.getsignal(sig) is before  # the previous handler is back
    resumed = Trainer(config(corpus, *steps), part, resume=True, progress=False)
    assert resumed.step == 7
    resumed.train()
    _same_losses(metrics(part), metrics(full))


def test_second_signal_stops_at_once_and_keeps_the_last_checkpoint(tmp_path, corpus, capsys):
    full = tmp_path / "full"
    Trainer(config(corpus, "train.max_steps=12"), full, progress=False).train()

    part = tmp_path / "part"
    t = Trainer(config(corpus, "train.max_steps=12"), part, progress=False)
    _signal_inside_a_step(t, at=[7, 7])  # Ctrl-C twice inside step 7
    assert t.train() == {"interrupted": True, "step": 4}  # save_every=4: nothing newer saved
    assert "nothing saved" in capsys.readouterr().err
    resumed = Trainer(config(corpus, "train.max_steps=12"), part, resume=True, progress=False)
    assert resumed.step == 4
    resumed.train()
    _same_losses(metrics(part), metrics(full))


def test_a_folder_no_pointer_names_is_written_again(tmp_path, corpus):
    """A kill between a checkpoint folder and its pointer leaves a folder from another
    trajectory (here: another learning rate) that a resumed run must not keep."""
    from safetensors.torch import load_file

    other = tmp_path / "other"
    Trainer(config(corpus, "train.max_steps=8", "train.lr=1e-2"), other, progress=False).train()
    run = tmp_path / "run"
    t = Trainer(config(corpus, "train.max_steps=8"), run, progress=False)
    _signal_inside_a_step(t, at=[4])
    assert t.train()["step"] == 4
    shutil.copytree(other / "ckpt-000008", run / "ckpt-000008")  # named by no pointer
    resumed = Trainer(config(corpus, "train.max_steps=8"), run, resume=True, progress=False)
    resumed.train()
    saved = load_file(str(run / "ckpt-000008" / "model.safetensors"))
    state = resumed.model.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in saved.items())


def test_a_fresh_run_drops_the_lines_of_one_killed_before_its_first_checkpoint(tmp_path, corpus):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 2, "train_loss": 9.0}\n{"step": 4, "tr')
    Trainer(config(corpus, "train.max_steps=4"), run, progress=False).train()
    assert [r["step"] for r in metrics(run) if "train_loss" in r] == [2, 4]
    assert all(r["train_loss"] != 9.0 for r in metrics(run) if "train_loss" in r)


def _same_losses(a, b):
    """Equal losses and steps; timing fields differ between runs."""
    keys = ("step", "train_loss", "lr", "valid_bpc", "valid_loss")
    strip = lambda rows: [{k: r[k] for k in keys if k in r} for r in rows]  # noqa: E731
    assert strip(a) == strip(b)
    return True


def test_sigkill_loses_only_steps_since_checkpoint(tmp_path, corpus):
    steps = "train.max_steps=300"
    full = tmp_path / "full"
    Trainer(config(corpus, steps), full, progress=False).train()

    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "srupp.cli", "train", "--out", str(run), "--no-progress",
           "--set", *TINY, f"data.corpus={corpus}", steps]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (run / "last.json").exists() and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # as soon as a first checkpoint exists
    proc.wait()
    saved = json.loads((run / "last.json").read_text())["step"]
    assert 4 <= saved < 300, "the kill should land mid-run"
    rc = main(["train", "--out", str(run), "--resume", "--no-progress"])
    assert rc == 0
    _same_losses(metrics(run), metrics(full))


def test_metrics_curves_and_loss_goes_down(tmp_path, corpus):
    run = tmp_path / "run"
    # RAdam's rectifier keeps early steps small, hence a high lr for a short run
    summary = Trainer(config(corpus, "train.max_steps=80", "train.lr=3e-2",
                             "train.eval_every=16", "train.save_every=16"), run,
                      progress=False).train()
    rows = metrics(run)
    train = [r for r in rows if "train_loss" in r]
    assert [r["step"] for r in train] == list(range(2, 81, 2))
    assert train[-1]["train_loss"] < train[0]["train_loss"] - 0.5
    assert [r["step"] for r in rows if "valid_bpc" in r] == [16, 32, 48, 64, 80, 80]
    assert all({"valid_loss", "valid_ppl"} <= set(r) for r in rows if "valid_bpc" in r)
    assert (run / "curves.png").stat().st_size > 1000
    assert summary["valid_bpc"] == rows[-1]["valid_bpc"]
    assert summary["valid_loss"] == rows[-1]["valid_loss"]
    assert {"last.json", "best.json"} <= {p.name for p in run.iterdir()}
    assert len(list(run.glob("ckpt-*"))) <= 2  # only last and best are kept


def test_final_evaluation_on_a_saved_step_updates_the_best_loss(tmp_path, corpus, monkeypatch):
    """The final evaluation lands on step 8, saved before it: its better loss is stored too."""
    losses = iter([3.0, 2.5, 2.0])  # evaluations at steps 4 and 8, then the final one at 8

    def validate(self, max_batches=None, *, final=False):
        loss = next(losses)
        return {"loss": loss, "bpc": loss / math.log(2), "ppl": math.exp(loss), "tokens": 1,
                "seconds": 0.0}

    monkeypatch.setattr(Trainer, "validate", validate)
    run = tmp_path / "run"
    Trainer(config(corpus, "train.max_steps=8"), run, progress=False).train()
    best = json.loads((run / "best.json").read_text())
    assert best["step"] == 8 and best["valid_loss"] == 2.0
    state = torch.load(run / best["dir"] / "trainer.pt", weights_only=True)
    assert state["best_loss"] == 2.0
    resumed = Trainer(config(corpus, "train.max_steps=8"), run, resume=True, progress=False)
    assert resumed.best_loss == 2.0

    # without matplotlib the run still ends; the warning says how to get curves.png
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.warns(UserWarning, match=r"pip install 'srupp\[plots\]'"):
        assert resumed.plot() is None


def test_time_budget_fixes_the_schedule_length(tmp_path, corpus):
    run = tmp_path / "timed"
    t = Trainer(config(corpus, "train.max_steps=100000", "train.max_seconds=3",
                       "train.calibration_steps=10", "train.save_every=1000",
                       "train.eval_every=1000", "train.log_every=10"), run, progress=False)
    t.train()
    assert t.schedule.calibrated and t.total_steps < 100000
    # the cosine (nearly) reached its end in time; step times on a shared 2-core
    # machine jitter, hence the slack
    assert t.step >= 0.7 * t.total_steps
    # the last checkpoint (past 1,000 steps an earlier one predates the last re-fit)
    state = torch.load(max(run.glob("ckpt-*")) / "trainer.pt", weights_only=True)
    assert state["total_steps"] == t.total_steps


def test_schedule_is_refitted_when_calibration_was_slow(tmp_path, corpus, monkeypatch):
    """Slow calibration steps would end the cosine long before the budget; the re-fit fixes it."""
    run = tmp_path / "refit"
    t = Trainer(config(corpus, "train.max_steps=100000", "train.max_seconds=4",
                       "train.calibration_steps=10", "train.save_every=100000",
                       "train.eval_every=100000", "train.log_every=10"), run, progress=False)
    real_step = Trainer._train_step

    def slow_at_first(self, it):
        if CALIBRATION_SKIP <= self.step < CALIBRATION_SKIP + 10:  # the timed window only
            time.sleep(0.1)
        return real_step(self, it)

    monkeypatch.setattr(Trainer, "_train_step", slow_at_first)
    calibrated = []
    real_refit = StepSchedule.refit
    monkeypatch.setattr(StepSchedule, "refit", lambda self, step, seconds: (
        calibrated.append(self.total_steps), real_refit(self, step, seconds)))
    t.train()
    assert t.schedule.refitted >= 1 and len(calibrated) == t.schedule.refitted
    assert t.total_steps > 1.5 * calibrated[0]  # the calibrated length was far too short
    # the budget is used instead of stopping at the first (slow) estimate, which
    # ended at 1.2 s of 4 when measured without it; the re-fit predicts from step times, so
    # allow for this shared machine's speed drifting after it (0.65 x was seen)
    assert t.train_seconds >= 0.55 * 4
    state = torch.load(next(run.glob("ckpt-*")) / "trainer.pt", weights_only=True)
    assert state["refitted"] == t.schedule.refitted and state["total_steps"] == t.total_steps


def test_schedule_follows_a_speed_change_after_the_first_refit(tmp_path, corpus, monkeypatch):
    """Steps slow until 40% of the budget, fast after: the later re-fits see the new speed.

    With one re-fit (at 25%, from slow steps only) the schedule ended at about half the
    budget here. Each later re-fit predicts from the steps since the previous one, and
    comes at a fraction of the fitted steps when that is reached before the time.
    """
    budget = 4.0
    t = Trainer(config(corpus, "train.max_steps=100000", f"train.max_seconds={budget}",
                       "train.calibration_steps=10", "train.save_every=100000",
                       "train.eval_every=100000", "train.log_every=10"), tmp_path / "r",
                progress=False)
    real_step = Trainer._train_step

    def slow_then_fast(self, it):
        if self.train_seconds < 0.4 * budget:
            time.sleep(0.05)
        return real_step(self, it)

    monkeypatch.setattr(Trainer, "_train_step", slow_then_fast)
    fits = []
    real_refit = StepSchedule.refit
    monkeypatch.setattr(StepSchedule, "refit", lambda self, step, seconds: (
        fits.append(seconds), real_refit(self, step, seconds)))
    t.train()
    assert t.schedule.refitted == len(REFIT_AT) == len(fits)
    print(f"re-fits at {[round(f, 2) for f in fits]} s, ended at {t.train_seconds:.2f} s")
    assert t.train_seconds >= 0.8 * budget


def test_schedule_shape():
    assert lr_factor(0, 10, 100, 0.0) == pytest.approx(0.1)
    assert lr_factor(9, 10, 100, 0.0) == pytest.approx(1.0)
    assert lr_factor(55, 10, 100, 0.0) == pytest.approx(0.5)
    assert lr_factor(100, 10, 100, 0.1) == pytest.approx(0.1)


# ------------------------------------------------------------------ the CLI

def run_cli(args, capsys):
    rc = main(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_eval_generate_params(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    rc, out, _ = run_cli(["train", "--data", str(corpus), "--out", str(run), "--no-progress",
                          "--set", *TINY, "--set", "train.max_steps=4"], capsys)
    assert rc == 0 and json.loads(out)["step"] == 4
    rc, out, _ = run_cli(["eval", "--checkpoint", str(run), "--split", "test",
                          "--set", "eval.batch_size=1"], capsys)
    res = json.loads(out)
    assert rc == 0 and set(res) >= {"bpc", "tokens", "seconds", "oov_rate"}
    assert math.isfinite(res["bpc"]) and res["oov_rate"] == 0.0
    gen = ["generate", "--checkpoint", str(run), "--prompt", "When in", "--max-new-tokens", "30",
           "--seed", "7"]
    rc, out1, err = run_cli(gen, capsys)
    assert rc == 0 and out1.startswith("When in") and "tokens_per_s" in err
    _, out2, _ = run_cli(gen, capsys)
    assert out1 == out2
    # a checkpoint folder stands on its own: model, config and tokenizer
    ckpt = next(run.glob("ckpt-*"))
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in ckpt.iterdir()}
    rc, out, _ = run_cli(["generate", "--checkpoint", str(ckpt), "--prompt", "When in",
                          "--max-new-tokens", "30", "--seed", "7"], capsys)
    assert rc == 0 and out == out1
    rc, out, _ = run_cli(["params", "--set", "model.d_model=16", "model.proj_size=8"], capsys)
    p = json.loads(out)
    assert p["params"] == p["embedding"] + p["layers"] + p["output"]


@pytest.mark.parametrize("args,match", [
    (["train", "--set", "train.lrr=1"], "did you mean 'train.lr'"),
    (["train", "--set", "train.batch_size=0"], "batch_size"),
    (["train", "--set", "train.log_every=3", "train.save_every=10"], "must divide"),
    (["train", "--data", "no-such-corpus"], "no-such-corpus"),
    (["eval", "--checkpoint", "/nonexistent/run"], "does not exist"),
])
def test_cli_bad_input_is_one_line_exit_2(args, match, capsys, tmp_path):
    rc, out, err = run_cli(args + (["--out", str(tmp_path / "r")] if args[0] == "train" else []),
                           capsys)
    assert rc == 2
    assert match in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_corrupt_checkpoint_and_foreign_data(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    main(["train", "--data", str(corpus), "--out", str(run), "--no-progress",
          "--set", *TINY, "data.tokenizer=char", "train.max_steps=4"])
    capsys.readouterr()
    foreign = tmp_path / "foreign.txt"
    foreign.write_text("Ωμέγα ζ ξ ψ " * 200)
    rc, _, err = run_cli(["eval", "--checkpoint", str(run), "--data", str(foreign)], capsys)
    assert rc == 2 and "out of vocabulary" in err
    ckpt = next(run.glob("ckpt-*"))
    blob = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(blob[:100])
    rc, _, err = run_cli(["eval", "--checkpoint", str(run)], capsys)
    assert rc == 2 and "corrupt" in err and err.count("\n") == 1
    (ckpt / "trainer.pt").write_bytes(b"not a zip")
    rc, _, err = run_cli(["train", "--out", str(run), "--resume"], capsys)
    assert rc == 2 and "corrupt" in err


def test_empty_corpus(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    rc, _, err = run_cli(["train", "--data", str(empty), "--out", str(tmp_path / "r")], capsys)
    assert rc == 2 and "empty" in err


def test_word_level_run_reports_perplexity(tmp_path, corpus, capsys):
    run = tmp_path / "words"
    rc, out, _ = run_cli(["train", "--data", str(corpus), "--out", str(run), "--no-progress",
                          "--set", *TINY, "data.tokenizer=word", "data.vocab_size=20",
                          "data.lowercase=true", "data.max_oov=0.9", "train.max_steps=4"],
                         capsys)
    summary = json.loads(out)
    # bits per token are not bits per character here: no valid_bpc anywhere
    assert rc == 0 and "valid_bpc" not in summary
    assert summary["valid_ppl"] == pytest.approx(math.exp(summary["valid_loss"]))
    valid = [r for r in metrics(run) if "valid_loss" in r]
    assert valid and all("valid_ppl" in r and "valid_bpc" not in r for r in valid)
    assert "valid_ppl" in json.loads((run / "best.json").read_text())
    tok = json.loads((run / "tokenizer.json").read_text())
    assert tok["type"] == "word" and len(tok["vocab"]) == 20 and tok["lowercase"]
    rc, out, _ = run_cli(["eval", "--checkpoint", str(run)], capsys)
    res = json.loads(out)
    assert rc == 0 and "ppl" in res and "bpc" not in res and 0 < res["oov_rate"] < 0.9
    rc, _, err = run_cli(["train", "--out", str(tmp_path / "x"), "--set", "data.lowercase=true"],
                         capsys)
    assert rc == 2 and "word tokenizer only" in err
