"""Token files: a ``.bin`` of raw uint16 or uint32 tokens (nanoGPT), or one with llm.c's header.

A ``.bin`` carries no type and no vocabulary, so a file read with the wrong width gives numbers
that look like tokens: a uint32 file read as uint16 trains on half-words, silently. What can be
checked is, so a wrong guess is an error naming the file rather than a quietly useless run:

- **llm.c's header** (``dev/data/data_common.py``): 256 little-endian int32, ``[0]`` the magic
  20240520, ``[1]`` the version (1: uint16 tokens, 2: uint32 tokens), ``[2]`` the token count;
  the tokens follow at byte 1024. The version decides the width (a different ``data.dtype`` is
  refused) and the count must match the file's size.
- **A raw file**'s size must be a whole number of tokens of ``data.dtype`` (uint16 by default), and
  one read as uint16 whose every second word is 0 or tiny (a high half) is refused as the uint32 file
  it almost surely is.
- The tokens must fit the vocabulary: checked on the first and last :data:`CHECK_TOKENS` of each
  file (a scan of billions of tokens at start-up would be slow; a wrong vocabulary or width shows
  at once).

Files are memory-mapped read-only, never read whole. May import: numpy, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np

from ..errors import ConfigError

DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
"""``data.dtype``'s values: little-endian, as numpy's ``tofile`` writes them on every common machine."""
DEFAULT_DTYPE = "uint16"
LLMC_MAGIC = 20240520
LLMC_HEADER_BYTES = 256 * 4
LLMC_VERSIONS = {1: "uint16", 2: "uint32"}
CHECK_TOKENS = 1 << 20
_HALF_WORD_SAMPLE = 64  # at least this many uint16 words before "every second one is 0" means uint32


def check_dtype(dtype: object) -> str | None:
    """``data.dtype`` as given (None: not given), refused unless one of :data:`DTYPES`."""
    if dtype is not None and (not isinstance(dtype, str) or dtype not in DTYPES):
        raise ConfigError("data.dtype", dtype, "one of: " + ", ".join(DTYPES) + " (the width of a .bin's tokens)")
    return dtype


def _llmc_header(file: Path, size: int) -> np.ndarray | None:
    """The file's llm.c header (256 int32) when it starts with the magic, else None."""
    if size < 4:
        return None
    with file.open("rb") as fh:
        head = fh.read(LLMC_HEADER_BYTES)
    if int(np.frombuffer(head[:4], dtype="<i4")[0]) != LLMC_MAGIC:
        return None
    if len(head) < LLMC_HEADER_BYTES:
        raise ConfigError(
            "data.path", str(file), f"an llm.c token file with its whole 1024-byte header; it has {size} bytes"
        )
    return np.frombuffer(head, dtype="<i4")


def read_tokens(file: Path, dtype: str | None, vocab_size: int, vocab_key: str) -> np.ndarray:
    """The tokens of one ``.bin`` (module docstring), memory-mapped; ``dtype`` None: the header's or uint16.

    Every refusal names the file and what was expected; ``vocab_key`` names where ``vocab_size`` came from.
    """
    try:
        return _read_tokens(file, dtype, vocab_size, vocab_key)
    except OSError as e:  # unreadable: permissions, an I/O error
        raise ConfigError("data.path", str(file), f"a readable token file ({e.strerror or e})") from None


def _read_tokens(file: Path, dtype: str | None, vocab_size: int, vocab_key: str) -> np.ndarray:
    st = file.stat()
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError("data.path", str(file), "a regular file of tokens (not a pipe, device or folder)")
    size, offset, explicit = st.st_size, 0, dtype
    header = _llmc_header(file, size)
    if header is not None:
        version, count = int(header[1]), int(header[2])
        if version not in LLMC_VERSIONS:
            allowed = f"an llm.c token file of version 1 (uint16) or 2 (uint32); its header says {version}"
            raise ConfigError("data.path", str(file), allowed)
        if explicit is not None and explicit != LLMC_VERSIONS[version]:
            why = f"{LLMC_VERSIONS[version]} (or leave data.dtype out): {file} has an llm.c header of version {version}"
            raise ConfigError("data.dtype", explicit, why)
        dtype, offset = LLMC_VERSIONS[version], LLMC_HEADER_BYTES
        width = DTYPES[dtype].itemsize
        if count <= 0 or offset + count * width != size:
            want = f"1024 + {count} x {width} = {offset + count * width}" if count > 0 else "a positive count"
            allowed = f"an llm.c file as its header says ({count} {dtype} tokens: {want} bytes); it has {size} bytes"
            raise ConfigError("data.path", str(file), allowed)
    dtype = dtype or DEFAULT_DTYPE
    width = DTYPES[dtype].itemsize
    if size - offset <= 0 or (size - offset) % width:
        hint = " (a uint16 file? leave data.dtype out)" if dtype == "uint32" and size % 2 == 0 else ""
        allowed = f"a non-empty file of whole {dtype} tokens ({width} bytes each){hint}; it has {size} bytes"
        raise ConfigError("data.path", str(file), allowed)
    tokens = np.memmap(file, dtype=DTYPES[dtype], mode="r", offset=offset)
    head, tail = tokens[:CHECK_TOKENS], tokens[-CHECK_TOKENS:]
    if dtype == "uint16" and header is None and _looks_uint32(head):
        allowed = f"uint32: {file} looks like uint32 tokens (every second 16-bit word is a high half, < 16)"
        raise ConfigError("data.dtype", explicit or DEFAULT_DTYPE, allowed)
    top = max(int(head.max()), int(tail.max()))
    if top >= vocab_size:
        hint = " (a uint16 file read as uint32?)" if dtype == "uint32" and header is None else ""
        allowed = f"more than {top}, the largest token id in {file} read as {dtype}{hint}"
        raise ConfigError(vocab_key, vocab_size, allowed)
    return tokens


def _looks_uint32(words: np.ndarray) -> bool:
    """Whether uint16 ``words`` look like little-endian uint32 tokens: every odd word a high half -- 0, or
    below 16 (vocabularies up to a million) while the even words reach past 255 -- which text never gives."""
    n = len(words) - len(words) % 2
    if n < _HALF_WORD_SAMPLE:
        return False
    high, low = int(words[1:n:2].max()), int(words[0:n:2].max())
    return (high == 0 and low > 0) or (high < 16 and low >= 256)


def is_regular(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file, without following it into a pipe or device (which would block)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False
