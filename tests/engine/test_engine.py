"""The decoding engine: a stream's tokens alone or batched, admission, lifecycle, sessions.

The engine decodes every active stream in one batched step under
``batch_invariant``, from states padded to a fixed window, so a stream's result
must not depend on its neighbours. What is checked here, and how exactly:

* float weights (fp32 and bf16), SRU++: the same tokens and the same logits, bit
  for bit, alone or batched, joining and leaving at any step (the few-rows
  products, the one-query attention and the fused step compute each row alone);
* w8a8 weights: bit for bit too (integer sums, activations rounded per row);
* int8 weights: not bit for bit (see test_int8_rows_depend_on_their_group_size);
  the tokens agree and the logits to rounding;
* the Transformer, SRU, LSTM and GRU backbones: the same tokens (SRU: the same bits).

Tiny models (vocabulary of a character tokenizer, width 16 or 64) with perturbed
weights, so that the logits are not degenerate and a wrong row shows in the tokens.
"""

import math
import time

import pytest
import torch

from srupp.data.tokenizers import CharTokenizer
from srupp.engine import (ABORT, LENGTH, STOP, Engine, EngineClosed, QueueFull, Sampling,
                          SessionBusy, SessionStore, model_fingerprint)
from srupp.models import build_model
from srupp.nn import SRUppState
from srupp.ops import cpu_kernels
from srupp.ops.matmul import batch_invariant
from srupp.ops.settings import tuning

from lm_helpers import tiny_srupp_lm
from tolerances import tol

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not cpu_kernels.is_available(),
                                 reason=f"the C++ extension is unavailable "
                                        f"({cpu_kernels.build_error()})")]

TOK = CharTokenizer(sorted(" .,abcdefghijklmnopqrstuvwxyz"))
V = TOK.vocab_size  # 30
WINDOW = 8          # smaller than every stream's prompt + output: the memory slides

# lengths 5, 13 (> WINDOW), 1 (no prompt to read: its state has no cached keys), 8, 2
PROMPTS = [[3, 1, 4, 1, 5], [2, 7, 18, 28, 18, 2, 8, 4, 5, 9, 0, 4, 5], [9],
           [2, 6, 5, 3, 5, 8, 9, 7], [16, 1]]
MAX_TOKENS = [30, 34, 31, 36, 32]  # different: streams leave at different steps

CASES = {
    "plain": dict(),
    "heads": dict(num_heads=2),
    "attention_every_2": dict(num_layers=3, attention_every_n_layers=2),
    "no_attention": dict(attention_last_n_layers=0),
    "no_memory": dict(mem_len=0),
}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def perturb(m, seed=1):
    """Move every weight off its initial value (biases start at 0, α at 0.7): the logits
    are then far from uniform and differ from token to token."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.3)
    return m.eval()


def srupp_lm(dtype=torch.float32, quant=None, **kw):
    cfg = dict(vocab_size=V, d_model=16, proj_size=8, mem_len=WINDOW)
    cfg.update(kw)
    m = perturb(tiny_srupp_lm(**cfg)).to(dtype)
    return m.quantize(quant) if quant else m


def baseline_lm(kind, **kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=V, d_model=16, num_layers=2, dropout=0.0, mem_len=WINDOW, type=kind)
    cfg.update(kw)
    return perturb(build_model(cfg))


def greedy(i):
    return Sampling(max_tokens=MAX_TOKENS[i], temperature=0)


def seeded(i):
    return Sampling(max_tokens=MAX_TOKENS[i], temperature=0.8, top_k=12, top_p=0.9, seed=100 + i)


def drain(e, limit=5000):
    for _ in range(limit):
        if e.idle:
            return
        e.step()
    raise AssertionError("the engine did not finish its streams")


def alone(m, sampling, prompts=PROMPTS, **kw):
    """Each prompt by itself: one stream at a time through one engine."""
    e = Engine(m, TOK, max_streams=8, **kw)
    return [e.generate(p, sampling(i)) for i, p in enumerate(prompts)]


def together(m, sampling, prompts=PROMPTS, **kw):
    """All submitted at once (their prompts are read one per step, so they join in turn)."""
    e = Engine(m, TOK, max_streams=8, **kw)
    streams = [e.submit(p, sampling(i)) for i, p in enumerate(prompts)]
    drain(e)
    return streams


def staggered(m, sampling, prompts=PROMPTS, **kw):
    """Submitted at different times: streams join a batch that is decoding, and leave it."""
    e = Engine(m, TOK, max_streams=8, **kw)
    streams = []
    for i, (p, wait) in enumerate(zip(prompts, [0, 0, 3, 0, 12])):
        for _ in range(wait):
            e.step()
        streams.append(e.submit(p, sampling(i)))
    drain(e)
    return streams


def tokens(streams):
    return [s.generated for s in streams]


def bits(t):
    return t.contiguous().view(torch.uint8)


@pytest.fixture
def logits_of(monkeypatch):
    """stream -> its logits (steps, V), as the batched step gave them. A lone stream's run
    on the C++ token loop (``_run_chunk``, which yields tokens, not logits) is turned off."""
    seen = {}
    real = Engine._sample

    def record(self, logits, active):
        for i, s in enumerate(active):
            seen.setdefault(s.id, []).append(logits[i].clone())
        return real(self, logits, active)

    monkeypatch.setattr(Engine, "_sample", record)
    monkeypatch.setattr(Engine, "_run_chunk", lambda self, rows, logits: None)
    return lambda stream: torch.stack(seen[stream.id])


def assert_same_bits(streams, reference, logits_of):
    assert tokens(streams) == tokens(reference)
    for s, r in zip(streams, reference):
        a, b = logits_of(s), logits_of(r)
        assert a.shape == b.shape and torch.equal(bits(a), bits(b)), \
            f"stream {s.id}: logits differ by {float((a.float() - b.float()).abs().max())}"


# ------------------------------------------------------------ batch invariance
@DTYPES
@pytest.mark.parametrize("case", list(CASES))
def test_a_stream_gives_the_same_tokens_alone_or_batched(case, dtype):
    """Greedy and seeded sampling; alone, a stream runs on the C++ token loop."""
    m = srupp_lm(dtype, **CASES[case])
    for sampling in (greedy, seeded):
        want = tokens(alone(m, sampling))
        assert [len(t) for t in want] == MAX_TOKENS
        assert len(set(map(tuple, want))) == len(want)  # the prompts lead apart
        assert tokens(together(m, sampling)) == want
        assert tokens(staggered(m, sampling)) == want


def events_of(streams):
    return [list(s.events(timeout=1)) for s in streams]


@DTYPES
@pytest.mark.parametrize("case", ["plain", "no_memory"])
def test_batched_streams_take_chunks_and_the_tokens_of_single_steps(case, dtype):
    """A batch runs on the C++ token loop in chunks (several tokens per event), each row
    sampled by its own stream: the same tokens and text as one token per step
    (``decode_chunk=0``), with streams that end inside a chunk by their length or a stop
    string, and joining and leaving as they come."""
    m = srupp_lm(dtype, **CASES[case])
    for sampling in (greedy, seeded):
        with tuning().use(decode_chunk=0):
            steps = staggered(m, sampling)
        ref = events_of(steps)
        assert all(len(ev.tokens) <= 1 for evs in ref for ev in evs)
        chunked = staggered(m, sampling)
        assert tokens(chunked) == tokens(steps)
        assert [s.text for s in chunked] == [s.text for s in steps]
        sizes = [len(ev.tokens) for evs in events_of(chunked) for ev in evs]
        assert max(sizes) > 2, sizes
    # a stop string met inside a chunk: the stream ends there, the others go on
    full = tokens(alone(m, greedy))
    text = TOK.decode(full[1])
    stop = text[9:11]
    cut = text.index(stop)

    def with_stop(i):
        return Sampling(max_tokens=MAX_TOKENS[i], temperature=0, stop=[stop] if i == 1 else [])

    streams = together(m, with_stop)
    assert streams[1].finish_reason == STOP and streams[1].text == text[:cut]
    assert [s.generated for i, s in enumerate(streams) if i != 1] == \
        [t for i, t in enumerate(full) if i != 1]


@DTYPES
@pytest.mark.parametrize("case", list(CASES))
def test_a_stream_gives_the_same_logit_bits_alone_or_batched(case, dtype, logits_of):
    """bf16 too: every product, norm, attention and the recurrence computes a row in the
    same order whatever the batch. The one-token prompt joins a decoding batch with no
    cached keys of its memory: it takes its first step apart (before, joining it dropped
    every row's cache and the recomputed keys moved the others' logits by ~1e-7)."""
    m = srupp_lm(dtype, **CASES[case])
    reference = alone(m, greedy)
    assert_same_bits(together(m, greedy), reference, logits_of)
    assert_same_bits(staggered(m, greedy), reference, logits_of)
    sampled = alone(m, seeded)
    assert_same_bits(staggered(m, seeded), sampled, logits_of)


@DTYPES
def test_w8a8_weights_give_the_same_bits_alone_or_batched(dtype, logits_of):
    """w8a8 rounds each row of activations to int8 with its own scale and sums integer
    products exactly, so the grouping of rows changes nothing: bit for bit, as floats.
    Width 64: products of 32 and 64 inputs, where the int8 kernel's accumulators differ."""
    m = srupp_lm(dtype, "w8a8", d_model=64, proj_size=32)
    reference = alone(m, greedy)
    assert_same_bits(together(m, greedy), reference, logits_of)
    assert_same_bits(staggered(m, greedy), reference, logits_of)


@DTYPES
def test_int8_weights_give_the_same_tokens_alone_or_batched(dtype, logits_of):
    """int8 weights (float activations) are not bit for bit (next test): the logits agree
    to rounding (fp32: ~1e-5 apart here; bf16: the same bits in these runs, because each
    output is rounded to bf16 after its fp32 sum, which almost always hides a difference
    in the sum's last bits, but not always), and the tokens, whose logits are never that
    close, agree."""
    m = srupp_lm(dtype, "int8", d_model=64, proj_size=32)
    for sampling in (greedy, seeded):
        want = tokens(alone(m, sampling))
        assert tokens(together(m, sampling)) == want
        assert tokens(staggered(m, sampling)) == want
    reference = alone(m, greedy)
    for s, r in zip(staggered(m, greedy), reference):
        torch.testing.assert_close(logits_of(s), logits_of(r), rtol=1e-4, atol=1e-4)


def test_int8_rows_depend_on_their_group_size():
    """What holds for int8 weights, exactly. The few-rows int8 kernel (ops/csrc/quant.cpp,
    AVX-512) takes rows in groups of 8 and splits each row's sum over U accumulators, U set
    by the group's size: 4 for a row alone, 2 for 2-3 rows, 1 for 4-8. A row's bits thus
    depend on its group's size class and on nothing else: {1}, {2, 3}, {4..8} (products
    of fewer than 32 inputs use one accumulator whatever the class; the plain loop, on
    CPUs without AVX-512, is row-invariant). Making U depend on the width alone would make
    int8 batch-invariant too."""
    m = srupp_lm(torch.float32, "int8", d_model=64, proj_size=32)
    rows = []
    for p in ([3, 1, 4], [1, 5, 9, 2], [6, 5], [3, 5, 8, 9, 7], [9, 3], [2, 7], [3, 8, 4], [6, 2]):
        state = m.backbone.padded_state(1, WINDOW)
        if len(p) > 1:
            _, state = m.prefill(torch.tensor([p[:-1]]), state)
        rows.append((p[-1], state))
    first = {}
    with torch.no_grad(), batch_invariant(8):
        for n in range(1, 9):   # row 0's logits in a batch of n rows
            logits, _ = m.step(torch.tensor([t for t, _ in rows[:n]]),
                               SRUppState.cat([s for _, s in rows[:n]]))
            first[n] = logits[0]
    for group in ([2, 3], [4, 5, 6, 7, 8]):
        for n in group[1:]:
            assert torch.equal(bits(first[n]), bits(first[group[0]])), (group, n)
    for n in range(2, 9):  # across classes: the same to rounding
        torch.testing.assert_close(first[n], first[1], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------- other backbones
BACKBONES = {"transformer": dict(num_heads=2), "sru": {}, "lstm": {}, "gru": {}}


@pytest.mark.parametrize("kind,run", [
    *[(k, "together") for k in BACKBONES],
    *[(k, "staggered") for k in BACKBONES],
])
def test_other_backbones_give_the_same_tokens_alone_or_batched(kind, run, logits_of):
    """Tokens: the Transformer's padded one-query attention goes to SDPA and the LSTM and
    GRU are torch's own RNN kernels, none batch-invariant (logits ~1e-6 apart); the SRU is
    srupp's products and recurrence, bit for bit."""
    m = baseline_lm(kind, **BACKBONES[kind])
    reference = alone(m, greedy)
    got = {"together": together, "staggered": staggered}[run](m, greedy)
    if kind == "sru":
        assert_same_bits(got, reference, logits_of)
    else:
        assert tokens(got) == tokens(reference)
    assert [len(t) for t in tokens(got)] == MAX_TOKENS


# ------------------------------------------------------------ against generate
@pytest.mark.parametrize("case", ["plain", "heads", "attention_every_2", "no_attention"])
def test_one_stream_gives_generate_s_tokens(case):
    """A stream alone gives ``model.generate``'s greedy tokens (fp32) for prompts of at
    most WINDOW + 1 tokens. Not bit for bit: generate reads the whole prompt in one
    forward (GEMMs, the full attention) and samples from its last position, while the
    engine reads all but the last token and steps that one (few-rows products, the
    one-query attention over a memory padded to the window): the same context, other
    kernels, so the logits agree to rounding (checked below). Longer prompts see
    different context: in generate every prompt position attends to the whole prompt,
    in the engine the last token sees only the window (and prefill_chunk splits the
    rest), so neither tokens nor logits need agree; with window 0 the engine's last
    prompt token sees only itself. In bf16 the rounding differences can flip a token."""
    m = srupp_lm(**CASES[case])
    e = Engine(m, TOK, max_streams=4)
    for p in PROMPTS:
        if len(p) > WINDOW + 1:
            continue
        got = e.generate(p, Sampling(max_tokens=30, temperature=0)).generated
        assert got == m.generate([p], 30, temperature=0, mem_len=WINDOW)[0], p
        with torch.no_grad():
            full = m(torch.tensor([p])).logits[0, -1]
            state = m.backbone.padded_state(1, WINDOW)
            if len(p) > 1:
                _, state = m.prefill(torch.tensor([p[:-1]]), state)
            first, _ = m.step(torch.tensor(p[-1:]), state)
        torch.testing.assert_close(first[0], full, **tol(torch.float32))


# ------------------------------------------------------------ admission, lifecycle
def test_a_prompt_read_in_chunks_gives_the_same_tokens():
    """prefill_chunk 3: an 11-token prefix is read over 4 steps, the first token comes
    with the last chunk. Within the window every prompt position sees every earlier one
    either way, so only the rounding differs (GEMMs over other row counts)."""
    m = srupp_lm(mem_len=16)
    p = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    want = Engine(m, TOK, prefill_chunk=256).generate(p, greedy(0)).generated
    e = Engine(m, TOK, prefill_chunk=3)
    s = e.submit(p, greedy(0))
    for _ in range(3):
        e.step()
        assert s.generated == [] and e.active_streams == 1
    e.step()
    assert len(s.generated) >= 1
    drain(e)
    assert s.generated == want and s.finish_reason == LENGTH


def test_more_streams_than_slots_queue_and_all_finish():
    m = srupp_lm()
    want = tokens(alone(m, greedy))
    e = Engine(m, TOK, max_streams=2)
    streams = [e.submit(p, greedy(i)) for i, p in enumerate(PROMPTS)]
    assert e.queue_depth == 5
    most = 0
    while not e.idle:
        e.step()
        most = max(most, e.active_streams)
        assert e.active_streams <= 2
    assert most == 2 and e.queue_depth == 0
    assert tokens(streams) == want and all(s.finish_reason == LENGTH for s in streams)


def test_a_full_queue_refuses_and_a_closed_engine_takes_nothing():
    m = srupp_lm()
    e = Engine(m, TOK, max_streams=2, max_queue=1)
    # two take the free slots at the next step, one waits: the fourth is one too many
    first = [e.submit([1, 2], greedy(i)) for i in range(3)]
    with pytest.raises(QueueFull, match="max_queue"):
        e.submit([1, 2], greedy(0))
    e.step()
    assert e.active_streams == 2 and e.queue_depth == 1
    with pytest.raises(QueueFull):
        e.submit([1, 2], greedy(0))
    e.close()
    with pytest.raises(EngineClosed):
        e.submit([1, 2], greedy(0))
    drain(e)  # what was taken before close() finishes
    assert all(s.finish_reason == LENGTH and len(s.generated) == MAX_TOKENS[i]
               for i, s in enumerate(first))


def test_cancel_ends_a_stream_and_frees_its_slot():
    m = srupp_lm()
    want = tokens(alone(m, greedy))
    e = Engine(m, TOK, max_streams=2)
    a, b, c = (e.submit(PROMPTS[i], greedy(i)) for i in range(3))
    with tuning().use(decode_chunk=2):  # 2 tokens a step: a is mid-way
        for _ in range(6):
            e.step()
    assert e.queue_depth == 1 and 0 < len(a.generated) < MAX_TOKENS[0]
    a.cancel()
    e.step()
    assert a.finish_reason == ABORT and a.generated == want[0][:len(a.generated)]
    assert e.queue_depth == 0 and e.active_streams == 2  # c took a's slot
    events = list(a.events(timeout=1))
    assert events[-1].finish_reason == ABORT
    assert [t for ev in events for t in ev.tokens] == a.generated
    drain(e)
    assert [b.generated, c.generated] == want[1:3]  # a's leaving changed nothing of theirs
    assert b.finish_reason == c.finish_reason == LENGTH


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_arrivals_cancels_and_lengths_keep_every_stream_s_tokens(seed, monkeypatch):
    """Streams arrive, leave at their length or are cancelled, at random steps, on chunks of
    the C++ loop (the batch grows, compacts in place and refills): every stream that was
    not cancelled gives its tokens alone; a cancelled one, a prefix of them."""
    calls = {"keep_rows": 0, "chunks": 0}
    keep, chunk = SRUppState.keep_rows, Engine._run_chunk

    def counted_keep(self, rows):
        calls["keep_rows"] += 1
        return keep(self, rows)

    def counted_chunk(self, rows, pending):
        out = chunk(self, rows, pending)
        calls["chunks"] += out is not None
        return out

    monkeypatch.setattr(SRUppState, "keep_rows", counted_keep)
    monkeypatch.setattr(Engine, "_run_chunk", counted_chunk)
    rng = torch.Generator().manual_seed(seed)
    m = srupp_lm()
    n = 16
    prompts = [PROMPTS[int(torch.randint(len(PROMPTS), (1,), generator=rng))] for _ in range(n)]
    lengths = [int(torch.randint(3, 80, (1,), generator=rng)) for _ in range(n)]
    settings = [Sampling(max_tokens=k, temperature=0.8, top_k=12, seed=500 + i)
                for i, k in enumerate(lengths)]
    e1 = Engine(m, TOK, max_streams=8)
    want = [e1.generate(p, st).generated for p, st in zip(prompts, settings)]
    e = Engine(m, TOK, max_streams=8, max_queue=n)
    streams, cancelled, todo = [], set(), list(range(n))
    for _ in range(4000):
        if todo and float(torch.rand(1, generator=rng)) < 0.5:
            i = todo.pop(0)
            streams.append((i, e.submit(prompts[i], settings[i])))
        if streams and float(torch.rand(1, generator=rng)) < 0.05:
            i, s = streams[int(torch.randint(len(streams), (1,), generator=rng))]
            if not s.done:
                s.cancel()
                cancelled.add(i)
        e.step()
        if not todo and all(s.done for _, s in streams):
            break
    assert not todo and all(s.done for _, s in streams)
    for i, s in streams:
        if i in cancelled and s.finish_reason == ABORT:
            assert s.generated == want[i][:len(s.generated)]
        else:
            assert s.finish_reason == LENGTH and s.generated == want[i], i
    assert e.idle and e._batch is None
    assert calls["keep_rows"] > 0 and calls["chunks"] > 0, calls  # the paths ran


def test_max_tokens_0_gives_nothing(logits_of):
    m = srupp_lm()
    e = Engine(m, TOK)
    other = e.submit(PROMPTS[1], greedy(1))
    for _ in range(3):
        e.step()
    for p in ([4], [4, 5, 6]):  # beside a decoding stream, which they leave as it was
        s = e.generate(p, Sampling(max_tokens=0))
        assert s.generated == [] and s.text == "" and s.finish_reason == LENGTH
    drain(e)
    assert e.idle and e.active_streams == 0
    assert_same_bits([other], [Engine(m, TOK).generate(PROMPTS[1], greedy(1))], logits_of)


def test_a_stop_string_ends_a_stream_before_it():
    m = srupp_lm()
    e = Engine(m, TOK)
    full = e.generate(PROMPTS[0], greedy(0))
    assert full.text == TOK.decode(full.generated)
    # a two-character stop string whose first occurrence starts after the first few tokens
    k = next(k for k in range(3, len(full.text) - 1)
             if full.text.index(full.text[k:k + 2]) == k)
    stop = full.text[k:k + 2]
    s = e.generate(PROMPTS[0], Sampling(max_tokens=MAX_TOKENS[0], temperature=0, stop=[stop]))
    assert s.finish_reason == STOP and s.text == full.text[:k]
    assert s.generated == full.generated[:k + 2]  # the stop string's tokens were generated


def test_an_end_token_ends_a_stream_with_it():
    m = srupp_lm()
    out = Engine(m, TOK).generate(PROMPTS[1], greedy(1)).generated
    eos = out[4]
    first = out.index(eos)
    s = Engine(m, TOK, eos_id=eos).generate(PROMPTS[1], greedy(1))
    assert s.finish_reason == STOP and s.generated == out[:first + 1]


@pytest.mark.parametrize("prompt,match", [([1, V], "outside the vocabulary"),
                                          ([-1], "outside the vocabulary"),
                                          ([], "at least one token"),
                                          ([1] * 9, "more than the limit of 8")])
def test_bad_prompts_are_value_errors(prompt, match):
    e = Engine(srupp_lm(), TOK, max_prompt_tokens=8)
    with pytest.raises(ValueError, match=match):
        e.submit(prompt, greedy(0))
    assert e.idle


@pytest.mark.parametrize("field,value", [("max_tokens", -1), ("temperature", math.nan),
                                         ("temperature", -0.5), ("top_p", 0.0),
                                         ("top_k", 0), ("seed", -1)])
def test_sampling_rejects_bad_values_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        Sampling(**{field: value})


# --------------------------------------------------------------------- sessions
P1, P2 = [3, 1, 4, 1, 5], [9, 2, 6]


def session_engine(m, directory=None, **kw):
    return Engine(m, TOK, max_streams=4,
                  sessions=SessionStore(directory, model_id=model_fingerprint(m)), **kw)


@pytest.mark.parametrize("on_disk", [False, True], ids=["memory", "disk"])
def test_a_session_continues_as_one_request_of_the_whole_conversation(on_disk, tmp_path):
    """(P1, s) -> O1, then (P2, s) -> O2 = the greedy tokens of a fresh P1 + O1 + P2. The
    session read P1 as a prompt and O1 through steps, the fresh request reads it all as
    one prompt: the same context (it fits in the window), other kernels, so this holds
    to rounding and is compared as tokens."""
    m = srupp_lm(mem_len=32)
    e = session_engine(m, tmp_path if on_disk else None)
    o1 = e.generate(P1, Sampling(max_tokens=6, temperature=0), session="s").generated
    # the second request decodes beside another stream
    other = e.submit(PROMPTS[1], greedy(1))
    o2 = e.generate(P2, Sampling(max_tokens=10, temperature=0), session="s").generated
    drain(e)
    fresh = Engine(m, TOK).generate(P1 + o1 + P2, Sampling(max_tokens=10, temperature=0))
    assert o2 == fresh.generated
    assert other.generated == Engine(m, TOK).generate(PROMPTS[1], greedy(1)).generated
    assert e.sessions.get("s").tokens == len(P1 + o1 + P2 + o2)
    assert ((tmp_path / "s.safetensors").is_file()) == on_disk


@pytest.mark.parametrize("end", ["stop", "eos"])
def test_a_session_that_ends_inside_a_chunk_continues_from_its_last_token(end, monkeypatch):
    """A session stream in a batch on chunks of the C++ loop, ended by a stop string or the
    end token inside a chunk (its row decodes on): its session keeps the state after its
    last token, so (P1, s) -> O1, (P2, s) -> O2 gives a fresh P1 + O1 + P2's tokens."""
    m = srupp_lm(mem_len=32)
    free = Engine(m, TOK).generate(P1, Sampling(max_tokens=30, temperature=0)).generated
    k = 12  # it ends at token k (0-based): inside the chunk that the loop runs
    text = TOK.decode(free)
    if end == "stop":
        stop = text[k:k + 2]
        k = text.index(stop) + 1  # the stop string's last token
        first, kw = Sampling(max_tokens=30, temperature=0, stop=[stop]), {}
    else:
        k = free.index(free[k])
        first, kw = Sampling(max_tokens=30, temperature=0), {"eos_id": free[k]}
    inside = []
    real = Engine._run_chunk

    def watch(self, rows, pending):
        out = real(self, rows, pending)
        inside.extend(s for s, ids in (out or []) if s.session == "s" and len(ids) > 2)
        return out

    monkeypatch.setattr(Engine, "_run_chunk", watch)
    e = session_engine(m, **kw)
    other = e.submit(PROMPTS[1], greedy(1))
    o1 = e.generate(P1, first, session="s").generated
    assert o1 == free[:k + 1] and inside  # ended at its token k, on a chunk
    # the state kept is the one single steps leave (to rounding: read, not stepped)
    with tuning().use(decode_chunk=0):
        ref = session_engine(m, **kw)
        ref.generate(P1, first, session="s")
    kept, want = e.sessions.get("s"), ref.sessions.get("s")
    assert kept.pending == want.pending and kept.tokens == want.tokens
    torch.testing.assert_close(kept.state.c, want.state.c, **tol(torch.float32))
    o2 = e.generate(P2, Sampling(max_tokens=10, temperature=0), session="s").generated
    drain(e)
    fresh = Engine(m, TOK, **kw).generate(P1 + o1 + P2, Sampling(max_tokens=10, temperature=0))
    assert o2 == fresh.generated
    assert other.generated == Engine(m, TOK, **kw).generate(PROMPTS[1], greedy(1)).generated


def test_a_session_takes_one_request_at_a_time():
    e = session_engine(srupp_lm())
    first = e.submit(P1, greedy(0), session="s")
    with pytest.raises(SessionBusy, match="'s'"):
        e.submit(P2, greedy(0), session="s")
    e.submit(P2, greedy(1), session="t")  # another session is free
    drain(e)
    assert first.finish_reason == LENGTH
    e.generate(P2, Sampling(max_tokens=2), session="s")  # free again


@pytest.mark.parametrize("p2", [P2, []], ids=["prompt", "no_prompt"])
def test_a_session_continues_the_same_after_the_store_is_reloaded(p2, tmp_path, logits_of):
    """The file keeps no cached keys and values: the first step after loading recomputes
    them (with a prompt, prefill does; without, the state steps apart before it joins, so
    the stream decoding beside it keeps its bits)."""
    m = srupp_lm(mem_len=32)
    e = session_engine(m, tmp_path)
    e.generate(P1, Sampling(max_tokens=6, temperature=0), session="s")
    later = Sampling(max_tokens=12, temperature=0)
    reloaded = session_engine(m, tmp_path)
    assert all(kv is None for kv in reloaded.sessions.get("s").state.kv_cache)
    other = reloaded.submit(PROMPTS[1], greedy(1))
    for _ in range(4):
        reloaded.step()
    got = reloaded.submit(p2, later, session="s")
    drain(reloaded)
    assert got.generated == e.generate(p2, later, session="s").generated  # from memory
    assert_same_bits([other], [Engine(m, TOK).generate(PROMPTS[1], greedy(1))], logits_of)


# ------------------------------------------------------------------ state bytes
def expected_bytes(m, window):
    """c (layers, 1, D) fp32, and for each attention layer its memory (window, n_in) and
    keys and values (window, 2 d') in the model's dtype, with one padding mask (window)."""
    layers = m.backbone.rnn.layers
    n = 4 * len(layers) * layers[0].output_size
    attending = [layer for layer in layers if layer.use_attention]
    if window and attending:
        size = m.embedding.weight.element_size()
        n += window + sum(window * (layer.input_size + 2 * layer.proj_size) * size
                          for layer in attending)
    return n


@pytest.mark.parametrize("case,dtype", [("plain", torch.float32), ("plain", torch.bfloat16),
                                        ("attention_every_2", torch.float32),
                                        ("no_attention", torch.float32),
                                        ("no_memory", torch.float32)])
def test_a_stream_s_state_keeps_its_bytes(case, dtype):
    m = srupp_lm(dtype, **CASES[case])
    window = m.config.mem_len
    e = session_engine(m)
    assert e.state_bytes == expected_bytes(m, window)
    other = e.submit(PROMPTS[4], Sampling(max_tokens=3 * WINDOW + 5, temperature=0))
    s = e.submit(PROMPTS[0], Sampling(max_tokens=3 * WINDOW, temperature=0), session="s")
    while not s.done:
        e.step()
        batch = e._batch  # every row of the decoding batch keeps `window` positions
        if batch is not None and window and "no_attention" != case:
            assert batch.memory_length == window and batch.memory_mask_pad.shape[1] == window
            assert batch.nbytes() == batch.batch_size * e.state_bytes
    drain(e)
    kept = e.sessions.get("s").state  # the stream's state after 3 x window tokens
    assert kept.memory_length == (window if "no_attention" != case else 0)
    assert kept.nbytes() == e.state_bytes and len(other.generated) == 3 * WINDOW + 5


def test_a_damaged_session_ends_its_stream_and_the_engine_goes_on(tmp_path):
    """A session file that cannot be read ends that stream (ABORT, with the reason in
    ``error``); the engine is not stuck on it, and the next stream decodes."""
    model = srupp_lm()
    (tmp_path / "bad.safetensors").write_bytes(b"garbage")
    store = SessionStore(tmp_path, model_id=model_fingerprint(model))
    engine = Engine(model, TOK, max_streams=1, sessions=store)
    bad = engine.submit([3], Sampling(max_tokens=2, temperature=0), session="bad")
    good = engine.submit([3, 4], Sampling(max_tokens=3, temperature=0))
    for _ in range(20):
        engine.step()
    assert bad.finish_reason == ABORT and bad.error and "bad" in bad.error
    assert good.finish_reason == LENGTH and len(good.generated) == 3


def test_an_adaptive_softmax_model_decodes_through_the_engine():
    """A model with an adaptive input and softmax (no C++ token loop for it) decodes alone
    on the batched step, and gives the same tokens alone or beside another stream."""
    from srupp.models import CausalLM, SRUppConfig

    torch.manual_seed(0)
    model = CausalLM(SRUppConfig(vocab_size=V, d_model=16, proj_size=8, num_layers=2,
                                 dropout=0.0, mem_len=8, adaptive_cutoffs=[10, 20], div_val=2,
                                 emb_dim=8, tie_embeddings=True)).eval()
    perturb(model)
    greedy = Sampling(max_tokens=12, temperature=0)
    alone = Engine(model, TOK, max_streams=2).generate([3, 1, 4], greedy).generated
    engine = Engine(model, TOK, max_streams=2)
    a, b = engine.submit([3, 1, 4], greedy), engine.submit([2, 7], greedy)
    while not (a.done and b.done):
        engine.step()
    assert a.generated == alone and len(alone) == 12


def test_run_ends_the_grace_period_when_told_to_hurry():
    """run(stop, grace, now): once stopped, streams in flight finish within the grace
    period; setting ``now`` (a server's second signal) aborts them at the next step."""
    import threading

    engine = Engine(srupp_lm(), TOK, max_streams=2)
    long = engine.submit([3, 4], Sampling(max_tokens=10**6, temperature=0))
    stop, now = threading.Event(), threading.Event()
    worker = threading.Thread(target=engine.run, args=(stop,), kwargs=dict(grace=600, now=now))
    worker.start()
    while len(long.generated) < 5:
        time.sleep(0.01)
    stop.set()
    time.sleep(0.2)
    assert worker.is_alive() and not long.done  # within its grace period: decoding on
    now.set()
    worker.join(10)
    assert not worker.is_alive() and long.finish_reason == ABORT
