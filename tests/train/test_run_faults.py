"""Faults a user meets with a run directory: a full disk, two writers, a run already finished.

- A full disk while a checkpoint, a pointer, metrics.jsonl or the tokenizer is
  written: ``srupp train`` prints one line naming the file and the cause and
  exits 2; no temporary file or folder is left; last.json still names the
  previous checkpoint, and ``--resume`` continues from it to the same losses
  as a run that never failed. Two ways: the writes patched to fail with ENOSPC
  at a random point of a random save (any machine), and a real, small tmpfs
  filled up just before a save (root only; skipped, saying why, elsewhere).
- One writer per run directory: a second ``srupp train`` refuses at once,
  naming the PID of the process that holds ``RUN/.lock``; a holder killed with
  SIGKILL leaves no stale lock.
- ``--resume`` of a run that finished its budget says so, exits 0 and writes
  nothing; with a raised budget it trains on.

The random choices differ from run to run; a failure names them.
"""

import errno
import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from srupp.cli import main
from srupp.errors import UserError
from srupp.train import Trainer
from srupp.train.lock import LOCK_FILE, lock_run_dir

from lm_helpers import TINY, config, metrics, one_line_error

SETS = ["train.max_steps=12", "train.save_every=4", "train.eval_every=4", "train.log_every=2"]
ENOSPC = os.strerror(errno.ENOSPC)  # "No space left on device"
KEYS = ("step", "train_loss", "lr", "valid_loss", "valid_bpc")


def train_args(run, corpus, *extra):
    return ["train", "--out", str(run), "--no-progress", "--set", *TINY,
            f"data.corpus={corpus}", *SETS, *extra]


def train_error(capsys, args):
    """srupp train on ``args`` must exit 2 with one ``srupp: error:`` line (after the line
    that announced the training, if it started), no traceback."""
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if not ln.startswith("srupp: training ")]
    assert len(lines) == 1 and lines[0].startswith("srupp: error: "), err
    assert "Traceback" not in err
    return lines[0]


def losses(run):
    """Steps, losses and learning rates of metrics.jsonl; timings differ between runs."""
    return [{k: r[k] for k in KEYS if k in r} for r in metrics(run)]


def debris(run):
    """Temporary files and folders (".NAME.tmp", ".ckpt-000008.tmp", ...) under ``run``."""
    return sorted(str(p.relative_to(run)) for p in run.rglob("*") if ".tmp" in p.name)


@pytest.fixture
def reference(tmp_path, corpus):
    """The losses of the run that never fails."""
    run = tmp_path / "reference"
    Trainer(config(corpus, *SETS), run, progress=False).train()
    return losses(run)


# ------------------------------------------------------------------ full disk, patched
class FailingFile(io.RawIOBase):
    """A file whose writes stop with ENOSPC after ``limit`` bytes (or characters)."""

    def __init__(self, f, limit):
        self.f, self.left = f, limit

    def writable(self):
        return True

    def write(self, data):
        if len(data) > self.left:
            self.f.write(data[:self.left])
            self.left = 0
            raise OSError(errno.ENOSPC, ENOSPC)  # as write(2) reports it: no file name
        self.left -= len(data)
        return self.f.write(data)

    def flush(self):
        if not self.f.closed:
            self.f.flush()

    def close(self):
        super().close()
        self.f.close()


class Fault:
    """Fails the ``nth`` write whose file name ``matches`` after ``limit`` bytes; once.

    ``before``: last.json's bytes when it struck.
    """

    def __init__(self, run, matches, nth, limit):
        self.run, self.matches, self.nth, self.limit = run, matches, nth, limit
        self.seen, self.before = 0, None

    def strikes(self, name) -> bool:
        if not self.matches(name) or self.seen > self.nth:
            return False
        self.seen += 1
        if self.seen != self.nth:
            return False
        self.seen += 1  # once
        last = self.run / "last.json"
        self.before = last.read_bytes() if last.exists() else None
        return True

    def open(self, file, mode="r", *args, **kwargs):
        f = open(file, mode, *args, **kwargs)
        if ("w" in mode or "a" in mode) and self.strikes(Path(file).name):
            return FailingFile(f, self.limit)
        return f

    def save_file(self, real):
        """A stand-in for safetensors' save_file: part of the file, then its own error."""
        from safetensors import SafetensorError

        def save(tensors, filename, metadata=None):
            if not self.strikes(Path(filename).name):
                return real(tensors, filename, metadata=metadata)
            real(tensors, filename, metadata=metadata)
            data = Path(filename).read_bytes()
            Path(filename).write_bytes(data[:min(self.limit, len(data) - 1)])
            if self.limit % 2:  # as safetensors says it, or as the plain OSError
                raise SafetensorError("Error while serializing: I/O error: No space left on "
                                      "device (os error 28)")
            raise OSError(errno.ENOSPC, ENOSPC)
        return save


# where: (what it patches, which file names, which of their writes may fail, bytes before)
POINTS = {
    # the weights of the checkpoint at step 8 or 12 (one model.safetensors per folder)
    "weights": ("save_file", lambda n: n == ".model.safetensors.tmp", (2, 3), 40000),
    # trainer.pt (the optimiser's state, through torch.save): at step 8, 12, or the
    # final evaluation's (which replaces trainer.pt of the folder of step 12)
    "optimizer": ("files", lambda n: n == ".trainer.pt.tmp", (2, 3, 4), 90000),
    # the tokenizer saved beside the model (the first write is the run directory's copy)
    "tokenizer": ("files", lambda n: n == ".tokenizer.json.tmp", (3, 4), 15),
    # the pointer last.json
    "pointer": ("files", lambda n: n == ".last.json.tmp", (2, 3, 4), 60),
    # a line of metrics.jsonl, after the first checkpoint
    "metrics": ("metrics", lambda n: n == "metrics.jsonl", tuple(range(4, 11)), 40),
}


@pytest.mark.parametrize("point", list(POINTS))
def test_a_full_disk_is_one_line_and_resume_continues(tmp_path, corpus, reference,
                                                      monkeypatch, capsys, point):
    import srupp._files
    import srupp.models.base
    import srupp.train.metrics

    rng = random.Random()
    patch, matches, nths, most = POINTS[point]
    run = tmp_path / "run"
    fault = Fault(run, matches, rng.choice(nths), rng.randrange(most))
    what = f"{point}: write {fault.nth} fails after {fault.limit} bytes"
    if patch == "save_file":
        monkeypatch.setattr(srupp.models.base, "save_file",
                            fault.save_file(srupp.models.base.save_file))
    else:
        module = srupp._files if patch == "files" else srupp.train.metrics
        monkeypatch.setattr(module, "open", fault.open, raising=False)
    capsys.readouterr()

    err = train_error(capsys, train_args(run, corpus))
    assert fault.seen > fault.nth, what  # it struck
    assert ENOSPC in err and str(run) in err, (what, err)
    assert debris(run) == [], what
    last = run / "last.json"
    assert last.read_bytes() == fault.before, what  # still the previous checkpoint
    assert all(json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()), what

    assert main(train_args(run, corpus, "--resume")) == 0, what  # the fault struck once
    assert losses(run) == reference, what


def test_what_a_failed_write_becomes(tmp_path):
    """write_error: the OSError behind torch's and safetensors' errors, naming the file."""
    from safetensors import SafetensorError

    from srupp._files import write_error

    f = tmp_path / "x.pt"
    err = write_error(OSError(errno.ENOSPC, ENOSPC), f)
    assert (err.errno, err.filename) == (errno.ENOSPC, str(f))
    named = OSError(errno.EACCES, "Permission denied", "/elsewhere")
    assert write_error(named, f) is named
    err = write_error(SafetensorError("Error while serializing: I/O error: Disk quota exceeded "
                                      "(os error 122)"), f)
    assert (err.errno, err.filename) == (122, str(f))
    try:  # torch.save's error over the OSError of the write it made
        try:
            raise OSError(errno.ENOSPC, ENOSPC)
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos "
                               "576 vs 534") from None
    except RuntimeError as e:
        err = write_error(e, f)
    assert err.errno == errno.ENOSPC and err.filename == str(f)
    # without one: a full disk by its free space, else EIO with torch's words
    bare = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 5 vs 3")
    err = write_error(bare, f)
    assert err.errno == errno.EIO and "unexpected pos" in err.strerror
    for other in (RuntimeError("CUDA out of memory"), ValueError("bad"), KeyboardInterrupt()):
        assert write_error(other, f) is None


def test_a_full_disk_while_exporting_leaves_no_half_export(tmp_path, monkeypatch, capsys):
    """save_pretrained, the Hugging Face export and the ONNX export: one line, no debris,
    an earlier export kept."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    import srupp.models.base
    import srupp.hf
    from srupp.models import build_model, load_model

    folder = tmp_path / "ckpt"
    build_model(dict(vocab_size=256, d_model=8, num_layers=2, type="sru")).save_pretrained(
        folder)
    (folder / "tokenizer.json").write_text(json.dumps({"type": "byte"}))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    fault = Fault(tmp_path, lambda n: n == ".model.safetensors.tmp", 1, 1001)
    monkeypatch.setattr(srupp.models.base, "save_file",
                        fault.save_file(srupp.models.base.save_file))
    with pytest.raises(OSError) as e:
        load_model(folder).save_pretrained(folder)
    assert e.value.errno == errno.ENOSPC
    assert e.value.filename == str(folder / "model.safetensors")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    monkeypatch.undo()

    hf = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(folder), "--format", "hf", "--out", str(hf)]) == 0
    earlier = {p.name: p.read_bytes() for p in hf.iterdir()}
    capsys.readouterr()

    def full(path, text):
        Path(path).with_name(f".{Path(path).name}.tmp").write_text(text[:5])
        raise OSError(errno.ENOSPC, ENOSPC)  # no file name, as a write reports it

    monkeypatch.setattr(srupp.hf, "atomic_write_text", full)
    err = one_line_error(capsys, ["export", "--checkpoint", str(folder), "--format", "hf",
                                  "--out", str(hf)])
    assert ENOSPC in err and str(hf) in err
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == earlier
    assert debris(tmp_path) == [] and [p.name for p in tmp_path.iterdir()
                                       if p.name.startswith(".")] == []


def test_a_full_disk_while_exporting_onnx(tmp_path, monkeypatch, capsys):
    pytest.importorskip("onnx", reason="onnx is not installed")
    import torch

    from srupp.models import build_model
    from srupp.onnx import MIN_EXPORT_TORCH

    if torch.torch_version.TorchVersion(torch.__version__) < MIN_EXPORT_TORCH:
        pytest.skip(f"ONNX export needs torch >= {MIN_EXPORT_TORCH}")
    folder = tmp_path / "ckpt"
    build_model(dict(vocab_size=256, d_model=8, num_layers=1, type="sru")).save_pretrained(
        folder)
    (folder / "tokenizer.json").write_text(json.dumps({"type": "byte"}))
    real = torch.onnx.ONNXProgram.save

    def save(self, destination, *args, **kwargs):
        real(self, destination, *args, **kwargs)
        data = Path(destination).read_bytes()
        Path(destination).write_bytes(data[:len(data) // 2])
        raise OSError(errno.ENOSPC, ENOSPC)

    monkeypatch.setattr(torch.onnx.ONNXProgram, "save", save)
    out = tmp_path / "onnx"
    err = one_line_error(capsys, ["export", "--checkpoint", str(folder), "--out", str(out)])
    assert ENOSPC in err and str(out / "forward.onnx") in err
    assert list(out.iterdir()) == []


# ---------------------------------------------------------------- full disk, a real one
@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs at tmp_path/disk, when this process may mount one (root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        reason = "a real full disk needs root to mount a tmpfs; the patched writes stand in"
        print(reason)
        pytest.skip(reason)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        reason = f"mount -t tmpfs failed ({res.stderr.strip() or res.returncode})"
        print(reason)
        pytest.skip(reason)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def fill(disk, leave):
    """Take all the space of ``disk`` but ``leave`` bytes; returns the filler file."""
    filler = disk / "filler"
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        os.posix_fallocate(fd, 0, max(1, free - leave))
    finally:
        os.close(fd)
    return filler


def test_a_really_full_disk_is_one_line_and_resume_continues(small_disk, corpus, reference,
                                                             monkeypatch, capsys):
    """The disk fills up just before the checkpoint of step 8: the save fails wherever
    the space ends (weights, state, trainer.pt, a pointer), as on a real machine."""
    import srupp.train.trainer

    rng = random.Random()
    run = small_disk / "run"
    for trial in range(3):
        leave = rng.randrange(150_000)  # less than a checkpoint (~160 kB in 4 kB pages)
        real, calls, state = srupp.train.trainer.save_checkpoint, [], {}

        def save(run_dir, step, *args, **kwargs):
            calls.append(step)
            if len(calls) == 2:  # the disk fills up before the second checkpoint
                state["before"] = (run_dir / "last.json").read_bytes()
                state["filler"] = fill(small_disk, leave)
            return real(run_dir, step, *args, **kwargs)

        monkeypatch.setattr(srupp.train.trainer, "save_checkpoint", save)
        what = f"trial {trial}: {leave} bytes left"
        err = train_error(capsys, train_args(run, corpus))
        assert ENOSPC in err and str(run) in err and "step 8 not saved" in err, (what, err)
        assert "--resume continues from step 4" in err, (what, err)
        assert debris(run) == [], what
        assert (run / "last.json").read_bytes() == state["before"], what
        assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-000004"], what
        state["filler"].unlink()
        monkeypatch.undo()
        assert main(train_args(run, corpus, "--resume")) == 0, what
        assert losses(run) == reference, what
        capsys.readouterr()
        for p in sorted(run.rglob("*"), reverse=True):  # the next trial starts afresh
            p.rmdir() if p.is_dir() else p.unlink()
        run.rmdir()


def test_a_full_disk_at_the_start_leaves_no_half_run(small_disk, corpus, capsys):
    fill(small_disk, 0)
    run = small_disk / "run"
    err = one_line_error(capsys, train_args(run, corpus))
    assert ENOSPC in err and str(run) in err, err
    assert not run.exists() or (debris(run) == [] and not (run / "last.json").exists())


# ------------------------------------------------------------- one writer per run
def hold_lock(run):
    """A helper process that takes ``run``'s lock as srupp train does, and keeps it."""
    code = ("import sys, time; from srupp.train.lock import lock_run_dir; "
            "lock = lock_run_dir(sys.argv[1]); print('locked', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_writer_is_refused_with_the_holders_pid(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert main(train_args(run, corpus)) == 0
    capsys.readouterr()
    holder = hold_lock(run)
    try:
        before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
        for extra in (["--resume"], ["--resume", "--set", "train.max_steps=20"], []):
            err = one_line_error(capsys, train_args(run, corpus, *extra))
            assert f"PID {holder.pid}" in err and str(run / LOCK_FILE) in err, err
        with pytest.raises(UserError, match=f"PID {holder.pid}"):
            Trainer(config(corpus, *SETS, "train.max_steps=20"), run, resume=True,
                    progress=False)
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
        # reading takes no lock
        assert main(["eval", "--checkpoint", str(run)]) == 0
        assert main(["generate", "--checkpoint", str(run), "--prompt", "When",
                     "--max-new-tokens", "3"]) == 0
    finally:
        holder.kill()
        holder.wait()
    # the kernel released the lock of the killed holder: no stale lock
    assert main(train_args(run, corpus, "--resume", "--set", "train.max_steps=16")) == 0
    assert metrics(run)[-1]["step"] == 16


def test_a_killed_srupp_train_leaves_no_stale_lock(tmp_path, corpus):
    """Two real srupp train processes: the second refuses, naming the first's PID; after
    the first is killed with SIGKILL, a third resumes the run to its end."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "srupp.cli", *train_args(run, corpus, "train.max_steps=300")]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.time() + 120
        while not (run / "last.json").exists() and time.time() < deadline:
            assert first.poll() is None, first.stderr.read()
            time.sleep(0.01)
        first.send_signal(signal.SIGSTOP)  # frozen mid-run, holding the lock
        second = subprocess.run([*cmd, "--resume"], capture_output=True, text=True,
                                timeout=120)
        assert second.returncode == 2, second.stderr
        assert second.stderr.count("\n") == 1 and "Traceback" not in second.stderr
        assert f"(PID {first.pid};" in second.stderr, second.stderr
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert (run / LOCK_FILE).read_text().strip() == str(first.pid)  # the file stays, unlocked
    lock_run_dir(run).release()  # free at once: the kernel released the killed one's lock
    saved = json.loads((run / "last.json").read_text())["step"]
    assert 4 <= saved < 300
    assert main(["train", "--out", str(run), "--resume", "--no-progress"]) == 0
    assert json.loads((run / "last.json").read_text())["step"] == 300


def test_one_process_two_trainers(tmp_path, corpus):
    """In one process too: an open trainer holds the run until its train() returns."""
    run = tmp_path / "run"
    first = Trainer(config(corpus, *SETS), run, progress=False)
    with pytest.raises(UserError, match="another trainer in this process"):
        Trainer(config(corpus, *SETS), run, resume=True, progress=False)
    first.train()
    again = Trainer(config(corpus, *SETS, "train.max_steps=16"), run, resume=True,
                    progress=False)
    del again  # dropped without close(): collected when the next one needs the lock
    Trainer(config(corpus, *SETS, "train.max_steps=16"), run, resume=True,
            progress=False).train()
    assert metrics(run)[-1]["step"] == 16


# ----------------------------------------------------------------- a finished run
def snapshot(run):
    """Every file under ``run``: its hash and modification time."""
    return {str(p.relative_to(run)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                      p.stat().st_mtime_ns)
            for p in sorted(run.rglob("*")) if p.is_file()}


def test_resuming_a_finished_run_says_so_and_writes_nothing(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert main(train_args(run, corpus)) == 0
    before = snapshot(run)
    capsys.readouterr()
    time.sleep(0.01)  # a rewrite would show in the times
    assert main(["train", "--out", str(run), "--resume", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert err == (f"srupp: run {run} finished at step 12; raise train.max_steps or "
                   f"train.max_seconds to continue\n") and out == ""
    assert snapshot(run) == before
    # from Python: the summary of its final evaluation, nothing written
    t = Trainer(config(corpus, *SETS), run, resume=True, progress=False)
    summary = t.train()
    assert summary["finished"] and summary["step"] == 12
    assert summary["valid_loss"] == metrics(run)[-1]["valid_loss"]
    assert snapshot(run) == before


def test_a_raised_budget_continues_a_finished_run(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert main(train_args(run, corpus)) == 0
    assert main(train_args(run, corpus, "--resume", "--set", "train.max_steps=20")) == 0
    rows = metrics(run)
    assert [r["step"] for r in rows if "train_loss" in r] == list(range(2, 21, 2))
    assert [r["step"] for r in rows if "valid_loss" in r] == [4, 8, 12, 12, 16, 20, 20]
    assert json.loads((run / "last.json").read_text())["step"] == 20
    # the raised budget is the run's now: a plain --resume has nothing to do
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--no-progress"]) == 0
    assert "finished at step 20" in capsys.readouterr().err


def test_a_raised_time_budget_continues_a_finished_run(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    budget = ["train.max_steps=100000", "train.max_seconds=0.5", "train.calibration_steps=5"]
    assert main(train_args(run, corpus, *budget)) == 0
    first = json.loads((run / "last.json").read_text())["step"]
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--no-progress"]) == 0
    assert f"finished at step {first}" in capsys.readouterr().err
    assert main(["train", "--out", str(run), "--resume", "--no-progress",
                 "--set", "train.max_seconds=1"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] > first and 0.5 < summary["train_seconds"] <= 1.5


def test_a_run_stopped_at_its_last_step_still_gets_its_final_evaluation(tmp_path, corpus,
                                                                        reference):
    """Stopped by a signal after its last step, before the final evaluation: not finished."""
    run = tmp_path / "run"
    t = Trainer(config(corpus, *SETS), run, progress=False)
    original = t._train_step

    def last_step_then_signal(it):
        sums = original(it)
        if t.step == 12:
            signal.raise_signal(signal.SIGINT)
        return sums

    t._train_step = last_step_then_signal
    assert t.train() == {"interrupted": True, "step": 12}
    resumed = Trainer(config(corpus, *SETS), run, resume=True, progress=False)
    assert resumed.finished_at is None
    resumed.train()
    assert losses(run) == reference
