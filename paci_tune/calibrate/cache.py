"""The profile cache: a config's quick profile is measured once and read back afterwards.

Once also across processes: the workers of a search share its work folder's ``profile.yaml``, and
two that calibrate it at the same time would each time their trials with their own profile (and
each calibration, on the same cores, with the other running). The first takes the profile's lock
(:mod:`paci_tune.base.locks`) and measures; the others say that they wait, wait, and read what it
wrote. May import: :mod:`.measure`, :mod:`paci_tune.sim`, :mod:`paci_tune.config`, :mod:`paci_tune.base`,
:mod:`paci_tune.errors`, torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..base.locks import Holder, wait_lock
from ..config.optimizer import OptimizerConfig
from ..config.schema import RunConfig
from ..errors import ConfigError
from ..sim.profile import FORMAT, Profile
from .measure import METHOD, calibrate, default_threads, device_name, resolve_target

Log = Callable[[str], None]

WAIT_S = 3 * 3600.0
"""How long a process waits for another's calibration of the same profile: generous, a calibration at
many micro-batch sizes on a busy machine takes many minutes; a crashed holder releases at once."""


def cache_key(
    cfg: RunConfig,
    device: torch.device,
    dtype: str,
    threads: int,
    microbatch_sizes: Sequence[int],
    optimizers: Sequence[str] = (),
) -> str:
    """Hash of everything a quick profile depends on: model, data, device, dtype, threads, micro-batch sizes.

    Also the measurement method and the pipeline shape it reproduces (stages set the co-runners
    and micro-batches in flight, the window the optimizer's cadence): a profile measured another
    way is not reused.
    """
    doc = {
        "format": FORMAT,
        "model": cfg.model,
        "data": cfg.data,
        "device": device_name(device),
        "dtype": dtype,
        "threads": threads,
        "microbatch_sizes": list(microbatch_sizes),
        "torch": str(torch.__version__),
        "method": METHOD,
        "stages": cfg.pipeline.stages,
        "window": cfg.pipeline.window,
    }
    timed = sorted({cfg.optimizer.timing_key, *optimizers})
    if timed != ["adamw"]:  # the optimizers whose steps it times (absent for AdamW alone: older keys stay valid)
        doc["optimizers"] = timed
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/paci-tune/profiles`` (``~/.cache/...`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "paci-tune" / "profiles"


def measured_profile(
    cfg: RunConfig,
    *,
    microbatch_sizes: Sequence[int] | None = None,
    path: Path | None = None,
    threads: int | None = None,
    log: Log | None = None,
    optimizers: Sequence[OptimizerConfig] = (),
) -> tuple[Profile, Path]:
    """A quick profile of ``cfg``, measured once and then read back: the program's one profile cache.

    At ``microbatch_sizes`` (default: the config's), kept at ``path`` when given -- a search keeps
    its profile in its work folder, so a resumed search times its trials exactly as before -- and
    otherwise in the user cache under a key of everything it depends on (:func:`cache_key`). Quick
    means few repeats on the config's device: enough to rank schedules and cuts, not a benchmark.
    The file is written atomically, so concurrent first calls cannot corrupt it. ``optimizers``: more
    optimizers whose steps it times besides the config's (a search over optimizers).
    """
    dev, dtype = resolve_target(cfg, None, None)
    n_threads = threads or default_threads(cfg.pipeline.stages)
    sizes = sorted(set(microbatch_sizes or [cfg.pipeline.microbatch_size]))
    if path is None:
        keys = [o.timing_key for o in optimizers]
        path = cache_dir() / f"{cache_key(cfg, dev, dtype, n_threads, sizes, keys)}.yaml"
    found = _usable(path, [cfg.optimizer, *optimizers])
    if found is not None:
        return found, path

    def waiting(holder: Holder) -> None:
        if log:
            log(f"waiting for {holder.describe()}, which is measuring the profile {path}, to finish (then reading it)")

    with wait_lock(path.with_name(f".{path.name}.lock"), timeout_s=WAIT_S, on_wait=waiting):
        found = _usable(path, [cfg.optimizer, *optimizers])  # measured by the process this one waited for
        if found is not None:
            return found, path
        if log:
            log(f"measuring the model once on this machine at micro-batch sizes {sizes}; kept as {path}")
        profile = calibrate(
            cfg,
            microbatch_sizes=sizes,
            repeats=3,
            warmup=1,
            threads=n_threads,
            p2p_repeats=30,
            log=log,
            optimizers=optimizers,
        )
        profile.save(path)
    return profile, path


def _usable(path: Path, optimizers: Sequence[OptimizerConfig]) -> Profile | None:
    """The profile at ``path`` if it is one that times every optimizer of ``optimizers``; a stale or
    foreign file is None (measured again and overwritten)."""
    if not path.is_file():
        return None
    try:
        found = Profile.load(path)
    except ConfigError:
        return None
    return found if all(o.timing_key in found.timed_optimizers() for o in optimizers) else None
