"""Text for streaming: token ids to final text as they come, and stop strings.

    TextDecoder   the text of a growing list of ids, piece by piece (any srupp tokenizer)
    StopMatcher   cuts a stream of text before the first of some stop strings
    check_stops   OpenAI's ``stop`` (None, a string or a list of strings) as a list

Streaming needs the text of each new token, but a token's text is not always
``decode([token])``: a byte tokenizer's character can span several ids (the first
bytes decode to U+FFFD until the rest come), a word tokenizer puts a space between
two words, and SentencePiece drops the whitespace at the start of a line. Decoding
all the ids again at every token gives the right text but costs the whole output
per token. :class:`TextDecoder` decodes a short window instead: a few ids already
shown (the anchor, whose text gives the new ids their context) and the new ones,
and hands on what the window's text adds to the anchor's.
"""

from __future__ import annotations

import codecs
import operator
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from srupp.data.tokenizers import Tokenizer

__all__ = ["TextDecoder", "StopMatcher", "check_stops"]

#: What decoding writes for bytes that are not (yet) a whole character.
REPLACEMENT = "\ufffd"


class TextDecoder:
    """The text of ids pushed one at a time; the pieces together are ``decode(ids)``.

    ``push(id)`` returns the text that id makes final (often ``""`` while a
    character is incomplete), ``flush()`` the rest at the end. For every
    tokenizer of srupp (byte, char, word, sentencepiece) the pieces concatenate
    to ``tokenizer.decode(ids)`` exactly.

    How: the ids are split as ``shown | anchor | new``. The text of ``shown`` and
    ``anchor`` has been handed on; ``anchor`` (usually one token) is decoded again
    with ``new`` so that what ``new`` adds is decoded in context (the space before
    a word, a character's first bytes), and the difference is handed on. Text
    ending in U+FFFD is held back: more ids may complete the character. After
    each piece, the anchor moves to the shortest suffix of the ids whose own
    text ends the window's text (one token, or a whole multi-byte character), so
    the window stays a few tokens and ``push`` decodes O(1) ids.

    Held-back runs longer than a character (bytes that are no character, or
    <unk> ids that decode to U+FFFD) are cut where ``MARGIN`` later ids show the
    text before the cut cannot change. A window that still grows past
    ``WINDOW`` ids (SentencePiece whitespace pieces in the middle of a line, which
    no short window decodes in context) is decoded only every ``width //
    WINDOW`` pushes: its text comes out later, exact, and the work stays linear.
    """

    #: Ids a window holds before it is decoded only now and then (see above).
    WINDOW = 32
    #: The longest anchor looked for (a UTF-8 character is at most 4 byte tokens).
    ANCHOR = 8
    #: Ids after a cut that settle the text before it: a UTF-8 character that
    #: crosses the cut ends at most 3 bytes after it.
    MARGIN = 3
    #: Held-back ids (no final text) at which a cut is looked for.
    HOLD = 6

    def __init__(self, tokenizer: "Tokenizer"):
        if not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"TextDecoder needs a tokenizer with decode(ids), got "
                            f"{type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        self._vocab = int(tokenizer.vocab_size)
        self._ids: List[int] = []
        self._start = 0          # the anchor is ids[_start:_read]; ids before it are shown
        self._read = 0           # the text of ids[:_read] has been handed on
        self._anchor_text = ""   # decode(ids[_start:_read])
        self._skipped = 0        # pushes not decoded since the last decode (long windows)
        self._pieces: List[str] = []
        self._finished = False
        # bytes: Python's incremental UTF-8 decoder gives decode's text exactly, a byte at
        # a time (an incomplete character waits, an invalid byte is U+FFFD at once)
        self._utf8 = (codecs.getincrementaldecoder("utf-8")(errors="replace")
                      if getattr(tokenizer, "type_name", None) == "byte" else None)

    @property
    def ids(self) -> List[int]:
        """The ids pushed so far (a copy)."""
        return list(self._ids)

    @property
    def text(self) -> str:
        """All the text handed on so far (by push and flush)."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def push(self, token_id: int) -> str:
        """Add one id; return the text that is now final (may be ``""``)."""
        if self._finished:
            raise ValueError("this TextDecoder was flushed: the stream has ended; start a new "
                             "TextDecoder for a new stream")
        self._ids.append(self._check_id(token_id))
        if self._utf8 is not None:
            return self._emit(self._utf8.decode(bytes((self._ids[-1],))))
        width = len(self._ids) - self._start
        if width > self.WINDOW:
            self._skipped += 1
            if self._skipped < width // self.WINDOW:
                return ""  # a long window: decoded every width // WINDOW pushes
        self._skipped = 0
        return self._advance(final=False)

    def push_many(self, token_ids: Sequence[int]) -> str:
        """Add several ids; return the text that is now final: the pieces that pushing
        them one by one returns, joined. A byte tokenizer's ids are decoded in one call
        (Python's incremental UTF-8 decoder gives the same text in any split), which
        costs a tenth of pushing them one at a time (the engine hands on a chunk of ids
        per stream at once)."""
        if self._utf8 is None or self._finished:
            return "".join([self.push(t) for t in token_ids])
        ids = list(token_ids)
        if not (ids and all(type(t) is int for t in ids) and 0 <= min(ids)
                and max(ids) < self._vocab):
            ids = [self._check_id(t) for t in ids]  # (raises for the first bad id)
        self._ids += ids
        return self._emit(self._utf8.decode(bytes(ids)))

    def flush(self) -> str:
        """The text still held back, as ``decode`` gives it (an incomplete character is
        U+FFFD); the stream has ended and takes no more ids."""
        if self._finished:
            return ""
        piece = (self._emit(self._utf8.decode(b"", final=True)) if self._utf8 is not None
                 else self._advance(final=True))
        self._finished = True
        return piece

    # ------------------------------------------------------------------ internals

    def _check_id(self, token_id: Any) -> int:
        if isinstance(token_id, bool):
            raise TypeError("push takes a token id (an int), got a bool")
        try:
            t = operator.index(token_id)
        except TypeError:
            raise TypeError(f"push takes a token id (an int), got "
                            f"{type(token_id).__name__}") from None
        if not 0 <= t < self._vocab:
            raise ValueError(f"token id {t} is outside the tokenizer's vocabulary "
                             f"(0..{self._vocab - 1}); the ids come from a model made with a "
                             f"different tokenizer")
        return t

    def _decode(self, lo: int, hi: int) -> str:
        return self.tokenizer.decode(self._ids[lo:hi])

    def _emit(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
        return piece

    def _advance(self, final: bool) -> str:
        """Hand on what the window's text adds to the anchor's, if it is final."""
        n = len(self._ids)
        if self._read == n:
            return ""
        window = self._decode(self._start, n)
        if not window.startswith(self._anchor_text):
            # The new ids changed the anchor's text: wait for more, and at the end
            # take the difference from the whole text (no tokenizer of srupp does this).
            if not final:
                return ""
            full, shown = self.tokenizer.decode(self._ids), self.text
            if not full.startswith(shown):
                raise RuntimeError("the tokenizer's text for these ids does not begin with "
                                   "the text streamed so far; it cannot be streamed")
            self._read = n
            return self._emit(full[len(shown):])
        if not final and window.endswith(REPLACEMENT):
            # perhaps the first bytes of a character: hold back, or cut a long run
            return self._cut(window) if n - self._read >= self.HOLD else ""
        piece = window[len(self._anchor_text):]
        self._start, self._anchor_text = self._anchor(n, window)
        self._read = n
        return self._emit(piece)

    def _cut(self, window: str) -> str:
        """Hand on the text of a held-back run up to a cut ``s`` at least MARGIN ids
        before its end, where the ids show that text is final: the window's text
        begins with it (the MARGIN ids after the cut settle a character that crosses
        it), and the new anchor decodes the rest of the window to the same text (it
        does not, e.g., where an invalid byte sequence crosses the cut: decoded from
        inside, its bytes are U+FFFD each, in the window one U+FFFD for all).
        Returns the piece ("" with no cut)."""
        n = len(self._ids)
        for s in range(n - self.MARGIN, max(self._read, n - self.MARGIN - 4), -1):
            head = self._decode(self._start, s)
            if not (window.startswith(head) and head.startswith(self._anchor_text)):
                continue
            u, own = self._anchor(s, head)
            if self._decode(u, n) == own + window[len(head):]:
                piece = head[len(self._anchor_text):]
                self._start, self._read, self._anchor_text = u, s, own
                return self._emit(piece)
        return ""

    def _anchor(self, end: int, text: str) -> Tuple[int, str]:
        """The next anchor for the window ``ids[_start:end]`` whose text is ``text``:
        the shortest suffix (at most ANCHOR ids) whose own text is the end of ``text``,
        so that it gives the ids after it the context they have in the window (else
        the whole window). Returns (its start, its text).

        A suffix that starts inside a character decodes to U+FFFD where the window has
        the character: it fails. A word alone lacks the space it has after another, but
        still ends the text, and decoded after it the next word gets its space: it
        passes. A SentencePiece run of whitespace pieces decodes alone to "" (dropped,
        as at the start of a line), which ends any text: it passes only where the
        window has no text for it either.
        """
        silent = True  # whether the suffixes tried so far may have no text in the window
        for u in range(end - 1, max(self._start, end - self.ANCHOR) - 1, -1):
            own = self._decode(u, end)
            if own:
                if text.endswith(own):
                    return u, own
            elif silent and u > self._start:
                # no text alone: an anchor only if it has none in the window either (if it
                # has, so do the longer suffixes: the window is decoded once, not again)
                silent = self._decode(self._start, u) == text
                if silent:
                    return u, own
        return self._start, text


def check_stops(stop: Any) -> List[str]:
    """OpenAI's ``stop``: None, a string, or a list of strings -> a list of strings.

    Raises TypeError for another type and ValueError for an empty string; the
    messages name the field ``stop``. The number of stop strings is not limited
    here (the server checks its own limit).
    """
    if stop is None:
        return []
    if isinstance(stop, str):
        stops = [stop]
        where = ["stop"]
    elif isinstance(stop, (list, tuple)):
        stops = list(stop)
        where = [f"stop[{i}]" for i in range(len(stops))]
    else:
        raise TypeError(f"stop must be a string or a list of strings, got "
                        f"{type(stop).__name__}")
    for name, s in zip(where, stops):
        if not isinstance(s, str):
            raise TypeError(f"{name} must be a string, got {type(s).__name__}; stop is a "
                            f"string or a list of strings")
        if not s:
            raise ValueError(f"{name} is an empty string; a stop string needs at least one "
                             f"character (leave it out)")
    return stops


class StopMatcher:
    """Cut a stream of text before the first occurrence of any stop string.

    ``feed(piece)`` returns ``(text safe to send now, stopped)``. Text that may be
    the start of a stop string is held back until the next pieces show it is not;
    when a stop string occurs, the text before it is returned with ``stopped``
    True, and every later feed returns ``("", True)``. ``flush()`` returns what is
    held back at the end. For any split of a text into pieces, the returned texts
    together are the text cut before the earliest stop string (all of it if none).

    ``stops``: a string (one stop string) or a sequence of strings, as
    :func:`check_stops` takes them.
    """

    def __init__(self, stops: Optional[Sequence[str]]):
        self.stops: Tuple[str, ...] = tuple(check_stops(stops))
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string has occurred."""
        return self._stopped

    def feed(self, text: str) -> Tuple[str, bool]:
        if not isinstance(text, str):
            raise TypeError(f"feed takes text (str), got {type(text).__name__}")
        if self._stopped:
            return "", True
        if not self.stops:
            return text, False
        # Text sent earlier begins no stop string, so a stop can only start in buf.
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._stopped, self._held = True, ""
            return buf[:min(hits)], True
        keep = self._open_start(buf)
        self._held = buf[keep:]
        return buf[:keep], False

    def flush(self) -> str:
        """The text held back (empty once a stop string has occurred)."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _open_start(self, buf: str) -> int:
        """Where the longest end of ``buf`` that begins some stop string starts
        (``len(buf)`` if none does): the text from there may still become a stop."""
        for i in range(max(0, len(buf) - self._longest + 1), len(buf)):
            tail = buf[i:]
            if any(s.startswith(tail) for s in self.stops):
                return i
        return len(buf)
