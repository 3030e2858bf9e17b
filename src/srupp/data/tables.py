"""Tables of text for translation and classification: TSV files and their split.

A table is a tab-separated (TSV) UTF-8 file whose first line is a header
naming its columns. Fields are raw text: there is no quoting and no escaping,
so a field cannot hold a tab or a newline. :func:`read_table` reads the
columns a task needs and checks the whole file first.

:func:`load_table` gives a table's train, valid and test rows
(:class:`TableSplits`) from

* a registered table name (see :data:`TABLES`), such as ``"iwslt14-de-en"``,
  which :mod:`srupp.data.download` registers. Names win over paths: to read a
  local file that happens to have such a name, write ``./name``;
* a directory holding ``train.tsv``, ``valid.tsv`` and ``test.tsv``, used as
  they are;
* a single TSV file, split by the one rule of :func:`split_rows`.

The split rule
--------------
The same rule serves every single-file table (translation pairs,
classification examples), so that a split is reproducible from the file
alone. The rows (header excluded) are shuffled with
``random.Random(0).shuffle``. ``test_size`` and ``valid_size`` default each to
5 % of the rows, rounded down, at most 1,000 (``min(1000, int(0.05 * n))``).

* Plain: the first ``test_size`` shuffled rows are the test split, the next
  ``valid_size`` the validation split, and the rest the training split.
* Stratified (classification; ``stratify`` names the label column): every
  label in validation and test also occurs in training, and each label gets
  its share of test and validation rows (the quotas are in
  :func:`split_rows`). Within a label, its rows are taken in shuffled order:
  first its test quota, then its validation quota, the rest stay in training.

In both cases each split keeps the shuffled order. Valid and test may be empty
for a very small table (fewer than 20 rows with the default sizes).
"""

from __future__ import annotations

import csv
import heapq
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol, Sequence

from .tokenizers import _lines

__all__ = [
    "TableSplits",
    "TABLES",
    "register_table",
    "read_table",
    "load_table",
    "split_rows",
    "SPLIT_SEED",
    "MAX_SPLIT_SIZE",
]

SPLITS = ("train", "valid", "test")
#: The seed of the one shuffle behind every single-file split.
SPLIT_SEED = 0
#: The default test and validation sizes are 5 % of the rows, but at most this.
MAX_SPLIT_SIZE = 1000

Row = tuple[str, ...]


@dataclass(frozen=True)
class TableSplits:
    """A table's rows, split three ways.

    ``columns``: the selected column names, in the order asked; each row holds
    those columns' values in that order.
    """

    columns: tuple[str, ...]
    train: list[Row]
    valid: list[Row]
    test: list[Row]

    def __post_init__(self) -> None:
        width = len(self.columns)
        for split in SPLITS:
            bad = next((r for r in getattr(self, split) if len(r) != width), None)
            if bad is not None:
                raise ValueError(f"a {split} row has {len(bad)} values but the table has "
                                 f"{width} columns ({', '.join(self.columns)}); give each row "
                                 "one value per column")

    def split(self, name: str) -> list[Row]:
        """The rows of split ``name`` (``"train"``, ``"valid"`` or ``"test"``)."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; choose one of: {', '.join(SPLITS)}")
        return getattr(self, name)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{s}={len(getattr(self, s)):,} rows" for s in SPLITS)
        return f"TableSplits(columns={self.columns}, {sizes})"


# ----------------------------------------------------------------------------- registry


class TableLoader(Protocol):
    def __call__(self, source: Optional[str | Path] = None) -> TableSplits: ...


#: Known table names -> loader. A loader returns all of its table's columns;
#: ``source`` is a local location to read it from instead of its default one.
TABLES: dict[str, TableLoader] = {}


def register_table(name: str) -> Callable[[TableLoader], TableLoader]:
    """Decorator: make a loader known to :func:`load_table` under ``name``."""

    def deco(fn: TableLoader) -> TableLoader:
        if name in TABLES and TABLES[name] is not fn:
            raise TypeError(f"table {name!r} is already registered")
        TABLES[name] = fn
        return fn

    return deco


# ----------------------------------------------------------------------------- reading


def _check_columns(columns: Sequence[str]) -> tuple[str, ...]:
    # A bare string is a sequence too, of its characters: almost surely a mistake.
    msg = f"columns must be a list of column names, got {columns!r}; write e.g. ('de', 'en')"
    if isinstance(columns, str):
        raise TypeError(msg)
    try:
        columns = tuple(columns)
    except TypeError:
        raise TypeError(msg) from None
    if not all(isinstance(c, str) for c in columns):
        raise TypeError(msg)
    if not columns:
        raise ValueError("columns is empty; name the columns to read, e.g. columns=('de', 'en')")
    dupes = sorted({c for c in columns if columns.count(c) > 1})
    if dupes:
        raise ValueError(f"columns name {', '.join(map(repr, dupes))} more than once; "
                         "name each column once")
    return columns


def read_table(path: str | Path, columns: Sequence[str], *,
               allow_empty: bool = False) -> list[Row]:
    """The rows of a TSV file with a header, reduced to ``columns`` (in that order).

    Checks the whole file before returning and raises a ``ValueError`` naming
    the file (and line number, 1-based, the header being line 1) for: a missing
    file, no header (empty file), a column of ``columns`` missing from the
    header, a row with more or fewer fields than the header, an empty value in
    a selected column (unless ``allow_empty``), and bytes that are not UTF-8.
    A ``"\\r"`` ending a line is removed (Windows line ends); the final newline
    of the file may be missing; a leading UTF-8 byte-order mark is ignored.
    No line is skipped: an empty line in the middle is a row with too few fields.
    """
    columns = _check_columns(columns)
    path = Path(path).expanduser()
    where = f"table file {str(path)!r}"
    if not path.is_file():
        raise ValueError(f"{where} does not exist; give the path of a tab-separated file "
                         "whose first line names its columns")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {where}: {e.strerror or e}; check the path and "
                         "its permissions") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{where}, line {line}: byte 0x{data[e.start]:02x} is not UTF-8; "
                         "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    lines = [ln[:-1] if ln.endswith("\r") else ln for ln in _lines(text.removeprefix("\ufeff"))]
    if not lines or not lines[0].strip():
        raise ValueError(f"{where} has no header; its first line must name the columns, "
                         "separated by tabs")

    # QUOTE_NONE: a quote character is ordinary text, never the start of a quoted field.
    reader = csv.reader(lines, delimiter="\t", quoting=csv.QUOTE_NONE)
    rows: list[Row] = []
    try:
        header = next(reader)
        dupes = sorted({c for c in header if header.count(c) > 1})
        if dupes:
            raise ValueError(f"{where}: the header names column(s) {', '.join(map(repr, dupes))} "
                             "more than once; give every column its own name")
        missing = [c for c in columns if c not in header]
        if missing:
            raise ValueError(f"{where} has no column {', '.join(map(repr, missing))}; its "
                             f"header has: {', '.join(map(repr, header))}")
        picks = [header.index(c) for c in columns]
        for line_no, fields in enumerate(reader, start=2):
            fields = fields or [""]  # csv reads an empty line as no fields at all
            if len(fields) != len(header):
                raise ValueError(f"{where}, line {line_no}: {len(fields)} field(s), but the "
                                 f"header has {len(header)}; separate the fields by exactly "
                                 "one tab each")
            row = tuple(fields[i] for i in picks)
            if not allow_empty and "" in row:
                col = columns[row.index("")]
                raise ValueError(f"{where}, line {line_no}: column {col!r} is empty; fill it "
                                 "in or remove the row")
            rows.append(row)
    except csv.Error as e:  # e.g. a lone "\r" inside a line, or a field over csv's size limit
        raise ValueError(f"{where}, line {reader.line_num}: {e}; fix or remove that "
                         "line") from None
    return rows


# ----------------------------------------------------------------------------- the split rule


def _size(name: str, value: Optional[int], default: int) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be a non-negative integer or None, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative integer or None, got {value}")
    return value


def _allocate(total: int, counts: dict[str, int], caps: dict[str, int]) -> dict[str, int]:
    """``total`` rows shared among labels in proportion to ``counts``, each at
    most ``caps[label]`` (see :func:`split_rows`)."""
    n = sum(counts.values())
    labels = sorted(counts)
    quota = {lb: min(total * counts[lb] // n, caps[lb]) for lb in labels}
    left = total - sum(quota.values())
    # Largest remainder: one more row for the labels whose exact share lost the
    # most to rounding down (ties: label name), while their cap allows.
    for lb in sorted(labels, key=lambda lb: (-(total * counts[lb] % n), lb)):
        if left == 0:
            break
        if quota[lb] < caps[lb]:
            quota[lb] += 1
            left -= 1
    # Caps kept some labels below their share: one row at a time from the label
    # with the most rows still free to leave training (ties: label name).
    spare = [(-(caps[lb] - quota[lb]), lb) for lb in labels if caps[lb] > quota[lb]]
    heapq.heapify(spare)
    while left and spare:
        neg, lb = heapq.heappop(spare)
        quota[lb] += 1
        left -= 1
        if neg + 1 < 0:
            heapq.heappush(spare, (neg + 1, lb))
    return quota


def split_rows(rows: Sequence[Row], *, test_size: Optional[int] = None,
               valid_size: Optional[int] = None,
               stratify_index: Optional[int] = None) -> tuple[list[Row], list[Row], list[Row]]:
    """``(train, valid, test)`` by the one split rule (module doc), deterministic.

    ``rows``: ``n`` rows; ``test_size`` / ``valid_size``: default
    ``min(1000, int(0.05 * n))`` each. The rows are shuffled with
    ``random.Random(0).shuffle``; every output list keeps that shuffled order.

    Plain (``stratify_index=None``): test is the first ``test_size`` shuffled
    rows, valid the next ``valid_size``, train the rest.

    Stratified (``stratify_index``: the position of the label in a row). Let
    label ``l`` have ``c_l`` rows; at most ``c_l - 1`` of them may leave
    training (a label with one row stays in training). Quotas, for test first
    with ``T = test_size``, then for validation with ``T = valid_size`` and
    what test left of each label's ``c_l - 1``:

    1. each label gets ``floor(T * c_l / n)``, at most its cap;
    2. the rows still missing go one each to the labels with the largest
       remainder ``T * c_l mod n`` (ties: label name in sorted order), skipping
       labels at their cap (largest-remainder method);
    3. if caps still leave rows missing, they go one at a time to the label
       with the most rows left below its cap (ties: label name).

    The quotas then sum exactly to ``T``. Label ``l``'s rows, in shuffled
    order, give its test quota first, then its validation quota; the rest are
    training rows. A ``ValueError`` says when the sizes leave no training row,
    or, stratified, need more rows than can leave training.
    """
    n = len(rows)
    default = min(MAX_SPLIT_SIZE, n // 20)  # n // 20 == int(0.05 * n), without float rounding
    test_size = _size("test_size", test_size, default)
    valid_size = _size("valid_size", valid_size, default)
    if test_size + valid_size >= n:
        raise ValueError(f"test_size {test_size} + valid_size {valid_size} leave no training "
                         f"row of the table's {n}; use smaller sizes or a bigger table")
    order = list(range(n))
    random.Random(SPLIT_SEED).shuffle(order)

    if stratify_index is None:
        test = [rows[i] for i in order[:test_size]]
        valid = [rows[i] for i in order[test_size:test_size + valid_size]]
        train = [rows[i] for i in order[test_size + valid_size:]]
        return train, valid, test

    counts: dict[str, int] = {}
    for row in rows:
        counts[row[stratify_index]] = counts.get(row[stratify_index], 0) + 1
    free = {lb: c - 1 for lb, c in counts.items()}  # every label keeps one training row
    if test_size + valid_size > sum(free.values()):
        raise ValueError(f"test_size {test_size} + valid_size {valid_size} need more rows than "
                         f"the {sum(free.values())} that can leave training while each of the "
                         f"{len(counts)} labels keeps a training row; use smaller sizes")
    test_quota = _allocate(test_size, counts, free)
    valid_quota = _allocate(valid_size, counts, {lb: free[lb] - test_quota[lb] for lb in counts})

    train, valid, test = [], [], []
    taken = dict.fromkeys(counts, 0)  # rows of each label seen so far, in shuffled order
    for i in order:
        row = rows[i]
        lb = row[stratify_index]
        k = taken[lb]
        taken[lb] = k + 1
        if k < test_quota[lb]:
            test.append(row)
        elif k < test_quota[lb] + valid_quota[lb]:
            valid.append(row)
        else:
            train.append(row)
    return train, valid, test


# ----------------------------------------------------------------------------- loading


def _check_seen(label_col: str, splits: TableSplits, where: str) -> None:
    k = splits.columns.index(label_col)
    seen = {row[k] for row in splits.train}
    unseen = sorted({row[k] for s in ("valid", "test") for row in splits.split(s)} - seen)
    if unseen:
        shown = ", ".join(map(repr, unseen[:10])) + (f" and {len(unseen) - 10} more"
                                                     if len(unseen) > 10 else "")
        raise ValueError(f"{where}: label(s) {shown} of column {label_col!r} occur in valid or "
                         "test but not in train; add training rows for them or drop those rows")


def _select(name: str, table: TableSplits, columns: tuple[str, ...]) -> TableSplits:
    missing = [c for c in columns if c not in table.columns]
    if missing:
        raise ValueError(f"table {name!r} has no column {', '.join(map(repr, missing))}; its "
                         f"columns are: {', '.join(map(repr, table.columns))}")
    picks = [table.columns.index(c) for c in columns]
    if picks == list(range(len(table.columns))):
        return table
    return TableSplits(columns, *([tuple(r[i] for i in picks) for r in table.split(s)]
                                 for s in SPLITS))


def load_table(source: str | Path, columns: Sequence[str], *, stratify: Optional[str] = None,
               test_size: Optional[int] = None,
               valid_size: Optional[int] = None) -> TableSplits:
    """Train, valid and test rows of ``columns`` from ``source`` (see the module doc).

    ``source``: a registered table name, a directory with ``train.tsv``,
    ``valid.tsv`` and ``test.tsv``, or one TSV file, split by
    :func:`split_rows` (``test_size`` / ``valid_size`` apply only there).
    ``stratify``: the label column, one of ``columns``: a single file is
    split stratified by it, and for fixed splits every valid and test label
    must occur in train.
    """
    columns = _check_columns(columns)
    if stratify is not None and stratify not in columns:
        raise ValueError(f"stratify={stratify!r} is not one of the columns read "
                         f"({', '.join(map(repr, columns))}); add it to columns")
    if not isinstance(source, (str, Path)):
        raise TypeError(f"source must be a table name or a path, got {type(source).__name__}")
    path = Path(source).expanduser()
    named = isinstance(source, str) and source in TABLES
    if named or path.is_dir():
        where = f"table {source!r}" if named else f"table directory {str(path)!r}"
        # Checked before loading: a named table may need a download first.
        if test_size is not None or valid_size is not None:
            raise ValueError(f"test_size and valid_size apply to a single TSV file only; "
                             f"{where} has fixed splits: leave them unset")
        if named:
            splits = _select(source, TABLES[source](), columns)
        else:
            files = [path / f"{s}.tsv" for s in SPLITS]
            absent = [f.name for f in files if not f.is_file()]
            if absent:
                raise ValueError(f"{where} lacks {', '.join(absent)}; it needs train.tsv, "
                                 "valid.tsv and test.tsv")
            splits = TableSplits(columns, *(read_table(f, columns) for f in files))
        if stratify is not None:
            _check_seen(stratify, splits, where)
        return splits
    if not path.is_file():
        raise ValueError(f"no table {str(source)!r}: it is no TSV file, no directory with "
                         "train.tsv, valid.tsv and test.tsv, and no table name (known: "
                         f"{', '.join(sorted(TABLES)) or 'none'})")
    rows = read_table(path, columns)
    k = None if stratify is None else columns.index(stratify)
    return TableSplits(columns, *split_rows(rows, test_size=test_size, valid_size=valid_size,
                                            stratify_index=k))
