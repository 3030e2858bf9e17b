"""Ctrl-C (SIGINT) and SIGTERM at random moments, then --resume: every logged loss as without them.

Real ``srupp train`` processes are interrupted at a random delay after training
started, so the signal lands anywhere in a step: while the batcher advances,
inside gradient accumulation, between ``optimizer.step()`` and the step
counter, during a checkpoint. The run must stop at a step boundary with a
consistent checkpoint, exit with code 130, and continue with ``--resume`` to the
same losses, bit for bit, as a run that was never interrupted.
"""

import json
import random
import signal
import subprocess
import sys
import time

from srupp.cli import main
from srupp.train import Trainer

from lm_helpers import TINY, config, metrics

STEPS = 100
SETS = ["train.log_every=1", "train.save_every=8", "train.eval_every=16",
        "train.eval_max_batches=1", f"train.max_steps={STEPS}"]
KEYS = ("step", "train_loss", "lr", "valid_loss", "valid_ppl", "valid_bpc")


def _strip(rows):
    """Steps, losses and learning rates; timing fields differ between runs."""
    return [{k: r[k] for k in KEYS if k in r} for r in rows]


def _lines(path):
    try:
        return path.read_text().count("\n")
    except FileNotFoundError:
        return 0


def test_signals_at_random_moments_resume_bit_for_bit(tmp_path, corpus):
    rng = random.Random()  # the moments differ from run to run; failures name them
    trials = [(signal.SIGINT, 1), (signal.SIGTERM, 1), (signal.SIGINT, 2), (signal.SIGTERM, 2)]
    procs = []
    for i, (sig, accum) in enumerate(trials):
        run = tmp_path / f"run{i}"
        cmd = [sys.executable, "-m", "srupp.cli", "train", "--out", str(run), "--no-progress",
               "--set", *TINY, *SETS, f"data.corpus={corpus}", f"train.grad_accum={accum}"]
        err = open(tmp_path / f"err{i}.txt", "w")
        procs.append({"run": run, "sig": sig, "accum": accum, "err": err, "when": None,
                      # a random step, then a random moment inside it
                      "lines": rng.randint(2, STEPS // 2), "delay": rng.uniform(0.0, 0.02),
                      "proc": subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)})
    try:
        _interrupt_resume_and_compare(tmp_path, corpus, procs)
    finally:
        for p in procs:
            if p["proc"].poll() is None:
                p["proc"].kill()
                p["proc"].wait()
            p["err"].close()


def _interrupt_resume_and_compare(tmp_path, corpus, procs):
    deadline = time.time() + 300
    while not all(p.get("sent") for p in procs) and time.time() < deadline:
        now = time.time()
        for p in procs:
            if p["proc"].poll() is not None:
                p["sent"] = True  # it ended (or failed) before its moment: checked below
            if p["when"] is None and _lines(p["run"] / "metrics.jsonl") >= p["lines"]:
                p["when"] = now + p["delay"]
            if p["when"] is not None and not p.get("sent") and now >= p["when"]:
                p["proc"].send_signal(p["sig"])
                p["sent"] = True
        time.sleep(0.002)
    # the uninterrupted references, in this process (no signal reaches it)
    full = {}
    for accum in (1, 2):
        Trainer(config(corpus, *SETS, f"train.grad_accum={accum}"), tmp_path / f"full{accum}",
                progress=False).train()
        full[accum] = _strip(metrics(tmp_path / f"full{accum}"))

    interrupted = 0
    for p in procs:
        rc = p["proc"].wait(timeout=300)
        p["err"].flush()
        err = open(p["err"].name).read()
        what = (f"{signal.Signals(p['sig']).name}, grad_accum={p['accum']}, after "
                f"{p['lines']} lines and {p['delay']:.3f}s")
        assert "Traceback" not in err, (what, err)
        if rc == 0:  # the run ended before the signal came: nothing to resume
            assert _strip(metrics(p["run"])) == full[p["accum"]], what
            continue
        assert rc == 130, (what, rc, err)
        saved = json.loads((p["run"] / "last.json").read_text())["step"]
        assert f"saved step {saved}" in err, (what, err)
        interrupted += saved < STEPS
        assert main(["train", "--out", str(p["run"]), "--resume", "--no-progress"]) == 0
        assert _strip(metrics(p["run"])) == full[p["accum"]], (what, saved)
    assert interrupted >= 2, "the signals should land mid-run"
