"""Command-line options shared by ``paci-tune train``, ``apply``, ``simulate`` and the pipeline worker entry point.

Options override keys of the YAML config; the worker accepts the same ones so that a user's own
multi-node ``torchrun`` launch and ``paci-tune train`` describe a run the same way. How an override
combines with the file (giving the window derives the micro-batch size, ...) is the config layer's
rule (:func:`paci_tune.config.derive_doc`). May import: click, :mod:`paci_tune.schedule` (the names).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from ..schedule import NAMES, OWN_PROGRAM

TIMED = [n for n in NAMES if n not in OWN_PROGRAM]

_RUN_OPTIONS: list[tuple[str, str, dict[str, Any]]] = [
    (
        "--schedule",
        "pipeline.schedule",
        {
            "type": click.Choice(list(NAMES)),
            "help": "Pipeline schedule. Those paci-tune does not run itself (" + ", ".join(TIMED) + ") train "
            "1f1b's numbers on the emulated runtime, timed by the simulator (sim/rst clocks only); on the "
            "distributed runtime they run torch's own classes.",
        },
    ),
    ("--chunks", "pipeline.chunks", {"type": int, "help": "Model chunks per stage of interleaved (v >= 2)."}),
    ("--stages", "pipeline.stages", {"type": int, "help": "Pipeline depth P (stages)."}),
    ("--window", "pipeline.window", {"type": int, "help": "Accumulation window a (micro-batches per global batch)."}),
    (
        "--microbatch-size",
        "pipeline.microbatch_size",
        {"type": int, "help": "Micro-batch size (global batch / (D * a))."},
    ),
    (
        "--data-parallel",
        "pipeline.data_parallel",
        {"type": int, "help": "Data-parallel replicas D of the pipeline (P x D devices; global batch = D*a*b)."},
    ),
    ("--inflight", "pipeline.inflight", {"type": int, "help": "Cap on micro-batches in flight per stage."}),
    (
        "--memory",
        "hardware.memory",
        {
            "type": str,
            "help": "Each device's memory (24GiB, 80GB or bytes): a run predicted above it is refused; "
            "none: no budget, whatever the file says.",
        },
    ),
    ("--runtime", "pipeline.runtime", {"type": click.Choice(["emulated", "distributed"]), "help": "Runtime."}),
    ("--device", "pipeline.device", {"type": click.Choice(["auto", "cpu", "cuda"]), "help": "Device."}),
    ("--precision", "pipeline.precision", {"type": click.Choice(["auto", "fp32", "bf16"]), "help": "Precision."}),
    (
        "--backward-weights",
        "pipeline.backward_weights",
        {
            "type": click.Choice(["forward", "current"]),
            "help": "PACI: a backward reads the weights its forward used (forward) or the current ones.",
        },
    ),
    (
        "--optimizer",
        "optimizer.name",
        {
            "type": click.Choice(["adamw", "sgd", "nadam", "muon"]),
            "help": "Optimizer (its settings from the file's optimizer section).",
        },
    ),
    ("--lr", "optimizer.lr", {"type": float, "help": "Peak learning rate."}),
    (
        "--stage-momentum",
        "pipeline.stage_momentum",
        {"type": float, "help": "PACI: per-stage momentum up to this beta1 at the stalest stage."},
    ),
    (
        "--predict-weights/--no-predict-weights",
        "pipeline.predict_weights",
        {"help": "PACI: forwards on the weights extrapolated along the optimizer's last step."},
    ),
    ("--stale-lr", "pipeline.stale_lr", {"type": float, "help": "PACI: PipeMare's per-stage LR over horizon T."}),
    ("--global-batch", "training.global_batch", {"type": int, "help": "Global batch in sequences."}),
    ("--steps", "training.steps", {"type": int, "help": "Budget in global batches (steps)."}),
    ("--seconds", "training.seconds", {"type": float, "help": "Budget in seconds of the clock."}),
    ("--seed", "training.seed", {"type": int, "help": "Seed of model init and data order."}),
    ("--eval-every", "training.eval_every", {"type": int, "help": "Validate every N steps."}),
    ("--checkpoint-every", "training.checkpoint_every", {"type": int, "help": "Checkpoint every N steps."}),
    ("--checkpoint-dir", "training.checkpoint_dir", {"type": str, "help": "Checkpoint folder."}),
    ("--clock", "training.clock", {"type": click.Choice(["wall", "rst", "sim"]), "help": "Clock for budgets."}),
    ("--profile", "training.profile", {"type": str, "help": "Cost profile (paci-tune calibrate) for rst/sim clocks."}),
    (
        "--init-from",
        "training.init_from",
        {
            "type": click.Path(resolve_path=True),
            "help": "Start a new run, in this layout, from a checkpoint (folder, or root with LATEST) of any other "
            "layout: weights, optimizer moments and steps move per model unit; steps, data and LR schedule continue "
            "at its step (training.steps counts from 0). Unlike --resume, the layout may differ.",
        },
    ),
]


def run_options(f: Callable) -> Callable:
    """Decorate a click command with every config-overriding option."""
    return some_run_options(*(flag for flag, _, _ in _RUN_OPTIONS))(f)


def some_run_options(*flags: str) -> Callable[[Callable], Callable]:
    """Decorate a click command with the config-overriding options ``flags`` only (e.g. ``"--stages"``)."""
    unknown = set(flags) - {flag for flag, _, _ in _RUN_OPTIONS}
    assert not unknown, f"not config-overriding options: {sorted(unknown)}"

    def decorate(f: Callable) -> Callable:
        for flag, _, kw in reversed(_RUN_OPTIONS):
            if flag in flags:
                f = click.option(flag, default=None, **kw)(f)
        return f

    return decorate


def overrides_from(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Dotted config overrides of the options that were given (which it removes from ``kwargs``)."""
    out: dict[str, Any] = {}
    for flag, key, _ in _RUN_OPTIONS:
        value = kwargs.pop(flag.split("/")[0].lstrip("-").replace("-", "_"), None)
        if key == "hardware.memory" and isinstance(value, str) and value.strip().lower() == "none":
            out[key] = None  # unset: the file's budget is lifted (derive_doc drops a None)
        elif value is not None:
            out[key] = value
    return out


def log_option(*flags: str) -> Callable[[Callable], Callable]:
    """``--log SINK`` (repeatable): live metric sinks, for ``train``, ``apply`` and the worker entry point
    (:mod:`paci_tune.train.sinks` checks the values; the commands read them as ``log_to``). ``flags``: the
    option's names; the worker's first is ``--log-to``, since torchrun's parser takes ``--log`` anywhere on its
    command line for an ambiguous abbreviation of its own ``--log-dir`` and ``--logs-specs``."""
    return click.option(
        *flags,
        "log_to",
        multiple=True,
        metavar="SINK",
        help="Live metrics as the run goes: tensorboard:DIR, wandb:PROJECT or mlflow:EXPERIMENT (repeatable; "
        "wandb and mlflow need pip install 'paci-tune[wandb]' / 'paci-tune[mlflow]'). See docs/metrics.md.",
    )
