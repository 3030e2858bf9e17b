"""Download, verify and load the standard benchmark corpora and tables.

Three corpora are registered with :func:`~srupp.data.corpora.load_corpus`,
and one table with :func:`~srupp.data.tables.load_table`:

``enwik8``
    ``http://mattmahoney.net/dc/enwik8.zip``, member ``enwik8``: exactly
    100,000,000 bytes of Wikipedia XML, split by *byte* position into the first
    90M (train), next 5M (valid) and last 5M (test) bytes.
``text8``
    ``http://mattmahoney.net/dc/text8.zip``, member ``text8``: 100,000,000
    bytes (lower-case a-z and spaces), split 90M/5M/5M the same way.
``wikitext-103``
    ``wikitext-103-v1.zip``, members ``wikitext-103/wiki.{train,valid,test}.tokens``
    (strict UTF-8), one per split. Each split's token count, counted as its
    whitespace-separated tokens plus one ``<eos>`` per line (the convention
    behind the published 103,227,021 / 217,646 / 245,569), must lie within
    1 % of the published figure.
``iwslt14-de-en`` (a table, columns ``de`` and ``en``)
    ``http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz``, the
    archive of fairseq's ``examples/translation/prepare-iwslt14.sh``, prepared
    as that script does, tokenisation aside: see :func:`prepare_iwslt14`.

Byte-level text (enwik8, text8)
-------------------------------
enwik8 is cut at exactly 100M bytes and its splits at byte positions, so a
split may start or end inside a multi-byte UTF-8 character. To keep every byte
exactly, each split is decoded with ``bytes.decode("utf-8", "surrogateescape")``:
valid UTF-8 becomes ordinary characters, and every byte that is not part of a
valid sequence becomes one lone surrogate U+DC80..U+DCFF.
:class:`~srupp.data.tokenizers.ByteTokenizer` encodes with the same error
handler, so ``ByteTokenizer().encode(split)`` gives back the split's original
bytes, one id per byte.

Cache, download, verification
-----------------------------
Archives live in ``<cache>/<name>/``, where ``<cache>`` is
:func:`~srupp.data.corpora.cache_dir` (``$SRUPP_CACHE`` or ``~/.cache/srupp``).
A missing archive is downloaded (resumed after an interruption, retried) and
every archive is verified (members, sizes, CRC-32s) by :mod:`srupp.data.fetch`,
which deletes one that fails; an archive put in the cache by hand is checked on
first use.

Without a network the error gives the URL and the exact path where the archive
can be put by hand. URLs, sizes and splits live in :data:`DATASETS` (tests
replace entries). Nothing is downloaded at import time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from .corpora import SPLITS, Corpus, _decode, cache_dir, register_corpus
from .fetch import download, read_members, verify_archive
from .tables import TableSplits, register_table
from .tokenizers import _lines

__all__ = [
    "DatasetSpec",
    "DATASETS",
    "cache_dir",
    "archive_path",
    "download",
    "verify_archive",
    "fetch",
    "load_downloaded",
    "count_tokens",
    "prepare_iwslt14",
    "load_iwslt14",
    "IWSLT14_MEMBERS",
]


@dataclass(frozen=True)
class DatasetSpec:
    """Where a corpus or table comes from and how to check and split it.

    ``archive``: the file name in the cache; its ending gives the format:
    ``.zip``, or ``.tgz`` / ``.tar.gz`` (a gzip-compressed tar archive).
    ``members``: the archive members read, in order. With
    ``split="positional"`` there is one member, cut by byte position in the
    proportions ``fractions`` (train, valid, test); with ``split="members"``
    there are three, one per split (train, valid, test); with
    ``split="table"`` any number, which a table loader turns into
    :class:`~srupp.data.tables.TableSplits` (not a corpus).
    ``sizes``: member -> expected uncompressed size in bytes (a member not
    listed is not size-checked).
    ``encoding``: ``"bytes"`` (UTF-8 with ``surrogateescape``, lossless for
    any bytes) or ``"utf-8"`` (strict).
    ``token_counts``: split -> expected count of whitespace tokens plus lines
    (``None``: not checked), allowed off by ``token_tolerance`` (relative).
    """

    url: str
    archive: str
    members: tuple[str, ...]
    sizes: Mapping[str, int] = field(default_factory=dict)
    split: str = "positional"
    fractions: tuple[int, int, int] = (90, 5, 5)
    encoding: str = "bytes"
    token_counts: Mapping[str, int] | None = None
    token_tolerance: float = 0.01

    def __post_init__(self) -> None:
        if self.split not in ("positional", "members", "table"):
            raise ValueError(f"split must be 'positional', 'members' or 'table', "
                             f"got {self.split!r}")
        want = {"positional": 1, "members": 3}.get(self.split)
        if want is not None and len(self.members) != want:
            raise ValueError(f"split={self.split!r} needs {want} member(s), got {self.members}")
        if not self.members:
            raise ValueError(f"split={self.split!r} needs at least one member, got none")
        if self.encoding not in ("bytes", "utf-8"):
            raise ValueError(f"encoding must be 'bytes' or 'utf-8', got {self.encoding!r}")
        if not self.archive.endswith((".zip", ".tgz", ".tar.gz")):
            raise ValueError(f"archive {self.archive!r} must end in .zip, .tgz or .tar.gz "
                             "(the formats srupp reads)")

    @property
    def is_tar(self) -> bool:
        """Whether the archive is a gzip-compressed tar file (otherwise a zip file)."""
        return not self.archive.endswith(".zip")


#: IWSLT'14 De-En: the training transcripts and the XML files of the test sets,
#: in the order fairseq concatenates them into its test split.
IWSLT14_TEST_SETS = ("IWSLT14.TED.dev2010", "IWSLT14.TEDX.dev2012", "IWSLT14.TED.tst2010",
                     "IWSLT14.TED.tst2011", "IWSLT14.TED.tst2012")
IWSLT14_MEMBERS = (("de-en/train.tags.de-en.de", "de-en/train.tags.de-en.en")
                   + tuple(f"de-en/{name}.de-en.{lang}.xml"
                           for name in IWSLT14_TEST_SETS for lang in ("de", "en")))

#: Known downloadable corpora and tables: name -> spec. Tests may replace entries.
DATASETS: dict[str, DatasetSpec] = {
    "enwik8": DatasetSpec(
        url="http://mattmahoney.net/dc/enwik8.zip",
        archive="enwik8.zip",
        members=("enwik8",),
        sizes={"enwik8": 100_000_000},
    ),
    "text8": DatasetSpec(
        url="http://mattmahoney.net/dc/text8.zip",
        archive="text8.zip",
        members=("text8",),
        sizes={"text8": 100_000_000},
    ),
    "wikitext-103": DatasetSpec(
        url="https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip",
        archive="wikitext-103-v1.zip",
        members=("wikitext-103/wiki.train.tokens", "wikitext-103/wiki.valid.tokens",
                 "wikitext-103/wiki.test.tokens"),
        split="members",
        encoding="utf-8",
        token_counts={"train": 103_227_021, "valid": 217_646, "test": 245_569},
    ),
    # The archive's size and checksum are not pinned: they could not be measured
    # offline. Its structure (every member below present) and gzip's own CRC-32
    # are checked instead, and prepare_iwslt14 checks that the sides pair up.
    "iwslt14-de-en": DatasetSpec(
        url="http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz",
        archive="de-en.tgz",
        members=IWSLT14_MEMBERS,
        split="table",
        encoding="utf-8",
    ),
}


def _spec(name: str) -> DatasetSpec:
    try:
        return DATASETS[name]
    except KeyError:
        raise ValueError(f"unknown downloadable corpus {name!r}; choose one of: "
                         f"{', '.join(sorted(DATASETS))}") from None


def archive_path(name: str) -> Path:
    """Where corpus ``name``'s archive is (or will be) cached."""
    return cache_dir() / name / _spec(name).archive


# ----------------------------------------------------------------------------- fetching


def fetch(name: str, *, retries: int = 3, progress: bool = True) -> Path:
    """The verified archive of corpus or table ``name``, downloading it if it is not cached."""
    spec = _spec(name)
    path = archive_path(name)
    if not path.is_file():
        download(spec.url, path, retries=retries, progress=progress)
    verify_archive(path, spec)
    return path


# ----------------------------------------------------------------------------- loading


def count_tokens(text: str) -> tuple[int, int]:
    """``(whitespace-separated tokens, lines)`` of ``text``; a last line without
    a newline counts too. Works line by line, so huge texts need little memory."""
    words = 0
    start = 0
    n = len(text)
    while start < n:
        end = text.find("\n", start)
        if end < 0:
            end = n
        words += len(text[start:end].split())
        start = end + 1
    lines = text.count("\n") + (1 if text and not text.endswith("\n") else 0)
    return words, lines


def _archive(name: str, spec: DatasetSpec, source: str | Path | None, progress: bool) -> Path:
    """The verified archive of ``name``: ``source`` (a file, or a folder holding
    it; verified but never downloaded or deleted), or the cached one, fetched
    first if missing."""
    if source is None:
        return fetch(name, progress=progress)
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / spec.archive
    if not path.is_file():
        raise ValueError(f"no {name} archive at {str(path)!r}; give the path of "
                         f"{spec.archive} (from {spec.url})")
    verify_archive(path, spec, delete_bad=False)
    return path


def _check_tokens(name: str, split: str, member: str, text: str, spec: DatasetSpec,
                  path: Path) -> None:
    words, lines = count_tokens(text)
    if words == 0:
        raise ValueError(f"corpus {name!r}: {member} ({split} split) in {path} has no tokens; "
                         "it is not the expected archive: delete it and run again")
    want = spec.token_counts.get(split)
    got = words + lines
    if want is not None and abs(got - want) > spec.token_tolerance * want:
        raise ValueError(f"corpus {name!r}: {member} ({split} split) has {got:,} tokens "
                         f"({words:,} words + {lines:,} line ends), expected {want:,} "
                         f"(within {spec.token_tolerance:.0%}); {path} is not the expected "
                         "archive: delete it and run again")


def load_downloaded(name: str, source: str | Path | None = None, *,
                    progress: bool = True) -> Corpus:
    """Load downloadable corpus ``name`` (see the module doc).

    ``source``: an archive file, or a folder holding it, to read instead of
    the cache (it is verified but never downloaded or deleted). Default: the
    cached archive, downloaded first if missing.
    """
    spec = _spec(name)
    if spec.split == "table":
        raise ValueError(f"{name!r} is a table, not a text corpus; load it with "
                         f"srupp.data.load_table({name!r}, columns)")
    path = _archive(name, spec, source, progress)
    blobs = read_members(path, spec)

    if spec.split == "positional":
        data = blobs[0]
        total = sum(spec.fractions)
        a = len(data) * spec.fractions[0] // total
        b = len(data) * (spec.fractions[0] + spec.fractions[1]) // total
        parts = [data[:a], data[a:b], data[b:]]
        wheres = [f"{spec.members[0]} ({s} split)" for s in SPLITS]
    else:
        parts, wheres = blobs, list(spec.members)

    texts: dict[str, str] = {}
    for i, (split, where) in enumerate(zip(SPLITS, wheres)):
        part, parts[i] = parts[i], b""  # free each split's bytes once decoded
        text = (part.decode("utf-8", errors="surrogateescape") if spec.encoding == "bytes"
                else _decode(part, f"{where} in {path}"))
        if spec.token_counts is not None:
            _check_tokens(name, split, where, text, spec, path)
        texts[split] = text
    return Corpus(name, **texts)


def _make_loader(name: str):
    def loader(source: str | Path | None = None) -> Corpus:
        return load_downloaded(name, source)

    loader.__name__ = loader.__qualname__ = "load_" + name.replace("-", "_")
    loader.__doc__ = (f"The {name} corpus (downloaded to the cache on first use); "
                      "see :mod:`srupp.data.download`.")
    return loader


for _name in tuple(DATASETS):
    if DATASETS[_name].split != "table":
        register_corpus(_name)(_make_loader(_name))
del _name


# ----------------------------------------------------------------------------- IWSLT'14 De-En

#: Training lines that hold one of these are talk metadata and are dropped.
IWSLT14_DROP_TAGS = ("<url>", "<talkid>", "<keywords>")
#: These tags are removed from training lines, keeping the text between them.
IWSLT14_UNWRAP_TAGS = ("<title>", "</title>", "<description>", "</description>")
#: clean-corpus-n.perl's settings in fairseq: ``-ratio 1.5 ... 1 175`` (and its
#: default -max-word-length 1000).
IWSLT14_MIN_WORDS, IWSLT14_MAX_WORDS, IWSLT14_MAX_RATIO, IWSLT14_MAX_WORD_CHARS = 1, 175, 1.5, 1000
#: Every 23rd cleaned training pair (1-based line number divisible by 23) is validation.
IWSLT14_VALID_EVERY = 23

_SEG_OPEN = re.compile(r'<seg id="[0-9]*">\s*')
_SEG_CLOSE = re.compile(r"\s*</seg>\s*")


def _normalise(line: str) -> str:
    """Whitespace runs as one space, none at the ends, lower case."""
    return " ".join(line.split()).lower()


def _train_lines(text: str) -> list[str]:
    lines = []
    for line in _lines(text):
        if any(tag in line for tag in IWSLT14_DROP_TAGS):
            continue
        for tag in IWSLT14_UNWRAP_TAGS:
            line = line.replace(tag, "")
        lines.append(_normalise(line))
    return lines


def _segments(text: str) -> list[str]:
    """The text of each ``<seg id="N">...</seg>`` line, normalised, with the
    right single quote (U+2019) as an apostrophe, as fairseq's sed does."""
    return [_normalise(_SEG_CLOSE.sub("", _SEG_OPEN.sub("", line)).replace("\u2019", "'"))
            for line in _lines(text) if "<seg id" in line]


def _keep_pair(de: str, en: str) -> bool:
    """clean-corpus-n.perl's test on one (whitespace-normalised) pair."""
    d, e = de.split(), en.split()
    if not (IWSLT14_MIN_WORDS <= len(d) <= IWSLT14_MAX_WORDS
            and IWSLT14_MIN_WORDS <= len(e) <= IWSLT14_MAX_WORDS):
        return False  # also drops empty sides
    if len(d) / len(e) > IWSLT14_MAX_RATIO or len(e) / len(d) > IWSLT14_MAX_RATIO:
        return False
    return max(map(len, d + e)) <= IWSLT14_MAX_WORD_CHARS


def prepare_iwslt14(files: Mapping[str, str]) -> dict[str, list[tuple[str, str]]]:
    """IWSLT'14 De-En train, valid and test pairs ``(de, en)`` from the archive's texts.

    ``files``: member name (:data:`IWSLT14_MEMBERS`, e.g.
    ``"de-en/train.tags.de-en.de"``) -> its text. Reproduces fairseq's
    ``examples/translation/prepare-iwslt14.sh`` step by step:

    * training text (``train.tags.de-en.{de,en}``), each side on its own:
      lines holding ``<url>``, ``<talkid>`` or ``<keywords>`` are dropped;
      ``<title>``, ``</title>``, ``<description>``, ``</description>`` are
      removed from the others, keeping the title and description text (the
      script's ``grep -v`` and ``sed``). Then the sides are paired line by
      line and cleaned as ``clean-corpus-n.perl -ratio 1.5 ... 1 175`` does:
      whitespace runs become one space, ends are stripped, and a pair is
      dropped when a side has fewer than 1 or more than 175 words, when one
      side has more than 1.5 times the words of the other, or when a word is
      longer than 1,000 characters. Both sides are lower-cased.
    * valid: the cleaned training pairs whose 1-based line number is
      divisible by 23; train: the others.
    * test: the ``<seg id="N">`` lines of ``IWSLT14.TED.dev2010``,
      ``IWSLT14.TEDX.dev2012``, ``IWSLT14.TED.tst2010``, ``tst2011`` and
      ``tst2012`` (``.de-en.{de,en}.xml``), in that order: the text between
      the tags, U+2019 replaced by ``'``, whitespace normalised, lower-cased.
      Not cleaned (as in fairseq), so every segment is kept.

    Differences from fairseq: no Moses tokenisation (nor its escaping of
    ``&``, ``<``, ``'`` ...) and no BPE; the text stays raw, for a subword
    model (SentencePiece) to tokenise later. So the 1-175 word and 1.5 ratio
    limits count whitespace-separated words of untokenised text, where
    fairseq counts Moses tokens (punctuation split off): a few pairs near the
    limits are kept or dropped differently, and the counts differ slightly
    from fairseq's 160,239 / 7,283 / 6,750. ``str.lower`` stands for
    Moses' ``lowercase.perl`` (Perl's ``lc``).

    Raises a ``ValueError`` when a member is missing or the two sides of a
    file pair do not have the same number of lines (segments).
    """
    missing = [m for m in IWSLT14_MEMBERS if m not in files]
    if missing:
        raise ValueError(f"the IWSLT'14 texts lack {missing[0]}; give the complete de-en.tgz "
                         "archive")

    def paired(de: list[str], en: list[str], what: str) -> list[tuple[str, str]]:
        if len(de) != len(en):
            raise ValueError(f"IWSLT'14 {what}: {len(de):,} German but {len(en):,} English "
                             "lines, which cannot be paired; the archive is not the expected "
                             "one: delete it and run again")
        return list(zip(de, en))

    train_files = [files[f"de-en/train.tags.de-en.{lang}"] for lang in ("de", "en")]
    pairs = [p for p in paired(*map(_train_lines, train_files), "train.tags.de-en")
             if _keep_pair(*p)]
    test = []
    for name in IWSLT14_TEST_SETS:
        test += paired(*(_segments(files[f"de-en/{name}.de-en.{lang}.xml"])
                         for lang in ("de", "en")), f"{name}.de-en.{{de,en}}.xml")
    return {"train": [p for i, p in enumerate(pairs, 1) if i % IWSLT14_VALID_EVERY],
            "valid": [p for i, p in enumerate(pairs, 1) if not i % IWSLT14_VALID_EVERY],
            "test": test}


@register_table("iwslt14-de-en")
def load_iwslt14(source: str | Path | None = None, *, progress: bool = True) -> TableSplits:
    """IWSLT'14 German-English as a table with columns ``("de", "en")``
    (:func:`prepare_iwslt14`), from its archive downloaded to the cache on
    first use (``<cache>/iwslt14-de-en/de-en.tgz``; see the module doc).

    ``source``: the ``de-en.tgz`` file, or a folder holding it, to read
    instead (verified, never downloaded or deleted).
    """
    name = "iwslt14-de-en"
    spec = _spec(name)
    path = _archive(name, spec, source, progress)
    texts = {m: _decode(b, f"{m} in {path}")
             for m, b in zip(spec.members, read_members(path, spec))}
    return TableSplits(("de", "en"), **prepare_iwslt14(texts))
