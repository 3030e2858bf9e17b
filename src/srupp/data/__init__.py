"""Data for character/byte-level language modelling: tokenizers, corpora, batching."""

from .batching import Batch, StreamBatcher
from . import download  # registers enwik8, text8, wikitext-103 (no download at import)
from .corpora import (
    CORPORA,
    SHAKESPEARE_TEST_POSITIONS,
    SHAKESPEARE_VALID_POSITIONS,
    Corpus,
    load_corpus,
    load_shakespeare,
    register_corpus,
    shakespeare_split,
)
from .tokenizers import (
    TOKENIZERS,
    ByteTokenizer,
    CharTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    WordTokenizer,
    build_tokenizer,
    register_tokenizer,
    tokenizer_from_dict,
)

__all__ = [
    "Batch",
    "StreamBatcher",
    "CORPORA",
    "SHAKESPEARE_TEST_POSITIONS",
    "SHAKESPEARE_VALID_POSITIONS",
    "Corpus",
    "load_corpus",
    "load_shakespeare",
    "register_corpus",
    "shakespeare_split",
    "TOKENIZERS",
    "ByteTokenizer",
    "CharTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "WordTokenizer",
    "build_tokenizer",
    "register_tokenizer",
    "tokenizer_from_dict",
]
