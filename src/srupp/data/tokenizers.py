"""Byte- and character-level tokenizers.

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

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Sequence, Union

import numpy as np
import torch

from srupp.errors import UserError

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "CharTokenizer",
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
            raise UserError(f"decode needs integer token ids, got a {ids.dtype} tensor")
        arr = ids.detach().cpu().numpy()
    else:
        arr = np.asarray(ids)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise UserError(f"decode needs integer token ids, got values of type {arr.dtype}")
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise UserError(f"decode takes a 1-D sequence of ids, got shape {tuple(arr.shape)}; "
                        "decode each row separately")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        bad = arr[(arr < 0) | (arr >= vocab_size)][0]
        raise UserError(f"token id {int(bad)} is outside this tokenizer's vocabulary "
                        f"(0..{vocab_size - 1}); the ids come from a model or data made "
                        "with a different tokenizer")
    return arr


def _check_text(text: str) -> None:
    if not isinstance(text, str):
        raise UserError(f"expected text as str, got {type(text).__name__}")


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
    unk_id = None

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> torch.Tensor:
        _check_text(text)
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise UserError(f"the text has a lone surrogate {text[e.start]!r} at character "
                            f"{e.start}, which is not valid Unicode; decode the source "
                            "file as UTF-8 with errors='strict' or 'replace'") from None
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
            raise UserError(f"the byte tokenizer takes no options, got: {', '.join(options)}")
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
                raise UserError(f"a char tokenizer's vocabulary holds single characters, "
                                f"got {c!r}; the saved tokenizer is corrupt")
        if len(set(chars)) != len(chars) or chars != sorted(chars):
            raise UserError("a char tokenizer's characters must be distinct and sorted; "
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
        if not text:
            return 0.0
        ids = self._lookup(text)
        return float(np.count_nonzero(ids == 0)) / len(ids)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type_name, "chars": "".join(self.chars)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CharTokenizer":
        chars = d.get("chars")
        if not isinstance(chars, str):
            raise UserError("a saved char tokenizer needs a 'chars' string; the saved "
                            "tokenizer is corrupt, rebuild it from the training text")
        return cls(chars)

    @classmethod
    def build(cls, train_text: str, **options: Any) -> "CharTokenizer":
        if options:
            raise UserError(f"the char tokenizer takes no options, got: {', '.join(options)}")
        _check_text(train_text)
        if not train_text:
            raise UserError("cannot build a char tokenizer from an empty training text; "
                            "check that the corpus's train split is not empty")
        uniq = np.unique(_code_points(train_text))
        chars = uniq.astype("<u4").tobytes().decode("utf-32-le", errors="surrogatepass")
        return cls(chars)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


def build_tokenizer(kind: str, train_text: str, **options: Any) -> Tokenizer:
    """Build a tokenizer of ``kind`` (``"byte"`` or ``"char"``; later: word,
    subword) from the training split. ``options`` go to the kind's ``build``."""
    cls = TOKENIZERS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise UserError(f"unknown tokenizer kind {kind!r}; choose one of: {_known_kinds()}")
    return cls.build(train_text, **options)


def tokenizer_from_dict(d: dict[str, Any]) -> Tokenizer:
    """Rebuild a tokenizer saved with ``to_dict()``."""
    if not isinstance(d, dict) or "type" not in d:
        raise UserError("a saved tokenizer must be a dict with a 'type' key "
                        f"(one of: {_known_kinds()}); the checkpoint or file is corrupt")
    cls = TOKENIZERS.get(d["type"])
    if cls is None:
        raise UserError(f"unknown saved tokenizer type {d['type']!r}; known types: "
                        f"{_known_kinds()} (was it saved by a newer srupp?)")
    return cls.from_dict(d)
