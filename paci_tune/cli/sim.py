"""``paci-tune calibrate`` and ``paci-tune simulate``: measure a cost profile, predict schedules.

Heavy imports (torch, matplotlib) happen inside the commands so ``paci-tune --help`` stays fast.
Progress goes to stderr; with ``--json`` stdout carries one JSON object and nothing else, so the
output can be piped straight into another program. May import: click, rich, :mod:`paci_tune.calibrate`,
:mod:`paci_tune.sim`, :mod:`paci_tune.pipeline`, :mod:`paci_tune.schedule`, :mod:`paci_tune.config`,
:mod:`paci_tune.base`, :mod:`paci_tune.errors`.
"""

from __future__ import annotations

import json
import math
from typing import Any

import click

from ..schedule import NAMES, schedule_of
from .common import stderr
from .options import overrides_from, some_run_options
from .ui import fmt_bytes

MAX_BATCHES = 100_000
_DEVICES = click.Choice(["auto", "cpu", "cuda"])
_PRECISIONS = click.Choice(["auto", "fp32", "bf16"])


def _fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


_threads_option = click.option(
    "--threads", type=int, default=None, help="CPU threads per stage of the calibration (default: cpu_count // stages)."
)


def _check_threads(threads: int | None) -> None:
    """``--threads`` (of ``calibrate``, or of ``simulate``'s quick calibration) is at most this machine's CPUs."""
    from ..base.processes import cpu_count
    from ..errors import ConfigError

    if threads is not None and not 1 <= threads <= cpu_count():
        raise ConfigError("--threads", threads, f"1..{cpu_count()} (this machine's CPUs: more measures contention)")


# ------------------------------------------------------------------------------------ calibrate


def _optimizers(cfg: Any, names: str | None) -> list[Any]:
    """``--optimizers``' names as optimizer configs: the config's section with each name."""
    import dataclasses

    from ..config.optimizer import OPTIMIZERS
    from ..errors import ConfigError

    out = []
    for name in [n.strip() for n in names.split(",") if n.strip()] if names else []:
        if name not in OPTIMIZERS:
            raise ConfigError("--optimizers", names, "comma-separated optimizers of: " + ", ".join(OPTIMIZERS))
        out.append(dataclasses.replace(cfg.optimizer, name=name))
    return out


def _check_calibrate_options(cfg: Any, sizes: list[int] | None, repeats: int, threads: int | None, out: str) -> None:
    """Everything a calibration would refuse after minutes of measuring, refused before it starts."""
    from ..base.files import check_writable
    from ..errors import ConfigError
    from ..pipeline.checks import check_model_and_data

    if repeats < 1:
        raise ConfigError("--repeats", repeats, "a positive integer")
    _check_threads(threads)
    check_model_and_data(cfg, sizes or ())
    check_writable(out, "--out")


@click.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False), help="Profile YAML to write.")
@click.option("--microbatch-sizes", default=None, help="Comma-separated micro-batch sizes (default: b/2,b,2b).")
@click.option("--device", type=_DEVICES, default=None, help="Device to measure on (default: the config's).")
@click.option("--precision", type=_PRECISIONS, default=None, help="Compute precision (default: the config's).")
@click.option(
    "--repeats", type=int, default=5, show_default=True, help="Timed global batches per micro-batch size (medians)."
)
@_threads_option
@click.option("--stages", type=int, default=None, help="Pipeline depth the default thread count assumes.")
@click.option(
    "--optimizers",
    default=None,
    help="Comma-separated optimizers whose steps to time too (nadam,muon): a search over optimizers needs each one's.",
)
@click.option(
    "--extend",
    default=None,
    type=click.Path(dir_okay=False, exists=True),
    help="Add --optimizers' steps to this existing profile (of CONFIG's model, from any machine), "
    "each rescaled from its own optimizer's step by their ratio timed alone here; nothing else is "
    "measured.",
)
def calibrate(
    config: str,
    out: str,
    microbatch_sizes: str | None,
    device: str | None,
    precision: str | None,
    repeats: int,
    threads: int | None,
    stages: int | None,
    optimizers: str | None,
    extend: str | None,
) -> None:
    """Measure the cost profile of CONFIG's model on this machine and write it as YAML.

    Per pipeline unit: forward/backward time, activation and saved bytes per micro-batch size,
    parameter bytes and optimizer-step time; plus point-to-point and all-reduce latency and bandwidth. The
    file can be edited or written by hand for other hardware (see paci_tune/sim/profile.py).
    """
    from rich.console import Console
    from rich.table import Table

    from ..calibrate import calibrate as run_calibration
    from ..calibrate import parse_sizes
    from ..config import load_config

    cfg = load_config(config, overrides_from({"stages": stages}))
    sizes = parse_sizes(microbatch_sizes, "--microbatch-sizes")
    _check_calibrate_options(cfg, sizes, repeats, threads, out)
    others = _optimizers(cfg, optimizers)
    if extend is not None:
        from ..calibrate import with_optimizers
        from ..errors import ConfigError
        from ..sim.profile import Profile

        if not others:
            raise ConfigError("--optimizers", optimizers, "the optimizers whose steps --extend adds (nadam,muon)")
        extended = with_optimizers(Profile.load(extend, "--extend"), cfg, others, repeats=repeats)
        extended.save(out)
        stderr(f"wrote {out}: {extend} with the steps of {', '.join(extended.timed_optimizers())}")
        return
    profile = run_calibration(
        cfg,
        microbatch_sizes=sizes,
        device=device,
        precision=precision,
        repeats=repeats,
        threads=threads,
        log=lambda m: stderr(f"measuring {m}"),
        optimizers=others,
    )
    profile.save(out)
    table = Table(title=f"{profile.device} · {profile.dtype} · {profile.threads} thread(s) · seq {profile.seq_len}")
    b_max = profile.microbatch_sizes[-1]
    halves = f"B | W @{b_max}"  # the backward's input and weight halves (what zero-bubble schedules run apart)
    for col in ("unit", "params", "step", *[f"F+B @{b}" for b in profile.microbatch_sizes], halves, "saved/mb"):
        table.add_column(col, justify="right")
    for u in profile.units:
        big = u.costs[b_max]
        b_in, b_w = big.split(1.0)  # measured by calibrate (never derived here)
        table.add_row(
            u.name,
            fmt_bytes(u.param_bytes),
            _fmt_seconds(u.optimizer_s),
            *[_fmt_seconds(u.costs[b].forward_s + u.costs[b].backward_s) for b in profile.microbatch_sizes],
            f"{_fmt_seconds(b_in)} | {_fmt_seconds(b_w)}",
            f"{fmt_bytes(big.saved_bytes)} @{b_max}",
        )
    table.caption = (
        f"p2p {profile.p2p.backend}: latency {_fmt_seconds(profile.p2p.latency_s)}, "
        f"bandwidth {profile.p2p.bandwidth_Bps / 1e9:.2f} GB/s · all-reduce {profile.allreduce.backend}: "
        f"{_fmt_seconds(profile.allreduce.latency_s)} + bytes / {profile.allreduce.bandwidth_Bps / 1e9:.2f} GB/s "
        f"per ring step · written to {out}"
    )
    Console(width=max(Console().width, 110)).print(table)


# ------------------------------------------------------------------------------------- simulate


@click.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option(
    "--schedule",
    "schedules",
    type=click.Choice([*NAMES, "all"]),
    multiple=True,
    default=("all",),
    show_default=True,
    help="Schedule to simulate; repeat for several. all: every schedule (a layout one cannot run is shown "
    "refused, with the reason).",
)
@click.option("--chunks", type=int, default=2, show_default=True, help="Model chunks per stage of interleaved (v).")
@some_run_options("--stages", "--window", "--microbatch-size", "--data-parallel")  # the pipeline's shape
@click.option(
    "--profile",
    "profile_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Cost profile YAML (default: a quick in-process calibration, cached).",
)
@click.option("--timeline", type=click.Path(dir_okay=False), default=None, help="Draw the timelines to FILE.png/.svg.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout instead of a table.")
@click.option("--batches", type=int, default=8, show_default=True, help="Global batches to simulate (PACI: >= 4P).")
@click.option(
    "--memory-gib",
    type=float,
    default=None,
    help="Device memory per stage (default: the config's hardware.memory): each schedule's cut is the "
    "fastest that fits it, else the leanest, shown over it.",
)
@_threads_option
def simulate(
    config: str,
    schedules: tuple[str, ...],
    chunks: int,
    profile_path: str | None,
    timeline: str | None,
    as_json: bool,
    batches: int,
    memory_gib: float | None,
    threads: int | None,
    **shape: int | None,
) -> None:
    """Predict step time, tokens/s, bubble, memory and drift of CONFIG's pipeline per schedule.

    The simulator replays the runtimes' own schedule action lists with durations from a cost
    profile. Without --profile the model is calibrated quickly on this machine and the profile
    cached under ~/.cache/paci-tune/profiles, so later calls are fast. With --data-parallel D the
    layout is D replicas on P x D devices: each step adds its stage's gradient all-reduce. PACI
    follows the config's pipeline.backward_weights (--backward-weights is not an option here: set it
    in CONFIG): forward counts the weight copies kept for in-flight backwards, in memory and step time.
    """
    from ..base.files import check_writable
    from ..calibrate.predict import predict_schedules
    from ..config import load_config
    from ..errors import ConfigError
    from ..sim.memory import GIB

    if batches < 1:
        raise ConfigError("--batches", batches, "a positive integer")
    if chunks < 2:
        raise ConfigError("--chunks", chunks, "an integer >= 2 (model chunks per stage of interleaved)")
    if memory_gib is not None and not (memory_gib > 0 and math.isfinite(memory_gib)):
        raise ConfigError("--memory-gib", memory_gib, "a positive number of GiB")
    if timeline is not None and not timeline.lower().endswith((".png", ".svg")):
        raise ConfigError("--timeline", timeline, "a file name ending in .png or .svg")
    _check_threads(threads)
    if batches > MAX_BATCHES:
        raise ConfigError("--batches", batches, f"at most {MAX_BATCHES} (each is replayed action by action)")
    cfg = load_config(config, overrides_from(shape))
    if timeline is not None:
        check_writable(timeline, "--timeline")
    memory_bytes = None if memory_gib is None else memory_gib * GIB
    prediction = predict_schedules(
        cfg,
        schedules=list(dict.fromkeys(n for x in schedules for n in (NAMES if x == "all" else [x]))),
        chunks=chunks,
        profile_path=profile_path,
        batches=batches,
        memory_bytes=memory_bytes,
        threads=threads,
        log=lambda m: stderr(f"calibrating: {m}"),
    )
    drawn = None
    if timeline is not None:
        drawn = prediction.draw_timelines(timeline)
        stderr(f"timeline written to {drawn}")
    doc = prediction.to_doc(config, drawn)
    results, errors = prediction.results, prediction.not_fitting
    if as_json:
        click.echo(json.dumps(doc, allow_nan=False, default=_json_default))
        return
    _print_table(doc, results, errors, prediction.memory_bytes)


def _json_default(o: object) -> object:
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def _print_table(doc: dict[str, Any], results: dict, errors: dict[str, str], memory_bytes: float | None) -> None:
    from rich.console import Console
    from rich.table import Table

    prof = doc["profile"]
    table = Table(
        title=f"{doc['config']} · P={doc['n_stages']} · D={doc['data_parallel']} ({doc['devices']} devices) · "
        f"a={doc['window']} · b={doc['microbatch_size']} · "
        f"profile: {prof['device']} {prof['dtype']}, {prof['threads']} thread(s)"
    )
    cols = ("schedule", "cut", "step", "tokens/s", "bubble", "steady", "all-reduce", "peak MiB per device", "drift")
    for col in cols:
        table.add_column(col, justify="right")
    for name, r in results.items():
        mems = "/".join(f"{st.peak_memory_bytes / 2**20:.1f}" for st in r.per_stage)
        over = memory_bytes is not None and r.peak_memory_bytes > memory_bytes
        table.add_row(
            name,
            ",".join(map(str, r.layout.partition or ())),
            _fmt_seconds(r.step_time_s),
            f"{r.tokens_per_s:,.0f}",
            f"{r.bubble_fraction:.1%}",
            f"{r.steady_bubble_fraction:.1%}",
            f"{r.allreduce_fraction:.1%}",
            f"[red]{mems}[/red]" if over else mems,
            f"{r.max_drift} (bound {max(s.drift_bound for s in r.per_stage)})"
            if schedule_of(name).asynchronous
            else str(r.max_drift),
        )
    for name, msg in errors.items():
        if name not in results:  # refused by the layout; one over the budget has its row, in red
            table.add_row(name, "-", "-", "-", "-", "-", "-", "[red]refused[/red]", "-")
        stderr(f"{name}: {msg}")
    notes = (
        [f"peak per device: the search's figure, in red over the budget of {memory_bytes / 2**20:.1f} MiB"]
        if (memory_bytes is not None)
        else []
    )
    notes += [
        f"analytic flush bubble (P-1)/(m+P-1) = {(doc['n_stages'] - 1) / (doc['window'] + doc['n_stages'] - 1):.1%}"
    ]
    if "paci_vs_1f1b_throughput" in doc:
        m, pp = doc["window"], doc["n_stages"]
        notes.append(f"paci/1f1b throughput {doc['paci_vs_1f1b_throughput']:.3f} (analytic {(m + pp - 1) / m:.3f})")
    for name in results:
        if schedule_of(name).asynchronous and doc["backward_weights"] == "forward":
            notes.append(f"{name}: backward_weights forward (weight copies in memory and step time)")
    for name, r in results.items():
        if not schedule_of(name).own_program:
            notes.append(f"{name}: analytic bubble {r.analytic_bubble_fraction:.1%}")
    for name, r in results.items():
        if tied := max(st.tied_allreduce_s for st in r.per_stage):
            notes.append(f"{name}: tied parameters summed among their stages, {_fmt_seconds(tied)} a step (all-reduce)")
    derived = [name for name, r in results.items() if r.backward_split == "derived"]
    if derived:
        notes.append(f"{', '.join(derived)}: the profile has no B/W split, derived as W = backward/2 (trainable units)")
    notes.append(f"profile {prof['path']}")
    table.caption = " · ".join(notes)
    Console(width=max(Console().width, 110)).print(table)
