"""The profile cache: a config's quick profile is measured once and read back afterwards.

May import: :mod:`.measure`, :mod:`paci_tune.sim`, :mod:`paci_tune.config`, :mod:`paci_tune.errors`, torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..config.optimizer import OptimizerConfig
from ..config.schema import RunConfig
from ..errors import ConfigError
from ..sim.profile import FORMAT, Profile
from .measure import METHOD, calibrate, default_threads, device_name, resolve_target

Log = Callable[[str], None]


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
    if path.is_file():
        try:
            found = Profile.load(path)
            if all(o.timing_key in found.timed_optimizers() for o in [cfg.optimizer, *optimizers]):
                return found, path
        except ConfigError:
            pass  # a stale or foreign file: measure again and overwrite it
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
