"""Word-level and SentencePiece tokenizers."""

import json
import sys

import pytest
import torch

from srupp.data.tokenizers import (
    SentencePieceTokenizer,
    WordTokenizer,
    build_tokenizer,
    tokenizer_from_dict,
)

TRAIN = "the cat sat on the mat\nthe dog sat\na cat ran\n"


def test_specials_and_frequency_order():
    tok = build_tokenizer("word", TRAIN)
    assert isinstance(tok, WordTokenizer)
    assert tok.vocab[:2] == ("<unk>", "<eos>")
    assert (tok.unk_id, tok.eos_id) == (0, 1)
    # the:3, cat:2, sat:2 (cat first seen before sat), then count-1 words in first-occurrence order
    assert tok.vocab[2:] == ("the", "cat", "sat", "on", "mat", "dog", "a", "ran")
    assert tok.vocab_size == 10


def test_round_trip_and_eos():
    tok = build_tokenizer("word", TRAIN)
    ids = tok.encode(TRAIN)
    assert ids.dtype == torch.int64 and ids.ndim == 1
    assert ids.tolist().count(tok.eos_id) == 3
    assert ids[-1].item() == tok.eos_id
    assert tok.decode(ids) == TRAIN
    # a last line without newline is still a line; extra whitespace is collapsed
    assert tok.encode("the  cat\tsat").tolist() == tok.encode("the cat sat\n").tolist()
    assert tok.encode("cat\n\ndog").tolist() == [3, 1, 1, 7, 1]  # empty line -> lone <eos>
    assert tok.encode("").numel() == 0
    assert tok.decode([]) == ""
    assert tok.decode([3, 1, 4]) == "cat\nsat"
    assert tok.decode(torch.tensor([2, 3])) == "the cat"


def test_unk_and_oov_rate():
    tok = build_tokenizer("word", TRAIN)
    ids = tok.encode("the zebra sat\nmoon\n").tolist()
    assert ids == [2, 0, 4, 1, 0, 1]
    assert tok.decode(ids) == "the <unk> sat\n<unk>\n"
    assert tok.oov_rate("the zebra sat\nmoon\n") == pytest.approx(2 / 4)  # <eos> not counted
    assert tok.oov_rate(TRAIN) == 0.0
    assert tok.oov_rate("") == 0.0
    assert tok.oov_rate("\n\n") == 0.0
    # literal specials in the text (Penn Treebank style) map to their ids
    assert tok.encode("<unk> <eos>").tolist() == [0, 1, 1]


def test_vocab_size_cap_includes_specials():
    tok = build_tokenizer("word", TRAIN, vocab_size=4)
    assert tok.vocab == ("<unk>", "<eos>", "the", "cat")
    assert tok.vocab_size == 4
    assert tok.encode("sat").tolist() == [0, 1]
    big = build_tokenizer("word", TRAIN, vocab_size=1000)
    assert big.vocab_size == 10  # no padding beyond the training words


def test_min_freq():
    tok = build_tokenizer("word", TRAIN, min_freq=2)
    assert tok.vocab == ("<unk>", "<eos>", "the", "cat", "sat")
    assert build_tokenizer("word", TRAIN, min_freq=3).vocab == ("<unk>", "<eos>", "the")
    assert build_tokenizer("word", TRAIN, min_freq=2, vocab_size=3).vocab[2:] == ("the",)
    assert build_tokenizer("word", TRAIN, min_freq=4).vocab_size == 2


def test_lowercase():
    text = "The cat\nthe CAT Cat\n"
    cased = build_tokenizer("word", text)
    assert cased.vocab[2:] == ("The", "cat", "the", "CAT", "Cat")
    low = build_tokenizer("word", text, lowercase=True)
    assert low.vocab[2:] == ("cat", "the")
    assert low.encode("THE Cat").tolist() == [3, 2, 1]
    assert low.decode(low.encode("THE Cat\n")) == "the cat\n"
    assert low.token_to_id("CAT") == 2 and cased.token_to_id("dog") == 0
    assert tokenizer_from_dict(low.to_dict()).lowercase is True


def test_tie_break_is_first_occurrence_and_deterministic():
    a = build_tokenizer("word", "z y x\nb a\n")
    assert a.vocab[2:] == ("z", "y", "x", "b", "a")
    b = build_tokenizer("word", "a b\nx y z\n")
    assert b.vocab[2:] == ("a", "b", "x", "y", "z")
    # with a cap, the earlier-seen of equally frequent words wins
    assert build_tokenizer("word", "q r s q r s p", vocab_size=4).vocab[2:] == ("q", "r")
    assert build_tokenizer("word", TRAIN) == build_tokenizer("word", TRAIN)


def test_to_dict_from_dict():
    tok = build_tokenizer("word", TRAIN, vocab_size=6, lowercase=True)
    d = json.loads(json.dumps(tok.to_dict()))
    assert d["type"] == "word" and d["vocab"][:2] == ["<unk>", "<eos>"]
    back = tokenizer_from_dict(d)
    assert isinstance(back, WordTokenizer) and back == tok
    assert back.encode(TRAIN).tolist() == tok.encode(TRAIN).tolist()
    with pytest.raises(ValueError, match="corrupt"):
        tokenizer_from_dict({"type": "word"})
    with pytest.raises(ValueError, match="<unk>"):
        tokenizer_from_dict({"type": "word", "vocab": ["a", "b"]})
    with pytest.raises(ValueError, match="duplicate"):
        tokenizer_from_dict({"type": "word", "vocab": ["<unk>", "<eos>", "a", "a"]})
    with pytest.raises(ValueError, match="whitespace"):
        tokenizer_from_dict({"type": "word", "vocab": ["<unk>", "<eos>", "a b"]})


@pytest.mark.parametrize("options, match", [
    ({"vocab_size": 2}, "at least 3"),
    ({"vocab_size": 0}, "at least 3"),
    ({"vocab_size": 5.5}, "integer"),
    ({"vocab_size": True}, "integer"),
    ({"min_freq": 0}, "min_freq"),
    ({"lowercase": "yes"}, "True or False"),
    ({"vocab": 10}, "does not take option"),
])
def test_build_option_errors(options, match):
    with pytest.raises(ValueError, match=match) as e:
        build_tokenizer("word", TRAIN, **options)
    assert "\n" not in str(e.value)


def test_errors():
    with pytest.raises(ValueError, match="no words"):
        build_tokenizer("word", "  \n\t\n")
    with pytest.raises(ValueError, match="no words"):
        build_tokenizer("word", "")
    tok = build_tokenizer("word", TRAIN)
    with pytest.raises(ValueError, match="outside"):
        tok.decode([tok.vocab_size])
    with pytest.raises(TypeError, match="str"):
        tok.encode(b"bytes")


def test_encode_is_fast():
    import time

    words = [f"w{i % 5000}" for i in range(200_000)]
    text = "\n".join(" ".join(words[i:i + 20]) for i in range(0, len(words), 20)) + "\n"
    tok = build_tokenizer("word", text, vocab_size=3000)
    t = time.perf_counter()
    ids = tok.encode(text)
    elapsed = time.perf_counter() - t
    assert ids.numel() == 200_000 + 10_000
    assert elapsed < 1.0, f"encoding 210k tokens took {elapsed:.2f} s"


# ----------------------------------------------------------------------------- sentencepiece

try:
    import sentencepiece  # noqa: F401
    HAVE_SP = True
except ImportError:
    HAVE_SP = False

needs_sp = pytest.mark.skipif(not HAVE_SP, reason="sentencepiece is not installed "
                              "(pip install sentencepiece or pip install 'srupp[subword]')")

SP_TRAIN = "\n".join(
    f"the {a} {b} sat on the {c} while {b} {a} ran"
    for a in ("cat", "dog", "bird", "fox") for b in ("quickly", "slowly", "happily")
    for c in ("mat", "hat", "rug", "log", "bench")
) + "\n"


def test_sentencepiece_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # makes the import fail
    with pytest.raises(ValueError, match=r"pip install 'srupp\[subword\]'") as e:
        build_tokenizer("sentencepiece", SP_TRAIN, vocab_size=300)
    assert "\n" not in str(e.value)


@needs_sp
@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_sentencepiece_round_trip_and_save(model_type):
    """Without byte fallback (as tokenizers saved before srupp had it): unseen is <unk>."""
    tok = build_tokenizer("sentencepiece", SP_TRAIN, vocab_size=30, model_type=model_type,
                          byte_fallback=False)
    assert isinstance(tok, SentencePieceTokenizer) and not tok.byte_fallback
    assert tok.vocab_size == 30
    ids = tok.encode(SP_TRAIN)
    assert ids.dtype == torch.int64
    assert ids.tolist().count(tok.eos_id) == SP_TRAIN.count("\n")
    assert tok.decode(ids) == SP_TRAIN
    assert tok.oov_rate(SP_TRAIN) == 0.0
    assert tok.oov_rate("the cat Ω sat") > 0.0
    assert "⁇" in tok.decode(tok.encode("the cat Ω sat"))
    assert tok.encode("").numel() == 0
    d = json.loads(json.dumps(tok.to_dict()))
    assert d["type"] == "sentencepiece" and isinstance(d["model"], str)
    back = tokenizer_from_dict(d)
    assert back == tok and not back.byte_fallback
    assert back.encode(SP_TRAIN).tolist() == ids.tolist()


UNSEEN = "¡Qué â ß 你好!"  # not one of these characters is in SP_TRAIN (ASCII letters)


@needs_sp
@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_sentencepiece_byte_fallback_round_trips_unseen_characters(model_type):
    # 285: the 256 byte pieces, <unk>, <eos>, SP_TRAIN's 24 characters and 1 more piece
    tok = build_tokenizer("sentencepiece", SP_TRAIN, vocab_size=285, model_type=model_type)
    assert tok.byte_fallback and tok.vocab_size == 285
    ids = tok.encode(UNSEEN + "\nthe cat sat\n")
    assert tok.unk_id not in ids.tolist()
    assert tok.decode(ids) == UNSEEN + "\nthe cat sat\n"
    assert "⁇" not in tok.decode(ids)
    assert tok.oov_rate(UNSEEN) == 0.0
    back = tokenizer_from_dict(json.loads(json.dumps(tok.to_dict())))
    assert back.byte_fallback and back.decode(back.encode(UNSEEN)) == UNSEEN + "\n"
    # a byte piece alone that is not a whole character (a model's slip) is U+FFFD, not ⁇
    first_byte = 2 + "你".encode()[0]  # byte pieces are ids 2..257
    assert tok.decode([first_byte]) == "\ufffd"


@needs_sp
def test_sentencepiece_byte_fallback_needs_room_for_the_bytes():
    with pytest.raises(ValueError) as e:
        build_tokenizer("sentencepiece", SP_TRAIN, vocab_size=100)
    assert "too small for byte fallback" in str(e.value) and "byte_fallback=False" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"required_chars.*byte pieces count in it"):
        build_tokenizer("sentencepiece", SP_TRAIN, vocab_size=270)
    with pytest.raises(ValueError, match="byte_fallback must be True or False"):
        build_tokenizer("sentencepiece", SP_TRAIN, byte_fallback="yes")


@needs_sp
def test_sentencepiece_errors():
    with pytest.raises(ValueError, match="does not take option"):
        build_tokenizer("sentencepiece", SP_TRAIN, lowercase=True)
    with pytest.raises(ValueError, match="model_type"):
        build_tokenizer("sentencepiece", SP_TRAIN, model_type="wordpiece")
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer("sentencepiece", SP_TRAIN, vocab_size=100_000)
    with pytest.raises(ValueError, match="at least 3"):
        build_tokenizer("sentencepiece", SP_TRAIN, vocab_size=2)
    with pytest.raises(ValueError, match="no words"):
        build_tokenizer("sentencepiece", "\n \n")
    with pytest.raises(ValueError, match="corrupt"):
        tokenizer_from_dict({"type": "sentencepiece"})
    with pytest.raises(ValueError):
        tokenizer_from_dict({"type": "sentencepiece", "model": "bm90IGEgbW9kZWw="})

