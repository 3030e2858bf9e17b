"""srupp serve as its clients see it: a real server process on 127.0.0.1, spoken to with
the official openai client and with raw HTTP (httpx).

The checkpoint is a tiny byte-level SRU++ model trained for a moment on a repetitive
ASCII text, so that its greedy text is ASCII (text round trips are exact) and depends on
its context (a session that lost its state gives other text). One server serves the
tests that can share it; the disconnect and overload tests share a one-slot server; the
SIGTERM, restart and kill -9 tests start their own.
"""

import contextlib
import itertools
import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx", reason="srupp serve's tests speak HTTP with httpx")
openai = pytest.importorskip("openai", reason="srupp serve's tests use the openai client")
for _extra in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_extra, reason=f"srupp serve needs {_extra} (pip install 'srupp[serve]')")

from srupp.engine import SessionStore, model_fingerprint  # noqa: E402
from srupp.models import CausalLM, SRUppConfig, load_state, load_state_metadata  # noqa: E402

# the training text: each "the " is followed by a word that only the context before it
# decides (cat, mat, dog, log), so a continuation shows whether the context was kept
TEXT = "the cat sat on the mat and the dog ran to the log. "
# the session rule's prompts: after P1 and its greedy " and ", P2 goes on with "dog ..."
P1, P2 = "the cat sat on the mat", "the "

START_S = 120      # a server's start, at most (a first C++ kernel build included)
REQUEST_S = 30     # one short request, at most
LONG = 10**7       # max_tokens of a request that would run for minutes


# --------------------------------------------------------------------------- the model

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint folder: a byte-level SRU++ model (d_model 16) after 150 Adam steps on
    TEXT repeated (about a second of CPU); its greedy text continues TEXT. Training here
    also builds the C++ kernels (once, if not cached) before any server needs them."""
    folder = tmp_path_factory.mktemp("serve") / "tiny-lm"
    data = torch.tensor(list((TEXT * 8).encode()))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = CausalLM(SRUppConfig(vocab_size=256, d_model=16, proj_size=8, num_layers=2,
                                     dropout=0.0, mem_len=16))
        opt = torch.optim.Adam(model.parameters(), lr=2e-2)
        length = 32
        for _ in range(150):
            starts = torch.randint(0, len(data) - length - 1, (8,)).tolist()
            x = torch.stack([data[i:i + length] for i in starts])           # (8, L)
            y = torch.stack([data[i + 1:i + length + 1] for i in starts])   # (8, L)
            loss = model(x, targets=y).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval().save_pretrained(folder)
    (folder / "tokenizer.json").write_text(json.dumps({"type": "byte"}))
    return folder


# --------------------------------------------------------------------------- servers

class Server:
    """One `srupp serve` process on 127.0.0.1 and a free port; its log is in self.log()."""

    _count = itertools.count()

    def __init__(self, ckpt: Path, folder: Path, *flags: str):
        n = next(Server._count)
        self.out, self.err = folder / f"serve-{n}.out", folder / f"serve-{n}.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "srupp", "serve", "--checkpoint", str(ckpt),
                 "--host", "127.0.0.1", "--port", "0", "--threads", "1", *flags],
                stdout=out, stderr=err)
        try:
            self.info = self._first_line()
            self.url = self.info["url"]
            assert self.url.startswith("http://127.0.0.1:"), self.info
            self._wait_healthy()
            # what "serving normally" means for the tests below: this answer, again
            self.baseline = complete(self, "the cat", 8)
        except BaseException:
            self.stop()
            raise

    def _first_line(self) -> dict:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            text = self.out.read_text()
            if "\n" in text:
                return json.loads(text.splitlines()[0])
            assert self.proc.poll() is None, f"the server exited: {self.log()}"
            time.sleep(0.05)
        raise AssertionError(f"no first line in {START_S} s: {self.log()}")

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited: {self.log()}"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            time.sleep(0.05)
        raise AssertionError(f"/health not 200 in {START_S} s: {self.log()}")

    def serves_normally(self) -> bool:
        return complete(self, "the cat", 8) == self.baseline

    def log(self) -> str:
        return self.err.read_text(errors="replace")[-3000:]

    def stop(self) -> int:
        """SIGTERM, then SIGKILL if it has not exited in 30 s; its exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode


@contextlib.contextmanager
def serving(ckpt, folder, *flags):
    server = Server(ckpt, folder, *flags)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    """The shared server: four slots, sessions kept."""
    folder = tmp_path_factory.mktemp("shared")
    # one token per event (--chunk-ms 0): streaming shows in a short completion
    with serving(ckpt, folder, "--max-streams", "4", "--sessions", str(folder / "sessions"),
                 "--chunk-ms", "0") as s:
        yield s


@pytest.fixture(scope="module")
def one_slot(ckpt, tmp_path_factory):
    """A server with one slot and room for one request waiting, no sessions."""
    with serving(ckpt, tmp_path_factory.mktemp("one-slot"), "--max-streams", "1",
                 "--max-queue", "1") as s:
        yield s


# --------------------------------------------------------------------------- requests

def post(server, body, timeout=REQUEST_S) -> httpx.Response:
    """POST /v1/completions: a dict as JSON, bytes as they are."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + "/v1/completions", content=content, timeout=timeout,
                      headers={"Content-Type": "application/json"})


def complete(server, prompt, max_tokens, **fields) -> str:
    """The greedy completion's text (a 200 is asserted)."""
    r = post(server, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def sse_events(lines):
    """The payloads of server-sent event lines ("data: ..."), in order."""
    return [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]


def metrics(server) -> dict:
    """/metrics as {series (with its labels): value}."""
    r = httpx.get(server.url + "/metrics", timeout=REQUEST_S)
    assert r.status_code == 200, r.text
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


def srupp_generate(ckpt, prompt, max_tokens) -> str:
    """`srupp generate --temperature 0`'s stdout: the prompt, the text, a newline."""
    out = subprocess.run([sys.executable, "-m", "srupp", "generate", "--checkpoint", str(ckpt),
                          "--prompt", prompt, "--temperature", "0",
                          "--max-new-tokens", str(max_tokens)],
                         capture_output=True, text=True, timeout=START_S)
    assert out.returncode == 0, out.stderr
    return out.stdout


# --------------------------------------------------------------------------- the openai client

def test_openai_client_gives_srupp_generates_text(server, ckpt):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=REQUEST_S)
    models = client.models.list().data
    assert [m.id for m in models] == [ckpt.name]
    prompt, n = "the dog", 40
    expected = srupp_generate(ckpt, prompt, n)
    assert expected.isascii() and len(expected) == len(prompt) + n + 1, expected

    done = client.completions.create(model=ckpt.name, prompt=prompt, max_tokens=n,
                                     temperature=0)
    assert prompt + done.choices[0].text + "\n" == expected
    assert done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(prompt), n)

    chunks = list(client.completions.create(model=ckpt.name, prompt=prompt, max_tokens=n,
                                            temperature=0, stream=True))
    assert prompt + "".join(c.choices[0].text for c in chunks) + "\n" == expected
    assert len(chunks) > 2  # streamed as it came, not in one piece
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.completion_tokens, chunks[-1].usage.total_tokens) == (
        n, len(prompt) + n)


def test_raw_stream_ends_with_done(server):
    body = {"prompt": "the log", "max_tokens": 12, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      timeout=REQUEST_S) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        payloads = sse_events(list(r.iter_lines()))
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 12,
                                   "total_tokens": 19}
    assert all("usage" not in c for c in chunks[:-1])
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == complete(server, "the log", 12)


# --------------------------------------------------------------------------- metrics

def test_metrics_count_what_a_request_did(server):
    before = metrics(server)
    for series in ("srupp_active_streams", "srupp_queue_depth", "srupp_state_bytes_per_stream",
                   "srupp_tokens_generated_total", "srupp_time_to_first_token_seconds_count",
                   "srupp_inter_token_latency_seconds_count"):
        assert series in before, sorted(before)
    assert before["srupp_state_bytes_per_stream"] == server.info["state_bytes_per_stream"] > 0
    n = 21
    complete(server, "the mat", n)
    after = metrics(server)
    assert after["srupp_tokens_generated_total"] - before["srupp_tokens_generated_total"] == n
    assert (after["srupp_time_to_first_token_seconds_count"]
            - before["srupp_time_to_first_token_seconds_count"]) == 1
    assert (after["srupp_inter_token_latency_seconds_count"]
            - before["srupp_inter_token_latency_seconds_count"]) == n - 1
    assert after['srupp_time_to_first_token_seconds_bucket{le="+Inf"}'] == \
        after["srupp_time_to_first_token_seconds_count"]
    assert after['srupp_inter_token_latency_seconds_bucket{le="+Inf"}'] == \
        after["srupp_inter_token_latency_seconds_count"]
    assert after["srupp_active_streams"] == after["srupp_queue_depth"] == 0


def test_repeated_histogram_exposes_what_one_observation_at_a_time_would():
    """The inter-token histogram takes a chunk's n equal gaps in one call; its text must be
    prometheus_client.Histogram's after n observations each (values exact in binary, so
    that the sums agree to the bit; the library's extra _created series aside)."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from srupp.serve import _RepeatedHistogram

    buckets = (0.125, 0.25, 0.5, 1.0)
    one, many = CollectorRegistry(), CollectorRegistry()
    plain = Histogram("gap_seconds", "gaps", registry=one, buckets=buckets)
    repeated = _RepeatedHistogram("gap_seconds", "gaps", buckets, many)
    for value, n in [(0.0625, 3), (0.125, 1), (0.25, 2), (0.375, 5), (1.0, 1), (4.0, 2),
                     (0.5, 0)]:
        for _ in range(n):
            plain.observe(value)
        repeated.observe(value, n)
    text = [line for line in generate_latest(one).decode().splitlines()
            if "_created" not in line]
    assert generate_latest(many).decode().splitlines() == text
    assert 'gap_seconds_bucket{le="0.125"} 4.0' in text  # le: value <= bound counts


# --------------------------------------------------------------------------- bad requests

BAD = [  # (body, status, the field its error names (None: the body), words of the message)
    (b'{"prompt": "a", ', 400, None, "JSON"),
    (b'["a"]', 400, None, "object"),
    (b'"a"', 400, None, "object"),
    (b'{"prompt": "\xff\xfe"}', 400, None, "UTF-8"),
    (b'{"prompt": 5}', 400, "prompt", "prompt"),
    (b'{"prompt": ""}', 400, "prompt", "empty"),
    (b'{"prompt": "a", "max_tokens": "5"}', 400, "max_tokens", "max_tokens"),
    (b'{"prompt": "a", "max_tokens": -1}', 400, "max_tokens", "max_tokens"),
    (b'{"prompt": "a", "max_tokens": 2.5}', 400, "max_tokens", "max_tokens"),
    (b'{"prompt": "a", "stream": "yes"}', 400, "stream", "stream"),
    (b'{"prompt": "a", "temperature": Infinity}', 400, "temperature", "temperature"),
    (b'{"prompt": "a", "temperature": NaN}', 400, "temperature", "temperature"),
    (b'{"prompt": "a", "temperature": 1e999}', 400, "temperature", "temperature"),
    (b'{"prompt": "a", "temperature": 1' + b"0" * 400 + b"}", 400, "temperature",
     "temperature"),
    (b'{"prompt": "a", "temperature": -1}', 400, "temperature", "temperature"),
    (b'{"prompt": "a", "top_p": 0}', 400, "top_p", "top_p"),
    (b'{"prompt": "a", "top_p": 2}', 400, "top_p", "top_p"),
    (b'{"prompt": "a", "top_p": 1' + b"0" * 400 + b"}", 400, "top_p", "top_p"),
    (b'{"prompt": "a", "top_k": 0}', 400, "top_k", "top_k"),
    (b'{"prompt": "a", "seed": -1}', 400, "seed", "seed"),
    (b'{"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}', 400, "stop", "stop"),
    (b'{"prompt": "a", "stop": [""]}', 400, "stop", "stop"),
    (b'{"prompt": "a", "stop": ""}', 400, "stop", "stop"),
    (b'{"prompt": "a", "stop": 3}', 400, "stop", "stop"),
    (b'{"prompt": "a", "n": 2}', 400, "n", "n must be 1"),
    (b'{"prompt": "a", "session": 7}', 400, "session", "session"),
    (b'{"prompt": "a", "session": "no/slash"}', 400, "session", "session"),
    (b'{"prompt": "a", "session": ".hidden"}', 400, "session", "session"),
    (b'{"prompt": "a", "model": "another-model"}', 404, "model", "another-model"),
    (json.dumps({"prompt": "a" * 65537}).encode(), 413, "prompt", "65536"),
]


@pytest.mark.parametrize("body,status,field,words", BAD,
                         ids=[f"{i}-{b[:40]!r}" for i, (b, *_) in enumerate(BAD)])
def test_bad_request_names_its_field_and_the_server_goes_on(server, body, status, field,
                                                            words):
    r = post(server, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == field, error
    assert words in error["message"], error
    assert error["type"] == ("not_found" if status == 404 else "invalid_request_error")
    assert server.serves_normally()  # still up, and still right


# --------------------------------------------------------------------------- sessions

def test_session_continues_as_its_whole_text_would(server):
    o1 = complete(server, P1, 5, session="rule")
    o2 = complete(server, P2, 16, session="rule")
    assert o1.isascii() and o2.isascii(), (o1, o2)
    assert complete(server, P1 + o1 + P2, 16) == o2
    # the test's power: without the session's context the text differs
    assert complete(server, P2, 16) != o2


def test_delete_session(server):
    o1 = complete(server, P1, 5, session="gone")
    r = httpx.delete(server.url + "/v1/sessions/gone", timeout=REQUEST_S)
    assert r.status_code == 200 and r.json()["deleted"] is True, r.text
    r = httpx.delete(server.url + "/v1/sessions/gone", timeout=REQUEST_S)
    assert r.status_code == 404 and r.json()["error"]["param"] == "session", r.text
    # a new session of that name starts from nothing, not from P1 + o1
    assert complete(server, P2, 16, session="gone") == complete(server, P2, 16)
    assert complete(server, P2, 16) != complete(server, P1 + o1 + P2, 16)
    r = httpx.delete(server.url + "/v1/sessions/bad!id", timeout=REQUEST_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "session", r.text


def test_session_file_of_another_kind_is_refused(server):
    folder = Path(server.info["sessions"])
    (folder / "damaged.safetensors").write_bytes(b"not a state file")
    r = post(server, {"prompt": "a", "session": "damaged", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "session", r.text
    assert server.serves_normally()  # the engine is still running


def test_sessions_need_a_sessions_folder(one_slot):
    r = post(one_slot, {"prompt": "a", "session": "s", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "session", r.text
    assert "--sessions" in r.json()["error"]["message"]


def test_session_continues_the_same_after_a_restart(ckpt, tmp_path):
    sessions = tmp_path / "sessions"
    with serving(ckpt, tmp_path, "--sessions", str(sessions)) as first:
        o1a = complete(first, P1, 5, session="a")
        assert complete(first, P1, 5, session="b") == o1a
        oa = complete(first, P2, 16, session="a")
        assert first.stop() == 0, first.log()
    assert sorted(p.name for p in sessions.iterdir()) == ["a.safetensors", "b.safetensors"]
    with serving(ckpt, tmp_path, "--sessions", str(sessions)) as second:
        assert complete(second, P2, 16, session="b") == oa
        assert complete(second, P2, 16) != oa  # the test's power: b's state was used


def test_kill_9_leaves_only_whole_session_files(ckpt, tmp_path):
    sessions = tmp_path / "sessions"
    with serving(ckpt, tmp_path, "--sessions", str(sessions), "--max-streams", "4") as s:
        done, stop = [], threading.Event()

        def talk(i):  # session requests back to back: a file written after each
            with httpx.Client(timeout=REQUEST_S) as c:
                while not stop.is_set():
                    with contextlib.suppress(httpx.TransportError):
                        body = {"prompt": "the ", "max_tokens": 2, "session": f"s{i}"}
                        if c.post(s.url + "/v1/completions", json=body).status_code == 200:
                            done.append(i)

        threads = [threading.Thread(target=talk, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: len(done) >= 20, 60, "20 session requests")
            s.proc.kill()
            s.proc.wait(30)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
    files = sorted(p.name for p in sessions.iterdir() if not p.name.startswith("."))
    assert files and set(files) <= {"s0.safetensors", "s1.safetensors", "s2.safetensors"}
    from srupp.inference import load_run, weights_for_decoding

    model = load_run(ckpt).model
    weights_for_decoding(model, "fp32")
    store = SessionStore(sessions, model_id=model_fingerprint(model))
    for name in files:
        assert load_state_metadata(sessions / name)["session.id"] == name[:-len(".safetensors")]
        load_state(sessions / name)
        session = store.get(name[:-len(".safetensors")])
        assert session.tokens >= 4 and session.state.batch_size == 1
    # what a kill during a write leaves is a dot file, which the store removes on opening
    assert all(not p.name.startswith(".") for p in sessions.iterdir())


# --------------------------------------------------------------------------- slots and queue

def test_client_gone_mid_stream_frees_its_slot(one_slot):
    body = {"prompt": "the", "max_tokens": LONG, "temperature": 0, "stream": True}
    with httpx.Client(timeout=REQUEST_S) as c:
        with c.stream("POST", one_slot.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # (a generator dropped would close the connection)
            first = next(ln for ln in lines if ln.startswith("data: "))
            assert json.loads(first[len("data: "):])["choices"][0]["text"]
            assert metrics(one_slot)["srupp_active_streams"] == 1
    # the connection is closed: the stream ends, its one slot is free
    wait_for(lambda: metrics(one_slot)["srupp_active_streams"] == 0, 10,
             "srupp_active_streams back to 0")
    assert one_slot.serves_normally()


def test_client_gone_before_a_completion_frees_its_slot(one_slot):
    with pytest.raises(httpx.ReadTimeout):
        post(one_slot, {"prompt": "the", "max_tokens": LONG}, timeout=0.5)
    wait_for(lambda: metrics(one_slot)["srupp_active_streams"] == 0, 10,
             "srupp_active_streams back to 0")
    assert one_slot.serves_normally()


def test_overload_gets_429_and_nothing_hangs(one_slot):
    url = one_slot.url + "/v1/completions"
    body = {"prompt": "the", "max_tokens": LONG, "stream": True}
    release = threading.Event()

    def hold():
        """Send a long request; its status and Retry-After; keep it open until released."""
        with httpx.Client(timeout=REQUEST_S) as c, c.stream("POST", url, json=body) as r:
            out = (r.status_code, r.headers.get("retry-after"), None)
            if r.status_code != 200:
                r.read()
                out = out[:2] + (r.json()["error"],)
            assert release.wait(REQUEST_S)
            return out

    with ThreadPoolExecutor(6) as pool:
        try:
            first = pool.submit(hold)  # takes the slot
            wait_for(lambda: metrics(one_slot)["srupp_active_streams"] == 1, 10,
                     "the first stream")
            rest = [pool.submit(hold) for _ in range(5)]  # at once: one waits, four 429
            wait_for(lambda: metrics(one_slot)["srupp_queue_depth"] == 1, 10, "one queued")
            time.sleep(0.5)  # the refusals come at once; give them a moment, no more
        finally:
            release.set()
        results = [f.result(timeout=REQUEST_S) for f in [first] + rest]
    statuses = sorted(status for status, _, _ in results)
    assert statuses == [200, 200, 429, 429, 429, 429], results
    for status, retry_after, error in results:
        if status == 429:
            assert int(retry_after) >= 1 and error["type"] == "rate_limit_exceeded", error
    wait_for(lambda: metrics(one_slot)["srupp_active_streams"] == 0 and
             metrics(one_slot)["srupp_queue_depth"] == 0, 10, "slot and queue empty")
    assert one_slot.serves_normally()


# --------------------------------------------------------------------------- shutdown

def test_sigterm_drains_streams_saves_sessions_and_exits_0(ckpt, tmp_path):
    sessions = tmp_path / "sessions"
    grace = 2.0
    with serving(ckpt, tmp_path, "--grace", str(grace), "--sessions", str(sessions)) as s:
        lines, started = [], threading.Event()

        def long_stream():
            body = {"prompt": "the", "max_tokens": LONG, "stream": True, "session": "inflight"}
            with httpx.stream("POST", s.url + "/v1/completions", json=body,
                              timeout=grace + REQUEST_S) as r:
                for ln in r.iter_lines():
                    lines.append(ln)
                    started.set()

        reader = threading.Thread(target=long_stream)
        reader.start()
        assert started.wait(REQUEST_S), s.log()
        s.proc.send_signal(signal.SIGTERM)
        # draining: refused at once while the stream in flight goes on
        wait_for(lambda: httpx.get(s.url + "/health", timeout=5).status_code == 503, grace,
                 "/health 503 after SIGTERM")
        r = post(s, {"prompt": "the", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert s.proc.wait(grace + 20) == 0, s.log()  # within the grace and a margin
        reader.join(REQUEST_S)
        assert not reader.is_alive()
    payloads = sse_events(lines)
    assert payloads[-1] == "[DONE]", payloads[-3:]
    last = json.loads(payloads[-2])
    assert last["choices"][0]["finish_reason"] == "abort", last  # LONG outlasts the grace
    assert all(json.loads(p)["choices"][0]["finish_reason"] is None for p in payloads[:-2])
    kept = load_state_metadata(sessions / "inflight.safetensors")
    assert int(kept["session.tokens"]) == last["usage"]["total_tokens"]
