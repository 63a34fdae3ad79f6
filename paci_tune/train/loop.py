"""The training loop: budget, LR schedule over the budget, evaluation, checkpoints, metrics.

It knows nothing of how the pipeline runs. It asks the runtime to run *segments* of global
batches -- each ends drained, at an evaluation or checkpoint point -- and the runtime reports
losses as batches complete. The same loop runs in the single emulated process and on every rank
of the distributed runtime (SPMD); only the reporting rank writes records. It takes only a resolved
run (:func:`paci_tune.train.run.resolve_run`): a profile clock finds its profile named, and nothing
here loads the data, the model's metadata or the profile again. The summary that closes a run is
:mod:`.summary`'s. May import: :mod:`paci_tune.pipeline`, :mod:`paci_tune.config`, :mod:`paci_tune.errors`,
the train layer's own modules, :mod:`paci_tune.base`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..base.locks import Lock
from ..config.layout import Layout
from ..errors import ConfigError
from ..pipeline.evaluation import NEAR, REACHED, EvalPlan, EvalResult
from ..pipeline.factory import ResolvedRun, Setup, build_setup
from ..pipeline.runtime import Runtime, StageTiming
from . import checkpoint
from .clock import Clock, WallClock, run_clock
from .fingerprint import fingerprint, mismatch
from .lr import lr_factor, peak_lr, step_progress
from .metrics import RecordSink
from .nearness import after_validation, near, validated
from .summary import summary_record
from .timed import is_timed, numerics_config, numerics_run


@dataclasses.dataclass
class LoopState:
    """What the loop must carry across a resume besides the stages' own state."""

    batches_done: int = 0
    origin: int = 0  # the step this run started from (a checkpoint's, with training.init_from)
    segments: int = 0
    makespan: float = 0.0
    train_wall: float = 0.0
    clock: float = 0.0
    tokens: int = 0
    last_eval: int = -1
    last_eval_clock: float = 0.0
    last_val_loss: float | None = None
    far_vals: list[float] = dataclasses.field(default_factory=list)  # the far validations (training.eval_far_every)
    target_reached: bool = False
    last_checkpoint: int = 0
    clock_busy: list[float] = dataclasses.field(default_factory=list)  # per stage, on a profile clock
    clock_span: float = 0.0  # the clock's training time
    timing: list[dict] = dataclasses.field(default_factory=list)


class Trainer:
    """Runs one resolved training run (:class:`~paci_tune.pipeline.factory.ResolvedRun`) on this process's runtime."""

    def __init__(self, run: ResolvedRun, sink: RecordSink, *, distributed: bool = False) -> None:
        cfg = run.config
        self.cfg, self.sink = cfg, sink
        t, p = cfg.training, cfg.pipeline
        self.peak = peak_lr(cfg.optimizer, cfg.lr_schedule, t.global_batch)
        if t.clock != "wall" and not t.profile:
            raise ConfigError("training.profile", None, f"a cost profile for the {t.clock} clock (see resolve_run)")
        self.clock: Clock = WallClock()
        self._segment_first = 0
        # A schedule the simulator times trains 1F1B's numbers on its runtime; its clock times its own lists.
        self.setup: Setup = build_setup(numerics_run(run), self.lr_at, distributed=distributed, progress=self.progress)
        self.runtime: Runtime = self.setup.runtime
        self.tokens_per_batch = t.global_batch * self.setup.seq_len
        self.state = LoopState(timing=[dataclasses.asdict(StageTiming()) for _ in range(p.stages)])
        self.ckpt_root = Path(t.checkpoint_dir) if t.checkpoint_dir else None
        self._distributed = distributed
        self._init_optimizer: str | None = None  # set when --init-from could not move the optimizer's state

    @property
    def layout(self) -> Layout:
        """The run's own layout, its cut pinned: a timed schedule's (:mod:`.timed`) is its own, the runtime's
        (1F1B's, ``self.setup.partition``) is another; every other run's are one."""
        if is_timed(self.cfg):
            return self.cfg.layout
        return self.cfg.layout.with_partition(self.setup.partition)

    # ------------------------------------------------------------------ schedule over the budget
    def make_clock(self, offset: float) -> Clock:
        if self.cfg.training.clock == "wall":
            return WallClock(offset)
        assert self.setup.profile is not None  # a profile clock's config names one (checked in __init__)
        return run_clock(self.cfg, self.setup.profile, self.layout, offset)

    def progress(self, update_index: int) -> float:
        """Progress through the budget when step ``update_index`` is applied: read on the run's clock, or
        in steps over ``training.steps`` or ``lr_schedule.horizon_steps`` (counted from the run's first step)."""
        t, horizon = self.cfg.training, self.cfg.lr_schedule.horizon_steps
        if horizon is not None:
            return step_progress(update_index - self.state.origin, horizon)
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

    def _segment_length(self) -> int | None:
        """Batches until the next checkpoint or the end of the budget (0: the budget is spent).

        Segments end drained, so only checkpoints and the budget end them, never an evaluation.
        ``None``: a wall-clock time budget, which the pipeline checks on the way (:meth:`_control`).
        """
        t, b = self.cfg.training, self.state.batches_done
        ends = []
        if t.checkpoint_every:
            ends.append((b // t.checkpoint_every + 1) * t.checkpoint_every)
        if t.steps is not None:
            ends.append(t.steps)
        n = min(ends) - b if ends else None
        if t.seconds is not None:
            n = self.clock.batches_within(n, t.seconds)
        return n

    def _eval_points(self, first: int, n: int | None) -> Callable[[int], bool]:
        """The segment's evaluation points, as global batch indices (candidates on the wall clock).

        ``eval_every_seconds`` on a profile clock: the first batch whose model is complete at or past
        each grid point, read off the segment's simulated timeline. Otherwise every ``eval_every``
        batches (on the wall clock with ``eval_every_seconds``, stage 0 then decides by its clock).
        """
        t = self.cfg.training
        every_s = t.eval_every_seconds
        ends = None if every_s is None else self.clock.model_ends(n)
        if every_s is None or ends is None:
            return lambda k: (k + 1) % t.eval_every == 0
        due = (self.state.last_eval_clock // every_s + 1) * every_s
        points = set()
        for i, end in enumerate(ends):
            if end >= due - 1e-12:
                points.add(first + i)
                due = (end // every_s + 1) * every_s
        return points.__contains__

    def _control(self, k: int, news: int) -> tuple[bool, bool]:
        """Stage 0 at an evaluation point: (evaluate now, end the run after the batches already started).

        With ``training.eval_far_every``, a point between two far ones is validated only where the last
        stage's latest word (``news``) says the target is near (:mod:`.nearness`); none once it was reached."""
        t = self.cfg.training
        reached = end = bool(news & REACHED)  # the run ends, and no validation after the target's is scored
        evaluate = t.eval_far_every is None or validated(k + 1, t.eval_every, t.eval_far_every, bool(news & NEAR))
        if self.clock.measured:  # otherwise the segment's length and its evaluation points were planned
            now = self.clock.now()
            end = end or (t.seconds is not None and now >= t.seconds)
            if t.eval_every_seconds is not None:
                due = (self._wall_last_eval // t.eval_every_seconds + 1) * t.eval_every_seconds
                evaluate = now >= due - 1e-12
                if evaluate:
                    self._wall_last_eval = now
        return evaluate and not reached, end

    def _on_eval(self, r: EvalResult) -> int:
        """The last stage's report of an evaluation inside the pipeline; its news bits for stage 0: the target
        reached, the target near (at a far point, :mod:`.nearness` decides again)."""
        reached = self._record_eval(
            r.batch + 1, r.val_loss, self.clock.model_done(r.batch - self._segment_first), r.updates, r.snapshots
        )
        t = self.cfg.training
        dense = after_validation(self.state.far_vals, r.batch + 1, r.val_loss, t.eval_far_every, t.target_val_loss)
        return (REACHED if reached else 0) | (NEAR if dense else 0)

    # ------------------------------------------------------------------------------- the loop
    def run(self, resume: bool = False) -> dict[str, Any] | None:
        """Train through the budget: continuing this run's own checkpoint with ``resume``, else
        starting from ``training.init_from`` when it names one, else from scratch. The checkpoint
        folder is this run's alone while it trains (:meth:`_hold_checkpoints`)."""
        lock = self._hold_checkpoints()
        try:
            return self._run(resume)
        finally:
            self.sink.close()  # a failed run's metrics file and live sinks keep what they got
            if lock is not None:
                lock.release()

    def _hold_checkpoints(self) -> Lock | None:
        """The lock of the checkpoint folder (:func:`.checkpoint.hold`; a second run there is refused before
        any work). One process per run holds it: this one, unless the distributed launcher holds it for its
        workers (:data:`.checkpoint.LOCK_ENV`); under a torchrun of the user's own, rank 0 -- the other ranks
        are the same run and must not refuse each other."""
        root = self.ckpt_root
        if root is None or os.environ.get(checkpoint.LOCK_ENV) == str(root.resolve()):
            return None
        if self._distributed and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return None
        return checkpoint.hold(root)

    def _run(self, resume: bool) -> dict[str, Any] | None:
        if resume and (self.ckpt_root is None or checkpoint.latest(self.ckpt_root) is not None):
            self._resume()
        elif self.cfg.training.init_from:
            self._init_from(Path(self.cfg.training.init_from))
        self.runtime.warmup()
        self.runtime.barrier()  # ranks finish set-up at different times; do not count that as bubble
        self.clock = self.make_clock(self.state.clock)
        self._wall_last_eval = self.state.last_eval_clock
        self._emit_start()
        timing = [StageTiming(**d) for d in self.state.timing]
        t = self.cfg.training
        while self._budget_left():
            n = self._segment_length()
            if n == 0:
                break  # the budget cannot fit one more global batch
            first = self._segment_first = self.state.batches_done
            if t.eval_far_every is not None:  # the reporter's far validations (a resumed run's, on every rank)
                self.state.far_vals = list(self.runtime.share(self.state.far_vals))  # type: ignore[call-overload]
            dense = near(t.eval_far_every, t.target_val_loss, self.state.far_vals)  # a resumed run's word
            plan = EvalPlan(
                eval_at=self._eval_points(first, n),
                control=self._control,
                on_eval=self._on_eval,
                spent=self.clock.exclude,
                news=NEAR if dense else 0,
            )
            self.clock.begin_segment(n)
            start_clock = self.clock.now()
            report = self.runtime.run_segment(first, n, self._on_batch, plan)
            self.clock.end_segment(report.batches)
            busy = self.clock.last_busy  # none on the wall clock: clock_busy stays empty
            self.state.clock_busy = [
                a + b for a, b in zip(self.state.clock_busy or [0.0] * len(busy), busy, strict=True)
            ]
            self.state.clock_span += self.clock.now() - start_clock
            self.state.train_wall += report.wall
            self.state.makespan += report.makespan
            for acc, seg in zip(timing, report.stages, strict=True):
                acc.add(seg)
            self.state.timing = [dataclasses.asdict(x) for x in timing]
            self.state.batches_done += report.batches
            self.state.segments += 1
            self.state.tokens += report.batches * self.tokens_per_batch
            self._emit_segment(timing)
            ended = n is None or report.batches < n or bool(self.runtime.share(self.state.target_reached))
            if t.checkpoint_every and self.state.batches_done % t.checkpoint_every == 0:
                self._checkpoint()
            if ended:
                break
        reached = bool(self.runtime.share(self.state.target_reached))  # nothing after the target's is scored
        if not reached and self.runtime.share(self.state.last_eval) != self.state.batches_done:
            self._evaluate()
        if self.ckpt_root is not None and self.state.last_checkpoint != self.state.batches_done:
            self._checkpoint()  # the run's final state, at a point that depends on the step count only
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

    def _evaluate(self) -> None:
        """Validate the drained pipeline (the run's end, unless it reached its target: nothing after that
        validation is scored), every stage at the same update count."""
        val = self.runtime.evaluate()
        b = self.state.batches_done
        self._record_eval(
            b, val, self.clock.now(), [b] * self.cfg.pipeline.stages, [False] * self.cfg.pipeline.stages, drained=True
        )

    def _record_eval(
        self, step: int, val: float, clock: float, updates: list[int], snapshots: list[bool], drained: bool = False
    ) -> bool:
        """Record a validation (``drained``: the run's closing one); True once the target is reached."""
        self.state.last_eval, self.state.last_val_loss, self.state.last_eval_clock = step, val, clock
        self.sink.emit(
            {
                "event": "eval",
                "step": step,
                "val_loss": val,
                "tokens": step * self.tokens_per_batch,
                "clock": clock,
                "weights": {"updates": updates, "snapshot": snapshots},  # what each stage scored
                **({"drained": True} if drained else {}),
            }
        )
        target = self.cfg.training.target_val_loss
        if target is not None and val <= target:
            self.state.target_reached = True
        return self.state.target_reached

    def _checkpoint(self) -> None:
        assert self.ckpt_root is not None
        b = self.state.batches_done
        self.state.clock = self.clock.now()
        self.state.last_checkpoint = b
        checkpoint.save_stages(self.ckpt_root, b, self.runtime.state_dicts())
        self.runtime.barrier()
        if self.runtime.is_reporter:
            meta = {
                "fingerprint": fingerprint(self.cfg),
                "partition": self.setup.partition,
                "loop": dataclasses.asdict(self.state),
                "records": self.sink.records,
            }
            self.sink.flush()  # the sinks hold every step the checkpoint does before it exists (a resume purges after)
            checkpoint.commit(self.ckpt_root, b, meta, self.cfg.training.keep_checkpoints)
            self.sink.emit({"event": "checkpoint", "step": b, "path": str(checkpoint.folder_for(self.ckpt_root, b))})
        self.runtime.barrier()

    def _resume(self) -> None:
        if self.ckpt_root is None:
            raise ConfigError("training.checkpoint_dir", None, "a checkpoint folder to resume from (--checkpoint-dir)")
        if checkpoint.latest(self.ckpt_root) is None:
            self.sink.restore([])  # nothing saved yet: a fresh start is the resume, nothing of the killed run's kept
            return
        meta, states = checkpoint.load(self.ckpt_root, self.runtime.local_stages)
        diff = mismatch(meta["fingerprint"], fingerprint(self.cfg))
        if diff is None and meta["partition"] != self.setup.partition:
            diff = f"partition: checkpoint has {meta['partition']}, this run has {self.setup.partition}"
        if diff:
            raise ConfigError("--resume", str(self.ckpt_root), f"a checkpoint of the same configuration ({diff})")
        self.runtime.load_state_dicts(states)
        self.state = LoopState(**meta["loop"])
        self.sink.restore(meta["records"])

    def _init_from(self, path: Path) -> None:
        """Start this run, in its own layout, from another run's checkpoint (``training.init_from``).

        Weights, optimizer moments and step counts move per model unit; the step counter (and so
        the data position and, on a step budget, the LR schedule's position over ``training.steps``)
        continues at the checkpoint's step. Clock, records and timing start afresh, so a budget in
        seconds counts from the checkpoint. The data from there is drawn with this run's seed and
        batch: with the checkpoint's own, the run continues exactly the run that wrote it.

        A checkpoint of another optimizer (AdamW's moments, for a NAdam or Muon run) gives its
        weights and step count only: this run's optimizer starts its state afresh, as switching
        optimizers mid-run does (the start record says so: ``init_optimizer``).
        """
        folder = checkpoint.find(path)
        meta, states = checkpoint.reshard(folder, self.setup.partition, self.runtime.local_stages)
        mine, theirs = fingerprint(self.cfg), meta["fingerprint"]
        for section in ("model", "data"):  # the tokens, not how this run draws from them
            diff = mismatch(
                theirs.get(section, {}), {k: v for k, v in mine.get(section, {}).items() if k != "draw"}, section
            )
            if diff:
                raise ConfigError(checkpoint.INIT_FROM, str(folder), f"a checkpoint of the same {section} ({diff})")
        was = (theirs.get("optimizer") or {}).get("name", "adamw")
        if was != self.cfg.optimizer.name:
            for st in states.values():
                for entry in st["params"].values():
                    entry["state"] = {}
            self._init_optimizer = f"fresh: the checkpoint's {was} state is not {self.cfg.optimizer.name}'s"
        self.runtime.load_state_dicts(states)
        self.state.batches_done = self.state.last_checkpoint = self.state.origin = meta["loop"]["batches_done"]

    # --------------------------------------------------------------------------------- records
    def _emit_start(self) -> None:
        c, s = self.cfg, self.setup
        self.sink.emit(
            {
                "event": "start",
                "schedule": c.pipeline.schedule,
                "chunks": c.layout.chunks,
                "numerics_schedule": numerics_config(c).pipeline.schedule,
                "n_stages": c.pipeline.stages,
                "data_parallel": c.pipeline.data_parallel,
                "window": c.pipeline.window,
                "microbatch_size": c.pipeline.microbatch_size,
                "global_batch": c.training.global_batch,
                "runtime": c.pipeline.runtime,
                "device": str(s.device),
                "precision": s.precision,
                "threads": torch.get_num_threads(),  # this process's CPU threads (a search splits the cores)
                "partition": list(self.layout.partition or ()),
                "n_units": s.n_units,
                "steps": c.training.steps,
                "seconds": c.training.seconds,
                "resumed_at": self.state.batches_done,
                **({"init_optimizer": self._init_optimizer} if self._init_optimizer else {}),
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
        peak = max(x["peak_memory_bytes"] for x in stats)  # measured, but no record carries it before the summary
        self.sink.measure(self.state.batches_done, {"memory/peak_bytes": float(peak)})

    def _summary(self, timing: list[StageTiming]) -> dict[str, Any]:
        stats = self.runtime.stats(timing, self.state.makespan)
        meter = getattr(self.runtime, "meter", None)
        return summary_record(
            self.cfg, self.state, stats, self.sink.records, self.setup, self.clock, self.layout, meter
        )
