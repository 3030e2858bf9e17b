"""Data: corpora, tokenizers and batching for language models; tables for other tasks.

Corpora (:func:`load_corpus`): Shakespeare and Brown, the downloadable
enwik8, text8 and WikiText-103 (:mod:`srupp.data.download`), and local text
files or split directories. Tokenizers (:func:`build_tokenizer`): byte,
character, word and SentencePiece subword. :class:`StreamBatcher` cuts a token
stream into Transformer-XL style batches whose streams continue from batch to
batch.

Tables for translation and classification (:func:`load_table`): TSV files,
split directories and IWSLT'14 De-En, with one seeded split rule
(:mod:`srupp.data.tables`). :class:`LengthBatcher` groups their items by
length under a padded-token cap.

Problems raise a plain ``ValueError`` (bad data: a missing or damaged file,
too little text, a saved state that does not fit; or a bad argument value) or
``TypeError`` (an argument of the wrong type), with a one-line message in the
terms of this API that names the fix.
"""

from .batching import Batch, LengthBatch, LengthBatcher, StreamBatcher
from . import download  # registers the downloadable corpora and tables (no download at import)
from .tables import (
    TABLES,
    TableSplits,
    load_table,
    read_table,
    register_table,
    split_rows,
)
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
    "LengthBatch",
    "LengthBatcher",
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
    "TABLES",
    "TableSplits",
    "load_table",
    "read_table",
    "register_table",
    "split_rows",
]
