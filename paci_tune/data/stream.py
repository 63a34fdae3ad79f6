"""Micro-batches as pure functions of their index.

In a pipeline, stage 0 needs the inputs of micro-batch ``j`` and the last stage needs its
targets, in different processes and at different times; a checkpoint resumed at ``j`` must see
the same data again. So there is no iterator state: micro-batch ``j`` is a pure function of
``(seed, j)``, and any process can recompute it.

What one generator seed draws is ``data.draw``. ``microbatch`` (the default): micro-batch ``j``'s
``b`` windows, so the data -- and a run's curve -- depend on ``b``. ``sequence``: training sequence
``i`` of a seed is the same window whatever micro-batch carries it, micro-batch ``j`` of size ``b``
being sequences ``j*b .. j*b+b-1``; global batch ``g`` is then sequences ``g*G .. g*G+G-1`` for every
split of ``G`` into D replicas x a micro-batches x b sequences, and a schedule whose numerics are plain
gradient accumulation trains the same curve at every layout of a global batch (PACI at every D and b
of one depth and window): what lets a search share one training curve among layouts
(:mod:`paci_tune.tune.curves`). May import: numpy, torch, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from paci_tune.errors import ConfigError


def _windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather ``seq_len + 1`` tokens at each offset; inputs and next-token targets as int64."""
    rows = torch.from_numpy(tokens[offsets[:, None] + np.arange(seq_len + 1)].astype(np.int64))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _check(tokens: np.ndarray, seq_len: int, micro_batch_size: int) -> None:
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if seq_len < 1 or micro_batch_size < 1:
        raise ValueError(f"seq_len and micro_batch_size must be positive, got {seq_len}, {micro_batch_size}")
    if len(tokens) < seq_len + 1:
        allowed = f"at most {max(len(tokens) - 1, 0)}: the data split has only {len(tokens)} tokens"
        raise ConfigError("model.block_size", seq_len, allowed)


DRAWS = ("microbatch", "sequence")
"""``data.draw``: what one generator seed draws. ``microbatch`` (the default, and every run's draw until
2026-12-04): each micro-batch its own ``b`` windows, so the curve depends on ``b``. ``sequence``: every
split of a global batch trains on the same sequences (module docstring)."""

DEFAULT_DRAW = "microbatch"
"""The default keeps every recorded result and checkpoint as it was. ``sequence`` changes the samples a
seed draws, and the README example's 100-step warm-up was past the loss plateau only on the old ones
(with ``sequence`` its validation loss was 3.17 at step 100, not 2.86): a search that shares curves
(issue 39) turns it on together with a longer warm-up."""

BLOCK = 64
"""Training sequences drawn per generator (module docstring): any fixed number gives every split the same data."""


class MicroBatchStream:
    """Random training windows; ``get(j)`` depends only on ``(seed, j)`` (and ``draw``: module docstring).

    Data parallelism: replica ``r`` of ``replicas`` D reads micro-batch ``j * D + r`` of the
    single-replica stream, so the D replicas' micro-batches ``j`` of a step are D consecutive
    micro-batches of the D=1 stream with the same micro-batch size, and a D-replica run with window
    ``a`` trains on exactly the sequences of a D=1 run with window ``D * a`` (the same global batch).
    With ``draw="sequence"`` that is also a D=1 run with micro-batches D times larger: D, a and b then
    only decide who computes which sequences of a global batch.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        *,
        replicas: int = 1,
        replica: int = 0,
        draw: str = DEFAULT_DRAW,
    ) -> None:
        _check(tokens, seq_len, micro_batch_size)
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        if not 0 <= replica < replicas:
            raise ValueError(f"replica {replica} out of range for {replicas} replicas")
        self.tokens, self.seq_len, self.micro_batch_size, self.seed = tokens, seq_len, micro_batch_size, seed
        if draw not in DRAWS:
            raise ConfigError("data.draw", draw, " or ".join(DRAWS))
        self.replicas, self.replica, self.draw = replicas, replica, draw

    def get(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (micro_batch_size, seq_len) int64, with y[:, t] the token after x[:, t]."""
        if j < 0:
            raise IndexError(f"micro-batch index must be non-negative, got {j}")
        index = j * self.replicas + self.replica
        if self.draw == "microbatch":  # each micro-batch its own b windows, as before 2026-12-04
            rng = np.random.default_rng([self.seed, index])
            offsets = rng.integers(0, len(self.tokens) - self.seq_len, size=self.micro_batch_size)
            return _windows(self.tokens, offsets, self.seq_len)
        return _windows(self.tokens, self.offsets(index * self.micro_batch_size, self.micro_batch_size), self.seq_len)

    def offsets(self, first: int, count: int) -> np.ndarray:
        """Where training sequences ``first .. first+count-1`` start: sequence ``i`` is the
        ``i % BLOCK``-th draw of a generator seeded by ``(seed, i // BLOCK)`` (one generator per block of
        sequences, not per sequence: a generator costs ~20 us, a step may carry hundreds of sequences)."""
        high = len(self.tokens) - self.seq_len
        lo, hi = first // BLOCK, (first + count - 1) // BLOCK
        drawn = np.concatenate(
            [np.random.default_rng([self.seed, blk]).integers(0, high, size=BLOCK) for blk in range(lo, hi + 1)]
        )
        start = first - lo * BLOCK
        return drawn[start : start + count]


class ValidationSet:
    """``n_sequences`` fixed windows evenly spaced through the validation tokens, served in chunks.

    No seed and no dependence on the run's micro-batch size, window, depth or schedule: every run
    of a model on a data source is scored on the same tokens, so the validation losses a tuner
    ranks are comparable. ``chunk`` is how many sequences one evaluation forward carries (memory,
    not what is measured); the loss is the mean over all ``n_sequences`` (:meth:`mean_loss`).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, n_sequences: int, chunk: int) -> None:
        _check(tokens, seq_len, 1)
        if n_sequences < 1 or chunk < 1:
            raise ValueError(f"n_sequences and chunk must be positive, got {n_sequences}, {chunk}")
        self.tokens, self.seq_len, self.n_sequences, self.chunk = tokens, seq_len, n_sequences, chunk
        last = len(tokens) - seq_len - 1
        self.offsets = np.linspace(0, last, n_sequences).round().astype(np.int64)

    def __len__(self) -> int:
        """Chunks (evaluation forwards) in the set."""
        return -(-self.n_sequences // self.chunk)

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"validation chunk {i} out of range [0, {len(self)})")
        return _windows(self.tokens, self.offsets[i * self.chunk : (i + 1) * self.chunk], self.seq_len)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self.get(i) for i in range(len(self)))

    def mean_loss(self, chunk_losses: list[float]) -> float:
        """The mean over every sequence (and token) from the chunks' mean losses, in chunk order."""
        sizes = [min(self.chunk, self.n_sequences - i * self.chunk) for i in range(len(self))]
        return sum(loss * n for loss, n in zip(chunk_losses, sizes, strict=True)) / self.n_sequences
