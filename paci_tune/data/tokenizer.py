"""Byte-level tokenizer: the default because it needs no download.

Fetching a BPE vocabulary fails on offline machines, and the tuner only needs *a* stable
tokenization whose cost it can measure, not the best compression. UTF-8 bytes give a fixed
vocabulary of 256 that every run agrees on. May import: the standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable


class ByteTokenizer:
    """Token ids are the UTF-8 bytes of the text."""

    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Invalid byte sequences (a model's samples can contain them) decode to U+FFFD."""
        return bytes(ids).decode("utf-8", errors="replace")
