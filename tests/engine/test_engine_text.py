"""TextDecoder (streamed text == decode of all ids, for every tokenizer, in linear work)
and StopMatcher (stop strings across pieces), and check_stops."""

import random

import numpy as np
import pytest
import torch

from srupp.data.tokenizers import ByteTokenizer, build_tokenizer
from srupp.engine.text import StopMatcher, TextDecoder, check_stops

try:
    import sentencepiece  # noqa: F401
    HAVE_SP = True
except ImportError:
    HAVE_SP = False

TEXT = ("the cat sat on the mat\nhéllo wörld 你好 😀 ok\n"
        "the dog ran 🐕‍🦺 über ß\n\nthe  end  ")
SP_TRAIN = "\n".join(f"the {a} {b} sat on the {c} ran"
                     for a in ("cat", "dog", "fox") for b in ("quickly", "slowly")
                     for c in ("mat", "hat", "rug")) + "\n"


class Counting:
    """A tokenizer that counts the ids each decode call is given."""

    def __init__(self, tok):
        self.tok, self.calls, self.decoded = tok, 0, 0
        self.vocab_size = tok.vocab_size

    def decode(self, ids):
        self.calls += 1
        self.decoded += len(ids)
        return self.tok.decode(ids)


def tokenizers():
    toks = {"byte": ByteTokenizer(),
            "char": build_tokenizer("char", TEXT[:40]),  # leaves some characters unknown
            "word": build_tokenizer("word", TEXT)}
    if HAVE_SP:
        # tiny models (a few ms): byte fallback with both model types, and one without
        for mt in ("unigram", "bpe"):
            toks[f"sp-{mt}"] = build_tokenizer("sentencepiece", SP_TRAIN, vocab_size=280,
                                               model_type=mt)
        toks["sp-nofallback"] = build_tokenizer("sentencepiece", SP_TRAIN, vocab_size=26,
                                                byte_fallback=False)
    else:
        print("sentencepiece is not installed: the sentencepiece cases are left out")
    return toks


TOKS = tokenizers()


def interesting_ids(tok) -> list:
    """Ids to draw from, with the ones whose text depends on their neighbours (the
    specials, SentencePiece's whitespace piece, bytes past ASCII) drawn more often."""
    ids = list(range(tok.vocab_size))
    if tok.type_name == "sentencepiece":
        ws = tok._sp.piece_to_id("▁")
        ids += [0, 1] * 5 + [ws] * 15
        if tok.byte_fallback:
            ids += [2 + b for b in range(0x80, 0x100)]
    elif tok.type_name == "word":
        ids += [0, 1] * 3
    elif tok.type_name == "char":
        ids += [0] * 3
    return ids


def stream(dec, ids):
    """Push ids, checking after each that the text so far is final; returns the pieces."""
    pieces = []
    for k, t in enumerate(ids):
        pieces.append(dec.push(t))
        shown = "".join(pieces)
        assert dec.tokenizer.decode(ids[:k + 1]).startswith(shown), (k, shown)
    pieces.append(dec.flush())
    return pieces


# ------------------------------------------------------------------------- TextDecoder

@pytest.mark.parametrize("name", list(TOKS))
def test_decoder_pieces_are_the_decoded_text_for_random_ids(name):
    tok = TOKS[name]
    rng = random.Random(1234)
    pool = interesting_ids(tok)
    for trial in range(40):
        ids = [rng.choice(pool) for _ in range(rng.randrange(0, 60))]
        dec = TextDecoder(tok)
        pieces = stream(dec, ids)
        assert "".join(pieces) == tok.decode(ids), (trial, ids)
        assert dec.text == tok.decode(ids) and dec.ids == ids


@pytest.mark.parametrize("name", list(TOKS))
def test_push_many_gives_the_text_of_pushing_one_by_one(name):
    """Ids handed on in chunks of random sizes (the engine's chunks) give, chunk by chunk,
    the pieces that pushing each id alone gives, joined: bytes past ASCII and invalid
    UTF-8 split across chunks included."""
    tok = TOKS[name]
    rng = random.Random(99)
    pool = interesting_ids(tok)
    for trial in range(40):
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 80))]
        one, many = TextDecoder(tok), TextDecoder(tok)
        k = 0
        while k < len(ids):
            n = rng.randrange(1, 12)
            want = "".join(one.push(t) for t in ids[k:k + n])
            assert many.push_many(ids[k:k + n]) == want, (trial, ids, k, n)
            k += n
        assert many.flush() == one.flush() and many.text == tok.decode(ids)
        assert many.ids == ids


def test_push_many_refuses_a_bad_id_and_keeps_none_of_the_chunk():
    dec = TextDecoder(ByteTokenizer())
    for bad in ([104, 256], [-1], [104, "a"], [True]):
        with pytest.raises((ValueError, TypeError), match="token id"):
            dec.push_many(bad)
    assert dec.ids == [] and dec.text == ""
    assert dec.push_many([104, np.int64(105)]) == "hi"


@pytest.mark.parametrize("name", list(TOKS))
def test_decoder_shows_encoded_text_without_delay(name):
    """Ids of real text: after each id the whole text of the ids so far is shown,
    unless it ends in an incomplete character (U+FFFD)."""
    tok = TOKS[name]
    ids = tok.encode(TEXT).tolist()
    dec = TextDecoder(tok)
    for k, t in enumerate(ids):
        dec.push(t)
        now = tok.decode(ids[:k + 1])
        if not now.endswith("\ufffd"):
            assert dec.text == now, k
    dec.flush()
    assert dec.text == tok.decode(ids)


def test_decoder_byte_characters_split_across_tokens():
    tok = ByteTokenizer()
    ids = list("a😀b你".encode())  # 1 + 4 + 1 + 3 bytes
    dec = TextDecoder(tok)
    assert [dec.push(t) for t in ids] == ["a", "", "", "", "😀", "b", "", "", "你"]
    assert dec.flush() == ""
    # random valid text of multi-byte characters, with random bytes slipped in
    rng = random.Random(7)
    alphabet = "aé你😀🐕\u200d\n "
    for trial in range(60):
        data = bytearray("".join(rng.choice(alphabet) for _ in range(20)).encode())
        for _ in range(rng.randrange(4)):
            data.insert(rng.randrange(len(data) + 1), rng.randrange(0x80, 0x100))
        ids = list(data)
        assert "".join(stream(TextDecoder(tok), ids)) == tok.decode(ids), ids
    # runs of bytes that are mostly no character (long enough to be cut), with
    # invalid sequences that cross the cuts (f0 98 80 is one U+FFFD, 98 80 two)
    for trial in range(100):
        ids = [rng.choice([0x61, 0xE4, 0xF0, 0xF4, 0x80, 0x98, 0xBD, 0xFF]) for _ in range(60)]
        assert "".join(stream(TextDecoder(tok), ids)) == tok.decode(ids), ids


def test_decoder_flush_gives_an_incomplete_character_as_decode_does():
    tok = ByteTokenizer()
    assert TextDecoder(tok).flush() == ""  # no ids, no text
    dec = TextDecoder(tok)
    assert [dec.push(t) for t in [0x61, 0xF0, 0x9F, 0x98]] == ["a", "", "", ""]
    assert dec.flush() == "\ufffd" == tok.decode([0xF0, 0x9F, 0x98])
    assert dec.text == tok.decode([0x61, 0xF0, 0x9F, 0x98])
    assert dec.flush() == ""  # once only
    with pytest.raises(ValueError, match="flushed"):
        dec.push(0x61)


@pytest.mark.skipif(not HAVE_SP, reason="sentencepiece is not installed")
def test_decoder_sentencepiece_whitespace_and_bytes():
    """SentencePiece drops whitespace pieces at a line's start only, and gives a
    byte-fallback character once its last byte piece comes."""
    tok = TOKS["sp-unigram"]
    P = tok._sp.piece_to_id
    ws, t, h = P("▁"), P("t"), P("h")
    cases = [[t, ws, ws, ws, h],           # "t   h": mid-line spaces are kept
             [ws, ws, t, ws, h],           # "t h": leading ones are dropped
             [t, 1, ws, ws, h, ws, 1, ws],  # the same after <eos>
             [t, ws] + [2 + b for b in "😀".encode()] + [ws, h]]
    for ids in cases:
        assert "".join(stream(TextDecoder(tok), ids)) == tok.decode(ids), ids
    dec = TextDecoder(tok)
    emoji = [2 + b for b in "😀".encode()]
    assert [dec.push(i) for i in [t] + emoji] == ["t", "", "", "", "😀"]
    assert dec.flush() == ""


def test_decoder_word_tokenizer_spaces_and_lines():
    tok = TOKS["word"]
    ids = tok.encode("the cat\nsat\n\non the mat").tolist()
    dec = TextDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert pieces[:4] == ["the", " cat", "\n", "sat"]
    assert "".join(pieces) == tok.decode(ids) == "the cat\nsat\n\non the mat\n"


def long_runs(tok):
    """Runs of ids whose text is not final for long: (ids, whether text after the run is
    still shown at once). Only SentencePiece whitespace pieces in the middle of a line
    delay the text after them (no short window decodes them in context)."""
    if tok.type_name == "byte":
        return [([0xFF] * 1000, True), ([0xE4] * 500 + [0xBD] * 500, True),
                ([0xF0, 0x9F, 0x98] * 333, True)]
    if tok.type_name == "sentencepiece":
        P = tok._sp.piece_to_id
        runs = [([1] + [P("▁")] * 1000, True), ([P("t")] + [P("▁")] * 1000, False)]
        if tok.byte_fallback:
            runs.append(([2 + 0xFF] * 1000, True))
        return runs
    return [([0] * 1000, True)]  # <unk>: U+FFFD for the char tokenizer


def counted(tok, ids):
    """Stream ids through a TextDecoder that counts its decoding; check the text.
    Returns the counts and the text shown before flush."""
    counting = Counting(tok)
    dec = TextDecoder(counting)
    for t in ids:
        dec.push(t)
    pushed = dec.text
    dec.flush()
    assert dec.text == tok.decode(ids)
    return counting, pushed


@pytest.mark.parametrize("name", list(TOKS))
def test_decoder_work_is_linear(name):
    """The ids handed to decode grow linearly with the output (decoding everything at
    every push hands n**2 / 2), for ordinary text and for long runs whose text is not
    final; counted, not timed."""
    tok = TOKS[name]
    ids = tok.encode(TEXT * 15).tolist()
    n = len(ids)
    c, _ = counted(tok, ids)
    assert c.decoded <= 8 * n and c.calls <= 3 * n, (c.decoded, c.calls, n)
    tail = tok.encode("the cat sat\n").tolist()
    for run, prompt in long_runs(tok):
        n = len(run + tail)
        c, pushed = counted(tok, run + tail)
        assert c.decoded <= 80 * n and c.calls <= 3 * n, (c.decoded, c.calls, n)
        if prompt:  # the window is short again after the run: the tail's text is shown
            assert pushed == tok.decode(run + tail)


class Parity:
    """A toy tokenizer whose text depends on earlier ids: id 0 is "x" after an even
    number of x since the last "a" (id 1), else "X"."""

    vocab_size = 2

    def decode(self, ids):
        out, odd = [], False
        for i in ids:
            out.append(("X" if odd else "x") if i == 0 else "a")
            odd = not odd if i == 0 else False
        return "".join(out)


def test_decoder_anchors_only_on_ids_whose_own_text_ends_the_window():
    """An "x" alone is no anchor after an odd number of x (it reads "x" where the window
    has "X"): anchored there, the x after it would come out the wrong way round."""
    tok = Parity()
    rng = random.Random(5)
    for trial in range(30):
        ids = [rng.choice([0, 0, 0, 1]) for _ in range(rng.randrange(1, 80))]
        assert "".join(stream(TextDecoder(tok), ids)) == tok.decode(ids), ids


def test_decoder_errors():
    dec = TextDecoder(ByteTokenizer())
    for bad, err in [(256, ValueError), (-1, ValueError), ("a", TypeError),
                     (1.0, TypeError), (True, TypeError), (None, TypeError)]:
        with pytest.raises(err, match="token id"):
            dec.push(bad)
    assert dec.ids == [] and dec.text == ""  # a refused id is not kept
    with pytest.raises(TypeError, match="decode"):
        TextDecoder(object())
    assert dec.push(np.int64(104)) + dec.push(torch.tensor(105)) == "hi"


# ------------------------------------------------------------------------- StopMatcher

def cut(text, stops):
    """The text before the earliest occurrence of any stop string, and whether one occurs."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def open_tail(text, stops):
    """Length of the longest end of text that begins some stop string (brute force)."""
    return max([k for k in range(1, len(text) + 1) if any(s.startswith(text[-k:]) for s in stops)],
               default=0)


def run_stops(stops, pieces):
    """Feed pieces; check each answer against a brute-force account; return the text."""
    m, out, fed = StopMatcher(stops), [], ""
    for p in pieces:
        fed += p
        text, stopped = m.feed(p)
        out.append(text)
        want, hit = cut(fed, stops)
        assert stopped == hit == m.stopped
        sent = "".join(out)
        # sent exactly what cannot start a stop string: no more, no less
        assert sent == (want if hit else fed[:len(fed) - open_tail(fed, stops)]), (pieces, sent)
    out.append(m.flush())
    return "".join(out)


def test_stops_random_splits():
    rng = random.Random(2024)
    for trial in range(400):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 4)))
                 for _ in range(rng.randrange(1, 4))]
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 25)))
        cuts = sorted(rng.randrange(len(text) + 1) for _ in range(rng.randrange(0, 6)))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        assert run_stops(stops, pieces) == cut(text, stops)[0], (stops, pieces)


def test_stops_split_at_every_position():
    text = "Hello. ###END### trailing END"
    stops = ["###END###", "END!"]
    want = "Hello. "
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert run_stops(stops, [text[:i], text[i:j], text[j:]]) == want, (i, j)
    assert run_stops(stops, list(text)) == want


def test_stops_overlapping():
    assert run_stops(["aab", "ab"], list("xaab")) == "x"
    assert run_stops(["ab", "aab"], list("aaab")) == "a"  # "aab" starts first
    assert run_stops(["aab"], list("aaaab")) == "aa"
    assert run_stops(["abab"], ["aba", "bab"]) == ""
    assert run_stops(["aab"], list("aaac")) == "aaac"  # held, then released
    m = StopMatcher(["aab"])
    assert m.feed("xaa") == ("x", False) and m.flush() == "aa"


def test_stops_after_stop_and_without_stops():
    m = StopMatcher(["\n\n"])
    assert m.feed("one\n") == ("one", False)
    assert m.feed("\ntwo") == ("", True)
    assert m.feed("three") == ("", True) and m.flush() == "" and m.stopped
    m = StopMatcher([])
    assert m.feed("a") == ("a", False) and m.flush() == "" and not m.stopped
    assert StopMatcher("ab").stops == ("ab",)  # a string is one stop string


def pipeline(tok, ids, stops):
    """TextDecoder into StopMatcher, as the engine uses them: (text, stopped at step)."""
    dec, m, out = TextDecoder(tok), StopMatcher(stops), []
    for k, t in enumerate(ids):
        text, stopped = m.feed(dec.push(t))
        out.append(text)
        if stopped:
            return "".join(out), k
    out.append(m.feed(dec.flush())[0] + m.flush())
    return "".join(out), (len(ids) if m.stopped else None)


def test_stop_inside_a_held_back_character():
    tok = ByteTokenizer()
    ids = list("x😀y".encode())
    # the stop is found once the character's last byte comes, not before
    assert pipeline(tok, ids, ["😀"]) == ("x", 4)
    assert pipeline(tok, ids, ["😀y"]) == ("x", 5)
    # the U+FFFD of a character still incomplete never reaches the stop strings ...
    assert pipeline(tok, ids, ["\ufffd"]) == ("x😀y", None)
    # ... but one that decode gives for good does: bytes that are no character
    assert pipeline(tok, list(b"x\xf0\x9fy"), ["\ufffd"]) == ("x", 3)
    assert pipeline(tok, list(b"x\xf0\x9f"), ["\ufffd"]) == ("x", 3)  # at flush


def test_check_stops():
    assert check_stops(None) == []
    assert check_stops("x") == ["x"]
    assert check_stops(["a", "bc"]) == ["a", "bc"]
    assert check_stops(("a",)) == ["a"]
    assert check_stops([]) == []
    assert len(check_stops(["s"] * 9)) == 9  # the server limits the number, not this
    with pytest.raises(ValueError, match="^stop is an empty string"):
        check_stops("")
    with pytest.raises(ValueError, match=r"^stop\[1\] is an empty string"):
        check_stops(["a", ""])
    with pytest.raises(TypeError, match=r"^stop\[0\] must be a string"):
        check_stops([1])
    for bad in (5, {"a"}, b"ab", {"stop": "a"}):
        with pytest.raises(TypeError, match="^stop must be a string or a list of strings"):
            check_stops(bad)
    with pytest.raises(ValueError, match="stop"):
        StopMatcher([""])
    with pytest.raises(TypeError, match="stop"):
        StopMatcher(["a", None])
    with pytest.raises(TypeError, match="feed takes text"):
        StopMatcher(["a"]).feed(b"a")
