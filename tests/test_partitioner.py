"""The memory-aware partitioner against brute force over every contiguous cut."""

from __future__ import annotations

import functools
import itertools
import math
import random

import pytest

from paci_tune.config.layout import Layout
from paci_tune.errors import ConfigError
from paci_tune.schedule import min_max_partition
from paci_tune.sim import Profile, partition

OVERHEAD = 1000


def random_profile(rng: random.Random, n: int) -> Profile:
    units = []
    for _ in range(n):
        units.append(
            {
                "param_bytes": rng.randrange(0, 5000),
                "optimizer_s": rng.uniform(0, 0.5),
                "copy_s": rng.choice([None, rng.uniform(0, 0.3)]),  # absent in old profiles: no copy time
                "microbatch": {
                    2: {
                        "forward_s": rng.uniform(0.1, 2.0),
                        "backward_s": rng.uniform(0.1, 4.0),
                        "activation_bytes": rng.randrange(0, 3000),
                        "saved_bytes": rng.randrange(0, 8000),
                    }
                },
            }
        )
    return Profile.from_dict({"seq_len": 8, "units": units, "p2p": {"latency_s": 0.0, "bandwidth_Bps": math.inf}})


def compositions(n: int, parts: int) -> list[list[int]]:
    """Every way to cut n units into ``parts`` contiguous non-empty stages."""
    out = []
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        out.append([bounds[i + 1] - bounds[i] for i in range(parts)])
    return out


def hand_copies(s: int, stages: int, schedule: str, window: int, bw: str) -> int:
    """PACI in ``forward`` mode keeps ceil((P - s - 1) / a) copies of the weights at stage s; nothing else does."""
    return -(-(stages - s - 1) // window) if schedule == "paci" and bw == "forward" else 0


def hand_time(prof: Profile, first: int, stop: int, window: int, copies: int = 0) -> float:
    """F + B of one micro-batch plus the optimizer step (and, with copies, one weight clone) spread over the
    window (independent of the code)."""
    us = prof.units[first:stop]
    copy = sum(u.copy_s or 0.0 for u in us) if copies else 0.0
    return sum(u.costs[2].forward_s + u.costs[2].backward_s + u.optimizer_s / window for u in us) + copy / window


def hand_memory(
    prof: Profile, s: int, first: int, stop: int, stages: int, schedule: str, window: int, bw: str = "current"
) -> int:
    """Weights + grads + AdamW (2x) + in-flight x (saved + stage output unless last) + overhead, + the
    forward-mode weight copies (fp32 profile: 4 bytes per parameter each)."""
    us = prof.units[first:stop]
    params = sum(u.param_bytes for u in us)
    per_mb = sum(u.costs[2].saved_bytes for u in us)
    if s < stages - 1:
        per_mb += us[-1].costs[2].activation_bytes
    inflight = {"gpipe": window, "1f1b": min(stages - s, window), "paci": stages - s}[schedule]
    return (4 + hand_copies(s, stages, schedule, window, bw)) * params + inflight * per_mb + OVERHEAD


def brute_force(
    prof: Profile, stages: int, schedule: str, window: int, limit: float | None, bw: str = "current"
) -> float | None:
    best = None
    for sizes in compositions(prof.n_units, stages):
        start, worst, fits = 0, 0.0, True
        for s, size in enumerate(sizes):
            copies = hand_copies(s, stages, schedule, window, bw)
            worst = max(worst, hand_time(prof, start, start + size, window, copies))
            mem = hand_memory(prof, s, start, start + size, stages, schedule, window, bw)
            if limit is not None and mem > limit:
                fits = False
            start += size
        if fits and (best is None or worst < best):
            best = worst
    return best


@pytest.mark.parametrize("seed", range(6))
def test_partition_is_optimal_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    checked_binding = 0
    for _ in range(60):
        n = rng.randint(1, 9)
        stages = rng.randint(1, min(4, n))
        schedule = rng.choice(["paci", "1f1b", "gpipe"])
        window = rng.randint(1, 6)
        bw = rng.choice(["forward", "current"])
        prof = random_profile(rng, n)
        mem = functools.partial(hand_memory, prof, stages=stages, schedule=schedule, window=window, bw=bw)

        # No limit; limits between the leanest cut's peak and the whole model on one stage (feasible, often
        # binding: the fastest cut does not fit); and one below the leanest cut's peak (nothing fits).
        lean = min(max(mem(s, sum(c[:s]), sum(c[: s + 1])) for s in range(stages)) for c in compositions(n, stages))
        top = max(mem(s, 0, n) for s in range(stages))
        for limit in (
            None,
            rng.uniform(lean, top),
            rng.uniform(lean, lean + (top - lean) / 5),
            lean,
            rng.uniform(OVERHEAD, lean - 1),
        ):
            expected = brute_force(prof, stages, schedule, window, limit, bw)
            layout = Layout(schedule, stages, window=window, microbatch_size=2)
            kwargs = {"overhead_bytes": OVERHEAD, "backward_weights": bw}
            if expected is None:
                with pytest.raises(ConfigError) as e:
                    partition(prof, layout, memory_bytes=limit, **kwargs)
                assert e.value.key == "pipeline.stages" and "available on stage" in e.value.allowed
                continue
            got = partition(prof, layout, memory_bytes=limit, **kwargs)
            assert sum(got.sizes) == n and len(got.sizes) == stages and min(got.sizes) >= 1
            assert got.bottleneck_s == pytest.approx(expected, rel=1e-9)
            start = 0
            for s, size in enumerate(got.sizes):  # the reported figures are the hand ones
                copies = hand_copies(s, stages, schedule, window, bw)
                assert got.stage_time_s[s] == pytest.approx(hand_time(prof, start, start + size, window, copies))
                need = mem(s, start, start + size)
                assert got.memory_bytes[s] == need
                assert limit is None or need <= limit
                start += size
            checked_binding += expected > brute_force(prof, stages, schedule, window, None, bw) + 1e-12
    assert checked_binding >= 5


def test_memory_limit_forces_a_slower_cut() -> None:
    # Four equal-time units; unit 0 carries big activations. Unlimited, the best 2-stage cut is [2, 2].
    # Under PACI stage 0 holds 2 micro-batches in flight, so [2, 2] needs 2 x (2 x 1000 + 10) on stage 0;
    # a limit below that forces the first stage to keep only unit 0: [1, 3].
    def u(saved: int) -> dict:
        mb = {"forward_s": 1.0, "backward_s": 1.0, "activation_bytes": 10, "saved_bytes": saved}
        return {"param_bytes": 0, "optimizer_s": 0.0, "microbatch": {1: mb}}

    prof = Profile.from_dict(
        {"seq_len": 4, "units": [u(1000), u(1000), u(1), u(1)], "p2p": {"latency_s": 0, "bandwidth_Bps": 1e9}}
    )
    lay = Layout("paci", 2, window=4, microbatch_size=1)
    assert partition(prof, lay, overhead_bytes=0).sizes == [2, 2]
    assert partition(prof, lay, memory_bytes=4020, overhead_bytes=0).sizes == [2, 2]
    tight = partition(prof, lay, memory_bytes=4019, overhead_bytes=0)
    assert tight.sizes == [1, 3] and tight.bottleneck_s == 6.0
    with pytest.raises(ConfigError) as e:
        partition(prof, lay, memory_bytes=1000, overhead_bytes=0)
    assert "stage 0" in e.value.allowed


def test_min_max_partition_generic_and_bad_depth() -> None:
    costs = [3.0, 1.0, 1.0, 1.0, 3.0]
    pre = [0.0, *itertools.accumulate(costs)]
    sizes = min_max_partition(5, 3, lambda s, j, i: pre[i] - pre[j])
    assert sizes == [1, 3, 1]
    assert min_max_partition(3, 3, lambda s, j, i: 1.0, lambda s, j, i: False) is None
    with pytest.raises(ValueError):
        min_max_partition(2, 3, lambda s, j, i: 1.0)
    prof = random_profile(random.Random(0), 3)
    with pytest.raises(ConfigError) as e:
        partition(prof, Layout("paci", 4, window=2, microbatch_size=2))
    assert e.value.key == "pipeline.stages"
