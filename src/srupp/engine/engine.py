"""The decoding engine: many generation streams through one batched step.

    Sampling   one request's settings: max_tokens, temperature, top_k, top_p, seed, stop
    Stream     one request in flight: its tokens, sampler, text, and the events it hands on
    Event      what a stream hands its consumer after a step: new text, tokens, finish reason
    Engine     the streams: a bounded queue, prompts read in chunks between steps, and the
               next tokens of every active stream decoded at once

How a stream moves. It waits in the queue until a slot is free. It then reads its
prompt, all but its last token, in chunks of ``prefill_chunk`` tokens: each engine
step reads chunks of the waiting streams in turn until it has read that many tokens,
so a long prompt never stalls the others. The last token is the stream's *pending*
token. It then joins the batch: every step feeds each active stream's pending token
through the model at once and samples each stream's next token, which becomes pending;
where it can, a step runs a chunk of such tokens in one call of the C++ token loop
(:meth:`Engine._run_chunk`).
A stream therefore always holds (state, pending token): exactly what a session keeps
to continue later (:mod:`srupp.engine.sessions`).

Slots. A stream's state starts as the backbone's ``padded_state``: an SRU++ stack's
attention memory (or a Transformer's KV cache) is ``window`` positions of padding from
the first token, so every state keeps exactly ``window`` positions and the states of
streams at different points join into one batch as they are (``SRUppState.cat``). A
slot's memory is the state's bytes (:attr:`Engine.state_bytes`), fixed per stream;
``max_streams`` bounds them all.

Batch invariance. Decoding runs under :func:`srupp.ops.matmul.batch_invariant`: each
row's products, attention, norms and recurrence are computed the same way whatever the
other rows, so a stream's tokens are the same alone or beside any others (bit for bit
in fp32 and bf16; tests/engine/test_engine.py says what holds for int8 weights).
Each prompt is read as a batch of one, so it is invariant too.

Threads. :meth:`Engine.submit` and :meth:`Stream.cancel` may be called from any
thread; :meth:`Engine.step` (or :meth:`Engine.run`, its loop) from one thread only,
the one that runs the model.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, Iterator, List, Optional, Sequence, Tuple

import torch

from .._ranges import check
from ..models.lm import check_sampling, sample
from ..nn.append import sliding_windows
from ..nn.state import SRUppState
from ..ops.matmul import batch_invariant
from ..ops.settings import tuning
from .sessions import Session, SessionStore, check_session_id
from .text import StopMatcher, TextDecoder, check_stops

# finish reasons, as OpenAI's API names them; "abort": the server ended the stream
# (shutdown past its grace period, or the client went away)
STOP, LENGTH, ABORT = "stop", "length", "abort"

#: The attention window of a model whose config keeps every position (mem_len None):
#: a stream's state must have a fixed size.
DEFAULT_WINDOW = 1024


class QueueFull(RuntimeError):
    """The engine's queue is full: try again later (HTTP 429)."""


class EngineClosed(RuntimeError):
    """The engine takes no new streams: it is shutting down (HTTP 503)."""


class SessionBusy(RuntimeError):
    """A request for this session is already in flight (HTTP 409)."""


@dataclass(frozen=True)
class Sampling:
    """How one stream samples; checked on construction (ValueError/TypeError naming the field)."""

    max_tokens: int = 16                  # new tokens at most (OpenAI's default)
    temperature: float = 1.0              # 0: greedy, the most likely token
    top_k: Optional[int] = None           # sample among the k most likely tokens
    top_p: Optional[float] = None         # ... among those holding this much probability
    seed: Optional[int] = None            # None: a seed drawn for this stream
    stop: Tuple[str, ...] = ()            # the text ends before the first of these

    def __post_init__(self):
        check("max_tokens", self.max_tokens, ">= 0", integer=True)
        check_sampling(self.temperature, self.top_k, self.top_p)
        check("seed", self.seed, "[0, 2**63)", integer=True)
        object.__setattr__(self, "stop", tuple(check_stops(self.stop)))


@dataclass
class Event:
    """What a stream hands on after a step: final text, the tokens it came from, and
    once the stream has ended, why (STOP, LENGTH or ABORT)."""

    text: str
    tokens: List[int]
    finish_reason: Optional[str] = None


class Stream:
    """One request in flight. Read its events with :meth:`events` (or give the engine an
    ``on_event`` callback); :meth:`cancel` ends it at the next step."""

    _ids = itertools.count()

    def __init__(self, engine: "Engine", prompt: List[int], sampling: Sampling,
                 session: Optional[str], on_event: Optional[Callable[[Event], None]]):
        self.id = next(Stream._ids)
        self.prompt, self.sampling, self.session = prompt, sampling, session
        seed = sampling.seed if sampling.seed is not None else \
            int(torch.randint(0, 2**62, (1,)).item())
        self.generator = torch.Generator().manual_seed(seed)
        self.decoder = TextDecoder(engine.tokenizer)
        self.stopper = StopMatcher(sampling.stop)
        self.generated: List[int] = []
        self.text = ""                      # the text handed on so far
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None    # why the engine ended it (ABORT), if not asked to
        self.cancelled = False
        self.state: Any = None              # while reading the prompt; then a batch row
        self.todo: List[int] = []           # tokens to read: a session's pending + prompt
        self.read = 0                       # of todo
        self.pending = -1
        self.session_tokens = 0             # tokens the session had before this request
        # a session stream that may end inside a C++ chunk: its state and pending token at
        # the chunk's start; if it does, its state after its last token, read from there
        self.chunk_start: Optional[Tuple[Any, int]] = None
        self.end_state: Any = None
        self.submitted = time.perf_counter()
        self.first_token_at: Optional[float] = None
        self.last_token_at: Optional[float] = None
        self._on_event = on_event
        self._queue: "queue.SimpleQueue[Event]" = queue.SimpleQueue()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        """End the stream (a client that went away); its slot is freed at the next step."""
        self.cancelled = True

    def events(self, timeout: Optional[float] = None) -> Iterator[Event]:
        """The stream's events as they come, until its last (which has a finish reason)."""
        while True:
            event = self._queue.get(timeout=timeout)
            yield event
            if event.finish_reason is not None:
                return

    def _emit(self, event: Event) -> None:
        self.text += event.text
        if self._on_event is not None:
            self._on_event(event)
        else:
            self._queue.put(event)


#: Tokens per C++ call at least, however slow the step: each chunk is one event per
#: stream, and at fewer tokens per event the server's HTTP work (on the same cores)
#: slowed the steps more than shorter chunks saved (serve_load, 32 streams on 2 cores:
#: 10 ms chunks of 3.7 tokens gave 9,600 tokens/s, 20 ms chunks of 10 gave 13,400).
MIN_CHUNK = 8

_GREEDY = Sampling(temperature=0)  # a free row's (its tokens are not used)


class Engine:
    """Generation streams of one causal language model, batched.

    Args:
        model: a :class:`~srupp.models.CausalLM` (any backbone), put in eval mode.
        tokenizer: its tokenizer (ids -> text for the streams' text).
        max_streams: streams decoded at once (slots); more wait in the queue.
        max_queue: streams waiting at most; :meth:`submit` then raises :class:`QueueFull`.
        window: positions of attention memory (KV cache) each stream keeps; default
            the model's ``mem_len``, else :data:`DEFAULT_WINDOW`.
        prefill_chunk: prompt tokens read per engine step (of the waiting streams in turn).
        max_prompt_tokens: longer prompts are a ValueError (the server's 413).
        sessions: where sessions are kept; None: requests may not name one.
        eos_id: a stream also ends after this token (kept in its output).
        chunk_seconds: the batch decodes chunks of tokens in one call of the C++ token
            loop (:meth:`_run_chunk`) lasting about this long at most: the longest a new
            request waits to join, and about the gap between a stream's events. 0: one
            token per step.
    """

    def __init__(self, model, tokenizer, *, max_streams: int = 32, max_queue: int = 256,
                 window: Optional[int] = None, prefill_chunk: int = 256,
                 max_prompt_tokens: int = 65536, sessions: Optional[SessionStore] = None,
                 eos_id: Optional[int] = None, chunk_seconds: float = 0.04):
        for name, value in (("max_streams", max_streams), ("prefill_chunk", prefill_chunk),
                            ("max_prompt_tokens", max_prompt_tokens)):
            check(name, value, ">= 1", integer=True)
        check("max_queue", max_queue, ">= 0", integer=True)
        check("window", window, ">= 0", integer=True)
        if getattr(model, "task", None) != "lm":
            raise TypeError(f"the engine decodes causal language models, got "
                            f"{type(model).__name__}")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_streams, self.max_queue = max_streams, max_queue
        self.prefill_chunk, self.max_prompt_tokens = prefill_chunk, max_prompt_tokens
        self.sessions, self.eos_id = sessions, eos_id
        check("chunk_seconds", chunk_seconds, ">= 0")
        self.chunk_seconds = float(chunk_seconds)
        self._token_seconds: dict = {}  # batch rows -> seconds per token of the last C++ call
        config_window = getattr(model.config, "mem_len", None)
        self.window = window if window is not None else (
            config_window if config_window is not None else DEFAULT_WINDOW)
        self.vocab_size = model.config.vocab_size
        self.closed = False
        self.tokens_generated = 0
        # observers (the server's metrics): seconds to a stream's first token; and between
        # tokens, as (gap, n): n gaps of that length (a chunk's tokens, spread evenly)
        self.on_first_token: Optional[Callable[[float], None]] = None
        self.on_inter_token: Optional[Callable[[float, int], None]] = None
        self._lock = threading.Condition()
        self._queue: Deque[Stream] = collections.deque()
        self._reading: Deque[Stream] = collections.deque()   # reading their prompts
        self._active: List[Optional[Stream]] = []  # rows of self._batch: a stream, or None (free)
        self._apart: List[Stream] = []       # read their prompts; first step alone (_batch_join)
        self._batch: Any = None
        self._busy_sessions: set = set()

    # ------------------------------------------------------------------ any thread
    def submit(self, prompt: Sequence[int], sampling: Sampling = Sampling(), *,
               session: Optional[str] = None,
               on_event: Optional[Callable[[Event], None]] = None) -> Stream:
        """Queue a stream: prompt token ids (may be empty only when continuing a session).

        Raises ValueError (a bad prompt or session id), :class:`QueueFull`,
        :class:`EngineClosed` or :class:`SessionBusy`.
        """
        prompt = [int(t) for t in prompt]
        if session is not None:
            if self.sessions is None:
                raise ValueError("session: this engine keeps no sessions (start the server "
                                 "with --sessions DIR)")
            check_session_id(session)
        if not prompt and session is None:
            raise ValueError("prompt: give at least one token")
        if len(prompt) > self.max_prompt_tokens:
            raise ValueError(f"prompt: {len(prompt)} tokens, more than the limit of "
                             f"{self.max_prompt_tokens}")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary "
                             f"(0 .. {self.vocab_size - 1})")
        with self._lock:
            if self.closed:
                raise EngineClosed("the engine is shutting down")
            # the free slots take the first of the queue at the next step; the rest wait
            if len(self._queue) >= self.max_queue + max(0, self._free_slots()):
                raise QueueFull(f"{len(self._queue)} streams are waiting (max_queue)")
            if session is not None:
                if session in self._busy_sessions:
                    raise SessionBusy(f"session {session!r} has a request in flight")
                self._busy_sessions.add(session)
            stream = Stream(self, prompt, sampling, session, on_event)
            self._queue.append(stream)
            self._lock.notify_all()
        return stream

    def close(self) -> None:
        """Take no new streams (those queued and in flight go on)."""
        with self._lock:
            self.closed = True
            self._lock.notify_all()

    @property
    def active_streams(self) -> int:
        return self._decoding() + len(self._apart) + len(self._reading)

    def _decoding(self) -> int:
        """Streams in the batch (its rows less the free ones)."""
        return sum(s is not None for s in self._active)

    @functools.cached_property
    def state_bytes(self) -> int:
        """Bytes of one stream's state as decoding holds it (its cached keys and values
        included): measured once, on first use, from a state that read one token."""
        with torch.no_grad():
            ids = torch.zeros(1, 1, dtype=torch.long, device=self.model.device)
            _, state = self.model.prefill(ids, self._new_state())
        return int(state.nbytes()) if hasattr(state, "nbytes") else 0

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def idle(self) -> bool:
        return not (self._queue or self._reading or self._apart or self._decoding())

    # ------------------------------------------------------------ the model thread
    def step(self) -> bool:
        """One engine step: admit waiting streams to free slots, read chunks of waiting
        prompts (``prefill_chunk`` tokens each, in turn, until that many are read), then
        decode the next tokens of every active stream (one, or a chunk:
        :meth:`_run_chunk`). False when there was nothing to do."""
        worked = self._drop_cancelled()  # first: their slots go to waiting streams now
        with self._lock:
            while self._queue and self._free_slots() > 0:
                self._reading.append(self._queue.popleft())
        # sliding windows: this engine keeps one state per stream and drops the one before
        with torch.no_grad(), sliding_windows():
            # whole chunks of each prompt, so that where a prompt is cut does not depend
            # on the others (the arithmetic of a chunk depends on its length)
            budget = self.prefill_chunk
            while self._reading and budget > 0:
                budget -= self._read_chunk(self._reading[0], self.prefill_chunk)
                worked = True
            if self._apart or self._decoding():
                self._decode()
                worked = True
        return worked

    def run(self, stop: threading.Event, *, grace: float = 30.0,
            now: Optional[threading.Event] = None) -> None:
        """Step until ``stop`` is set; then take no new streams, finish those in flight
        for up to ``grace`` seconds (less once ``now`` is set: at the next step), end the
        rest with ABORT, and save their sessions."""
        while not stop.is_set():
            if self.step():
                # hand the interpreter to the threads that relay this step's tokens (a
                # server's event loop): without a pause this loop would keep it, and they
                # would stream nothing until every stream had ended
                time.sleep(0)
                continue
            with self._lock:
                if self.idle and not stop.is_set():
                    self._lock.wait(0.05)
        self.close()
        deadline = time.monotonic() + grace
        while not self.idle and time.monotonic() < deadline \
                and not (now is not None and now.is_set()):
            self.step()
        self.abort_all()

    def abort_all(self) -> None:
        """End every stream now (ABORT), keeping the sessions of those decoding."""
        with self._lock:
            waiting, self._queue = list(self._queue) + list(self._reading), collections.deque()
            self._reading = collections.deque()
        for s in waiting:
            self._finish(s, ABORT)
        apart, self._apart = self._apart, []
        for s in apart:
            self._keep_session(s, s.state)
            self._finish(s, ABORT)
        self._leave([s for s in self._active if s is not None], ABORT)

    def generate(self, prompt: Sequence[int], sampling: Sampling = Sampling(), *,
                 session: Optional[str] = None,
                 on_event: Optional[Callable[[Event], None]] = None) -> Stream:
        """One stream from start to end on this thread (the engine must be otherwise idle):
        what ``srupp generate`` runs. Returns the finished stream."""
        stream = self.submit(prompt, sampling, session=session, on_event=on_event)
        while not stream.done:
            self.step()
        return stream

    # ------------------------------------------------------------------ internals
    def _free_slots(self) -> int:
        return self.max_streams - self._decoding() - len(self._apart) - len(self._reading)

    def _new_state(self):
        state = self.model.backbone.padded_state(1, self.window)
        # with room after the window: the prompt's first chunk is then appended in place
        # (not into a second, larger buffer per arriving stream)
        return type(state).cat([state], room=True)

    def _drop_cancelled(self) -> bool:
        gone = [s for s in self._reading if s.cancelled]
        for s in gone:
            self._reading.remove(s)
            self._finish(s, ABORT)
        apart = [s for s in self._apart if s.cancelled]
        for s in apart:
            self._apart.remove(s)
            self._keep_session(s, s.state)
            self._finish(s, ABORT)
        rows = [s for s in self._active if s is not None and s.cancelled]
        if rows:
            self._leave(rows, ABORT)
        return bool(gone or apart or rows)

    def _read_chunk(self, s: Stream, most: int) -> int:
        """Read the next chunk of s's prompt, ``most`` tokens at most; once all but its last
        token are read, s joins the batch with that token pending. Returns the tokens read:
        none only when s is done reading (and has left the reading queue)."""
        if s.state is None:
            try:
                s.state, pending, s.session_tokens = self._start_state(s)
            except ValueError as e:  # a damaged session file, or one of another model
                self._reading.popleft()
                s.error = str(e)
                self._finish(s, ABORT)
                return 0
            s.todo = ([pending] if pending is not None else []) + s.prompt
            if not s.todo:  # a session with nothing pending and an empty prompt
                self._reading.popleft()
                self._finish(s, LENGTH)
                return 0
        n = max(0, min(most, len(s.todo) - 1 - s.read))
        if n > 0:
            ids = torch.tensor([s.todo[s.read:s.read + n]], device=self.model.device)
            _, s.state = self.model.prefill(ids, s.state)
            s.read += n
        if s.read < len(s.todo) - 1:
            return n
        self._reading.popleft()
        s.pending = s.todo[-1]
        if s.sampling.max_tokens == 0:  # done: its state never joins the batch
            self._keep_session(s, s.state)
            s.state = None
            self._finish(s, LENGTH)
            return n
        self._batch_join(s)
        return n

    def _start_state(self, s: Stream) -> Tuple[Any, Optional[int], int]:
        """(state, pending token or None, tokens so far) that s starts from."""
        if s.session is not None:
            kept = self.sessions.get(s.session)
            if kept is not None:
                return kept.state, kept.pending, kept.tokens
        return self._new_state(), None, 0

    def _batch_join(self, s: Stream) -> None:
        """s, its prompt read, takes a row of the batch. A state without the cached keys
        and values of its memory (a fresh one that read no prompt, a session loaded from
        disk) waits apart and takes its first step alone (:meth:`_decode`), as it would
        with no other stream: in the batch, its row would disagree with the batch's cache."""
        if _lacks_kv_cache(s.state):
            self._apart.append(s)
            return
        self._place(s, s.state)
        s.state = None

    def _place(self, s: Stream, state) -> None:
        """Put s's state (batch size 1) into a free row of the batch, in place; with none
        free, the batch grows, the new rows free: to twice its rows, or at once to room for
        every stream admitted and waiting (at most ``max_streams`` rows). A stream that
        joins or leaves thus copies its own row, not the batch, and a crowd that arrives
        together grows the batch once (each growth holds the old batch and the new at
        once)."""
        free = next((i for i, r in enumerate(self._active) if r is None), None)
        if free is None:
            waiting = len(self._reading) + len(self._apart) + len(self._queue)
            grow = max(1, min(max(len(self._active), 1 + waiting),
                              self.max_streams - len(self._active)))
            rows = state if grow == 1 else state.index_select(torch.zeros(grow, dtype=torch.long))
            # with room for the steps to come: the next step appends in place
            self._batch = type(state).cat([rows] if self._batch is None else [self._batch, rows],
                                          room=True)
            free = len(self._active)
            self._active += [None] * grow
        else:
            self._batch.put_row(free, state)
        self._active[free] = s

    def _decode(self) -> None:
        """The next tokens of every active stream: a chunk of them in one call of the C++
        token loop where it can (:meth:`_run_chunk`), else one step that feeds the pending
        tokens and samples the next (the chunk's tokens are those steps' very tokens). Free
        rows are computed too (token 0, results unused: rows do not mix)."""
        produced: List[Tuple[Stream, List[int]]] = []
        with batch_invariant(self.max_streams):
            if self._decoding():
                rows = self._active
                pending = torch.tensor([0 if s is None else s.pending for s in rows],
                                       device=self.model.device)                   # (B,)
                chunk = self._run_chunk(rows, pending)
                if chunk is not None:
                    produced += chunk
                else:
                    logits, self._batch = self.model.step(pending, self._batch)  # (B, V)
                    live = [i for i, s in enumerate(rows) if s is not None]
                    streams = [rows[i] for i in live]
                    ids = self._sample(logits if len(live) == len(rows) else logits[live],
                                       streams)
                    produced += [(st, [t]) for st, t in zip(streams, ids)]
            apart, self._apart = self._apart, []
            for s in apart:  # their first step alone, then they take a row (_batch_join)
                token = torch.tensor([s.pending], device=self.model.device)
                logits, s.state = self.model.step(token, s.state)         # (1, V)
                produced.append((s, self._sample(logits, [s])))
        now = time.perf_counter()
        ended: List[Stream] = []
        for s, ids in produced:
            # the stream takes its ids up to its max_tokens, its end token, its stop string
            used = min(len(ids), s.sampling.max_tokens - len(s.generated))
            if self.eos_id is not None and self.eos_id in ids[:used]:
                used = ids.index(self.eos_id) + 1
            if s.stopper.stops:  # token by token: a stop string may end it at any one
                text = []
                for k, t in enumerate(ids[:used]):
                    text.append(s.stopper.feed(s.decoder.push(t))[0])
                    if s.stopper.stopped:
                        used = k + 1
                        break
            else:  # the chunk's text at once
                text = [s.decoder.push_many(ids[:used])]
            s.generated += ids[:used]
            s.pending = ids[used - 1]
            if used < len(ids) or s.stopper.stopped or ids[used - 1] == self.eos_id \
                    or len(s.generated) >= s.sampling.max_tokens:
                ended.append(s)
            if s.chunk_start is not None:
                start, s.chunk_start = s.chunk_start, None
                if used < len(ids):  # it ended inside the chunk; its row decoded on
                    fed = torch.tensor([[start[1]] + ids[:used - 1]], device=self.model.device)
                    _, s.end_state = self.model.prefill(fed, start[0])
            self._time(s, now, used)
            s._emit(Event("".join(text), ids[:used]))
            self.tokens_generated += used
        for s in apart:
            if s not in ended:
                self._place(s, s.state)
                s.state = None
        if ended:
            self._leave(ended, None)

    def _run_chunk(self, rows: List[Optional[Stream]], pending: torch.Tensor
                   ) -> Optional[List[Tuple[Stream, List[int]]]]:
        """The batch's next tokens in one call of the C++ token loop
        (:meth:`CausalLM.fused_decoder`): the ``pending`` tokens (B,) fed, then n tokens
        sampled, each row by its own stream's settings and generator, all but the last fed;
        the last is left pending. The very tokens n of :meth:`_decode`'s steps give. A
        stream that ends inside the chunk (a stop string, the end token) takes its tokens
        up to there; its row, decoded on, is dropped. Its session, if it keeps one, needs
        the state after its last token: such a stream's state at the chunk's start is kept
        aside (a copy of its row), and the chunk's tokens up to its end are read after it
        (:meth:`_decode`). None (nothing run) where the loop does not apply (a model it
        can't run).

        n: what fits in ``chunk_seconds`` at the time per token the last call at this
        many rows took (2 at first, to measure it), but no less than :data:`MIN_CHUNK`;
        at most ``srupp.ops.tuning().decode_chunk`` (0: never chunk) and the fewest
        tokens any stream has left."""
        n = tuning().decode_chunk if self.chunk_seconds > 0 else 0
        per_token = self._token_seconds.get(len(rows))
        n = min(n, 2 if per_token is None
                else max(MIN_CHUNK, int(self.chunk_seconds / per_token)))
        for s in rows:
            if s is not None:
                # the chunk ends with the first stream's last token: its last tokens come
                # as soon as they are made, not a whole chunk later
                n = min(n, s.sampling.max_tokens - len(s.generated))
        emb = self.model.embedding
        if n < 2 or not isinstance(emb, torch.nn.Embedding):  # the loop embeds by lookup
            return None
        like = emb.weight.new_empty(len(rows), emb.embedding_dim)
        decoder = self.model.fused_decoder(self._batch, n, like)
        if decoder is None:
            return None
        steps, output = decoder
        for i, s in enumerate(rows):  # may end inside, by a stop string or the end token
            if s is not None and s.session is not None \
                    and (s.sampling.stop or self.eos_id is not None):
                s.chunk_start = (self._batch.index_select(torch.tensor([i])), s.pending)
        settings = [_GREEDY if s is None else s.sampling for s in rows]
        start = time.perf_counter()
        tokens, _, self._batch = steps.decode(
            pending.new_empty(0, 0), torch.zeros(len(rows), dtype=torch.bool), emb.weight,
            output, final=True, temperature=[p.temperature for p in settings],
            top_k=[p.top_k for p in settings], top_p=[p.top_p for p in settings],
            generator=[None if s is None else s.generator for s in rows], eos_id=None,
            first=pending)                                                # (B, n)
        self._token_seconds[len(rows)] = (time.perf_counter() - start) / n
        return [(s, ids) for s, ids in zip(rows, tokens.tolist()) if s is not None]

    def _sample(self, logits: torch.Tensor, active: List[Stream]) -> List[int]:
        """Each stream's next token by its own settings and generator; greedy rows at once."""
        ids: List[Optional[int]] = [None] * len(active)
        greedy = [i for i, s in enumerate(active) if s.sampling.temperature == 0]
        if greedy:
            rows = logits if len(greedy) == len(active) else logits[greedy]
            for i, t in zip(greedy, rows.argmax(-1).tolist()):
                ids[i] = t
        for i, s in enumerate(active):
            if ids[i] is None:
                p = s.sampling
                ids[i] = int(sample(logits[i:i + 1], temperature=p.temperature, top_k=p.top_k,
                                    top_p=p.top_p, generator=s.generator)[0])
        return ids  # type: ignore[return-value]

    def _time(self, s: Stream, now: float, n: int = 1) -> None:
        """Record n tokens of s that arrived at ``now`` (a chunk's are spread evenly)."""
        gaps, since = n, s.last_token_at
        if s.first_token_at is None:  # the first token; the rest of its chunk came with it
            s.first_token_at = since = now
            gaps -= 1
            if self.on_first_token is not None:
                self.on_first_token(now - s.submitted)
        if self.on_inter_token is not None and gaps > 0:
            self.on_inter_token((now - since) / gaps, gaps)
        s.last_token_at = now

    def _leave(self, streams: List[Stream], reason: Optional[str]) -> None:
        """These streams leave: sessions kept, their rows freed, and each ended (with
        ``reason``, or the one its last token gave). When half the rows or more are free,
        the batch is compacted (the free rows cost compute every step)."""
        rows = {id(s): i for i, s in enumerate(self._active) if s is not None}
        for s in streams:
            i = rows.get(id(s))
            if i is None:  # its first step was apart: its state is its own
                self._keep_session(s, s.state)
                s.state = None
                continue
            if s.session is not None:
                self._keep_session(s, s.end_state if s.end_state is not None
                                   else self._batch.index_select(torch.tensor([i])))
                s.end_state = None
            self._active[i] = None
        live = [i for i, s in enumerate(self._active) if s is not None]
        if not live:
            self._batch, self._active = None, []
        elif 2 * (len(self._active) - len(live)) >= len(self._active):
            self._batch = self._batch.keep_rows(live)  # in place, where the state can
            self._active = [self._active[i] for i in live]
        for s in streams:
            self._finish(s, reason)

    def _keep_session(self, s: Stream, state) -> None:
        """Keep s's session (if it names one): ``state`` (batch size 1) and its pending token."""
        if s.session is None or self.sessions is None or state is None:
            return
        self.sessions.put(s.session, Session(
            state=state, pending=s.pending,
            tokens=s.session_tokens + len(s.prompt) + len(s.generated),
            model_id=self.sessions.model_id, updated=time.time()), persist=True)

    def _finish(self, s: Stream, reason: Optional[str]) -> None:
        """End s: the text held back (unless a stop string cut it) and the finish reason."""
        if s.done:
            return
        if reason is None:
            last = s.generated[-1] if s.generated else None
            reason = STOP if s.stopper.stopped or (last is not None and last == self.eos_id) \
                else LENGTH
        rest = ""
        if not s.stopper.stopped:
            text, _ = s.stopper.feed(s.decoder.flush())
            rest = text + s.stopper.flush()
        s.finish_reason = reason
        with self._lock:
            self._busy_sessions.discard(s.session)
        s._emit(Event(rest, [], reason))


def _lacks_kv_cache(state) -> bool:
    """Whether an SRU++ state holds memory without its cached keys and values."""
    return isinstance(state, SRUppState) and any(
        m is not None and m.shape[1] > 0 and kv is None
        for m, kv in zip(state.memory, state.kv_cache))


def model_fingerprint(model) -> str:
    """A short id of a model's shape and weights (a strided sample of each tensor), that
    the sessions saved for it carry: a session is never continued by another model."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        h.update(flat[:: max(1, flat.numel() // 256)].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
