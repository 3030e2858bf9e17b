"""Training on several processes: real torchrun jobs on 127.0.0.1, gloo, tiny shapes.

Each test starts torchrun (``python -m torch.distributed.run``) as a
subprocess, with a time limit: DDP equals one process, ranks agree,
accumulation, exact resume after SIGKILL of the launcher, another world
size, two launchers meeting at a rendezvous, and a rank that dies.
"""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lm_helpers import TEXT, TINY, metrics, one_line_error

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the torchrun tests use /proc and SIGKILL (Linux)")

WORKER = Path(__file__).with_name("torchrun_worker.py")
LIMIT = 120  # seconds any one launch may take
# fp32, no dropout: two ranks must equal one process on the same global batch
EXACT = TINY + ["model.dropout=0", "train.batch_size=4", "train.max_steps=20",
                "train.log_every=2", "train.save_every=10", "train.eval_every=10"]
CLASSIFY = ["task=classify", "model.d_model=16", "model.proj_size=8", "model.num_layers=1",
            "model.dropout=0", "train.max_tokens=64", "train.warmup_steps=3", "train.lr=1e-2",
            "train.log_every=2", "train.save_every=10", "train.eval_every=10",
            "train.max_steps=20", "train.threads=1", "data.test_size=10", "data.valid_size=10",
            "data.text=text", "data.label=label"]


def _env(**extra):
    # one thread per process on this 2-core machine; torchrun warns otherwise
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _torchrun(*args, nproc=2):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "--max-restarts=0", *args]


def _run(cmd, env=None, timeout=LIMIT):
    res = subprocess.run(cmd, env=env or _env(), capture_output=True, text=True,
                         timeout=timeout)
    return res


def _ok(res):
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def _weights(run):
    ckpt = run / json.loads((run / "last.json").read_text())["dir"]
    return load_file(str(ckpt / "model.safetensors"))


def _close(a, b, tol):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=tol), (k, (a[k] - b[k]).abs().max())


def _rows(run, keys):
    return [{k: r[k] for k in keys if k in r} for r in metrics(run)]


def _one_process(run, sets):
    """``srupp train`` in this process: the one-process run that the ranks' runs are held
    to (starting another Python for it would double its time)."""
    from srupp.cli import main

    assert main(["train", "--out", str(run), "--no-progress", "--set", *sets]) == 0


@pytest.fixture(scope="module")
def exact_single(tmp_path_factory, once_per_run):
    """EXACT trained in one process, once per test run (the DDP and FSDP tests both read
    it): the run's folder and its corpus."""
    def train():
        folder = tmp_path_factory.mktemp("exact_single")
        corpus = folder / "corpus.txt"
        corpus.write_text(TEXT * 40)  # as the corpus fixture writes it
        _one_process(folder / "run", EXACT + [f"data.corpus={corpus}"])
        return [str(folder / "run"), str(corpus)]

    run, corpus = once_per_run("exact_single", train)
    return Path(run), Path(corpus)


def _worker(tmp_path, name, sets, env=None, nproc=2):
    out, report = tmp_path / name, tmp_path / f"{name}.json"
    _ok(_run(_torchrun(str(WORKER), str(out), str(report), *sets, nproc=nproc), env=env))
    return out, json.loads(report.read_text())


@pytest.mark.parametrize("shard", ["ddp", "fsdp"])
def test_two_ranks_equal_one_process_and_agree(tmp_path, exact_single, shard):
    single, corpus = exact_single
    ddp, report = _worker(tmp_path, "ddp", EXACT + [f"data.corpus={corpus}",
                                                    f"train.shard={shard}"])
    assert report["world_size"] == 2
    if shard == "ddp":  # replicas: bitwise the same (FSDP ranks hold different shards)
        assert report["ranks_bitwise_equal"]
    _close(_weights(single), _weights(ddp), 1e-6)
    one, two = (_rows(r, ("step", "train_loss", "valid_loss")) for r in (single, ddp))
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for a, b in zip(one, two):
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-7), (a, b)


def test_accumulation_syncing_once_equals_syncing_every_micro_batch(tmp_path, corpus):
    sets = EXACT + [f"data.corpus={corpus}", "train.grad_accum=2", "train.max_steps=8"]
    once, r1 = _worker(tmp_path, "once", sets)
    every, r2 = _worker(tmp_path, "every", sets, env=_env(SRUPP_TEST_SYNC_EVERY_MICROBATCH="1"))
    assert r1["ranks_bitwise_equal"] and r2["ranks_bitwise_equal"]
    _close(_weights(once), _weights(every), 1e-6)
    # rank 0 held the run's lock (srupp.train.lock): its PID is the lock file's
    assert (once / ".lock").read_text().strip() == Path(f"{tmp_path / 'once.json'}.pid0"
                                                        ).read_text()


def test_rank_0_refuses_a_run_another_process_writes(tmp_path, corpus):
    """Under torchrun too, one writer per run: rank 0 takes the lock, and names its holder."""
    run = tmp_path / "run"
    run.mkdir()
    code = ("import sys, time; from srupp.train.lock import lock_run_dir; "
            "lock = lock_run_dir(sys.argv[1]); print('locked', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(run)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        res = _run(_torchrun("-m", "srupp", "train", "--no-progress", "--out", str(run),
                             "--set", *TINY, f"data.corpus={corpus}", "train.batch_size=4"))
    finally:
        holder.kill()
        holder.wait()
    assert res.returncode != 0
    assert f"srupp: error: {run} is in use by another process (PID {holder.pid};" in res.stderr
    assert sorted(p.name for p in run.iterdir()) == [".lock"]  # nothing written


def test_classification_on_two_ranks_equals_one_process(tmp_path):
    rng = random.Random(2)
    words = "house cat dog tree car book table chair window door".split()
    rows = []
    for _ in range(80):
        idx = [rng.randrange(10) for _ in range(rng.randint(2, 6))]
        rows.append(" ".join(words[i] for i in idx) + "\t"
                    + ("animal" if {1, 2} & set(idx) else "thing"))
    data = tmp_path / "texts.tsv"
    data.write_text("text\tlabel\n" + "\n".join(rows) + "\n")
    sets = CLASSIFY + [f"data.corpus={data}"]
    single = tmp_path / "single"
    _one_process(single, sets)
    ddp, report = _worker(tmp_path, "ddp", sets)
    assert report["ranks_bitwise_equal"]
    _close(_weights(single), _weights(ddp), 1e-6)
    keys = ("step", "train_loss", "valid_loss", "valid_accuracy", "valid_macro_f1")
    for a, b in zip(_rows(single, keys), _rows(ddp, keys)):
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (a, b)


def _workers(pid):
    """The pids of srupp processes whose parent is ``pid`` (from /proc)."""
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                # the command may hold spaces and parentheses: the fields follow the last ')'
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                cmdline = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if int(fields[1]) == pid and b"srupp" in cmdline:
                kids.append(int(d.name))
    return kids


def _alive(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("shard", ["ddp", "fsdp"])
def test_sigkill_of_the_launcher_stops_its_workers_and_resume_is_exact(tmp_path, corpus, shard,
                                                                      capsys):
    sets = TINY + [f"data.corpus={corpus}", "train.batch_size=4", "train.max_steps=24",
                   "train.log_every=1", "train.save_every=4", "train.eval_every=8",
                   f"train.shard={shard}"]
    train = ["-m", "srupp", "train", "--no-progress", "--set", *sets]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    _ok(_run(_torchrun(*train, "--out", str(whole))))

    rng = random.Random()
    lines = rng.randint(6, 16)  # a random step past the first checkpoint, then a random moment
    launcher = subprocess.Popen(_torchrun(*train, "--out", str(cut)), env=_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + LIMIT
        while not ((cut / "metrics.jsonl").exists()
                   and (cut / "metrics.jsonl").read_text().count("\n") >= lines):
            assert launcher.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.05))
        workers = _workers(launcher.pid)
        assert len(workers) == 2
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        # the workers must not outlive their launcher
        deadline = time.monotonic() + 10
        while any(_alive(w) for w in workers):
            assert time.monotonic() < deadline, "a worker outlived the SIGKILLed torchrun"
            time.sleep(0.05)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()

    _ok(_run(_torchrun(*train, "--out", str(cut), "--resume")))
    keys = ("step", "train_loss", "lr", "valid_loss")
    assert _rows(cut, keys) == _rows(whole, keys)  # bit for bit
    assert all(torch.equal(a, b) for a, b in zip(_weights(cut).values(),
                                                _weights(whole).values()))

    # another world size (this process, one): one line naming both sizes, exit code 2
    err = one_line_error(capsys, ["train", "--out", str(cut), "--resume", "--no-progress",
                                  "--set", "train.max_steps=30"])
    assert "2 process(es)" in err and "has 1" in err, err


def test_batch_size_must_divide_by_world_size(tmp_path, corpus):
    res = _run(_torchrun("-m", "srupp", "train", "--no-progress", "--out",
                         str(tmp_path / "run"), "--set", *TINY, f"data.corpus={corpus}",
                         "train.batch_size=3"))
    assert res.returncode != 0
    assert "train.batch_size=3 is the global number of streams" in res.stderr
    # one line per rank (the other one says it stopped because rank 0 did); the only
    # traceback is torchrun's own report
    assert "srupp: error: train.batch_size=3 is the global number" in res.stderr
    assert "[rank0]: Traceback" not in res.stderr and "[rank1]: Traceback" not in res.stderr


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launchers_meet_at_a_rendezvous(tmp_path, corpus):
    port, out = _free_port(), tmp_path / "run"
    # bf16 autocast under DDP too (fp32 where the CPU has no bf16: the trainer says so)
    sets = TINY + [f"data.corpus={corpus}", "train.batch_size=4", "train.max_steps=4",
                   "train.log_every=2", "train.save_every=4", "train.eval_every=4",
                   "train.precision=bf16"]
    def launcher():
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=srupp-test",
             "--local-addr=127.0.0.1", "--max-restarts=0", "--rdzv-conf", "join_timeout=60",
             str(WORKER), str(out), str(tmp_path / "report.json"), *sets],
            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    # The second launcher starts once the first hosts the rendezvous store: started
    # together, both may try to host it, and the one that loses can fail to connect.
    nodes = [launcher()]
    deadline = time.monotonic() + LIMIT
    while time.monotonic() < deadline and nodes[0].poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    nodes.append(launcher())
    try:
        errs = [p.communicate(timeout=LIMIT)[1] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in nodes] == [0, 0], errs
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["world_size"] == 2 and report["ranks_bitwise_equal"]
    assert json.loads((out / "last.json").read_text())["step"] == 4
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-000004"]


def test_a_dead_rank_ends_the_job_with_an_error(tmp_path, corpus):
    report = tmp_path / "report.json"
    sets = TINY + [f"data.corpus={corpus}", "train.batch_size=4", "train.max_steps=100000",
                   "train.eval_every=100000", "train.save_every=1000", "train.log_every=1",
                   "train.dist_timeout=30"]
    launcher = subprocess.Popen(_torchrun(str(WORKER), str(tmp_path / "run"), str(report),
                                          *sets),
                                env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + LIMIT
        metrics_file = tmp_path / "run" / "metrics.jsonl"
        while not (metrics_file.exists() and metrics_file.read_text().count("\n") >= 3):
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(int(Path(f"{report}.pid1").read_text()), signal.SIGKILL)
        start = time.monotonic()
        rc = launcher.wait(timeout=60)
        assert rc != 0
        assert time.monotonic() - start < 60
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


# ------------------------------------------------------- the backend, without starting one

def test_nccl_on_cuda_gloo_on_the_cpu():
    from srupp.train.distributed import choose_backend

    assert choose_backend("cuda") == "nccl" and choose_backend("cuda:1") == "nccl"
    assert choose_backend("cpu") == "gloo"
    assert choose_backend("cuda", "gloo") == "gloo" and choose_backend("cpu", "mpi") == "mpi"


@pytest.fixture
def fake_group(monkeypatch):
    """torch.distributed and CUDA as a two-rank torchrun job sees them; records the calls."""
    from srupp.train import distributed as d

    calls, backend = [], []
    for k, v in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: bool(backend))
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda b, **kw: (calls.append(("init", b)), backend.append(b)))
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend[0])
    monkeypatch.setattr(torch.distributed, "new_group",
                        lambda **kw: calls.append(("new_group", kw["backend"])) or "host group")
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda t, group=None: calls.append(("all_reduce", t.device.type, group)))
    return d, calls


def test_cuda_ranks_join_nccl_and_sum_host_numbers_on_the_cpu(fake_group):
    d, calls = fake_group
    dist = d.setup("cuda")
    assert (dist.rank, dist.world_size, dist.local_rank) == (1, 2, 1)
    # each rank on its GPU, NCCL for the tensors, and gloo beside it for the host numbers
    assert calls == [("set_device", 1), ("init", "nccl"), ("new_group", "gloo")]
    calls.clear()
    dist.sum([1.0, 2.0])                     # no copy to the GPU and back: no wait for it
    assert calls == [("all_reduce", "cpu", "host group")]


def test_cpu_ranks_join_gloo_only(fake_group):
    d, calls = fake_group
    dist = d.setup("cpu")
    assert calls == [("init", "gloo")] and dist.host_group is None
    calls.clear()
    dist.sum([1.0])
    dist.sum_on_device(torch.zeros((), dtype=torch.float64))
    assert calls == [("all_reduce", "cpu", None)] * 2
