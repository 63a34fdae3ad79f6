"""Deterministic, download-free data: token sources and index-addressed micro-batches.

May import: numpy, torch, :mod:`paci_tune.base`, :mod:`paci_tune.errors`.
"""

from paci_tune.data.sources import (
    TokenSource,
    bin_source,
    load_source,
    stdlib_corpus,
    synthetic_source,
    text_source,
)
from paci_tune.data.stream import MicroBatchStream, ValidationSet
from paci_tune.data.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "MicroBatchStream",
    "TokenSource",
    "ValidationSet",
    "bin_source",
    "load_source",
    "stdlib_corpus",
    "synthetic_source",
    "text_source",
]
