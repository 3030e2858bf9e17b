"""SessionStore: memory and disk round trips, LRU eviction, ids, model fingerprints,
and files that survive a SIGKILL at any moment of a write."""

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from srupp.engine.sessions import Session, SessionStore
from srupp.models import TensorState
from srupp.nn import SRUppState


def srupp_state(seed=0) -> SRUppState:
    g = torch.Generator().manual_seed(seed)
    return SRUppState(c=torch.randn(2, 1, 4, generator=g),  # (layers, B, D)
                      memory=[torch.randn(1, 3, 4, generator=g), None],  # (B, M, n_in)
                      memory_mask_pad=torch.tensor([[True, False, False]]),
                      mem_len=8)


def tensor_state(seed=0) -> TensorState:
    g = torch.Generator().manual_seed(seed)
    return TensorState({"h": torch.randn(2, 1, 5, generator=g).to(torch.bfloat16),
                        "pos": torch.tensor([3, 1, 4])},
                       {"h": 1, "pos": None})


def session(state, pending=7, tokens=12, model_id="m1", updated=1717171717.123456789 / 3):
    return Session(state, pending=pending, tokens=tokens, model_id=model_id, updated=updated)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(a: Session, b: Session):
    """Same class, same tensors bit for bit (dtype, shape, bytes), same scalars."""
    assert type(a.state) is type(b.state)
    da, db = a.state.to_dict(), b.state.to_dict()
    assert da.keys() == db.keys()
    for k in da:
        assert da[k].dtype == db[k].dtype and da[k].shape == db[k].shape, k
        assert torch.equal(bits(da[k]), bits(db[k])), k
    assert (a.pending, a.tokens, a.model_id, a.updated) == (b.pending, b.tokens, b.model_id,
                                                            b.updated)


# ------------------------------------------------------------------ round trips
def test_round_trip_in_memory_and_after_a_restart(tmp_path):
    a, b = session(srupp_state(1)), session(tensor_state(2), pending=0, tokens=1)
    store = SessionStore(tmp_path, model_id="m1")
    store.put("a", a)
    store.put("conv-2_b.x", b)
    assert store.get("a") is a and store.get("conv-2_b.x") is b
    assert store.ids() == ["a", "conv-2_b.x"] and len(store) == 2 and "a" in store
    # write-back: nothing is on disk until saved
    assert sorted(os.listdir(tmp_path)) == []
    assert SessionStore(tmp_path, model_id="m1").get("a") is None
    assert store.save("a") is True and store.save("a") is False  # clean now
    assert store.save_all() == 1 and store.save_all() == 0
    assert sorted(os.listdir(tmp_path)) == ["a.safetensors", "conv-2_b.x.safetensors"]

    restarted = SessionStore(tmp_path, model_id="m1")
    assert restarted.ids() == ["a", "conv-2_b.x"] and len(restarted) == 2
    assert "a" in restarted and "c" not in restarted
    for sid, original in (("a", a), ("conv-2_b.x", b)):
        loaded = restarted.get(sid)
        assert loaded is not original
        assert_same(loaded, original)
        assert restarted.get(sid) is loaded  # cached in memory after the first read
    assert restarted.get("unknown") is None


def test_put_persist_writes_at_once_and_a_later_put_replaces_the_file(tmp_path):
    store = SessionStore(tmp_path, model_id="m1")
    store.put("a", session(srupp_state(1)), persist=True)
    newer = session(tensor_state(5), pending=3, tokens=40, updated=time.time())
    store.put("a", newer, persist=True)
    assert store.save_all() == 0
    assert_same(SessionStore(tmp_path, model_id="m1").get("a"), newer)


# ------------------------------------------------------------------ eviction
def test_least_recently_used_is_evicted_and_without_a_directory_is_gone():
    store = SessionStore(None, capacity=2, model_id="m1")
    assert not store.persistent
    store.put("a", session(srupp_state(1)))
    store.put("b", session(srupp_state(2)))
    store.get("a")  # a is now the most recently used
    store.put("c", session(srupp_state(3)), persist=True)  # persist: nowhere to write
    assert store.ids() == ["a", "c"] and store.get("b") is None and "b" not in store
    store.put("a", session(srupp_state(4)))  # replacing counts as a use
    store.put("d", session(srupp_state(5)))
    assert store.ids() == ["a", "d"]
    assert store.save_all() == 0


def test_eviction_with_a_directory_writes_dirty_sessions_first(tmp_path):
    store = SessionStore(tmp_path, capacity=2, model_id="m1")
    sessions = {sid: session(srupp_state(i), tokens=i) for i, sid in enumerate("abc")}
    for sid, s in sessions.items():
        store.put(sid, s)  # never saved: a's eviction writes it
    assert sorted(os.listdir(tmp_path)) == ["a.safetensors"]
    assert store.ids() == ["a", "b", "c"] and len(store) == 3
    loaded = store.get("a")  # from disk; evicts b, which is written too
    assert_same(loaded, sessions["a"])
    assert sorted(os.listdir(tmp_path)) == ["a.safetensors", "b.safetensors"]
    assert store.get("c") is sessions["c"]  # never left memory; now the most recent
    assert_same(store.get("b"), sessions["b"])  # evicts a, clean: not written again
    assert store.save_all() == 1  # c, the only dirty one
    assert sorted(os.listdir(tmp_path)) == [f"{s}.safetensors" for s in "abc"]


def test_delete_from_memory_and_disk(tmp_path):
    store = SessionStore(tmp_path, capacity=1, model_id="m1")
    store.put("a", session(srupp_state(1)), persist=True)
    store.put("b", session(srupp_state(2)))  # a: on disk only now
    store.put("c", session(srupp_state(3)), persist=True)  # b: evicted, written
    assert store.delete("a") is True and store.delete("a") is False
    assert store.delete("c") is True  # in memory and on disk
    assert store.ids() == ["b"] and store.get("a") is None and store.get("c") is None
    assert SessionStore(tmp_path, model_id="m1").ids() == ["b"]
    assert store.delete("never") is False
    memory_only = SessionStore(None, model_id="m1")
    memory_only.put("a", session(srupp_state(1)))
    assert memory_only.delete("a") is True and len(memory_only) == 0


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("bad", ["", "../x", "..", ".", ".hidden", "a/b", "a\\b", "x" * 129,
                                 "a b", "caf\u00e9", "a\x00b", None, 3])
def test_bad_session_ids_are_refused(tmp_path, bad):
    store = SessionStore(tmp_path, model_id="m1")
    s = session(srupp_state())
    for call in (lambda: store.get(bad), lambda: store.put(bad, s), lambda: store.delete(bad),
                 lambda: store.save(bad)):
        with pytest.raises(ValueError, match="session id"):
            call()
    assert bad not in store
    assert os.listdir(tmp_path) == [] and not (tmp_path.parent / "x.safetensors").exists()


def test_the_longest_id_and_every_allowed_character_work(tmp_path):
    store = SessionStore(tmp_path, model_id="m1")
    for sid in ("x" * 128, "AZaz09._-", "-", "a..b"):
        store.put(sid, session(srupp_state()), persist=True)
    assert SessionStore(tmp_path, model_id="m1").ids() == sorted(
        ["x" * 128, "AZaz09._-", "-", "a..b"])


def test_a_session_of_another_model_is_refused_by_name(tmp_path):
    SessionStore(tmp_path, model_id="model-A").put("chat1", session(srupp_state(),
                                                                    model_id="model-A"),
                                                   persist=True)
    other = SessionStore(tmp_path, model_id="model-B")
    assert "chat1" in other
    with pytest.raises(ValueError, match=r"'chat1'.*'model-A'.*'model-B'"):
        other.get("chat1")
    with pytest.raises(ValueError, match=r"'chat2'.*'model-A'.*'model-B'"):
        other.put("chat2", session(srupp_state(), model_id="model-A"))
    assert other.ids() == ["chat1"]


def test_bad_sessions_and_settings():
    with pytest.raises(ValueError, match="batch size 1"):
        Session(srupp_state().index_select(torch.tensor([0, 0])), 1, 2, "m1")
    with pytest.raises(ValueError, match="pending"):
        Session(srupp_state(), -1, 2, "m1")
    with pytest.raises(TypeError, match="SRUppState or a TensorState"):
        Session({"c": torch.zeros(1)}, 1, 2, "m1")
    with pytest.raises(ValueError, match="capacity"):
        SessionStore(None, capacity=0, model_id="m1")
    with pytest.raises(ValueError, match="model_id"):
        SessionStore(None, model_id="")


def test_temporary_files_are_never_sessions_and_are_removed_on_open(tmp_path):
    store = SessionStore(tmp_path, model_id="m1")
    store.put("a", session(srupp_state()), persist=True)
    blob = (tmp_path / "a.safetensors").read_bytes()
    # what a kill during a write leaves: atomic_path's dot-file beside the target, or
    # the one safetensors writes before renaming it to that
    (tmp_path / ".a.safetensors.tmp").write_bytes(blob[:len(blob) // 2])
    (tmp_path / ".tmpW9WSZb").write_bytes(blob[:10])
    (tmp_path / ".b.safetensors.tmp").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("not a session")
    assert store.ids() == ["a"] and ".b" not in store
    assert SessionStore(tmp_path, model_id="m1").ids() == ["a"]
    assert sorted(os.listdir(tmp_path)) == ["a.safetensors", "notes.txt"]


def test_threads_sharing_a_store(tmp_path):
    # the server's engine thread and its request handlers call one store at once
    store = SessionStore(tmp_path, capacity=2, model_id="m1")
    errors = []

    def work(seed):
        rng = random.Random(seed)
        try:
            for i in range(40):
                sid = f"s{rng.randrange(4)}"
                op = rng.randrange(4)
                if op == 0:
                    store.put(sid, session(srupp_state(i), tokens=i), persist=rng.random() < 0.5)
                elif op == 1:
                    store.get(sid)
                elif op == 2:
                    store.save_all()
                else:
                    store.delete(sid) if rng.random() < 0.2 else store.ids()
        except BaseException as e:  # reported below: a thread's exception is otherwise lost
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    store.save_all()
    restarted = SessionStore(tmp_path, model_id="m1")
    assert restarted.ids() == store.ids()
    for sid in restarted.ids():
        assert_same(restarted.get(sid), store.get(sid))


# ------------------------------------------------------------------ SIGKILL mid-write
# One process imports srupp once, then forks a writer per round; the test kills each
# writer with SIGKILL at a random moment. A writer saves three sessions in turn, each
# state filled with its token count, so a file mixing two writes would show.
ZYGOTE = r"""
import os, sys, traceback
import torch
from srupp.engine.sessions import Session, SessionStore
from srupp.models import TensorState
from srupp.nn import SRUppState

directory, M = sys.argv[1], int(sys.argv[2])

def write_forever():
    store = SessionStore(directory, capacity=2, model_id="m")
    n = 0
    while True:
        n += 1
        fill = float(n)
        if n % 3 == 1:
            state = TensorState({"h": torch.full((1, M, 64), fill), "n": torch.tensor(n)},
                                {"h": 0, "n": None})
        else:
            state = SRUppState(c=torch.full((2, 1, 4), fill),
                               memory=[torch.full((1, M, 64), fill), None])
        store.put(f"s{n % 3}", Session(state, pending=n % 50, tokens=n, model_id="m"),
                  persist=True)
        if n == 1:
            print("writing", os.getpid(), flush=True)

for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        try:
            write_forever()
        except BaseException:
            traceback.print_exc()
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    print("status", os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1, flush=True)
"""


def test_sigkill_during_writes_leaves_only_whole_sessions(tmp_path):
    rng = random.Random(1234)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    zygote = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(tmp_path), "2048"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=env)
    lines: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in zygote.stdout], daemon=True).start()

    def line() -> str:
        try:
            return lines.get(timeout=60)
        except queue.Empty:
            pytest.fail(f"the writer process said nothing for 60 s (exit code {zygote.poll()})")

    left_temporary = 0
    try:
        for _ in range(6):
            zygote.stdin.write("go\n")
            zygote.stdin.flush()
            word, pid = line().split()
            assert word == "writing"
            time.sleep(rng.uniform(0.0, 0.15))
            os.kill(int(pid), signal.SIGKILL)
            assert line().split() == ["status", str(int(signal.SIGKILL))]  # killed, not failed

            names = set(os.listdir(tmp_path))
            left_temporary += any(n.endswith(".tmp") for n in names)
            sessions = sorted(n[:-len(".safetensors")] for n in names
                              if n.endswith(".safetensors") and not n.startswith("."))
            store = SessionStore(tmp_path, model_id="m")
            assert store.ids() == sessions and set(sessions) <= {"s0", "s1", "s2"}
            assert sorted(os.listdir(tmp_path)) == [f"{s}.safetensors" for s in sessions]
            for sid in sessions:
                s = store.get(sid)  # loads: no file is cut short
                n = s.tokens
                assert sid == f"s{n % 3}" and s.pending == n % 50
                assert all(bool((t == n).all()) for t in s.state.to_dict().values()
                           if t.is_floating_point()), f"{sid} mixes two writes"
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=30)
    # not asserted (the moment is random): how often a kill caught a write half done
    print(f"{left_temporary} of 6 kills left a temporary file")
