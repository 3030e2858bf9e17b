"""``srupp serve``: a language model behind an OpenAI-compatible HTTP API.

    POST   /v1/completions        OpenAI's completions (``stream`` as server-sent events),
                                  plus ``top_k`` and ``session``
    GET    /v1/models             the one model served
    DELETE /v1/sessions/{id}      forget a session
    GET    /health                200 once the model is loaded (503 while shutting down)
    GET    /metrics               Prometheus text

One :class:`~srupp.engine.Engine` runs on its own thread and decodes every stream in
one batched step, in chunks of about ``chunk_ms`` milliseconds; request handlers submit
streams to it and relay their events (a stream's chunk is one server-sent event).
FastAPI, uvicorn and prometheus_client come with ``pip install 'srupp[serve]'`` and
are imported when a server is made, not with srupp.

Shutdown (SIGTERM or Ctrl-C): new requests get 503 at once; streams in flight go on
for up to ``grace`` seconds and the rest end with finish_reason "abort"; every session
is saved; the process exits 0.
"""


import asyncio
import bisect
import contextlib
import gc
import itertools
import json
import math
import signal
import socket
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Dict, Optional

from ._extras import require
from .engine import (Engine, EngineClosed, QueueFull, Sampling, SessionBusy,
                     SessionStore, check_session_id, model_fingerprint)

#: OpenAI allows at most this many stop strings.
MAX_STOPS = 4

#: Seconds a client is told to wait after a 429.
RETRY_AFTER_S = 1


class BadRequest(ValueError):
    """A request the server refuses: its HTTP status and a message naming the field."""

    def __init__(self, message: str, status: int = 400, field: Optional[str] = None):
        super().__init__(message)
        self.status, self.field = status, field


def _error(status: int, message: str, kind: str, field: Optional[str] = None,
           headers: Optional[dict] = None):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": field,
                                   "code": None}}, status_code=status, headers=headers)


# --------------------------------------------------------------------------- requests

def _field(body: dict, name: str, kinds: tuple, default: Any, what: str) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise BadRequest(f"{name} must be {what}, got {type(value).__name__}", field=name)
    return value


def parse_completion(body: Any, tokenizer, engine: Engine) -> Dict[str, Any]:
    """The fields of a completions request, checked; a :class:`BadRequest` names the field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # OpenAI's batch form with one prompt
    if not isinstance(prompt, str):
        raise BadRequest("prompt must be a string (one prompt per request)", field="prompt")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise BadRequest("n must be 1: send one request per completion", field="n")
    max_tokens = _field(body, "max_tokens", (int,), 16, "an integer >= 0")
    temperature = _field(body, "temperature", (int, float), 1.0, "a number")
    top_p = _field(body, "top_p", (int, float), None, "a number in (0, 1]")
    top_k = _field(body, "top_k", (int,), None, "an integer >= 1")
    seed = _field(body, "seed", (int,), None, "an integer")
    stream = _field(body, "stream", (bool,), False, "true or false")
    session = _field(body, "session", (str,), None, "a string")
    if session is not None:
        try:
            check_session_id(session)
        except ValueError as e:
            raise BadRequest(str(e), field="session") from None
    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOPS:
        raise BadRequest(f"stop takes at most {MAX_STOPS} strings", field="stop")
    # JSON's Infinity, NaN and 1e999 parse as floats; an integer may be too large for one
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        try:
            finite = value is None or math.isfinite(float(value))
        except OverflowError:
            finite = False
        if not finite:
            raise BadRequest(f"{name} must be a finite number", field=name)
    try:
        sampling = Sampling(max_tokens=max_tokens, temperature=float(temperature),
                            top_k=top_k, top_p=None if top_p is None else float(top_p),
                            seed=seed, stop=stop if stop is not None else ())
    except (ValueError, TypeError) as e:
        message = str(e)
        field = next((f for f in ("max_tokens", "temperature", "top_k", "top_p", "seed",
                                  "stop") if message.startswith(f) or f in message), None)
        raise BadRequest(message, field=field) from None
    try:
        ids = tokenizer.encode(prompt).tolist() if prompt else []
    except ValueError as e:
        raise BadRequest(f"prompt: {e}", field="prompt") from None
    if len(ids) > engine.max_prompt_tokens:
        raise BadRequest(f"prompt is {len(ids)} tokens, more than the limit of "
                         f"{engine.max_prompt_tokens}", status=413, field="prompt")
    if not ids and session is None:
        raise BadRequest("prompt is empty: give at least one character", field="prompt")
    return dict(ids=ids, sampling=sampling, stream=stream, session=session,
                model=body.get("model"))


# --------------------------------------------------------------------------- the app

def _chunk_frame(empty: dict):
    """An SSE event of ``empty`` (a chunk whose text is "") as the text before and after
    the text's JSON string, so that each piece costs one ``json.dumps`` of its text."""
    marker = "\u0000srupp-text\u0000"
    frame = f"data: {json.dumps({**empty, 'choices': [{**empty['choices'][0], 'text': marker}]})}\n\n"
    head, tail = frame.split(json.dumps(marker))
    return head, tail


class _Relay:
    """Events from the engine's thread to the requests' queues on the event loop: one
    wake-up of the loop per batch of events (an engine step's), not one per event."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self._lock = loop, threading.Lock()
        self._pending: list = []

    def send(self, queue: asyncio.Queue, event) -> None:
        with self._lock:
            self._pending.append((queue, event))
            first = len(self._pending) == 1
        if first:
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for queue, event in batch:
            queue.put_nowait(event)


class _RepeatedHistogram:
    """A Prometheus histogram that takes n equal observations in one call: a chunk brings
    each stream its tokens at once, and one ``Histogram.observe`` per token (640 a chunk at
    32 streams) took 2-3% of the engine's thread. A custom collector, so that its series
    are those of ``prometheus_client.Histogram`` (``_bucket``, ``_count``, ``_sum``)."""

    def __init__(self, name: str, documentation: str, buckets, registry):
        self.name, self.documentation = name, documentation
        self.bounds = [float(b) for b in buckets] + [float("inf")]
        self.counts = [0] * len(self.bounds)
        self.total = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float, n: int = 1) -> None:
        i = bisect.bisect_left(self.bounds, value)  # the first bucket with value <= le
        with self._lock:
            self.counts[i] += n
            self.total += value * n

    def collect(self):
        from prometheus_client.core import HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        with self._lock:
            counts, total = list(self.counts), self.total
        cumulative = list(itertools.accumulate(counts))
        yield HistogramMetricFamily(
            self.name, self.documentation, sum_value=total,
            buckets=[(floatToGoString(b), c) for b, c in zip(self.bounds, cumulative)])


class Server:
    """The engine, its thread, its metrics and the HTTP app around them."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, *, grace: float = 30.0):
        require("fastapi", "serve", "srupp serve")
        require("prometheus_client", "serve", "srupp serve")
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.grace = grace
        self.created = int(time.time())
        self.draining = False
        self.failed = False
        self._stop = threading.Event()
        self._relay: Optional[_Relay] = None
        self._thread: Optional[threading.Thread] = None
        self._metrics()
        self.app = self._app()

    def relay(self, loop: asyncio.AbstractEventLoop) -> "_Relay":
        """The relay of engine events into ``loop`` (one per loop)."""
        if self._relay is None or self._relay.loop is not loop:
            self._relay = _Relay(loop)
        return self._relay

    # -------------------------------------------------------------- engine thread
    def start(self) -> None:
        """Run the engine on a thread of its own (for embedding the app in another server;
        ``srupp serve`` runs it on the main thread: see :func:`serve`)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="srupp-engine", daemon=True)
            self._thread.start()

    def run(self) -> bool:
        """Run the engine on this thread until :meth:`drain` and the grace period end;
        False if it failed (its traceback printed)."""
        try:
            self.engine.run(self._stop, grace=self.grace)
            return True
        except Exception:
            # an engine that failed decodes nothing more: /health and new requests get 503,
            # and the streams in flight end (ABORT) rather than leave their clients waiting
            traceback.print_exc()
            self.draining = self.failed = True
            self.engine.close()
            with contextlib.suppress(Exception):
                self.engine.abort_all()
            return False

    def drain(self) -> None:
        """Refuse new requests (503), and end the engine within the grace period."""
        self.draining = True
        self.engine.close()
        self._stop.set()

    def join(self, timeout: Optional[float] = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
        if self.engine.sessions is not None:
            self.engine.sessions.save_all()

    # -------------------------------------------------------------------- metrics
    def _metrics(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = reg = CollectorRegistry()
        e = self.engine
        Gauge("srupp_active_streams", "Streams decoding or reading their prompts",
              registry=reg).set_function(lambda: e.active_streams)
        Gauge("srupp_queue_depth", "Streams waiting for a slot",
              registry=reg).set_function(lambda: e.queue_depth)
        Gauge("srupp_state_bytes_per_stream", "Bytes of one stream's decoding state",
              registry=reg).set(e.state_bytes)
        Gauge("srupp_max_streams", "Slots: streams decoded at once", registry=reg).set(
            e.max_streams)
        tokens = Counter("srupp_tokens_generated", "Tokens generated", registry=reg)
        tokens.inc(0)
        self._tokens_seen = 0
        buckets = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)
        ttft = Histogram("srupp_time_to_first_token_seconds",
                         "From a request's arrival to its first token", registry=reg,
                         buckets=buckets)
        itl = _RepeatedHistogram("srupp_inter_token_latency_seconds",
                                 "Between a stream's consecutive tokens", buckets, reg)
        self.requests = Counter("srupp_requests", "Completion requests by outcome",
                                ["status"], registry=reg)
        e.on_first_token = ttft.observe
        e.on_inter_token = itl.observe
        self._tokens_counter = tokens

    def metrics_text(self) -> bytes:
        from prometheus_client import generate_latest

        new = self.engine.tokens_generated - self._tokens_seen
        if new > 0:
            self._tokens_counter.inc(new)
            self._tokens_seen += new
        return generate_latest(self.registry)

    # ------------------------------------------------------------------------ app
    def _app(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, Response, StreamingResponse

        app = FastAPI(title="srupp", docs_url=None, redoc_url=None)
        server = self

        @app.get("/health")
        async def health():
            if server.draining:
                why = "its engine failed" if server.failed else "the server is shutting down"
                return _error(503, why, "unavailable")
            return {"status": "ok", "model": server.model_name}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                                "created": server.created,
                                                "owned_by": "srupp"}]}

        @app.get("/metrics")
        async def metrics():
            from prometheus_client import CONTENT_TYPE_LATEST

            return Response(server.metrics_text(), media_type=CONTENT_TYPE_LATEST)

        @app.delete("/v1/sessions/{session_id}")
        async def delete_session(session_id: str):
            store = server.engine.sessions
            if store is None:
                return _error(404, "this server keeps no sessions (--sessions DIR)",
                              "not_found")
            try:
                deleted = store.delete(session_id)
            except ValueError as e:
                return _error(400, str(e), "invalid_request_error", "session")
            if not deleted:
                return _error(404, f"no session {session_id!r}", "not_found", "session")
            return {"id": session_id, "object": "session", "deleted": True}

        @app.post("/v1/completions")
        async def completions(request: Request):
            if server.draining:
                server.requests.labels("503").inc()
                return _error(503, "the server is shutting down", "unavailable")
            raw = await request.body()
            try:
                try:
                    body = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    raise BadRequest("the body is not valid UTF-8") from None
                except json.JSONDecodeError as e:
                    raise BadRequest(f"the body is not valid JSON ({e.msg} at character "
                                     f"{e.pos})") from None
                req = parse_completion(body, server.tokenizer, server.engine)
                if req["model"] is not None and req["model"] != server.model_name:
                    raise BadRequest(f"model {req['model']!r} is not served here; this server "
                                     f"serves {server.model_name!r}", 404, "model")
                if req["session"] is not None and server.engine.sessions is not None:
                    try:  # a session the engine could not continue (saved for another model,
                        # or a damaged file) is refused here, not met on the engine's thread
                        server.engine.sessions.get(req["session"])
                    except ValueError as e:
                        raise BadRequest(f"session: {e}", field="session") from None
            except BadRequest as e:
                server.requests.labels(str(e.status)).inc()
                kind = "not_found" if e.status == 404 else "invalid_request_error"
                return _error(e.status, str(e), kind, e.field)
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()
            relay = server.relay(loop)
            try:
                stream = server.engine.submit(
                    req["ids"], req["sampling"], session=req["session"],
                    on_event=lambda ev: relay.send(events, ev))
            except QueueFull as e:
                server.requests.labels("429").inc()
                return _error(429, f"the server is busy ({e}); retry", "rate_limit_exceeded",
                              headers={"Retry-After": str(RETRY_AFTER_S)})
            except EngineClosed:
                server.requests.labels("503").inc()
                return _error(503, "the server is shutting down", "unavailable")
            except SessionBusy as e:
                server.requests.labels("409").inc()
                return _error(409, str(e), "conflict", "session")
            except ValueError as e:
                server.requests.labels("400").inc()
                return _error(400, str(e), "invalid_request_error", str(e).split(":")[0])
            server.requests.labels("200").inc()
            ident, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

            def chunk(text: str, finish: Optional[str], usage: Optional[dict] = None) -> dict:
                out = {"id": ident, "object": "text_completion", "created": created,
                       "model": server.model_name,
                       "choices": [{"text": text, "index": 0, "logprobs": None,
                                    "finish_reason": finish}]}
                if usage is not None:
                    out["usage"] = usage
                if req["session"] is not None:
                    out["session"] = req["session"]
                return out

            def usage() -> dict:
                n, m = len(req["ids"]), len(stream.generated)
                return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

            if req["stream"]:
                # every chunk but the last is this text around the piece's JSON string
                head, tail = _chunk_frame(chunk("", None))

                async def sse():
                    try:
                        while True:
                            ev = await events.get()
                            if ev.finish_reason is not None:
                                data = chunk(ev.text, ev.finish_reason, usage())
                                yield f"data: {json.dumps(data)}\n\ndata: [DONE]\n\n"
                                break
                            if ev.text:
                                yield f"{head}{json.dumps(ev.text)}{tail}"
                    finally:  # the client went away (or the stream ended): free the slot
                        stream.cancel()

                return StreamingResponse(sse(), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})

            # the client may go away while it waits: look every quarter second, whether
            # or not events came meanwhile (they come all the time from a long stream)
            text, finish, look_at = [], None, loop.time() + 0.25
            while finish is None:
                try:
                    ev = await asyncio.wait_for(events.get(), timeout=0.25)
                    text.append(ev.text)
                    finish = ev.finish_reason
                except asyncio.TimeoutError:
                    pass
                if finish is None and loop.time() >= look_at:
                    look_at = loop.time() + 0.25
                    if await request.is_disconnected():
                        stream.cancel()
                        return Response(status_code=499)
            return JSONResponse(chunk("".join(text), finish, usage()))

        return app


# --------------------------------------------------------------------------- main

def serve(run, *, host: str = "127.0.0.1", port: int = 8000,
          max_streams: int = 32, max_queue: int = 256, sessions: Optional[str] = None,
          dtype: str = "fp32", mem_len: Optional[int] = None, grace: float = 30.0,
          threads: Optional[int] = None, chunk_ms: float = 40.0,
          log_level: str = "warning") -> int:
    """Serve a loaded run (:func:`srupp.inference.load_run` of a language model) until
    SIGTERM or Ctrl-C (see the module's docstring); returns the exit status: 0, or 1 when
    the engine failed (its traceback printed; the server answered 503 until stopped)."""
    require("uvicorn", "serve", "srupp serve")
    require("fastapi", "serve", "srupp serve")
    import torch
    import uvicorn

    from .inference import weights_for_decoding

    if threads:
        torch.set_num_threads(threads)
    tokenizer, model, ckpt = run.tokenizer, run.model, run.checkpoint
    weights_for_decoding(model, dtype)
    store = None
    if sessions is not None:
        Path(sessions).mkdir(parents=True, exist_ok=True)
        store = SessionStore(sessions, model_id=model_fingerprint(model))
    engine = Engine(model, tokenizer, max_streams=max_streams, max_queue=max_queue,
                    window=mem_len, sessions=store, eos_id=getattr(tokenizer, "eos_id", None),
                    chunk_seconds=chunk_ms / 1e3)
    # the run's folder name (a checkpoint folder's own name when it stands alone)
    ckpt = Path(ckpt).resolve()
    name = ckpt.parent.name if ckpt.name.startswith("ckpt-") else ckpt.name
    server = Server(engine, tokenizer, name, grace=grace)
    # the model and the libraries are loaded for good: keep the collector off them (it
    # walked them at every full collection, a few % of each decoding step)
    gc.collect()
    gc.freeze()
    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=5)
    # bound here, so that port 0 (any free port) is known before serving, and printed
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # each SSE event is a small write: without this, Nagle's algorithm holds it until the
    # client acknowledges the one before, which a client delays by up to 40 ms
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        from .errors import UserError

        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}); give another "
                        f"--port, or 0 for any free one") from None
    port = sock.getsockname()[1]
    # listening from here: a client that connects as soon as it reads the URL below waits
    # in the backlog until uvicorn's thread accepts, instead of being refused
    sock.listen(2048)
    print(json.dumps({"url": f"http://{host}:{port}", "model": name, "dtype": dtype,
                      "max_streams": max_streams, "window": engine.window,
                      "state_bytes_per_stream": engine.state_bytes,
                      "sessions": sessions}), flush=True)
    # The engine runs on the main thread and HTTP on another: PyTorch's OpenMP threads
    # serve the thread that first ran a parallel region; from any other, every region put
    # its threads to sleep and woke them (a stream decoded 6x slower). uvicorn installs no
    # signal handlers off the main thread, so the drain is this thread's.
    http = uvicorn.Server(config)
    web = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, name="srupp-http",
                           daemon=True)

    def on_signal(sig, frame):  # drain first: 503s, streams end, sessions saved
        if server._stop.is_set():  # a second signal: stop serving now (Ctrl-C twice: at once)
            http.should_exit = True
            http.force_exit = http.force_exit or sig == signal.SIGINT
            # not abort_all() here: a handler runs between two bytecodes of this thread,
            # maybe inside an engine step; the engine aborts at its next step boundary
            server._now.set()
            return
        server.drain()

    handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    web.start()
    ok = False
    try:
        ok = server.run()
        if not ok:  # the engine failed: answer 503 until told to stop
            while not server._stop.is_set():
                server._stop.wait(0.5)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        http.should_exit = True
        web.join(grace + 10)
        if server.engine.sessions is not None:
            server.engine.sessions.save_all()
    return 0 if ok else 1


__all__ = ["serve", "Server", "parse_completion", "BadRequest"]
