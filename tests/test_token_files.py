"""``.bin`` token files are read as what they are, or refused naming the file: never read silently wrong.

Oracle: numpy's own read of the bytes the test wrote (``np.fromfile`` with the width and offset the
format defines), and llm.c's header layout (``dev/data/data_common.py``: 256 int32, magic 20240520,
version 1 = uint16 / 2 = uint32 tokens, the token count, then the tokens).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from paci_tune.data import load_source
from paci_tune.errors import ConfigError

MAGIC = 20240520


def _raw(folder: Path, train: np.ndarray, val: np.ndarray) -> Path:
    folder.mkdir(exist_ok=True)
    train.tofile(folder / "train.bin")
    val.tofile(folder / "val.bin")
    return folder


def _llmc(path: Path, tokens: np.ndarray, version: int, count: int | None = None) -> None:
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (MAGIC, version, len(tokens) if count is None else count)
    with path.open("wb") as fh:
        fh.write(header.tobytes())
        fh.write(tokens.tobytes())


def _load(folder: Path, **spec: Any) -> Any:
    return load_source({"source": "bin", "path": str(folder), **spec}, None)


def _refused(folder: Path, **spec: Any) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        _load(folder, **spec)
    return e.value


def test_uint16_files_read_as_numpy_reads_them(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    folder = _raw(
        tmp_path / "d", rng.integers(0, 50257, 5000, dtype=np.uint16), rng.integers(0, 50257, 700).astype("<u2")
    )
    for spec in ({}, {"dtype": "uint16"}):
        src = _load(folder, **spec)
        for split in ("train", "val"):
            np.testing.assert_array_equal(getattr(src, split), np.fromfile(folder / f"{split}.bin", dtype="<u2"))
    assert src.vocab_size == 50257


def test_uint32_files_with_a_large_vocabulary(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    train, val = rng.integers(0, 128256, 4000).astype("<u4"), rng.integers(0, 128256, 600).astype("<u4")
    folder = _raw(tmp_path / "llama", train, val)
    src = _load(folder, dtype="uint32", vocab_size=128256)
    np.testing.assert_array_equal(src.train, np.fromfile(folder / "train.bin", dtype="<u4"))
    np.testing.assert_array_equal(src.val, val)
    e = _refused(folder, vocab_size=128256)  # read as uint16 by default: half-words that look like tokens
    assert e.key == "data.dtype" and "uint32" in e.allowed and "train.bin" in e.allowed, e


def test_uint32_files_of_small_tokens_are_not_read_as_uint16(tmp_path: Path) -> None:
    folder = _raw(tmp_path / "d", np.arange(1, 3001, dtype="<u4") % 50000, np.arange(1, 501, dtype="<u4"))
    e = _refused(folder)
    assert e.key == "data.dtype" and "every second" in e.allowed, e
    np.testing.assert_array_equal(_load(folder, dtype="uint32").train, np.fromfile(folder / "train.bin", dtype="<u4"))


@pytest.mark.parametrize(("version", "dtype"), [(1, "<u2"), (2, "<u4")])
def test_llmc_headers_decide_the_width(tmp_path: Path, version: int, dtype: str) -> None:
    rng = np.random.default_rng(version)
    folder = tmp_path / "llmc"
    folder.mkdir()
    train, val = rng.integers(0, 50257, 3000).astype(dtype), rng.integers(0, 50257, 400).astype(dtype)
    _llmc(folder / "train.bin", train, version)
    _llmc(folder / "val.bin", val, version)
    name = "uint16" if version == 1 else "uint32"
    for spec in ({}, {"dtype": name}):
        src = _load(folder, **spec)
        for split in ("train", "val"):
            oracle = np.fromfile(folder / f"{split}.bin", dtype=dtype, offset=1024)
            np.testing.assert_array_equal(getattr(src, split), oracle)
    other = "uint32" if version == 1 else "uint16"
    e = _refused(folder, dtype=other)
    assert e.key == "data.dtype" and e.value == other and name in e.allowed and "llm.c" in e.allowed, e


def test_llmc_count_and_version_must_match_the_file(tmp_path: Path) -> None:
    folder = tmp_path / "llmc"
    folder.mkdir()
    tokens = np.arange(2000, dtype="<u2")
    _llmc(folder / "val.bin", tokens, 1)
    _llmc(folder / "train.bin", tokens, 1, count=2500)  # a truncated file: the header promises more
    e = _refused(folder)
    assert e.key == "data.path" and "train.bin" in str(e.value) and "2500" in e.allowed and "5024" in e.allowed, e
    _llmc(folder / "train.bin", tokens, 3)
    e = _refused(folder)
    assert e.key == "data.path" and "version" in e.allowed and "3" in e.allowed, e


def test_sizes_that_are_not_whole_tokens_are_refused(tmp_path: Path) -> None:
    folder = _raw(tmp_path / "d", np.arange(1001, dtype="<u2"), np.arange(300, dtype="<u2"))
    with (folder / "val.bin").open("ab") as fh:
        fh.write(b"\x01")  # 601 bytes: not whole uint16 tokens
    e = _refused(folder)
    assert e.key == "data.path" and "val.bin" in str(e.value) and "601 bytes" in e.allowed, e
    e = _refused(folder, dtype="uint32")  # train.bin: 2002 bytes, not whole uint32 tokens
    assert e.key == "data.path" and "2002 bytes" in e.allowed and "4 bytes each" in e.allowed, e
    e = _refused(folder, dtype="int8")
    assert e.key == "data.dtype" and "uint16" in e.allowed and "uint32" in e.allowed


def test_a_token_beyond_the_vocabulary_is_refused_naming_the_file(tmp_path: Path) -> None:
    train = (np.arange(1_500_000) % 1000).astype("<u2")
    train[-1] = 1234  # past the first 2**20 tokens: a check of the head alone would miss it
    val = (np.arange(500) % 1000).astype("<u2")
    folder = _raw(tmp_path / "d", train, val)
    e = _refused(folder, vocab_size=1000, dtype="uint16")
    assert e.key == "data.vocab_size" and e.value == 1000 and "1234" in e.allowed and "train.bin" in e.allowed, e
    assert _load(folder, vocab_size=1235).vocab_size == 1235


def test_a_named_pipe_for_a_token_file_is_refused_not_waited_on(tmp_path: Path) -> None:
    folder = _raw(tmp_path / "d", np.arange(1000, dtype="<u2"), np.arange(300, dtype="<u2"))
    (folder / "val.bin").unlink()
    os.mkfifo(folder / "val.bin")
    e = _refused(folder, dtype="uint16")
    assert e.key == "data.path" and "val.bin" in str(e.value) and "regular file" in e.allowed, e
