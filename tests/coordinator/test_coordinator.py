"""``pearl coordinator`` as a real process on the local backend: an elastic request is
submitted, granted and folded into the journalled state; a coordinator killed and
restarted resumes from its journal; a bad configuration is one clear line, exit 2."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from pearl.cli.main import main
from pearl.coordinator.journal import replay
from pearl.core.state import AllocationStatus
from pearl.runlog.jsonl import ReadStats, read_records


def _config(tmp_path: Path, **changes: object) -> Path:
    doc: dict[str, object] = {
        "schema_version": 1,
        "run_id": "t1",
        "run_dir": "run",
        "profile": "qwen3-8b",
        "backend": "local",
        "gpus_per_node": {"h800": 8},
        "decision_interval_s": 0.2,
        "base": {
            "trainer": [{"name": "n0", "gpu_type": "h800", "num_gpus": 8}],
            "rollout": [{"name": "n1", "gpu_type": "h20", "num_gpus": 8}],
        },
        "policy": {
            "elastic": {"rule": "greedy", "gpu_type": "h800", "max_allocations": 1},
            "borrowing": {"rule": "never"},
        },
    }
    doc.update(changes)
    path = tmp_path / "coordinator.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    trajs = [
        {"traj_id": f"q{i}", "phase": "queued", "context_tokens": 2000, "remaining_turns": 4}
        for i in range(64)
    ]
    (run / "workload.json").write_text(json.dumps({"trajectories": trajs}), encoding="utf-8")
    return path


def _coordinator(config: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "pearl.cli.main", "coordinator", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(predicate, timeout_s: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def _granted(journal: Path) -> list[str]:
    state = replay(journal).state
    if state is None:
        return []
    return [
        a.allocation_id
        for a in state.allocations
        if a.kind.value == "elastic" and a.status is AllocationStatus.GRANTED
    ]


def test_a_grant_reaches_the_state_and_a_restart_resumes_it(tmp_path: Path) -> None:
    config = _config(tmp_path)
    journal = tmp_path / "run" / "journal.jsonl"
    proc = _coordinator(config)
    try:
        assert _wait_for(lambda: journal.exists() and _granted(journal) == ["el0001"]), (
            proc.stderr.read() if proc.poll() is not None and proc.stderr else "no grant"
        )
        state = replay(journal).state
        assert state is not None
        elastic = [g for g in state.gpus if g.allocation_id == "el0001"]
        assert len(elastic) == 8 and {g.gpu_type for g in elastic} == {"h800"}
        proc.send_signal(signal.SIGKILL)  # no goodbye: the journal is all there is
        proc.wait()
        records = replay(journal).num_records
        again = _coordinator(config)
        try:
            # It resumes from the journal. A local job cannot be found again by a new
            # coordinator (Slurm jobs can: tests/coordinator/test_on_slurm.py), so the
            # allocation ends as lost and, the cap free again, a new one is requested.
            assert _wait_for(lambda: replay(journal).num_records > records + 2)
            assert _wait_for(lambda: _granted(journal) == ["el0002"])
            ended = replay(journal).state
            assert ended is not None
            (first,) = [a for a in ended.allocations if a.allocation_id == "el0001"]
            assert first.status is AllocationStatus.ENDED
        finally:
            again.send_signal(signal.SIGTERM)
            again.wait(timeout=30)
        # the run log: one run, both incarnations, in the simulator's schema
        stats = ReadStats()
        log = list(read_records(tmp_path / "run" / "events.jsonl", stats))
        assert stats.records == stats.lines and log
        started = [r for r in log if r.type == "run_started"]
        assert len(started) == 1 and started[0].source == "coordinator"
        allocs = [(r.allocation_id, r.status, r.reason) for r in log if r.type == "allocation"]
        assert ("el0001", "granted", "") in allocs and ("el0001", "ended", "lost") in allocs
        assert ("el0002", "granted", "") in allocs
        added = {r.gpu_id for r in log if r.type == "gpu_added" and r.allocation_id == "el0001"}
        removed = {r.gpu_id: r.reason for r in log if r.type == "gpu_removed"}
        assert len(added) == 8 and all(removed[g] == "lost" for g in added)
        assert not [r for r in log if r.type == "run_ended"]  # a signal: the run goes on
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_local_jobs(tmp_path / "run" / "jobs")


def _kill_local_jobs(folder: Path) -> None:
    """The local backend's job processes outlive a killed coordinator (as Slurm jobs do)."""
    out = subprocess.run(["pgrep", "-f", str(folder)], capture_output=True, text=True)
    for pid in out.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def test_a_bad_elastic_gpu_type_is_one_clear_line(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    config = _config(tmp_path, policy={"elastic": {"rule": "greedy", "gpu_type": "b200"}})
    assert main(["coordinator", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "coordinator.yaml: policy.elastic.gpu_type: 'b200' is not in gpus_per_node" in err[0]


def test_allocation_ids_are_never_reused_across_restarts(tmp_path: Path) -> None:
    """A coordinator stopped right after submitting (the allocation is in the journal's
    intents but not yet in its state) must not hand the same id to a new job."""
    from pearl.cluster.local_backend import LocalBackend
    from pearl.coordinator.config import load_config
    from pearl.coordinator.loop import Coordinator, workload_file
    from pearl.io.documents import load_profile

    config, run_dir = load_config(_config(tmp_path))
    profile = load_profile(config.profile)

    def coordinator(clock_s: float) -> Coordinator:
        return Coordinator.open(
            config,
            profile,
            run_dir,
            LocalBackend(run_dir / "jobs"),
            clock=lambda: clock_s,
            workload=workload_file(run_dir / "workload.json"),
        )

    first = coordinator(1.0)
    first.tick()  # submits el0001; it reaches the state only at the next observation
    first.close()
    second = coordinator(2.0)
    assert [i["id"] for i in second.unfinished] == ["el0001"]
    second.tick()  # el0001 cannot be found again (local): it ends as lost, el0002 follows
    second.close()
    text = (run_dir / "journal.jsonl").read_text()
    assert text.count('"id":"el0001","action":"submit"') == 1
    assert '"id":"el0002","action":"submit"' in text
    _kill_local_jobs(run_dir / "jobs")


def test_a_decision_is_carried_out_requests_plan_releases(tmp_path: Path) -> None:
    """The coordinator as the core executor's world (pearl.core.execution): a decision
    with requests, a plan and releases is journalled in that order, the releases after the
    plan's end (here without agents: the plan is not executed, and says so)."""
    from pearl.core.config import SwitchingConfig
    from pearl.core.decide import decide
    from pearl.core.decision import ElasticAction, ElasticRequest
    from pearl.core.observation import Observation

    coordinator = _open(tmp_path, clock=lambda: 1.0)
    config, run_dir = coordinator.config, tmp_path / "run"
    try:
        coordinator.tick()  # asks for el0001
        cfg = config.policy.model_copy(update={"switching": SwitchingConfig(rule="always")})
        obs = Observation(workload=coordinator.workload())
        d = decide(coordinator.state, obs, cfg, coordinator.profile, 2.0)
        assert not d.plan.empty  # it starts engines
        request = ElasticRequest(
            num_gpus=8, gpu_type="h800", partition="elastic", time_limit_min=60
        )
        crafted = replace(d, elastic=ElasticAction(requests=(request,), releases=("el0001",)))
        before = replay(run_dir / "journal.jsonl").num_records
        coordinator.executor.carry_out(crafted, 2.0)
    finally:
        coordinator.close()
    records = [json.loads(line) for line in (run_dir / "journal.jsonl").read_text().splitlines()]
    acts = [
        (r["kind"], r["data"]["id"].split("-")[0], r["data"].get("action"))
        for r in records[before:]
        if r["kind"] in ("intent", "done")
    ]
    assert acts == [
        ("intent", "el0002", "submit"),  # the tick's own request was el0001
        ("done", "el0002", None),
        ("intent", "plan", "plan"),
        ("done", "plan", None),
        ("intent", "release", "release"),
        ("done", "release", None),
    ]
    plan_done = next(
        r for r in records[before:] if r["kind"] == "done" and "plan" in r["data"]["id"]
    )
    assert plan_done["data"] == {**plan_done["data"], "ok": False, "error": "no control plane"}
    _kill_local_jobs(run_dir / "jobs")


def _open(tmp_path: Path, clock: Callable[[], float], control: Any = None) -> Any:
    """A coordinator incarnation in-process on the local backend, on ``_config``'s run."""
    from pearl.cluster.local_backend import LocalBackend
    from pearl.coordinator.config import load_config
    from pearl.coordinator.loop import Coordinator, workload_file
    from pearl.io.documents import load_profile

    config, run_dir = load_config(_config(tmp_path))
    return Coordinator.open(
        config,
        load_profile(config.profile),
        run_dir,
        LocalBackend(run_dir / "jobs"),
        clock=clock,
        workload=workload_file(run_dir / "workload.json"),
        control=control,
    )


def _plan_decision(coordinator: Any, now_s: float) -> Any:
    """A decision with a plan on the coordinator's state (switching forced: it starts
    engines), as ``decide`` makes it."""
    from pearl.core.config import SwitchingConfig
    from pearl.core.decide import decide
    from pearl.core.observation import Observation

    cfg = coordinator.config.policy.model_copy(update={"switching": SwitchingConfig(rule="always")})
    obs = Observation(workload=coordinator.workload())
    d = decide(coordinator.state, obs, cfg, coordinator.profile, now_s)
    assert len(d.plan.steps) >= 2
    return d


@pytest.mark.parametrize("num_ok", [None, 1], ids=["all-acknowledged", "part-failed"])
def test_the_state_after_a_plan_is_journalled_at_its_measured_end(
    tmp_path: Path, num_ok: int | None
) -> None:
    """With a control plane (the documented fake of control_fakes.py), the state after a
    plan holds the steps that stand and is stamped with the measured end, not with the
    planner's estimate; a failed plan keeps its acknowledged part and says why."""
    from control_fakes import AckingControl

    times = itertools.count(0.0, 0.5)  # every reading of the clock half a second on
    coordinator = _open(tmp_path, clock=lambda: next(times), control=AckingControl(num_ok))
    run_dir = tmp_path / "run"
    try:
        d = _plan_decision(coordinator, 2.0)
        assert d.plan.makespan_s > 10.0  # the estimate is far from the measured end
        coordinator.executor.carry_out(d, 2.0)
        state = coordinator.state
    finally:
        coordinator.close()
    journal = replay(run_dir / "journal.jsonl")
    assert journal.state == state and state.time_s < d.plan.makespan_s
    started = {w.worker_id for w in state.workers} - {w.worker_id for w in d.state.workers}
    wanted = len(d.plan.steps) if num_ok is None else num_ok
    assert len(started) <= wanted and (num_ok is not None or started)
    done = [
        json.loads(line)["data"]
        for line in (run_dir / "journal.jsonl").read_text().splitlines()
        if '"kind":"done"' in line and '"id":"plan-' in line
    ]
    assert [r["ok"] for r in done] == [num_ok is None]
    if num_ok is not None:
        assert "timeout" in done[0]["error"]
    _kill_local_jobs(run_dir / "jobs")


def test_a_plan_that_raises_leaves_no_plan_running(tmp_path: Path) -> None:
    """A control plane that fails outright: the error reaches the caller, the executor
    runs no plan any more, and nothing is released."""
    from control_fakes import AckingControl

    from pearl.core.decision import ElasticAction

    class BrokenControl(AckingControl):
        def execute(self, plan: Any) -> Any:
            raise RuntimeError("MPI is gone")

    coordinator = _open(tmp_path, clock=lambda: 1.0, control=BrokenControl())
    run_dir = tmp_path / "run"
    try:
        d = _plan_decision(coordinator, 1.0)
        crafted = replace(d, elastic=ElasticAction(releases=("el0001",)))
        with pytest.raises(RuntimeError, match="MPI is gone"):
            coordinator.executor.carry_out(crafted, 1.0)
        assert not coordinator.executor.plan_running
    finally:
        coordinator.close()
    assert '"action":"release"' not in (run_dir / "journal.jsonl").read_text()


def test_a_router_that_cannot_be_told_of_a_lost_worker_stops_nothing(tmp_path: Path) -> None:
    """An engine died: the state drops it even when telling the router fails (the router
    finds it failing, later); the coordinator goes on."""
    from control_fakes import AckingControl

    from pearl.coordinator.reconcile import AgentEvent

    class UnreachableRouter(AckingControl):
        def __init__(self) -> None:
            super().__init__()
            self.pending: list[AgentEvent] = []
            self.told: list[tuple[str, ...]] = []

        def events(self) -> list[AgentEvent]:
            out, self.pending = self.pending, []
            return out

        def workers_lost(self, worker_ids: tuple[str, ...], reason: str) -> None:
            self.told.append(worker_ids)
            raise RuntimeError("router: timed out")

    control = UnreachableRouter()
    times = itertools.count(0.0, 0.5)
    coordinator = _open(tmp_path, clock=lambda: next(times), control=control)
    try:
        coordinator.executor.carry_out(_plan_decision(coordinator, 2.0), 2.0)
        dead = coordinator.state.workers[0]
        detail = f"{dead.worker_id} (-9)"
        control.pending = [AgentEvent("exited", "a0", dead.node, detail, (dead.worker_id,))]
        coordinator.tick()
        assert control.told == [(dead.worker_id,)]
        assert dead.worker_id not in {w.worker_id for w in coordinator.state.workers}
    finally:
        coordinator.close()
    _kill_local_jobs(tmp_path / "run" / "jobs")


def test_agents_router_url_is_checked(tmp_path: Path) -> None:
    """``agents.router_url`` names the router told of every plan step; a value that is not
    an http(s) URL is refused at load with the field named."""
    from pearl.coordinator.config import load_config
    from pearl.io.documents import InputError

    config, _ = load_config(_config(tmp_path, agents={"router_url": "http://10.0.0.5:8000"}))
    assert config.agents is not None and config.agents.router_url == "http://10.0.0.5:8000"
    with pytest.raises(InputError, match="router_url"):
        load_config(_config(tmp_path, agents={"router_url": "10.0.0.5:8000"}))
