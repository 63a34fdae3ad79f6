"""The training loop: budget, LR schedule over the budget, evaluation, checkpoints, metrics.

It knows nothing of how the pipeline runs. It asks the runtime to run *segments* of global
batches -- each ends drained, at an evaluation or checkpoint point -- and the runtime reports
losses as batches complete. The same loop runs in the single emulated process and on every rank
of the distributed runtime (SPMD); only the reporting rank writes records. It runs a resolved
config (:func:`paci_tune.train.run.resolve_run`): a profile clock finds its profile named.
May import: :mod:`paci_tune.pipeline`, :mod:`paci_tune.config`, the train layer's own modules.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from ..config.schema import RunConfig
from ..errors import ConfigError
from ..pipeline.factory import Setup, build_setup
from ..pipeline.runtime import StageTiming
from . import checkpoint
from .clock import Clock, ProfileClock, WallClock
from .lr import lr_factor, peak_lr, step_progress
from .metrics import RecordSink

# Settings that change how a run executes but not its numbers: a run may resume under others.
_EXECUTION_ONLY = {
    "pipeline": {"runtime", "device", "backend"},
    "training": {"checkpoint_every", "checkpoint_dir", "keep_checkpoints", "steps", "seconds"},
}


def fingerprint(cfg: RunConfig) -> dict[str, Any]:
    """The part of a config a checkpoint must match to resume with the same numerics."""
    doc = cfg.to_dict()
    for section, keys in _EXECUTION_ONLY.items():
        doc[section] = {k: v for k, v in doc[section].items() if k not in keys}
    doc["budget"] = {"steps": cfg.training.steps, "seconds": cfg.training.seconds}
    return doc


def _mismatch(a: Any, b: Any, path: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            m = _mismatch(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
            if m:
                return m
        return None
    a = list(a) if isinstance(a, tuple) else a
    b = list(b) if isinstance(b, tuple) else b
    return None if a == b else f"{path}: checkpoint has {a!r}, this run has {b!r}"


@dataclasses.dataclass
class LoopState:
    """What the loop must carry across a resume besides the stages' own state."""

    batches_done: int = 0
    segments: int = 0
    makespan: float = 0.0
    train_wall: float = 0.0
    clock: float = 0.0
    tokens: int = 0
    last_eval: int = -1
    last_eval_clock: float = 0.0
    last_val_loss: float | None = None
    timing: list[dict] = dataclasses.field(default_factory=list)


class Trainer:
    """Runs one training run described by a :class:`RunConfig` on this process's runtime."""

    def __init__(self, cfg: RunConfig, sink: RecordSink, *, distributed: bool = False) -> None:
        self.cfg, self.sink = cfg, sink
        t, p = cfg.training, cfg.pipeline
        self.peak = peak_lr(cfg.optimizer, cfg.lr_schedule, t.global_batch)
        if t.clock != "wall" and not t.profile:
            raise ConfigError("training.profile", None, f"a cost profile for the {t.clock} clock (see resolve_run)")
        self.clock: Clock = WallClock()
        self._segment_first = 0
        self.setup: Setup = build_setup(cfg, self.lr_at, distributed=distributed)
        self.runtime: Any = self.setup.runtime
        self.tokens_per_batch = t.global_batch * self.setup.seq_len
        self.state = LoopState(timing=[dataclasses.asdict(StageTiming()) for _ in range(p.stages)])
        self.ckpt_root = Path(t.checkpoint_dir) if t.checkpoint_dir else None

    # ------------------------------------------------------------------ schedule over the budget
    def make_clock(self, offset: float) -> Clock:
        t, p = self.cfg.training, self.cfg.pipeline
        if t.clock == "wall":
            return WallClock(offset)
        assert self.setup.profile is not None  # a profile clock's config names one (checked in __init__)
        return ProfileClock(
            t.clock,
            self.setup.profile,
            schedule=p.schedule,
            stages=p.stages,
            window=p.window,
            microbatch_size=p.microbatch_size,
            partition=self.setup.partition,
            inflight=p.inflight,
            offset=offset,
        )

    def progress(self, update_index: int) -> float:
        """Progress through the budget when step ``update_index`` is applied (read on the run's clock)."""
        t = self.cfg.training
        if t.seconds is not None:
            return self.clock.batch_done(update_index - self._segment_first) / t.seconds
        assert t.steps is not None
        return step_progress(update_index, t.steps)

    def lr_at(self, update_index: int) -> float:
        s = self.cfg.lr_schedule
        return self.peak * lr_factor(self.progress(update_index), s.warmup_fraction, s.min_ratio)

    def _budget_left(self) -> bool:
        t, b = self.cfg.training, self.state.batches_done
        if t.steps is not None and b >= t.steps:
            return False
        if t.seconds is not None:
            return not self.runtime.agree(self.clock.now() >= t.seconds)
        return True

    def _next_eval_time(self) -> float | None:
        """The next point of the evaluation grid on the clock, when evaluating by clock time."""
        every = self.cfg.training.eval_every_seconds
        if every is None:
            return None
        return (self.state.last_eval_clock // every + 1) * every

    def _segment_length(self) -> int:
        """Batches until the next evaluation, checkpoint or end of budget (0: the budget is spent).

        With ``eval_every_seconds``, a profile clock knows ahead how many batches reach the next
        grid point; the wall clock cannot, so it runs segments of ``eval_every`` batches and
        evaluates at the first segment end past the grid point.
        """
        t, b = self.cfg.training, self.state.batches_done
        ends = [(b // t.eval_every + 1) * t.eval_every]
        if t.checkpoint_every:
            ends.append((b // t.checkpoint_every + 1) * t.checkpoint_every)
        if t.steps is not None:
            ends.append(t.steps)
        n = min(ends) - b
        if t.seconds is not None:
            n = self.clock.batches_within(n, t.seconds)
        next_eval = self._next_eval_time()
        if n and next_eval is not None:
            n = max(1, self.clock.batches_within(n, next_eval))
        return n

    def _eval_due(self) -> bool:
        t = self.cfg.training
        next_eval = self._next_eval_time()
        if next_eval is not None:  # every rank must take the same decision: wall readings differ by rank
            return self.runtime.agree(self.clock.now() >= next_eval - 1e-12)
        return self.state.batches_done % t.eval_every == 0

    # ------------------------------------------------------------------------------- the loop
    def run(self, resume: bool = False) -> dict[str, Any] | None:
        if resume:
            self._resume()
        self.runtime.warmup()
        self.runtime.barrier()  # ranks finish set-up at different times; do not count that as bubble
        self.clock = self.make_clock(self.state.clock)
        self._emit_start()
        timing = [StageTiming(**d) for d in self.state.timing]
        stop = False
        while not stop and self._budget_left():
            n = self._segment_length()
            if n == 0:
                break  # the budget cannot fit one more global batch
            self._segment_first = self.state.batches_done
            self.clock.begin_segment(n)
            t0 = time.perf_counter()
            report = self.runtime.run_segment(self.state.batches_done, n, self._on_batch)
            self.state.train_wall += time.perf_counter() - t0
            self.clock.end_segment()
            self.state.makespan += report.makespan
            for acc, seg in zip(timing, report.stages, strict=True):
                acc.add(seg)
            self.state.timing = [dataclasses.asdict(x) for x in timing]
            self.state.batches_done += n
            self.state.segments += 1
            self.state.tokens += n * self.tokens_per_batch
            self._emit_segment(timing)
            t = self.cfg.training
            if self._eval_due():
                stop = self._evaluate()
            if t.checkpoint_every and self.state.batches_done % t.checkpoint_every == 0:
                self._checkpoint()
        if self.state.last_eval != self.state.batches_done:
            self._evaluate()
        summary = self._summary(timing)
        self.sink.emit(summary)
        self.sink.finish()
        self.runtime.close()
        return summary if self.runtime.is_reporter else None

    def _on_batch(self, k: int, loss: float) -> None:
        self.sink.emit(
            {
                "event": "train",
                "step": k + 1,
                "loss": loss,
                "lr": self.lr_at(k),
                "tokens": (k + 1) * self.tokens_per_batch,
                "clock": self.clock.batch_done(k - self._segment_first),
            }
        )

    def _evaluate(self) -> bool:
        """Validate; True when the configured target is reached (every rank gets the same answer)."""
        val = self.runtime.evaluate()
        self.state.last_eval, self.state.last_val_loss = self.state.batches_done, val
        self.state.last_eval_clock = self.clock.now()
        self.sink.emit(
            {
                "event": "eval",
                "step": self.state.batches_done,
                "val_loss": val,
                "tokens": self.state.tokens,
                "clock": self.clock.now(),
            }
        )
        target = self.cfg.training.target_val_loss
        return target is not None and val <= target

    def _checkpoint(self) -> None:
        assert self.ckpt_root is not None
        b = self.state.batches_done
        self.state.clock = self.clock.now()
        checkpoint.save_stages(self.ckpt_root, b, self.runtime.state_dicts())
        self.runtime.barrier()
        if self.runtime.is_reporter:
            meta = {
                "fingerprint": fingerprint(self.cfg),
                "partition": self.setup.partition,
                "loop": dataclasses.asdict(self.state),
                "records": self.sink.records,
            }
            checkpoint.commit(self.ckpt_root, b, meta, self.cfg.training.keep_checkpoints)
            self.sink.emit({"event": "checkpoint", "step": b, "path": str(checkpoint.folder_for(self.ckpt_root, b))})
        self.runtime.barrier()

    def _resume(self) -> None:
        if self.ckpt_root is None:
            raise ConfigError("training.checkpoint_dir", None, "a checkpoint folder to resume from (--checkpoint-dir)")
        if checkpoint.latest(self.ckpt_root) is None:
            return  # nothing saved yet: a fresh start is the resume
        meta, states = checkpoint.load(self.ckpt_root, self.runtime.local_stages)
        diff = _mismatch(meta["fingerprint"], fingerprint(self.cfg))
        if diff is None and meta["partition"] != self.setup.partition:
            diff = f"partition: checkpoint has {meta['partition']}, this run has {self.setup.partition}"
        if diff:
            raise ConfigError("--resume", str(self.ckpt_root), f"a checkpoint of the same configuration ({diff})")
        self.runtime.load_state_dicts(states)
        self.state = LoopState(**meta["loop"])
        self.sink.restore(meta["records"])

    # --------------------------------------------------------------------------------- records
    def _emit_start(self) -> None:
        c, s = self.cfg, self.setup
        self.sink.emit(
            {
                "event": "start",
                "schedule": c.pipeline.schedule,
                "n_stages": c.pipeline.stages,
                "window": c.pipeline.window,
                "microbatch_size": c.pipeline.microbatch_size,
                "global_batch": c.training.global_batch,
                "runtime": c.pipeline.runtime,
                "device": str(s.device),
                "precision": s.precision,
                "partition": s.partition,
                "n_units": s.n_units,
                "steps": c.training.steps,
                "seconds": c.training.seconds,
                "resumed_at": self.state.batches_done,
                "clock": self.clock.now(),
            }
        )

    def _emit_segment(self, timing: list[StageTiming]) -> None:
        stats = self.runtime.stats(timing, self.state.makespan)
        self.sink.emit(
            {
                "event": "segment",
                "step": self.state.batches_done,
                "tokens_per_s": self.state.tokens / self.state.makespan if self.state.makespan else 0.0,
                "bubble_fraction": sum(x["bubble_fraction"] for x in stats) / len(stats),
                "max_drift": max(x["max_drift"] for x in stats),
                "clock": self.clock.now(),
            }
        )

    def _summary(self, timing: list[StageTiming]) -> dict[str, Any]:
        c, st = self.cfg, self.state
        stats = self.runtime.stats(timing, st.makespan)
        losses = [r["loss"] for r in self.sink.records if r.get("event") == "train"]
        tail = losses[-10:]
        p, m = c.pipeline.stages, c.pipeline.window
        if c.pipeline.schedule == "paci":  # fills and drains once per segment (at evals and checkpoints)
            fill = st.segments * (p - 1)
            analytic = fill / (m * st.batches_done + fill) if st.batches_done else 0.0
        else:
            analytic = (p - 1) / (m + p - 1)
        mfu_flops = self.setup.flops_per_token
        return {
            "event": "summary",
            "schedule": c.pipeline.schedule,
            "runtime": c.pipeline.runtime,
            "n_stages": p,
            "window": m,
            "microbatch_size": c.pipeline.microbatch_size,
            "global_batch": c.training.global_batch,
            "partition": self.setup.partition,
            "device": str(self.setup.device),
            "precision": self.setup.precision,
            "steps": st.batches_done,
            "tokens": st.tokens,
            "tokens_per_s": st.tokens / st.makespan if st.makespan else 0.0,
            "wall_tokens_per_s": st.tokens / st.train_wall if st.train_wall else 0.0,
            "train_seconds": st.train_wall,
            "pipeline_seconds": st.makespan,
            "model_flops_per_token": mfu_flops,
            "bubble_fraction": sum(x["bubble_fraction"] for x in stats) / len(stats),
            "analytic_bubble_fraction": analytic,
            "max_drift": max(x["max_drift"] for x in stats),
            "drift_bound": max(x["drift_bound"] for x in stats) if c.pipeline.schedule == "paci" else 0,
            "peak_memory_bytes": max(x["peak_memory_bytes"] for x in stats),
            "final_val_loss": st.last_val_loss,
            "train_loss": sum(tail) / len(tail) if tail else None,
            "clock": self.clock.now(),
            "clock_name": self.clock.name,
            "clock_tokens_per_s": st.tokens / self.clock.now() if self.clock.now() > 0 else 0.0,
            "profile": self.cfg.training.profile,
            "stages": stats,
        }
