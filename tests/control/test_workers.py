"""The agent's worker management against real processes over real HTTP: the documented
fake engine (``pearl.control.fakes``) started by :class:`ProcessWorkers`."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pearl.control import pdeath
from pearl.control.messages import Command
from pearl.control.workers import ProcessWorkers, WorkerError

FAKE = [sys.executable, "-m", "pearl.control.fakes", "--port", "{port}"]


def _cmd(action: str, worker: str = "w0", role: str | None = None, **kw: object) -> Command:
    return Command(
        cmd_id=f"{action}-{worker}",
        step_id=0,
        action=action,
        worker_id=worker,
        role=role,
        deadline_s=kw.pop("deadline_s", 10.0),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def _metric(workers: ProcessWorkers, worker: str, name: str) -> str:
    text = workers._http(worker, "/metrics", "GET", 2.0)
    m = re.search(rf"^{name}(?:\{{[^}}]*\}})?\s+(\S+)$", text, re.M)
    assert m is not None, text
    return m.group(1)


@pytest.fixture
def workers() -> Iterator[ProcessWorkers]:
    w = ProcessWorkers({"*": FAKE}, {"n0/0": 0, "n0/1": 1, "n0/2": 2})
    yield w
    w.stop_all(5.0)


def test_an_engine_runs_on_its_gpus_and_obeys_every_action(workers: ProcessWorkers) -> None:
    workers.execute(_cmd("start", role="decode", gpu_ids=("n0/2", "n0/1")))
    assert workers.worker_ids() == ("w0",)
    info = workers._http("w0", "/metrics", "GET", 2.0)
    assert 'cuda_visible_devices="2,1"' in info  # the local indices of its GPUs, in order
    workers.execute(_cmd("sleep", role="idle"))
    assert _metric(workers, "w0", "pearl_fake_sleeping") == "1"
    workers.execute(_cmd("wake", role="prefill"))
    assert _metric(workers, "w0", "pearl_fake_sleeping") == "0"
    workers.execute(_cmd("sync_weights"))
    workers.execute(_cmd("sync_weights"))
    assert _metric(workers, "w0", "pearl_fake_weight_reloads") == "2"
    workers.execute(_cmd("drain"))
    assert workers.procs["w0"].state.phase == "draining"
    workers.execute(_cmd("switch", role="decode"))
    assert workers.procs["w0"].state.role == "decode"
    proc = workers.procs["w0"].proc
    workers.execute(_cmd("stop"))
    assert proc.poll() is not None and workers.worker_ids() == ()


def test_a_trainer_offloads_and_onloads(workers: ProcessWorkers) -> None:
    workers.execute(_cmd("start", "t0", role="train", gpu_ids=("n0/0",)))
    workers.execute(_cmd("offload", "t0", role="idle"))
    assert _metric(workers, "t0", "pearl_fake_sleeping") == "1"
    workers.execute(_cmd("onload", "t0", role="train"))
    assert _metric(workers, "t0", "pearl_fake_sleeping") == "0"
    assert workers.procs["t0"].state.role == "train"


def test_failures_are_worker_errors(workers: ProcessWorkers) -> None:
    with pytest.raises(WorkerError, match="not on this node"):
        workers.execute(_cmd("start", role="decode", gpu_ids=("n9/0",)))
    with pytest.raises(WorkerError, match="no worker w1"):
        workers.execute(_cmd("sleep", "w1", role="idle"))
    slow = ProcessWorkers({"*": [*FAKE, "--start-delay-s", "5"]}, {"n0/0": 0})
    try:
        with pytest.raises(WorkerError, match="not healthy within"):
            slow.execute(_cmd("start", role="decode", gpu_ids=("n0/0",), deadline_s=0.5))
        assert slow.worker_ids() == ()  # the half-started process was stopped
    finally:
        slow.stop_all(2.0)
    dead = ProcessWorkers({"*": [sys.executable, "-c", "raise SystemExit(4)"]}, {"n0/0": 0})
    with pytest.raises(WorkerError, match="exited with 4 on start"):
        dead.execute(_cmd("start", role="decode", gpu_ids=("n0/0",)))


def test_an_engine_whose_agent_is_gone_before_it_starts_does_not_start(tmp_path: Path) -> None:
    """The wrapper checks that its parent is still the one that started it once the
    parent-death signal is armed: if the agent died first, the engine never runs."""
    marker = tmp_path / "ran"
    touch = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    wrong_parent = subprocess.run(
        [sys.executable, "-m", "pearl.control.pdeath", "1", *touch], timeout=30
    )
    assert wrong_parent.returncode == 1 and not marker.exists()
    right = subprocess.run(pdeath.command(touch), timeout=30)
    assert right.returncode == 0 and marker.exists()
