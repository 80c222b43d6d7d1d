"""Processes killed under a job's payload are started again: the run's job
(``pearl.cluster.child_job.ChildJob``: ``pearl run`` killed by a signal it could not
handle) and an elastic allocation's (``pearl.cluster.agent_payload.AgentPayload``: a node
agent that died), each with real child processes that kill themselves with SIGKILL a set
number of times (the command is the one thing the tests replace)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pearl.cluster.child_job import ChildJob

# each run appends a line to the marker file, then kills itself with the signal named
# (SIGKILL unless a 4th argument says) until it has KILLS lines
SCRIPT = (
    "import os, signal, sys; p = sys.argv[1]; kills = int(sys.argv[2]);"
    "sig = signal.Signals[sys.argv[4] if len(sys.argv) > 4 else 'SIGKILL'];"
    "n = len(open(p).read().splitlines()) if os.path.exists(p) else 0;"
    "open(p, 'a').write('run\\n');"
    "os.kill(os.getpid(), sig) if n < kills else sys.exit(int(sys.argv[3]))"
)


class _Scripted(ChildJob):
    def __init__(
        self, marker: Path, kills: int, code: int = 0, sig: str = "SIGKILL", **kw: float
    ) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.marker, self.kills, self.code, self.sig = marker, kills, code, sig

    def command(self, *argv: str) -> list[str]:
        marker, kills, code = str(self.marker), str(self.kills), str(self.code)
        return [sys.executable, "-c", SCRIPT, marker, kills, code, self.sig]


def _runs(marker: Path) -> int:
    return len(marker.read_text().splitlines())


def test_a_run_killed_by_sigkill_is_started_again_in_its_job(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "runs"
    assert _Scripted(marker, kills=2)("run", "cfg.yaml") == 0
    assert _runs(marker) == 3
    err = capfd.readouterr().err
    assert "pearl run killed by SIGKILL: starting it again" in err and "restart 2 of 3" in err


def test_restarts_are_bounded_and_an_exit_of_its_own_is_not_restarted(tmp_path: Path) -> None:
    always = tmp_path / "always"
    with pytest.raises(RuntimeError, match="exited with status -9"):
        _Scripted(always, kills=99, max_restarts=2)("run")
    assert _runs(always) == 3  # the first run and two restarts
    stopped = tmp_path / "stopped"  # 128 + SIGTERM: a signal it handled (a requeue, scancel)
    with pytest.raises(RuntimeError, match="exited with status 143"):
        _Scripted(stopped, kills=0, code=143)("run")
    assert _runs(stopped) == 1
    cancelled = tmp_path / "cancelled"  # SIGTERM before its handlers: scancel at its start
    with pytest.raises(RuntimeError, match="exited with status -15"):
        _Scripted(cancelled, kills=1, sig="SIGTERM")("run")
    assert _runs(cancelled) == 1


def test_an_agent_that_dies_is_started_again_and_the_allocation_kept(tmp_path: Path) -> None:
    code = f"""
import sys
from dataclasses import dataclass
from pearl.cluster.agent_payload import AgentPayload
SCRIPT = {SCRIPT!r}

@dataclass(frozen=True)
class Scripted(AgentPayload):
    kills: int = 0

    def command(self, node, gpus, job_id=None):
        return [sys.executable, "-c", SCRIPT, self.run_dir + "/runs", str(self.kills), "0"]

print("status", Scripted(run_dir=sys.argv[1], gpu_type="h20", kills=int(sys.argv[2]))())
"""
    for kills, status, runs in ((2, 0, 3), (9, -9, 4)):  # 3 restarts at most
        run_dir = tmp_path / f"kills-{kills}"
        run_dir.mkdir()
        out = subprocess.run(
            [sys.executable, "-c", code, str(run_dir), str(kills)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.stdout.strip() == f"status {status}", out.stderr
        assert _runs(run_dir / "runs") == runs
        assert out.stderr.count("died (status -9): starting another") == runs - 1, out.stderr
