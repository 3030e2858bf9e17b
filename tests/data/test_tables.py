"""TSV tables: reading and checking, the one split rule (plain and stratified), sources."""

import random
from collections import Counter

import pytest

from srupp.data import TABLES, TableSplits, load_table, read_table, register_table, split_rows


def one_line(excinfo):
    msg = str(excinfo.value)
    assert msg and "\n" not in msg
    return msg


def write(path, text, encoding="utf-8"):
    path.write_bytes(text.encode(encoding) if isinstance(text, str) else text)
    return path


def tsv(path, header, rows):
    return write(path, "\t".join(header) + "\n" + "".join("\t".join(r) + "\n" for r in rows))


# ----------------------------------------------------------------------------- read_table


def test_read_selects_columns_in_order_and_keeps_raw_text(tmp_path):
    p = write(tmp_path / "t.tsv", 'en\tde\tid\r\n"Hi"\t\'Hallo\' \\t\t1\r\nx y\tz\t2')
    assert read_table(p, ["de", "en"]) == [("'Hallo' \\t", '"Hi"'), ("z", "x y")]
    assert read_table(p, ("id",)) == [("1",), ("2",)]
    # a leading byte-order mark is not part of the first column's name
    write(p, "\ufeffa\tb\n1\t2\n")
    assert read_table(p, ["a"]) == [("1",)]


@pytest.mark.parametrize("text, columns, words", [
    ("a\tb\n1\t2\n3\n", ["a"], ["line 3", "1 field(s)", "header has 2"]),
    ("a\tb\n1\t2\t3\n", ["b"], ["line 2", "3 field(s)", "header has 2"]),
    ("a\tb\n1\t2\n\n3\t4\n", ["a"], ["line 3", "1 field(s)"]),   # an inner empty line
    ("a\tb\n1\t2\n\n", ["a"], ["line 3"]),                       # two newlines at the end
    ("a\tb\n1\t2\n", ["a", "c"], ["no column 'c'", "'a', 'b'"]),
    ("", ["a"], ["no header"]),
    ("\n1\t2\n", ["a"], ["no header"]),
    ("a\tb\n1\t\n", ["b"], ["line 2", "column 'b' is empty"]),
    ("a\ta\n1\t2\n", ["a"], ["'a' more than once"]),
    ("a\tb\n1\tx\ry\n", ["a"], ["line 2"]),                      # a lone carriage return
])
def test_bad_tables(tmp_path, text, columns, words):
    p = write(tmp_path / "t.tsv", text)
    with pytest.raises(ValueError) as e:
        read_table(p, columns)
    msg = one_line(e)
    assert str(p) in msg
    for w in words:
        assert w in msg


def test_empty_value_allowed_and_unselected(tmp_path):
    p = write(tmp_path / "t.tsv", "a\tb\n1\t\n")
    assert read_table(p, ["b"], allow_empty=True) == [("",)]
    assert read_table(p, ["a"]) == [("1",)]   # only selected columns must be filled


def test_bad_utf8_names_the_line(tmp_path):
    p = write(tmp_path / "t.tsv", b"a\tb\n1\t2\n3\tcaf\xe9\n")
    with pytest.raises(ValueError) as e:
        read_table(p, ["a"])
    assert "line 3" in one_line(e) and "0xe9" in one_line(e) and "UTF-8" in one_line(e)


def test_missing_file_and_bad_columns(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_table(tmp_path / "nope.tsv", ["a"])
    p = write(tmp_path / "t.tsv", "a\n1\n")
    with pytest.raises(TypeError, match="list of column names"):
        read_table(p, "a")
    with pytest.raises(ValueError, match="more than once"):
        read_table(p, ["a", "a"])
    with pytest.raises(ValueError, match="columns is empty"):
        read_table(p, [])


# ----------------------------------------------------------------------------- split rule


def expected_plain(rows, test_size, valid_size):
    """The rule as stated, computed independently: shuffle a copy, cut test, valid, train."""
    shuffled = list(rows)
    random.Random(0).shuffle(shuffled)
    return (shuffled[test_size + valid_size:], shuffled[test_size:test_size + valid_size],
            shuffled[:test_size])


def test_plain_split_is_the_documented_rule(tmp_path):
    rows = [(f"src {i}", f"tgt {i}") for i in range(30)]
    assert split_rows(rows, test_size=4, valid_size=3) == expected_plain(rows, 4, 3)
    p = tsv(tmp_path / "pairs.tsv", ("en", "de"), rows)
    t = load_table(p, ("de", "en"), test_size=4, valid_size=3)
    train, valid, test = expected_plain([(de, en) for en, de in rows], 4, 3)
    assert (t.columns, t.train, t.valid, t.test) == (("de", "en"), train, valid, test)
    assert t.split("valid") == valid
    with pytest.raises(ValueError, match="unknown split"):
        t.split("dev")


@pytest.mark.parametrize("n, size", [(19, 0), (20, 1), (399, 19), (20_000, 1000), (30_000, 1000)])
def test_default_sizes(n, size):
    rows = [(str(i),) for i in range(n)]
    train, valid, test = split_rows(rows)
    assert (len(test), len(valid), len(train)) == (size, size, n - 2 * size)
    assert (train, valid, test) == expected_plain(rows, size, size)


def test_sizes_errors():
    rows = [(str(i),) for i in range(10)]
    with pytest.raises(ValueError, match="leave no training row"):
        split_rows(rows, test_size=5, valid_size=5)
    with pytest.raises(ValueError, match="non-negative"):
        split_rows(rows, test_size=-1)
    with pytest.raises(TypeError, match="non-negative integer"):
        split_rows(rows, valid_size=1.5)
    assert [len(s) for s in split_rows(rows, test_size=0, valid_size=9)] == [1, 9, 0]


def labelled(counts):
    """Rows (text, label), grouped by label: 'label-k' texts for each label."""
    return [(f"{lb}-{k}", lb) for lb, c in counts.items() for k in range(c)]


def test_stratified_quotas_exact_and_labels_seen():
    counts = {"big": 60, "mid": 25, "small": 9, "pair": 2, "one": 1, "one2": 1, "three": 3}
    rows = labelled(counts)
    train, valid, test = split_rows(rows, test_size=11, valid_size=7, stratify_index=1)
    assert (len(test), len(valid), len(train)) == (11, 7, len(rows) - 18)
    assert sorted(train + valid + test) == sorted(rows)
    seen = {lb for _, lb in train}
    assert {lb for _, lb in valid + test} <= seen == set(counts)
    # single-row labels never leave training
    assert ("one-0", "one") in train and ("one2-0", "one2") in train
    # proportional shares: n = 101; test: big 11*60/101 = 6.53, mid 2.72, small 0.98, ...
    tc, vc = Counter(lb for _, lb in test), Counter(lb for _, lb in valid)
    assert tc["big"] in (6, 7) and tc["mid"] in (2, 3) and vc["big"] in (4, 5)
    # within a label, test takes its first rows in shuffled order, then valid
    order = list(rows)
    random.Random(0).shuffle(order)
    for lb in counts:
        mine = [r for r in order if r[1] == lb]
        assert mine[:tc[lb]] == [r for r in test if r[1] == lb]
        assert mine[tc[lb]:tc[lb] + vc[lb]] == [r for r in valid if r[1] == lb]
    # every output keeps the shuffled order
    for split in (train, valid, test):
        members = set(split)
        assert split == [r for r in order if r in members]


def test_stratified_largest_remainder_by_hand():
    # n = 10, test 3: a 3*5/10 = 1.5, b 3*3/10 = 0.9, c 3*2/10 = 0.6 -> floors 1, 0, 0;
    # remainders (of 10) a 5, b 9, c 6: b then c get one more -> a 1, b 1, c 1.
    rows = labelled({"a": 5, "b": 3, "c": 2})
    _, valid, test = split_rows(rows, test_size=3, valid_size=0, stratify_index=1)
    assert Counter(lb for _, lb in test) == {"a": 1, "b": 1, "c": 1} and valid == []


def test_stratified_caps_fill_from_other_labels():
    # Each of 4 labels with 2 rows may give one; the 2 others with 1 row none. The
    # 5-row label takes what the caps leave over. Sizes sum to the capacity: 4 + 4.
    rows = labelled({"w": 2, "x": 2, "y": 2, "z": 2, "big": 5, "s1": 1, "s2": 1})
    train, valid, test = split_rows(rows, test_size=4, valid_size=4, stratify_index=1)
    assert len(test) == len(valid) == 4
    assert Counter(lb for _, lb in train) == dict.fromkeys(["w", "x", "y", "z", "big",
                                                            "s1", "s2"], 1)
    with pytest.raises(ValueError, match="keeps a training row"):
        split_rows(rows, test_size=5, valid_size=4, stratify_index=1)


def test_stratified_is_deterministic():
    # Labels are ordered by name wherever order matters, never by hash (PYTHONHASHSEED);
    # a child process would check that directly, but importing srupp there takes seconds.
    rows = [(str(i), f"l{i % 7 + i % 3}") for i in range(300)]
    first = split_rows(rows, test_size=17, valid_size=13, stratify_index=1)
    assert split_rows(list(rows), test_size=17, valid_size=13, stratify_index=1) == first
    # Counts l0..l8: 15 28 43 43 43 43 42 29 14 (n = 300). Test 17: floors 0 1 2 2 2 2 2 1 0
    # (12), remainders .85 .59 .44 .44 .44 .44 .38 .64 .79: one more for l0, l8, l7, l1 and
    # l2 (first by name of the four tied). Valid 13: floors 0 1 1 1 1 1 1 1 0 (7), then
    # l2 l3 l4 l5 (.86), l6 (.82), l0 (.65).
    test = dict(l0=1, l1=2, l2=3, l3=2, l4=2, l5=2, l6=2, l7=2, l8=1)
    valid = dict(l0=1, l1=1, l2=2, l3=2, l4=2, l5=2, l6=2, l7=1)
    assert Counter(lb for _, lb in first[2]) == test
    assert Counter(lb for _, lb in first[1]) == valid


def test_stratified_load_from_file(tmp_path):
    rows = [(f"text {i}", "even" if i % 2 else "odd") for i in range(40)] + [("lone", "rare")]
    p = tsv(tmp_path / "c.tsv", ("text", "label"), rows)
    t = load_table(p, ("label", "text"), stratify="label", test_size=4, valid_size=2)
    flipped = [(lb, tx) for tx, lb in rows]
    assert (t.train, t.valid, t.test) == split_rows(flipped, test_size=4, valid_size=2,
                                                    stratify_index=0)
    assert ("rare", "lone") in t.train
    with pytest.raises(ValueError, match="not one of the columns"):
        load_table(p, ("text",), stratify="label")


# ----------------------------------------------------------------------------- sources


def test_directory_source_used_as_is(tmp_path):
    d = tmp_path / "split"
    d.mkdir()
    tsv(d / "train.tsv", ("label", "text"), [("a", "one"), ("b", "two")])
    tsv(d / "valid.tsv", ("text", "label"), [("three", "a")])   # column order may differ
    tsv(d / "test.tsv", ("label", "text"), [("b", "four")])
    t = load_table(d, ["text", "label"], stratify="label")
    assert t == TableSplits(("text", "label"), [("one", "a"), ("two", "b")], [("three", "a")],
                            [("four", "b")])
    with pytest.raises(ValueError, match="fixed splits"):
        load_table(d, ["text"], test_size=1)


def test_directory_unseen_labels_and_missing_file(tmp_path):
    d = tmp_path / "split"
    d.mkdir()
    tsv(d / "train.tsv", ("label", "text"), [("a", "one")])
    tsv(d / "valid.tsv", ("label", "text"), [("a", "two")])
    tsv(d / "test.tsv", ("label", "text"), [("zeta", "three"), ("beta", "four")])
    with pytest.raises(ValueError) as e:
        load_table(d, ["text", "label"], stratify="label")
    assert "'beta', 'zeta'" in one_line(e) and "not in train" in one_line(e)
    assert load_table(d, ["text", "label"]).test == [("three", "zeta"), ("four", "beta")]
    (d / "valid.tsv").unlink()
    with pytest.raises(ValueError, match="lacks valid.tsv"):
        load_table(d, ["text"])
    with pytest.raises(ValueError, match="no table"):
        load_table(tmp_path / "nothing-here", ["text"])


def test_named_table(monkeypatch):
    calls = []

    def loader(source=None):
        calls.append(source)
        return TableSplits(("x", "y"), [("1", "a"), ("2", "b")], [("3", "a")], [("4", "b")])

    monkeypatch.delitem(TABLES, "toy-table", raising=False)
    register_table("toy-table")(loader)
    try:
        t = load_table("toy-table", ("y", "x"))
        assert t.columns == ("y", "x") and t.test == [("b", "4")] and calls == [None]
        with pytest.raises(ValueError) as e:
            load_table("toy-table", ("x", "z"))
        assert "no column 'z'" in one_line(e) and "'x', 'y'" in one_line(e)
        with pytest.raises(ValueError, match="fixed splits"):
            load_table("toy-table", ("x",), valid_size=3)
        assert len(calls) == 2   # the size check comes before loading (no download)
        with pytest.raises(TypeError, match="already registered"):
            register_table("toy-table")(lambda source=None: None)
    finally:
        TABLES.pop("toy-table", None)
