"""Validate paci-tune on one NVIDIA GPU (issue 6), in one call that fits a short device lease.

What it measures, in order (each step is independent: a failure is recorded and the next runs):

1. **env** -- the GPU, torch and CUDA versions, and an 8192^3 bf16 matmul as the achievable peak.
2. **calibrate** -- a cost profile of GPT-2 Medium (vocabulary 50304, sequence 1024) in bf16 at
   micro-batch sizes 4, 8, 16, 32; written twice: as measured, and with its ``p2p`` replaced by
   an NVLink-class link (one GPU cannot measure a GPU-to-GPU link; the measured ``p2p`` is gloo
   over host loopback). The second is the one to commit under ``examples/profiles/``.
3. **mfu** -- single-device training (P=1) of gpt2-small and gpt2-medium in bf16: steady
   tokens/s on the wall clock and model-FLOPs utilisation (PaLM's 6N + 12LTd FLOPs per token).
4. **emulated** -- gpt2-small on the emulated runtime, P=4, a=8, paci and 1f1b, a few hundred
   steps, with the ``rst`` clock on a profile of the same model (transfers free, as the emulated
   runtime has none): tokens/s, MFU, peak CUDA memory, bubble, and the profile's predicted step
   time against the measured one (goal: within 10%); and the simulator's predicted peak memory
   of the same pipeline (all its stages share the one GPU here, so their sum is the bound).
5. **paper** -- the paper's setting simulated on the GPT-2 Medium profile: P=8, global batch 128
   and 256, a in {4, 8, 16}; throughput, bubble, peak memory per stage, and each PACI
   configuration's throughput over the fastest flush configuration of its batch.

Every figure goes to ``OUT/gpu_check.json`` (rewritten after each step) and a readable report
to stdout. ``--smoke`` runs the same steps on the CPU with a tiny model in about a minute, so
this script is tested where no GPU is (tests/test_gpu_check_script.py).

    bash bench/gpu_check.sh            # on the GPU machine: GPU tests, then this script
    python bench/gpu_check.py --smoke --out runs/gpu-check-smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]

# Dense bf16 tensor-core peak of the SXM parts, from NVIDIA's data sheets (MFU's usual yardstick).
SPEC_BF16_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}
# One GPU cannot measure a GPU-to-GPU link; the paper-setting simulation assumes one NVLink-class
# hop: NVLink 4 gives 450 GB/s per direction, NCCL point-to-point reaches about 2/3 of it.
NVLINK_P2P = {"latency_s": 2.0e-5, "bandwidth_Bps": 3.0e11, "backend": "assumed nvlink4 (not measured)"}
FREE_P2P = {"latency_s": 0.0, "bandwidth_Bps": math.inf, "backend": "free (emulated runtime: no transfers)"}

PAPER_SCHEDULES = ("--schedule", "paci", "--schedule", "1f1b", "--schedule", "gpipe")
"""The schedules the paper compares (PACI, 1F1B-flush, GPipe), as simulate options."""


@dataclass(frozen=True)
class Scale:
    """Everything that differs between the GPU run and the CPU smoke run."""

    device: str
    precision: str
    small: dict[str, Any]  # model sections
    medium: dict[str, Any]
    medium_sizes: str
    mfu_steps: int
    pipe_steps: int
    pipe_global_batch: int
    pipe_window: int
    pipe_stages: int
    paper_stages: int
    paper_batches: tuple[int, ...]
    paper_windows: tuple[int, ...]
    repeats: int


GPU = Scale(
    device="cuda",
    precision="bf16",
    small={"preset": "gpt2-small", "vocab_size": 50304},
    medium={"preset": "gpt2-medium", "vocab_size": 50304},
    medium_sizes="4,8,16,32",
    mfu_steps=40,
    pipe_steps=200,
    pipe_global_batch=32,
    pipe_window=8,
    pipe_stages=4,
    paper_stages=8,
    paper_batches=(128, 256),
    paper_windows=(4, 8, 16),
    repeats=3,
)
SMOKE = Scale(
    device="cpu",
    precision="fp32",
    small={"preset": "tiny", "n_layer": 2, "d_model": 64, "n_head": 2, "block_size": 64},
    medium={"preset": "tiny", "n_layer": 4, "d_model": 64, "n_head": 2, "block_size": 64},
    medium_sizes="2,4",
    mfu_steps=6,
    pipe_steps=6,
    pipe_global_batch=8,
    pipe_window=4,
    pipe_stages=2,
    paper_stages=4,
    paper_batches=(8, 16),
    paper_windows=(2, 4),
    repeats=1,
)


def run_config(model: dict[str, Any], scale: Scale, global_batch: int, window: int, stages: int) -> dict[str, Any]:
    return {
        "model": dict(model),
        "data": {"source": "stdlib"},
        "training": {"global_batch": global_batch, "steps": 10, "seed": 0, "eval_every": 10**6, "eval_sequences": 16},
        "optimizer": {"name": "adamw", "lr": 6.0e-4, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "lr_schedule": {"warmup_fraction": 0.02, "min_ratio": 0.1},
        "pipeline": {
            "schedule": "paci",
            "stages": stages,
            "window": window,
            "runtime": "emulated",
            "device": scale.device,
            "precision": scale.precision,
        },
    }


class Check:
    """Runs the steps, keeps every figure, and writes them to OUT/gpu_check.json as it goes."""

    def __init__(self, out: Path, work: Path, scale: Scale) -> None:
        self.out, self.work, self.scale = out, work, scale
        self.results: dict[str, Any] = {"smoke": scale is SMOKE, "steps": {}}
        self.medium_profile: Path | None = None  # written by the calibrate step, read by the paper step
        self.failed: list[str] = []

    # ---------------------------------------------------------------------------- plumbing
    def save(self) -> None:
        path = self.out / "gpu_check.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.results, indent=2, default=str))
        os.replace(tmp, path)

    def step(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        print(f"\n== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            figures = fn()
            self.results["steps"][name] = {"ok": True, "seconds": round(time.perf_counter() - t0, 1), **figures}
        except Exception as exc:  # one broken step must not hide the others' figures
            traceback.print_exc()
            self.failed.append(name)
            seconds = round(time.perf_counter() - t0, 1)
            self.results["steps"][name] = {"ok": False, "seconds": seconds, "error": repr(exc)}
        print(f"-- {name}: {'ok' if name not in self.failed else 'FAILED'} in {time.perf_counter() - t0:.0f} s")
        self.save()

    def cli(self, *args: str | Path, json_out: bool = False) -> Any:
        cmd = [sys.executable, "-m", "paci_tune.cli", *map(str, args)]
        print("$ paci-tune " + " ".join(map(str, args)), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=self.work)
        if proc.returncode:
            raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-4000:]}")
        return json.loads(proc.stdout) if json_out else None

    def write(self, name: str, doc: dict[str, Any]) -> Path:
        path = self.work / name
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def train(self, config: Path, name: str, *args: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        metrics = self.work / f"{name}.jsonl"
        self.cli("train", config, "--no-live", "--metrics", metrics, *args)
        records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        return next(r for r in records if r["event"] == "summary"), records

    @property
    def peak_flops(self) -> float | None:
        env = self.results["steps"].get("env", {})
        return env.get("spec_bf16_flops") or env.get("matmul_flops")

    def mfu(self, tokens_per_s: float, flops_per_token: float | None, devices: int = 1) -> float | None:
        peak = self.peak_flops
        if not peak or not flops_per_token:
            return None
        return tokens_per_s * flops_per_token / (devices * peak)

    # ---------------------------------------------------------------------------- the steps
    def env(self) -> dict[str, Any]:
        import torch

        doc: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
        if self.scale.device != "cuda":
            doc["device"] = "cpu"
            return doc
        props = torch.cuda.get_device_properties(0)
        doc.update(
            device=props.name,
            memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            gpus=torch.cuda.device_count(),
        )
        doc["spec_bf16_flops"] = next((v for k, v in SPEC_BF16_FLOPS.items() if k in props.name), None)
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        doc["matmul_flops"] = 10 * 2 * n**3 / (time.perf_counter() - t0)
        del a, b
        torch.cuda.empty_cache()
        print(f"{props.name}: matmul {doc['matmul_flops'] / 1e12:.0f} TFLOP/s bf16 (spec {doc['spec_bf16_flops']})")
        return doc

    def calibrate(self) -> dict[str, Any]:
        s = self.scale
        cfg = self.write("medium.yaml", run_config(s.medium, s, 128, 8, s.paper_stages))
        measured = self.work / "medium-profile-measured.yaml"
        self.cli(
            "calibrate",
            cfg,
            "--out",
            measured,
            "--microbatch-sizes",
            s.medium_sizes,
            "--device",
            s.device,
            "--precision",
            s.precision,
            "--stages",
            s.paper_stages,
            "--repeats",
            s.repeats,
            "--optimizers",
            "nadam,muon",
        )
        doc = yaml.safe_load(measured.read_text())
        measured_p2p = dict(doc["p2p"])
        doc["p2p"] = NVLINK_P2P
        name = "gpt2-medium-h200-bf16.yaml" if s.device == "cuda" else "smoke-medium-profile.yaml"
        (self.out / name).write_text(yaml.safe_dump(doc, sort_keys=False))
        self.medium_profile = self.out / name
        units = doc["units"]
        per_size = {}
        for b in sorted(units[0]["microbatch"]):
            fwd = sum(u["microbatch"][b]["forward_s"] for u in units)
            bwd = sum(u["microbatch"][b]["backward_s"] for u in units)
            per_size[int(b)] = {"forward_s": fwd, "backward_s": bwd, "tokens_per_s": b * doc["seq_len"] / (fwd + bwd)}
            print(f"  b={b:3d}: forward {fwd * 1e3:7.2f} ms  backward {bwd * 1e3:7.2f} ms per micro-batch")
        opt = sum(u["optimizer_s"] for u in units)
        # Each optimizer's step over the whole model (issue 37): Muon's Newton-Schulz on bf16 tensor cores.
        others: dict[str, float] = {}
        for u in units:
            for key, sec in (u.get("optimizer_steps") or {}).items():
                others[key] = others.get(key, 0.0) + sec
        print(
            f"  optimizer step: {doc.get('optimizer', 'adamw')} {opt * 1e3:.2f} ms; "
            + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in others.items())
        )
        return {
            "profile": name,
            "measured_p2p": measured_p2p,
            "per_microbatch": per_size,
            "optimizer_s": opt,
            "optimizer_steps_s": others,
        }

    def single_device(self) -> dict[str, Any]:
        s = self.scale
        out: dict[str, Any] = {}
        # (role, model, global batch, window): micro-batch 16 for small, 8 for medium (fits, fills the GPU)
        for role, model, gb, a in (("gpt2-small", s.small, 32, 2), ("gpt2-medium", s.medium, 32, 4)):
            cfg = self.write(f"mfu-{role}.yaml", run_config(model, s, gb, a, 1))
            summary, records = self.train(cfg, f"mfu-{role}", "--steps", s.mfu_steps)
            train = [r for r in records if r["event"] == "train"]
            k0 = len(train) // 4  # steady state: the first quarter holds allocator growth and kernel selection
            first, last = train[k0], train[-1]
            steady = (last["tokens"] - first["tokens"]) / (last["clock"] - first["clock"])
            fpt = summary["model_flops_per_token"]
            out[role] = {
                "microbatch_size": summary["microbatch_size"],
                "steady_tokens_per_s": steady,
                "wall_tokens_per_s": summary["wall_tokens_per_s"],
                "mfu": self.mfu(steady, fpt),
                "peak_memory_gib": summary["peak_memory_bytes"] / 2**30,
                "final_train_loss": summary["train_loss"],
            }
            mfu = out[role]["mfu"]
            print(f"  {role}: {steady:,.0f} tokens/s steady, MFU {'-' if mfu is None else f'{mfu:.1%}'}")
        return out

    def emulated(self) -> dict[str, Any]:
        s = self.scale
        p, a, gb = s.pipe_stages, s.pipe_window, s.pipe_global_batch
        cfg = self.write("small.yaml", run_config(s.small, s, gb, a, p))
        prof = self.work / "small-profile.yaml"
        self.cli(
            "calibrate",
            cfg,
            "--out",
            prof,
            "--microbatch-sizes",
            gb // a,
            "--device",
            s.device,
            "--precision",
            s.precision,
            "--stages",
            p,
            "--repeats",
            max(s.repeats, 3),
        )
        doc = yaml.safe_load(prof.read_text())
        doc["p2p"] = FREE_P2P
        free = self.out / ("gpt2-small-h200-bf16.yaml" if s.device == "cuda" else "smoke-small-profile.yaml")
        free.write_text(yaml.safe_dump(doc, sort_keys=False))
        out: dict[str, Any] = {"stages": p, "window": a, "global_batch": gb}
        sim = self.cli("simulate", cfg, "--profile", free, *PAPER_SCHEDULES, "--json", json_out=True)
        for sched in ("paci", "1f1b"):
            summary, _ = self.train(
                cfg, f"pipe-{sched}", "--schedule", sched, "--steps", s.pipe_steps, "--clock", "rst", "--profile", free
            )
            predicted = sim["schedules"][sched]
            fpt = summary["model_flops_per_token"]
            measured_step = summary["pipeline_seconds"] / summary["steps"]
            replayed_step = summary["clock"] / summary["steps"]
            out[sched] = {
                "steps": summary["steps"],
                "pipeline_tokens_per_s": summary["tokens_per_s"],
                "wall_tokens_per_s": summary["wall_tokens_per_s"],
                "mfu_per_device": self.mfu(summary["tokens_per_s"], fpt, p),
                "mfu_one_gpu_wall": self.mfu(summary["wall_tokens_per_s"], fpt),
                "bubble_fraction": summary["bubble_fraction"],
                "analytic_bubble_fraction": summary["analytic_bubble_fraction"],
                "peak_memory_gib": summary["peak_memory_bytes"] / 2**30,
                "predicted_peak_memory_gib_sum_of_stages": sum(st["peak_memory_bytes"] for st in predicted["stages"])
                / 2**30,
                "predicted_allocated_gib_per_stage": self.allocated(cfg, free, sched, summary),
                "measured_step_s": measured_step,
                "predicted_step_s": replayed_step,
                "predicted_over_measured": replayed_step / measured_step,
                "simulated_steady_step_s": predicted["steady_step_time_s"],
                "final_train_loss": summary["train_loss"],
            }
            o = out[sched]
            print(
                f"  {sched}: {o['pipeline_tokens_per_s']:,.0f} tokens/s over P={p} devices "
                f"({o['wall_tokens_per_s']:,.0f} on this one device), bubble {o['bubble_fraction']:.3f}, "
                f"peak {o['peak_memory_gib']:.2f} GiB (predicted {o['predicted_peak_memory_gib_sum_of_stages']:.2f}; "
                f"allocated per stage {'/'.join(f'{x:.2f}' for x in o['predicted_allocated_gib_per_stage'])}), "
                f"step measured "
                f"{measured_step * 1e3:.1f} ms vs profile {replayed_step * 1e3:.1f} ms "
                f"({o['predicted_over_measured']:.3f})"
            )
        return out

    def allocated(self, cfg: Path, profile: Path, schedule: str, summary: dict[str, Any]) -> list[float]:
        """The validated memory model's allocated peak per stage (GiB) of the run just trained: one process
        holds them all on the emulated runtime, so its measured peak lies between the largest and the sum."""
        from paci_tune.config import load_config
        from paci_tune.pipeline.planning import predicted_stage_memory
        from paci_tune.sim.profile import Profile

        run = load_config(cfg, {"pipeline.schedule": schedule, "training.steps": self.scale.pipe_steps})
        stages = predicted_stage_memory(run, Profile.load(profile), summary["partition"])
        return [st.allocated / 2**30 for st in stages]

    def paper(self) -> dict[str, Any]:
        s = self.scale
        p = s.paper_stages
        rows: list[dict[str, Any]] = []
        for gb in s.paper_batches:
            cfg = self.write(f"paper-b{gb}.yaml", run_config(s.medium, s, gb, s.paper_windows[0], p))
            for a in s.paper_windows:
                sim = self.cli(
                    "simulate",
                    cfg,
                    "--profile",
                    self.medium_profile,
                    "--stages",
                    p,
                    "--window",
                    a,
                    *PAPER_SCHEDULES,
                    "--batches",
                    4 * p,
                    "--json",
                    json_out=True,
                )
                for sched, r in sim["schedules"].items():
                    rows.append(
                        {
                            "global_batch": gb,
                            "window": a,
                            "microbatch_size": gb // a,
                            "schedule": sched,
                            "tokens_per_s": r["steady_tokens_per_s"],
                            "bubble_fraction": r["steady_bubble_fraction"],
                            "analytic_flush_bubble": (p - 1) / (a + p - 1),
                            "peak_memory_gib_per_stage": [st["peak_memory_bytes"] / 2**30 for st in r["stages"]],
                        }
                    )
        for gb in s.paper_batches:
            flush = [r for r in rows if r["global_batch"] == gb and r["schedule"] != "paci"]
            best = max(flush, key=lambda r: r["tokens_per_s"])
            for r in rows:
                if r["global_batch"] == gb:
                    r["over_fastest_flush"] = r["tokens_per_s"] / best["tokens_per_s"]
        print(
            f"  {'B':>4} {'a':>3} {'b':>3} {'schedule':>8} {'tokens/s':>10} {'bubble':>7} {'flush (P-1)/(m+P-1)':>20}"
            f" {'/best flush':>11}  peak GiB per stage"
        )
        for r in rows:
            mem = "/".join(f"{m:.1f}" for m in r["peak_memory_gib_per_stage"])
            print(
                f"  {r['global_batch']:4d} {r['window']:3d} {r['microbatch_size']:3d} {r['schedule']:>8} "
                f"{r['tokens_per_s']:10,.0f} {r['bubble_fraction']:7.3f} {r['analytic_flush_bubble']:20.3f} "
                f"{r['over_fastest_flush']:11.3f}  {mem}"
            )
        return {"stages": p, "p2p": NVLINK_P2P, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/gpu-check"), help="Folder for the figures and profiles.")
    ap.add_argument("--smoke", action="store_true", help="Tiny CPU version of every step (tests the script).")
    ap.add_argument("--only", nargs="+", default=None, help="Run these steps only: env calibrate mfu emulated paper.")
    args = ap.parse_args()
    scale = SMOKE if args.smoke else GPU
    if scale is GPU:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device visible: run with --smoke to check the script on the CPU", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        check = Check(out, Path(tmp), scale)
        steps = {
            "env": check.env,
            "calibrate": check.calibrate,
            "mfu": check.single_device,
            "emulated": check.emulated,
            "paper": check.paper,
        }
        wanted = args.only or list(steps)
        if "paper" in wanted and "calibrate" not in wanted:
            wanted.insert(0, "calibrate")  # the paper's simulation reads the profile calibrate writes
        for name in steps:
            if name in wanted:
                check.step(name, steps[name])
    print(f"\nfigures: {out / 'gpu_check.json'}; failed steps: {', '.join(check.failed) or 'none'}")
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
