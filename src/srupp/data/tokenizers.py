"""Byte-, character-, word- and subword-level tokenizers.

Every tokenizer maps text to a 1-D ``torch.LongTensor`` of ids and back, has a
``vocab_size``, reports the share of symbols it cannot represent
(``oov_rate``), and saves itself as a small JSON-serialisable dict
(``to_dict``, always with a ``"type"`` key) that :func:`tokenizer_from_dict`
turns back into an equal tokenizer.

New kinds (word, subword) plug in by subclassing :class:`Tokenizer`, setting
``type_name`` and decorating the class with :func:`register_tokenizer`; then
:func:`build_tokenizer` and :func:`tokenizer_from_dict` know them.
"""

from __future__ import annotations

import base64
import io
from collections import Counter
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Sequence, Union

import numpy as np
import torch

from srupp._extras import require

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "CharTokenizer",
    "WordTokenizer",
    "SentencePieceTokenizer",
    "TOKENIZERS",
    "register_tokenizer",
    "build_tokenizer",
    "tokenizer_from_dict",
]

IdsLike = Union[torch.Tensor, np.ndarray, Sequence[int]]

#: Registry of tokenizer kinds: ``type_name`` -> class.
TOKENIZERS: dict[str, type["Tokenizer"]] = {}


def register_tokenizer(cls: type["Tokenizer"]) -> type["Tokenizer"]:
    """Class decorator: make ``cls`` known to :func:`build_tokenizer` and
    :func:`tokenizer_from_dict` under ``cls.type_name``."""
    name = getattr(cls, "type_name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__} needs a non-empty string class attribute 'type_name'")
    if name in TOKENIZERS and TOKENIZERS[name] is not cls:
        raise TypeError(f"tokenizer type {name!r} is already registered by "
                        f"{TOKENIZERS[name].__name__}")
    TOKENIZERS[name] = cls
    return cls


def _known_kinds() -> str:
    return ", ".join(sorted(TOKENIZERS))


def _ids_to_numpy(ids: IdsLike, vocab_size: int) -> np.ndarray:
    """Validate ``ids`` (1-D, integer, in range) and return them as int64 numpy."""
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"decode needs integer token ids, got a {ids.dtype} tensor")
        arr = ids.detach().cpu().numpy()
    else:
        arr = np.asarray(ids)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"decode needs integer token ids, got values of type {arr.dtype}")
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(f"decode takes a 1-D sequence of ids, got shape {tuple(arr.shape)}; "
                         "decode each row separately")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        bad = arr[(arr < 0) | (arr >= vocab_size)][0]
        raise ValueError(f"token id {int(bad)} is outside this tokenizer's vocabulary "
                         f"(0..{vocab_size - 1}); the ids come from a model or data made "
                         "with a different tokenizer")
    return arr


def _check_text(text: str) -> None:
    if not isinstance(text, str):
        raise TypeError(f"expected text as str, got {type(text).__name__}")


class Tokenizer(ABC):
    """Base class: text <-> 1-D ``LongTensor`` of ids."""

    #: Name under which the class is registered and saved (``to_dict()["type"]``).
    type_name: ClassVar[str] = ""

    #: Id of the unknown symbol, or ``None`` when every text is representable.
    unk_id: int | None = None

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids; valid ids are ``0 .. vocab_size - 1``."""

    @abstractmethod
    def encode(self, text: str) -> torch.Tensor:
        """Text -> 1-D ``torch.int64`` tensor of ids."""

    @abstractmethod
    def decode(self, ids: IdsLike) -> str:
        """1-D ids (tensor, array or list) -> text. Never fails on valid ids."""

    @abstractmethod
    def oov_rate(self, text: str) -> float:
        """Fraction of the text's symbols that encode to the unknown id (0.0 if none)."""

    @abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable description with a ``"type"`` key."""

    @classmethod
    @abstractmethod
    def from_dict(cls, d: dict[str, Any]) -> "Tokenizer":
        """Inverse of :meth:`to_dict`."""

    @classmethod
    @abstractmethod
    def build(cls, train_text: str, **options: Any) -> "Tokenizer":
        """Build the tokenizer from the training split."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tokenizer):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash((self.type_name, self.vocab_size))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


@register_tokenizer
class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids (vocabulary 256, no unknown symbol).

    ``decode`` uses ``errors="replace"``: an incomplete or invalid multi-byte
    sequence (e.g. a model that sampled half a character) becomes U+FFFD
    instead of raising.
    """

    type_name = "byte"

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> torch.Tensor:
        # "surrogateescape": U+DC80..U+DCFF stand for raw bytes 0x80..0xFF (text
        # decoded with errors="surrogateescape", e.g. enwik8), so bytes round-trip.
        _check_text(text)
        try:
            data = text.encode("utf-8", errors="surrogateescape")
        except UnicodeEncodeError as e:
            raise ValueError(f"the text has a lone surrogate {text[e.start]!r} at character "
                             f"{e.start}, which is not valid Unicode; decode the source "
                             "file as UTF-8 with errors='strict', 'replace' or "
                             "'surrogateescape'") from None
        return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64))

    def decode(self, ids: IdsLike) -> str:
        arr = _ids_to_numpy(ids, 256)
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def oov_rate(self, text: str) -> float:
        _check_text(text)
        return 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type_name}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ByteTokenizer":
        return cls()

    @classmethod
    def build(cls, train_text: str, **options: Any) -> "ByteTokenizer":
        if options:
            raise ValueError(f"the byte tokenizer takes no options, got: {', '.join(options)}")
        return cls()


def _code_points(text: str) -> np.ndarray:
    """The text's Unicode code points as a uint32 array (one per character)."""
    return np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype="<u4")


@register_tokenizer
class CharTokenizer(Tokenizer):
    """Unicode characters as ids, vocabulary taken from the training split.

    Id 0 is the reserved unknown symbol ``<unk>``; the training split's
    distinct characters, sorted by code point, get ids ``1 .. len(chars)``.
    Characters not seen in training encode to 0. ``decode`` turns id 0 into
    U+FFFD (the Unicode replacement character "\\ufffd"), one character per
    id, so the decoded text has as many characters as there were ids.
    """

    type_name = "char"
    unk_id = 0
    unk_token = "<unk>"
    #: What ``decode`` writes for the unknown id.
    unk_decoded = "\ufffd"

    def __init__(self, chars: Sequence[str] | str):
        chars = list(chars)
        for c in chars:
            if not isinstance(c, str) or len(c) != 1:
                raise ValueError(f"a char tokenizer's vocabulary holds single characters, "
                                 f"got {c!r}; the saved tokenizer is corrupt")
        if len(set(chars)) != len(chars) or chars != sorted(chars):
            raise ValueError("a char tokenizer's characters must be distinct and sorted; "
                             "the saved tokenizer is corrupt, rebuild it from the training text")
        self.chars: tuple[str, ...] = tuple(chars)
        self._cps = _code_points("".join(self.chars))  # sorted, uint32
        # encode table: code point -> id, dense up to the largest known code
        # point, plus one trailing 0 (unk) that every larger code point maps to.
        top = int(self._cps[-1]) + 1 if len(self._cps) else 0
        self._lut = np.zeros(top + 1, dtype=np.int32)
        self._lut[self._cps] = np.arange(1, len(self._cps) + 1, dtype=np.int32)
        # decode table: id -> code point (id 0 -> U+FFFD)
        self._table = np.concatenate([np.array([ord(self.unk_decoded)], dtype=np.uint32),
                                      self._cps.astype(np.uint32)])

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1

    def _lookup(self, text: str) -> np.ndarray:
        cps = np.minimum(_code_points(text), len(self._lut) - 1)
        return self._lut[cps].astype(np.int64)

    def encode(self, text: str) -> torch.Tensor:
        _check_text(text)
        return torch.from_numpy(self._lookup(text))

    def decode(self, ids: IdsLike) -> str:
        arr = _ids_to_numpy(ids, self.vocab_size)
        return self._table[arr].astype("<u4").tobytes().decode("utf-32-le",
                                                                errors="surrogatepass")

    def oov_rate(self, text: str) -> float:
        _check_text(text)
        ids = self._lookup(text)
        return float(np.count_nonzero(ids == 0)) / len(ids) if len(ids) else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type_name, "chars": "".join(self.chars)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CharTokenizer":
        return cls(_saved_field(d, "chars", "char", str))

    @classmethod
    def build(cls, train_text: str, **options: Any) -> "CharTokenizer":
        if options:
            raise ValueError(f"the char tokenizer takes no options, got: {', '.join(options)}")
        _check_text(train_text)
        if not train_text:
            raise ValueError("cannot build a char tokenizer from an empty training text; "
                             "check that the corpus's train split is not empty")
        uniq = np.unique(_code_points(train_text))
        chars = uniq.astype("<u4").tobytes().decode("utf-32-le", errors="surrogatepass")
        return cls(chars)


# ----------------------------------------------------------------------------- word level


def _lines(text: str) -> list[str]:
    """``text`` cut at ``"\\n"``; a final newline does not start an extra (empty) line."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def _check_options(kind: str, options: dict[str, Any], allowed: Sequence[str]) -> None:
    unknown = [k for k in options if k not in allowed]
    if unknown:
        raise ValueError(f"the {kind} tokenizer does not take option(s) {', '.join(unknown)}; "
                         f"its options are: {', '.join(allowed)}")


def _check_int(name: str, value: Any, minimum: int, kind: str, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{kind} tokenizer option {name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{kind} tokenizer option {name}={value} is too small; {hint}")
    return int(value)


def _check_bool(name: str, value: Any, kind: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{kind} tokenizer option {name} must be True or False, got {value!r}")
    return value


def _saved_field(d: dict[str, Any], key: str, kind: str, expected: type) -> Any:
    """``d[key]`` of a tokenizer of ``kind`` saved with ``to_dict()``: ``expected`` (str or
    list), or ValueError."""
    value = d.get(key)
    if not isinstance(value, expected):
        what = "string" if expected is str else expected.__name__
        raise ValueError(f"a saved {kind} tokenizer needs a {key!r} {what}; the saved "
                         "tokenizer is corrupt, rebuild it from the training text")
    return value


class _LineTokenizer(Tokenizer):
    """Shared by the word and sentencepiece tokenizers: ``<unk>`` is 0,
    ``<eos>`` is 1 and ends every line of the text."""

    unk_id = 0
    eos_id = 1

    @abstractmethod
    def _encode_list(self, text: str) -> list[int]:
        """Text -> ids as a list, ``<eos>`` after each line."""

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self._encode_list(text), dtype=torch.int64)

    def oov_rate(self, text: str) -> float:
        """Share of the text's symbols (``<eos>`` not counted) that encode to ``<unk>``."""
        ids = np.asarray(self._encode_list(text), dtype=np.int64)
        n = int(np.count_nonzero(ids != self.eos_id))
        return float(np.count_nonzero(ids == self.unk_id)) / n if n else 0.0

    def _lines_of_ids(self, ids: IdsLike) -> list[list[int]]:
        """Validated ``ids`` cut at ``<eos>``: one list per line, the last one
        (after the final ``<eos>``, often empty) included."""
        lines: list[list[int]] = [[]]
        for i in _ids_to_numpy(ids, self.vocab_size).tolist():
            if i == self.eos_id:
                lines.append([])
            else:
                lines[-1].append(i)
        return lines


@register_tokenizer
class WordTokenizer(_LineTokenizer):
    """Whitespace-separated words as ids, vocabulary taken from the training split.

    Ids: ``<unk>`` is 0, ``<eos>`` is 1, then the kept training words from the
    most to the least frequent; words of equal count keep the order of their
    first occurrence in the training text (so the vocabulary is deterministic
    and does not depend on hash seeds).

    ``encode`` splits the text into lines at ``"\\n"`` (a final newline does
    not start an extra line, and a last line without a newline is still a
    line), each line into words with ``str.split()`` (any whitespace), maps
    every word to its id (``<unk>`` if it is not in the vocabulary) and
    appends ``<eos>`` after each line. With ``lowercase=True`` the text is
    lower-cased first (at build and at encode time). A word that is literally
    ``<unk>`` or ``<eos>`` (as in the Penn Treebank files) maps to that
    special id.

    ``decode`` writes the words of a line joined by one space and ``<eos>`` as
    ``"\\n"``; unknown words come back as ``<unk>``. So for text whose lines
    are single-space separated words, known to the vocabulary and ending in a
    newline, ``decode(encode(text)) == text``.
    """

    type_name = "word"
    unk_token = "<unk>"
    eos_token = "<eos>"
    SPECIALS: ClassVar[tuple[str, ...]] = (unk_token, eos_token)

    def __init__(self, vocab: Sequence[str], lowercase: bool = False):
        vocab = list(vocab)
        if len(vocab) < 2 or tuple(vocab[:2]) != self.SPECIALS:
            raise ValueError("a word tokenizer's vocabulary must start with '<unk>', '<eos>'; "
                             "the saved tokenizer is corrupt, rebuild it from the training text")
        for w in vocab:
            if not isinstance(w, str) or not w or len(w.split()) != 1 or w.strip() != w:
                raise ValueError(f"a word tokenizer's vocabulary holds non-empty words without "
                                 f"whitespace, got {w!r}; the saved tokenizer is corrupt")
        if len(set(vocab)) != len(vocab):
            raise ValueError("a word tokenizer's vocabulary has duplicate words; the saved "
                             "tokenizer is corrupt, rebuild it from the training text")
        self.vocab: tuple[str, ...] = tuple(vocab)
        self.lowercase = _check_bool("lowercase", lowercase, "word")
        self._ids: dict[str, int] = {w: i for i, w in enumerate(self.vocab)}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def token_to_id(self, word: str) -> int:
        """Id of ``word`` (after lower-casing if the tokenizer does), ``unk_id`` if unknown."""
        return self._ids.get(word.lower() if self.lowercase else word, self.unk_id)

    def _encode_list(self, text: str) -> list[int]:
        _check_text(text)
        if self.lowercase:
            text = text.lower()
        get, unk = self._ids.get, self.unk_id
        out: list[int] = []
        for line in _lines(text):
            out.extend([get(w, unk) for w in line.split()])
            out.append(self.eos_id)
        return out

    def decode(self, ids: IdsLike) -> str:
        vocab = self.vocab
        return "\n".join(" ".join(vocab[i] for i in line) for line in self._lines_of_ids(ids))

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type_name, "vocab": list(self.vocab), "lowercase": self.lowercase}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WordTokenizer":
        return cls(_saved_field(d, "vocab", "word", list), lowercase=d.get("lowercase", False))

    @classmethod
    def build(cls, train_text: str, **options: Any) -> "WordTokenizer":
        """Options: ``vocab_size`` (default ``None``: no cap) is the most ids in
        total, the two specials included; ``min_freq`` (default 1) drops words
        seen fewer times in training; ``lowercase`` (default ``False``)."""
        _check_options("word", options, ("vocab_size", "min_freq", "lowercase"))
        vocab_size = options.get("vocab_size")
        if vocab_size is not None:
            vocab_size = _check_int("vocab_size", vocab_size, 3, "word",
                                    "use at least 3 (<unk>, <eos> and one word) or leave it "
                                    "unset for no cap")
        min_freq = _check_int("min_freq", options.get("min_freq", 1), 1, "word",
                              "use 1 (keep every word) or more")
        lowercase = _check_bool("lowercase", options.get("lowercase", False), "word")
        _check_text(train_text)
        if lowercase:
            train_text = train_text.lower()
        counts = Counter(train_text.split())  # keeps first-occurrence order
        if not counts:
            raise ValueError("cannot build a word tokenizer from a training text with no words; "
                             "check that the corpus's train split is not empty or blank")
        for s in cls.SPECIALS:
            counts.pop(s, None)
        # sorted() is stable: equal counts keep first-occurrence order.
        words = sorted((w for w, c in counts.items() if c >= min_freq),
                       key=lambda w: -counts[w])
        if vocab_size is not None:
            words = words[:vocab_size - len(cls.SPECIALS)]
        return cls([*cls.SPECIALS, *words], lowercase=lowercase)

    def __repr__(self) -> str:
        return f"WordTokenizer(vocab_size={self.vocab_size}, lowercase={self.lowercase})"


# ----------------------------------------------------------------------------- subword

_SP_MODEL_TYPES = ("unigram", "bpe", "char", "word")


def _import_sentencepiece() -> Any:
    """The sentencepiece module, or MissingExtra naming ``pip install 'srupp[subword]'``."""
    return require("sentencepiece", "subword", "the sentencepiece tokenizer")


@register_tokenizer
class SentencePieceTokenizer(_LineTokenizer):
    """Subword pieces from a SentencePiece model trained on the training split.

    Ids: ``<unk>`` is 0, ``<eos>`` (SentencePiece's ``</s>``) is 1, then the
    model's pieces; there is no ``<s>`` nor padding id. As with
    :class:`WordTokenizer`, the text is cut into lines at ``"\\n"`` (a final
    newline does not start an extra line), each line is encoded on its own and
    followed by ``<eos>``; ``decode`` turns ``<eos>`` back into ``"\\n"``.
    SentencePiece normalises each line (NFKC, runs of spaces collapsed,
    leading and trailing spaces dropped).

    Byte fallback (the default when building): the model also holds the 256
    UTF-8 bytes as pieces (ids 2..257), and a character no piece covers is
    encoded as its bytes, so no text encodes to ``<unk>`` and ``decode``
    gives the characters back (bytes that are not valid UTF-8, e.g. a model
    that output half a character, decode to U+FFFD). A model built without
    byte fallback (``byte_fallback=False``)
    encodes such characters as ``<unk>``, which decodes as ``" ⁇ "``.

    The serialized model is kept in :meth:`to_dict` (base64), so it is saved
    with the model that uses it. Needs ``pip install sentencepiece``.
    """

    type_name = "sentencepiece"

    #: No smaller vocab_size holds byte fallback: the 256 byte pieces, <unk>, <eos>, and
    #: a piece for each character of the training text (at least one).
    MIN_VOCAB_BYTE_FALLBACK: ClassVar[int] = 256 + 2 + 1

    def __init__(self, model_proto: bytes):
        spm = _import_sentencepiece()
        if not isinstance(model_proto, (bytes, bytearray)) or not model_proto:
            raise ValueError("a sentencepiece tokenizer needs a serialized model; the saved "
                             "tokenizer is corrupt, rebuild it from the training text")
        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(bytes(model_proto))
        except (RuntimeError, OSError) as e:
            raise ValueError(f"cannot load the sentencepiece model ({e}); the saved tokenizer "
                             "is corrupt, rebuild it from the training text") from None
        if sp.unk_id() != self.unk_id or sp.eos_id() != self.eos_id:
            raise ValueError(f"this sentencepiece model has unk id {sp.unk_id()} and eos id "
                             f"{sp.eos_id()}, srupp needs 0 and 1; build it with "
                             "build_tokenizer('sentencepiece', ...)")
        self.model_proto = bytes(model_proto)
        self._sp = sp

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def byte_fallback(self) -> bool:
        """Whether characters outside the pieces are encoded as UTF-8 byte pieces."""
        return bool(self._sp.IsByte(self._sp.PieceToId("<0x00>")))

    def _encode_list(self, text: str) -> list[int]:
        _check_text(text)
        out: list[int] = []
        for ids in self._sp.encode(_lines(text), out_type=int):
            out.extend(ids)
            out.append(self.eos_id)
        return out

    def decode(self, ids: IdsLike) -> str:
        return "\n".join(self._sp.decode(self._lines_of_ids(ids)))

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type_name,
                "model": base64.b64encode(self.model_proto).decode("ascii")}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SentencePieceTokenizer":
        model = _saved_field(d, "model", "sentencepiece", str)
        try:
            proto = base64.b64decode(model.encode("ascii"), validate=True)
        except (ValueError, UnicodeEncodeError):
            raise ValueError("a saved sentencepiece tokenizer's 'model' is not valid base64; "
                             "the saved tokenizer is corrupt, rebuild it") from None
        return cls(proto)

    @classmethod
    def build(cls, train_text: str, **options: Any) -> "SentencePieceTokenizer":
        """Options: ``vocab_size`` (default 8000, the specials and, with byte
        fallback, the 256 byte pieces included), ``model_type`` (``"unigram"``
        default, ``"bpe"``, ``"char"``, ``"word"``) and ``byte_fallback``
        (default ``True``). Trains in memory, one sentence per non-blank line
        of ``train_text``."""
        _check_options("sentencepiece", options, ("vocab_size", "model_type", "byte_fallback"))
        vocab_size = _check_int("vocab_size", options.get("vocab_size", 8000), 3,
                                "sentencepiece", "use at least 3")
        model_type = options.get("model_type", "unigram")
        if model_type not in _SP_MODEL_TYPES:
            raise ValueError(f"sentencepiece model_type {model_type!r} is unknown; choose one of: "
                             f"{', '.join(_SP_MODEL_TYPES)}")
        byte_fallback = _check_bool("byte_fallback", options.get("byte_fallback", True),
                                    "sentencepiece")
        if byte_fallback and vocab_size < cls.MIN_VOCAB_BYTE_FALLBACK:
            raise ValueError(f"sentencepiece vocab_size={vocab_size} is too small for byte "
                             f"fallback, whose 256 byte pieces count in the vocabulary: use at "
                             f"least {cls.MIN_VOCAB_BYTE_FALLBACK - 1} plus the number of "
                             f"distinct characters of the training text, or byte_fallback=False "
                             f"(unseen characters then decode as ⁇)")
        _check_text(train_text)
        spm = _import_sentencepiece()
        sentences = [line for line in _lines(train_text) if line.strip()]
        if not sentences:
            raise ValueError("cannot build a sentencepiece tokenizer from a training text with "
                             "no words; check that the corpus's train split is not empty")
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sentences), model_writer=model,
                vocab_size=vocab_size, model_type=model_type, byte_fallback=byte_fallback,
                unk_id=cls.unk_id, eos_id=cls.eos_id, bos_id=-1, pad_id=-1,
                input_sentence_size=0, max_sentence_length=1 << 20,
                minloglevel=2)
        except RuntimeError as e:
            msg = " ".join(str(e).split())
            msg = msg.split("] ", 1)[-1]  # drop sentencepiece's "INTERNAL: file.cc(n) [check]"
            counted = " (byte fallback's 256 byte pieces count in it)" if byte_fallback else ""
            raise ValueError(f"sentencepiece could not train on the training text: {msg}; "
                             f"adjust vocab_size{counted}") from None
        return cls(model.getvalue())


def build_tokenizer(kind: str, train_text: str, **options: Any) -> Tokenizer:
    """Build a tokenizer of ``kind`` (``"byte"``, ``"char"``, ``"word"`` or
    ``"sentencepiece"``) from the training split. ``options`` go to the kind's
    ``build`` (e.g. ``vocab_size``, ``min_freq``, ``lowercase`` for ``"word"``);
    an option the kind does not take raises ``ValueError``."""
    cls = TOKENIZERS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown tokenizer kind {kind!r}; choose one of: {_known_kinds()}")
    return cls.build(train_text, **options)


def tokenizer_from_dict(d: dict[str, Any]) -> Tokenizer:
    """Rebuild a tokenizer saved with ``to_dict()``."""
    if not isinstance(d, dict) or "type" not in d:
        raise ValueError("a saved tokenizer must be a dict with a 'type' key "
                         f"(one of: {_known_kinds()}); the checkpoint or file is corrupt")
    cls = TOKENIZERS.get(d["type"])
    if cls is None:
        raise ValueError(f"unknown saved tokenizer type {d['type']!r}; known types: "
                         f"{_known_kinds()} (was it saved by a newer srupp?)")
    return cls.from_dict(d)
