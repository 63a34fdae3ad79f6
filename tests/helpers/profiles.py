"""Cost profiles written by hand, so that simulated figures are exact and no test depends on how busy
the machine is: units of a profile document, a Profile from them, and a whole reference profile
document for the searches that read one instead of measuring.
"""

from __future__ import annotations

import math
from typing import Any

from paci_tune.sim import Profile

FREE = {"latency_s": 0.0, "bandwidth_Bps": math.inf}


def unit(f: float, b: float, *, act: int = 1000, saved: int = 5000, params: int = 4000, opt: float = 0.0, mb: int = 1):
    """One unit of a profile document: forward/backward seconds and bytes at micro-batch size ``mb``."""
    return {
        "param_bytes": params,
        "optimizer_s": opt,
        "microbatch": {mb: {"forward_s": f, "backward_s": b, "activation_bytes": act, "saved_bytes": saved}},
    }


def make_profile(units: list[dict[str, Any]], p2p: dict[str, float] | None = None, seq_len: int = 16) -> Profile:
    """A Profile of these units on a p2p link (free by default)."""
    return Profile.from_dict({"seq_len": seq_len, "units": units, "p2p": p2p or FREE})


def equal_profile(n: int, f: float = 1.0, b: float = 2.0) -> Profile:
    """``n`` equal units, forward ``f`` and backward ``b`` seconds."""
    return make_profile([unit(f, b) for _ in range(n)])


def reference_profile(n_units: int, seq_len: int) -> dict[str, Any]:
    """A hand-written profile document of ``n_units`` equal units at micro-batch size 8: a search on the
    rst clock reads it instead of measuring (the install and docs checks)."""
    cost = {"forward_s": 0.002, "backward_s": 0.004, "activation_bytes": 65536, "saved_bytes": 262144}
    each = {"param_bytes": 1 << 20, "optimizer_s": 0.001, "microbatch": {8: cost}}
    return {
        "seq_len": seq_len,
        "units": [dict(each, name=f"u{i}") for i in range(n_units)],
        "p2p": {"latency_s": 1.0e-5, "bandwidth_Bps": 1.0e10},
    }
