"""One stage process of a distributed run dies (SIGKILL, or an exception): the run ends, quickly
and cleanly, and says which rank failed first.

Bound: torchrun notices a dead worker on its next monitor pass (well under a second) and stops
the others with SIGTERM; a rank blocked in a gloo receive from the dead one fails at once
("connection closed by peer"). ``DEATH_BOUND_S`` is the documented bound for the whole run or
trial to end after the death, with room for a loaded 2-core CI machine. Oracles: the operating
system (every process of the run gone, the exit status), the study read back with Optuna, and
the time the dying rank wrote down just before it died.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import optuna
import pytest
from helpers import REPO
from helpers.broken import misbehaving_model
from helpers.cli import cli_command, cli_env
from helpers.configs import make_config, write_config
from helpers.processes import alive, descendants, kill_all, survivors_after
from helpers.searches import search_with_model
from optuna.trial import TrialState

pytestmark = pytest.mark.slow

DEATH_BOUND_S = 30.0


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [e[len(b"RANK=") :] for e in env if e.startswith(b"RANK=")]
    return int(ranks[0]) if ranks else None


def test_a_killed_rank_ends_train_in_bounded_time_with_one_line(tmp_path: Path) -> None:
    doc = make_config(
        training={"steps": 100_000, "eval_every": 100_000, "checkpoint_every": 5},
        pipeline={"schedule": "paci", "stages": 2, "window": 2},
    )
    ckpt = tmp_path / "ckpt"
    cmd = cli_command(write_config(tmp_path, doc), "--runtime", "distributed", "--checkpoint-dir", ckpt)
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (ckpt / "LATEST").exists():  # the workers are up and training
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "no checkpoint after 120 s"
            time.sleep(0.05)
        tree = descendants(proc.pid)
        victims = [pid for pid in tree if _rank_of(pid) == 1]
        assert len(victims) == 1, f"rank 1 not found among {tree}"
        os.kill(victims[0], signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=DEATH_BOUND_S + 30)
        took = time.monotonic() - killed
        survivors = survivors_after(tree, 10)
    finally:
        kill_all(tree)
    assert took < DEATH_BOUND_S, f"the run took {took:.1f} s to end after rank 1 died"
    assert proc.returncode == 1, err[-2000:]
    assert not survivors, f"{len(survivors)} processes outlived the failed run"
    assert "Traceback" not in err, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: pipeline worker rank 1 (stage 1, replica 0) was killed by signal 9 (SIGKILL)"), last
    log = Path(last.rsplit("(log: ", 1)[1].rstrip(")"))
    assert log.is_file(), "the message points at the workers' log"


DYING_MODEL = misbehaving_model(
    "Two stages; the last one dies by micro-batch size: 1 is SIGKILLed, 2 raises, 4 trains.",
    """
    if torch.is_grad_enabled() and os.environ.get("RANK") == "1":
        self.calls += 1
        with open(HERE / "pids.txt", "a") as f:
            f.write(f"{os.getpid()} {os.getppid()}\\n")
        if self.calls > 3 and h.shape[0] == 1:
            (HERE / "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if self.calls > 3 and h.shape[0] == 2:
            raise RuntimeError("boom: a bug in the last stage")
    """,
)


@pytest.mark.whole_machine  # a wall-clock search of 2 devices: a core each
def test_a_rank_dying_mid_trial_fails_that_trial_and_the_study_goes_on(tmp_path: Path) -> None:
    proc = search_with_model(tmp_path, "dying_model", DYING_MODEL, [1, 2, 4], "distributed", 3.0, 60, 180, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = optuna.load_study(study_name="model.paci", storage=f"sqlite:///{tmp_path / 'work' / 'study.db'}")
    by_size = {t.params["microbatch_size"]: t for t in study.trials}
    killed, raised, healthy = by_size[1], by_size[2], by_size[4]
    assert killed.state == TrialState.FAIL
    assert killed.user_attrs["fail_reason"] == "crash: rank 1 (stage 1, replica 0) was killed by signal 9 (SIGKILL)"
    assert raised.state == TrialState.FAIL
    assert raised.user_attrs["fail_reason"].startswith("crash: rank 1 (stage 1, replica 0) exited with code 1")
    assert "RuntimeError: boom: a bug in the last stage" in raised.user_attrs["fail_reason"]
    assert healthy.state == TrialState.COMPLETE
    assert killed.datetime_complete is not None
    took = killed.datetime_complete.timestamp() - float((tmp_path / "killed_at").read_text())
    assert 0 <= took < DEATH_BOUND_S, f"the trial was failed {took:.1f} s after its rank died"
    pids = {int(p) for line in (tmp_path / "pids.txt").read_text().split("\n") if line for p in line.split()}
    assert pids and not [p for p in pids if alive(p)], "a worker or torchrun of a trial outlived it"
