"""Byte and char tokenizers: round trips, unknowns, saving, errors, speed."""

import json
import time

import numpy as np
import pytest
import torch

from srupp.data import (
    TOKENIZERS,
    ByteTokenizer,
    CharTokenizer,
    build_tokenizer,
    tokenizer_from_dict,
)

TEXTS = ["", "hello world\n", "naïve café — Ωμέγα, 日本語, emoji 😀👍🏽\r\n\ttab"]


def one_line_error(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg and msg.strip() == msg and msg
    return msg


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == torch.int64 and ids.dim() == 1
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text
    assert tok.decode(ids.numpy()) == text
    assert tok.vocab_size == 256 and tok.oov_rate(text) == 0.0 and tok.unk_id is None


def test_byte_decode_partial_multibyte_does_not_crash():
    tok = ByteTokenizer()
    ids = tok.encode("a😀b")
    assert tok.decode(ids[:3]) == "a\ufffd"             # cut inside the emoji
    assert tok.decode(torch.tensor([0xFF, 0x41])) == "\ufffdA"   # invalid lead byte


@pytest.mark.parametrize("text", TEXTS[1:])
def test_char_round_trip(text):
    tok = CharTokenizer.build(text)
    assert tok.chars == tuple(sorted(set(text)))
    assert tok.vocab_size == len(set(text)) + 1
    ids = tok.encode(text)
    assert ids.dtype == torch.int64 and ids.shape == (len(text),)
    assert int(ids.min()) >= 1                           # nothing unknown
    assert ids.tolist() == [tok.chars.index(c) + 1 for c in text]
    assert tok.decode(ids) == text
    assert tok.oov_rate(text) == 0.0


def test_char_unknown_chars():
    tok = CharTokenizer.build("abcab")
    assert tok.unk_id == 0 and tok.unk_token == "<unk>"
    ids = tok.encode("abxé😀c")
    assert ids.tolist() == [1, 2, 0, 0, 0, 3]
    assert tok.decode(ids) == "ab\ufffd\ufffd\ufffdc"     # one U+FFFD per unknown id
    assert tok.oov_rate("abxé") == pytest.approx(0.5)
    assert tok.oov_rate("") == 0.0
    # a character above every vocabulary code point, and one below
    assert tok.encode("\U0010FFFF\x00").tolist() == [0, 0]


@pytest.mark.parametrize("tok", [ByteTokenizer(), CharTokenizer.build(TEXTS[2])],
                         ids=["byte", "char"])
def test_to_dict_from_dict(tok):
    d = tok.to_dict()
    assert d["type"] == tok.type_name
    back = tokenizer_from_dict(json.loads(json.dumps(d)))
    assert type(back) is type(tok) and back == tok
    assert back.encode(TEXTS[2]).tolist() == tok.encode(TEXTS[2]).tolist()


def test_build_tokenizer_kinds_and_errors():
    assert isinstance(build_tokenizer("byte", "abc"), ByteTokenizer)
    char = build_tokenizer("char", "cab")
    assert isinstance(char, CharTokenizer) and char.chars == ("a", "b", "c")
    assert {"byte", "char"} <= set(TOKENIZERS)
    with pytest.raises(ValueError) as e:
        build_tokenizer("bpe", "abc")
    msg = one_line_error(e)
    assert "'bpe'" in msg and "byte" in msg and "char" in msg
    with pytest.raises(ValueError, match="empty training text"):
        build_tokenizer("char", "")


def test_from_dict_errors():
    with pytest.raises(ValueError, match="'type'"):
        tokenizer_from_dict({"chars": "abc"})
    with pytest.raises(ValueError) as e:
        tokenizer_from_dict({"type": "wordpiece"})
    assert "wordpiece" in one_line_error(e) and "char" in str(e.value)
    with pytest.raises(ValueError, match="'chars'"):
        tokenizer_from_dict({"type": "char"})
    with pytest.raises(ValueError, match="sorted"):
        tokenizer_from_dict({"type": "char", "chars": "ba"})


@pytest.mark.parametrize("tok", [ByteTokenizer(), CharTokenizer.build("abc")], ids=["byte", "char"])
def test_decode_bad_ids(tok):
    with pytest.raises(ValueError) as e:
        tok.decode([1, tok.vocab_size])
    assert str(tok.vocab_size) in one_line_error(e)
    with pytest.raises(ValueError, match="outside"):
        tok.decode(torch.tensor([-1]))
    with pytest.raises(ValueError, match="1-D"):
        tok.decode(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        tok.decode(torch.zeros(2))
    assert tok.decode([]) == ""


def test_encode_5mb_is_fast():
    rng = np.random.default_rng(0)
    alphabet = np.array(list("abcdefghijklmnopqrstuvwxyz ,.;:\n'ABCDEFGHIJ"))
    text = "".join(rng.choice(alphabet, size=100_000)) * 50   # 5 MB
    tok = CharTokenizer.build(text[:100_000] + "é")
    byte = ByteTokenizer()
    byte.encode(text[:1000]), tok.encode(text[:1000])        # warm up
    t0 = time.perf_counter()
    ids_c = tok.encode(text)
    ids_b = byte.encode(text)
    elapsed = time.perf_counter() - t0
    assert ids_c.shape == ids_b.shape == (len(text),)
    assert elapsed < 1.0, f"encoding 5 MB took {elapsed:.2f}s"
