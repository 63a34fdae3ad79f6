"""PACI's per-stage staleness controls: what each stage of a run gets from ``pipeline``'s three keys.

Under PACI a micro-batch's gradient at stage ``s`` arrives up to ``tau_s = ceil((P-s-1)/a)`` optimizer
updates after its forward (:func:`paci_tune.schedule.drift_bound`): the first stage's are the stalest,
the last stage's are never late. Three remedies from the asynchronous-pipeline literature act on a
stage by its ``tau_s``; none applies to a synchronous schedule (the config refuses them there):

- ``stage_momentum`` (Ajanthan et al., ICML 2025): a longer momentum horizon where gradients are
  staler, ``beta1_s = beta1 + tau_s (beta1_max - beta1) / P`` (:func:`.optimizers.stage_config`);
- ``predict_weights`` (SpecTrain, PipeOptim): the forwards run on the weights extrapolated ``tau_s``
  steps along the optimizer's last step (:mod:`.optim`);
- ``stale_lr`` (PipeMare, MLSys 2021): a smaller step where gradients are staler, early on,
  ``lr_s(t) = lr(t) / tau_s ** (1 - min(t / T, 1))``, ``t / T`` read as progress through the budget
  over the horizon (a stage with ``tau_s <= 1`` keeps the run's LR).

May import: :mod:`paci_tune.config`, :mod:`paci_tune.schedule` and the pipeline layer's :mod:`.optimizers`.
"""

from __future__ import annotations

from collections.abc import Callable

from ..config.optimizer import OptimizerConfig
from ..config.schema import PipelineConfig
from ..schedule import drift_bound, schedule_of
from .optimizers import stage_config


def staleness_of(p: PipelineConfig, stage: int) -> int:
    """``tau`` of ``stage``: PACI's drift bound there, 0 under a synchronous schedule."""
    return drift_bound(stage, p.stages, p.window) if schedule_of(p.schedule).asynchronous else 0


def stage_optimizer(opt: OptimizerConfig, p: PipelineConfig, stage: int) -> OptimizerConfig:
    """``opt`` as ``stage`` steps it: with its stage momentum when ``pipeline.stage_momentum`` is on."""
    return stage_config(opt, p.stage_momentum, staleness_of(p, stage), p.stages)


def prediction_steps(p: PipelineConfig, stage: int) -> int:
    """How many steps ahead ``stage``'s forwards extrapolate its weights (0: no prediction there)."""
    return staleness_of(p, stage) if p.predict_weights else 0


def stale_lr_factor(tau: int, progress: float, horizon: float) -> float:
    """PipeMare's multiplier of a stage's LR at ``progress`` through the budget (module docstring)."""
    if tau <= 1:
        return 1.0
    return float(tau) ** -(1.0 - min(progress / horizon, 1.0))


def stage_lr(
    lr_at: Callable[[int], float], progress: Callable[[int], float] | None, p: PipelineConfig, stage: int
) -> Callable[[int], float]:
    """``stage``'s LR of its k-th step: the run's ``lr_at(k)``, under ``stale_lr`` scaled by PipeMare's factor
    at ``progress(k)`` (the LR schedule's own reading of the budget)."""
    tau = staleness_of(p, stage)
    horizon = p.stale_lr
    if horizon is None or tau <= 1:
        return lr_at
    if progress is None:
        raise ValueError("pipeline.stale_lr needs the run's progress through its budget")
    return lambda k: lr_at(k) * stale_lr_factor(tau, progress(k), horizon)
