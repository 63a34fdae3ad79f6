"""Data: index-pure micro-batches, exact synthetic entropies, and the sources' determinism and errors."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from paci_tune.data import (
    ByteTokenizer,
    MicroBatchStream,
    ValidationSet,
    bin_source,
    load_source,
    stdlib_corpus,
    synthetic_source,
    text_source,
)
from paci_tune.data.sources import SEPARATOR
from paci_tune.errors import ConfigError


def test_byte_tokenizer_round_trips_utf8() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓")
    assert tok.vocab_size == 256 and max(ids) < 256 and len(ids) == 10
    assert tok.decode(ids) == "héllo ✓"


def test_stream_is_a_pure_function_of_seed_and_index() -> None:
    tokens = np.arange(10_000, dtype=np.int64)  # y == x + 1 exactly when windows are contiguous
    a = MicroBatchStream(tokens, seq_len=16, micro_batch_size=4, seed=3)
    b = MicroBatchStream(tokens, seq_len=16, micro_batch_size=4, seed=3)
    later = [a.get(j) for j in (9, 2, 5)]  # order of calls must not matter
    x, y = b.get(5)
    assert torch.equal(x, later[2][0]) and torch.equal(y, later[2][1])
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(a.get(6)[0], x)
    assert not torch.equal(MicroBatchStream(tokens, 16, 4, seed=4).get(5)[0], x)


@pytest.mark.parametrize("global_batch", [8, 96, 130])  # 130 crosses generator blocks at odd places
def test_a_global_batch_is_the_same_sequences_at_every_split(global_batch: int) -> None:
    """``draw="sequence"``: global batch g is the same sequences, in the same order
    within each replica's share, for every D x a x b = G (what a shared training curve rests on,
    paci_tune.tune.curves). Oracle: the b = 1, D = 1 stream, sequence by sequence."""
    tokens = np.arange(100_000, dtype=np.int64)
    one = MicroBatchStream(tokens, seq_len=8, micro_batch_size=1, seed=7, draw="sequence")
    for g in range(3):
        want = torch.cat([one.get(g * global_batch + i)[0] for i in range(global_batch)])
        for d in (1, 2):
            for b in (1, 2, 5, global_batch // 2):
                if global_batch % (d * b):
                    continue
                a = global_batch // (d * b)
                streams = [
                    MicroBatchStream(tokens, 8, b, seed=7, replicas=d, replica=r, draw="sequence") for r in range(d)
                ]
                got = torch.cat([streams[r].get(g * a + j)[0] for j in range(a) for r in range(d)])
                assert torch.equal(got, want), (g, d, a, b)


def test_stream_uses_the_whole_range_and_accepts_small_dtypes() -> None:
    tokens = np.arange(40, dtype=np.uint16)
    stream = MicroBatchStream(tokens, seq_len=8, micro_batch_size=64, seed=0)
    firsts = torch.cat([stream.get(j)[0][:, 0] for j in range(20)])
    ys = torch.cat([stream.get(j)[1][:, -1] for j in range(20)])
    assert firsts.min() == 0 and ys.max() == 39  # first and last window both reachable


def test_stream_rejects_too_short_data() -> None:
    with pytest.raises(ConfigError) as info:
        MicroBatchStream(np.arange(16), seq_len=16, micro_batch_size=1, seed=0)
    assert info.value.key == "model.block_size"
    MicroBatchStream(np.arange(17), seq_len=16, micro_batch_size=1, seed=0).get(0)


def test_validation_set_is_fixed_and_evenly_spaced() -> None:
    tokens = np.arange(1_000)
    val = ValidationSet(tokens, seq_len=10, n_sequences=12, chunk=3)
    assert len(val) == 4 and len(list(val)) == 4
    x0, _ = val.get(0)
    _, y3 = val.get(3)
    assert x0[0, 0] == 0 and y3[-1, -1] == 999  # spans the whole split
    starts = torch.cat([val.get(i)[0][:, 0] for i in range(4)])
    gaps = torch.diff(starts)
    assert gaps.min() >= 89 and gaps.max() <= 91
    again = ValidationSet(tokens, 10, 12, 3)
    assert all(torch.equal(val.get(i)[0], again.get(i)[0]) for i in range(4))
    with pytest.raises(IndexError):
        val.get(4)


def test_validation_set_does_not_depend_on_how_it_is_chunked() -> None:
    """The same sequences whatever the chunk; the mean is over sequences, a short last chunk included."""
    tokens = np.arange(5_000)
    a, b = ValidationSet(tokens, 16, 10, 4), ValidationSet(tokens, 16, 10, 10)
    assert torch.equal(torch.cat([x for x, _ in a]), torch.cat([x for x, _ in b]))
    assert [len(x) for x, _ in a] == [4, 4, 2]
    assert a.mean_loss([1.0, 1.0, 4.0]) == pytest.approx((8 * 1.0 + 2 * 4.0) / 10)


def _conditional_entropy(tokens: np.ndarray, vocab: int) -> float:
    pairs = np.bincount(tokens[:-1].astype(np.int64) * vocab + tokens[1:], minlength=vocab * vocab)
    joint = pairs.reshape(vocab, vocab) / pairs.sum()
    cond = joint / np.maximum(joint.sum(axis=1, keepdims=True), 1e-300)
    mask = joint > 0
    return float(-(joint[mask] * np.log(cond[mask])).sum())


def _entropy(tokens: np.ndarray, vocab: int) -> float:
    p = np.bincount(tokens, minlength=vocab) / len(tokens)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def test_synthetic_entropies_are_exact() -> None:
    src = synthetic_source(vocab_size=64, branching=4, n_train=200_000, n_val=20_000, seed=0)
    assert src.entropy_rate == pytest.approx(math.log(4))
    assert src.unigram_entropy is not None and src.unigram_entropy > math.log(4) + 2
    assert _conditional_entropy(src.train, 64) == pytest.approx(math.log(4), abs=0.02)
    assert _entropy(src.train, 64) == pytest.approx(src.unigram_entropy, abs=0.02)
    successors = np.unique(src.train[:-1].astype(np.int64) * 64 + src.train[1:]) // 64
    assert np.array_equal(np.bincount(successors, minlength=64), np.full(64, 4))  # exactly 4 each


def test_synthetic_is_deterministic_and_val_independent_of_train_size() -> None:
    a = synthetic_source(vocab_size=16, branching=2, n_train=5_000, n_val=1_000, seed=1)
    b = synthetic_source(vocab_size=16, branching=2, n_train=7_000, n_val=1_000, seed=1)
    c = synthetic_source(vocab_size=16, branching=2, n_train=5_000, n_val=1_000, seed=2)
    assert np.array_equal(a.val, b.val) and np.array_equal(a.train, b.train[:5_000])
    assert not np.array_equal(a.train, c.train)
    assert a.train.max() < 16 and a.train.dtype == np.uint16


def test_synthetic_degenerate_branching() -> None:
    src = synthetic_source(vocab_size=8, branching=1, n_train=100, n_val=10, seed=0)
    assert src.entropy_rate == 0.0 and src.unigram_entropy == pytest.approx(math.log(8))
    assert np.all(np.diff(src.train.astype(np.int64)) % 8 == 1)
    with pytest.raises(ConfigError) as info:
        synthetic_source(vocab_size=8, branching=9)
    assert info.value.key == "data.branching"


def _files(tokens: np.ndarray) -> set[bytes]:
    return {chunk for chunk in tokens.tobytes().split(SEPARATOR) if len(chunk) > 200}


def test_stdlib_corpus_is_deterministic_with_disjoint_val() -> None:
    a, b = stdlib_corpus(max_bytes=1_500_000), stdlib_corpus(max_bytes=1_500_000)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert a.train.size > 1_000_000 and a.val.size > 0 and a.vocab_size == 256
    assert a.train.size + a.val.size <= 1_500_000
    assert b"def " in a.train.tobytes()
    assert not _files(a.train) & _files(a.val)


def test_text_source_file_and_folder(tmp_path: Path) -> None:
    file = tmp_path / "one.txt"
    file.write_bytes(b"abcdefghij" * 100)
    src = text_source(str(file), val_fraction=0.1)
    assert src.val.tobytes() == (b"abcdefghij" * 10) and src.train.size == 900

    folder = tmp_path / "corpus"
    for i in range(30):
        (folder / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
        (folder / f"d{i % 3}" / f"f{i:02}.md").write_text(f"document {i} " * 20)
    (folder / "blob.bin").write_bytes(b"\x00\x01\x02" * 10)
    (folder / ".hidden").mkdir()
    (folder / ".hidden" / "secret.txt").write_text("secret")
    a, b = text_source(str(folder), 0.2), text_source(str(folder), 0.2)
    assert np.array_equal(a.train, b.train) and a.val.size > 0
    text = a.train.tobytes() + a.val.tobytes()
    assert b"secret" not in text and b"\x01\x02" not in text
    assert text.count(SEPARATOR) == 30 and not _files(a.train) & _files(a.val)


def test_text_source_errors(tmp_path: Path) -> None:
    for path in (tmp_path / "missing.txt", tmp_path):  # missing, then an empty folder
        with pytest.raises(ConfigError) as info:
            text_source(str(path))
        assert info.value.key == "data.path"
    (tmp_path / "empty.txt").touch()
    with pytest.raises(ConfigError):
        text_source(str(tmp_path / "empty.txt"))


def test_bin_source(tmp_path: Path) -> None:
    np.array([1, 2, 3, 500, 7], dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.array([4, 5, 6], dtype=np.uint16).tofile(tmp_path / "val.bin")
    src = bin_source(str(tmp_path), vocab_size=512)
    assert src.train.tolist() == [1, 2, 3, 500, 7] and src.val.tolist() == [4, 5, 6]
    assert not src.train.flags.writeable and src.vocab_size == 512
    with pytest.raises(ConfigError) as info:
        bin_source(str(tmp_path), vocab_size=500)
    assert info.value.key == "model.vocab_size"
    (tmp_path / "val.bin").unlink()
    with pytest.raises(ConfigError) as info:
        bin_source(str(tmp_path), vocab_size=512)
    assert info.value.key == "data.path" and "val.bin" in str(info.value)


def test_load_source_dispatch(tmp_path: Path) -> None:
    synth = load_source({"source": "synthetic", "vocab_size": 8, "n_train": 100, "n_val": 20}, None)
    assert synth.vocab_size == 8 and synth.train.size == 100
    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    assert load_source({"source": "text", "path": str(tmp_path / "a.txt")}, 256).vocab_size == 256
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(5, dtype=np.uint16).tofile(tmp_path / "val.bin")
    assert load_source({"source": "bin", "path": str(tmp_path)}, 16).val.tolist() == [0, 1, 2, 3, 4]
    assert load_source({"source": "bin", "path": str(tmp_path)}, None).vocab_size == 50257  # GPT-2
    assert load_source({"source": "bin", "path": str(tmp_path), "vocab_size": 12}, 16).vocab_size == 12
    with pytest.raises(ConfigError) as info:
        load_source({"source": "bin", "path": str(tmp_path), "vocab_size": 5}, None)
    assert info.value.key == "data.vocab_size"
    with pytest.raises(ConfigError) as info:
        load_source({"source": "bin", "path": str(tmp_path), "vocab_size": 12}, 11)
    assert info.value.key == "model.vocab_size"
    assert load_source({"source": "stdlib", "max_bytes": 10_000}, None).train.size > 0


@pytest.mark.parametrize(
    ("spec", "hint", "key"),
    [
        ({"source": "web"}, None, "data.source"),
        ({"source": "synthetic", "branchy": 3}, None, "data.branchy"),
        ({"source": "stdlib", "path": "x"}, None, "data.path"),
        ({"source": "synthetic", "n_train": "many"}, None, "data.n_train"),
        ({"source": "stdlib", "max_bytes": 10_000}, 100, "model.vocab_size"),
        ({"source": "text"}, None, "data.path"),
        ({"source": "text", "path": "/definitely/not/here"}, None, "data.path"),
        ({"source": "bin", "path": "/definitely/not/here"}, None, "data.path"),
        ({"source": "bin", "path": "/definitely/not/here", "vocab_size": 0}, None, "data.vocab_size"),
    ],
)
def test_load_source_errors_name_the_key(spec: dict[str, object], hint: int | None, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_source(spec, hint)
    assert info.value.key == key


def test_the_draw_is_named_when_wrong_and_the_default_is_the_old_one() -> None:
    with pytest.raises(ConfigError) as e:
        load_source({"source": "synthetic", "draw": "token"}, None)
    assert e.value.key == "data.draw"
    tokens = np.arange(10_000, dtype=np.int64)
    old = MicroBatchStream(tokens, 8, 4, seed=3).get(5)[0]  # the default
    offsets = np.random.default_rng([3, 5]).integers(0, len(tokens) - 8, size=4)  # the draw before 2026-12-04
    assert torch.equal(old[:, 0], torch.from_numpy(offsets))
