"""``pearl run --cluster slurm`` on the dev cluster, as a user runs it from a login node
(``--submit``: the run's own job through submitit), with the shipped example config, and
every fault of issue 16 in one run (seeded: the example's seed; bounded: each wait has a
timeout):

1. decide()'s elastic request is granted by Slurm, the grant's node agent starts
   reference engines that serve the rollout's turns (where decide() starts engines there:
   it may judge a late grant not worth their cold start, issue 18; the test says which);
2. ``kill -9`` of one of the job's own engines mid-rollout, and of an elastic one where
   there is one: each leaves the state (a ``gone`` worker with no stop) and the router,
   its turns continue elsewhere;
3. the node's owner takes it back mid-batch (its turns go on elsewhere);
4. the next grant; ``kill -9`` of its node agent (the allocation's payload starts another,
   which joins with no engines) and of the trainer's process (the run starts another from
   its last checkpoint);
5. ``scontrol requeue`` of the run's job mid-run: the next incarnation replays its
   journal, resumes the rollout and the trainer from their books, and the elastic
   allocation held across the requeue rejoins;
6. ``kill -9`` of the run's process (its rollout manager, router and coordinator): the
   job starts it again from the run directory, and the run ends.

The books are checked at the end: every update trained once, in order; every trajectory
finished once (or again when an update took it back, by the staleness rule, with its
record), or lost with a record when its manager stopped (started again from its prompt);
none lost to the preemption or a killed engine; the trainer never waited for lent devices
past ``max_return_delay_s``. Prints what it checked."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lent_slot import check_returns
from slurm_cluster import REPO, DevCluster, dev_cluster, wait_for

from pearl.coordinator.journal import replay
from pearl.core.config import BorrowingConfig

pytest.importorskip("torch")
pytest.importorskip("submitit")
pytest.importorskip("mpi4py")
pytestmark = pytest.mark.fault  # alone: pytest -m fault

EXAMPLE = REPO / "examples" / "runs" / "dev-cluster.yaml"
STEPS = 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    yield from dev_cluster(tmp_path_factory, port_base="23800")


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line being written
            out.append(json.loads(line))
    return out


def _events(out: Path, kind: str) -> list[dict[str, Any]]:
    return [r for r in _records(out / "events.jsonl") if r["type"] == kind]


def _served_on(out: Path, node: str) -> int:
    turns = [r for r in _records(out / "rollout.jsonl") if r["type"] == "turn_ended"]
    return sum(any(w.startswith(f"e-{node}-") for w in t["served_by"]) for t in turns)


def _alive_agents(out: Path, node: str) -> set[str]:
    """The ids of the agents on ``node`` alive in the run's ``agents.json`` (an id names
    the agent's process: a new agent, a new id)."""
    try:
        agents = json.loads((out / "agents.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return set()
    return {a["agent_id"] for a in agents if a["node"] == node and a["state"] == "alive"}


def _elastic_nodes(out: Path) -> dict[str, str]:
    """Each elastic allocation whose GPUs are in the journalled state, and its node."""
    journal = out / "journal.jsonl"
    state = replay(journal).state if journal.exists() else None
    if state is None:
        return {}
    return {g.allocation_id: g.node for g in state.gpus if g.allocation_id.startswith("el")}


def _pids(*words: str) -> list[int]:
    """The Python processes of this machine (every dev-cluster node is this machine) whose
    arguments include each of ``words`` (a word ending in ``*``: an argument it begins);
    not an ``mpiexec`` that runs one."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            args = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        found = all(
            any(a.startswith(w[:-1]) if w.endswith("*") else a == w for a in args) for w in words
        )
        if found and "python" in Path(args[0]).name:
            out.append(int(d.name))
    return sorted(out)


def _kill(what: str, *words: str) -> int:
    (pid, *_) = _pids(*words) or [0]
    assert pid, f"no process of {what} ({' '.join(words)})"
    os.kill(pid, signal.SIGKILL)
    return pid


def _engine_ids(prefix: str) -> list[str]:
    """The worker ids of the running engines whose id begins with ``prefix``."""
    ids = []
    for pid in _pids("serve", "--engine-id", f"{prefix}*"):
        with contextlib.suppress(OSError):
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            ids.append(args[args.index("--engine-id") + 1])
    return sorted(set(ids))


def _gone_without_stop(out: Path, worker_id: str) -> bool:
    """The run log has ``worker_id`` gone, and no plan step stopped it."""
    phases = [r for r in _events(out, "worker_phase") if r["worker_id"] == worker_id]
    steps = _events(out, "plan_step")
    stopped = [s for s in steps if s["worker_id"] == worker_id and s["action"] == "stop"]
    return any(r["phase"] == "gone" for r in phases) and not stopped


def _job_logs(*folders: Path) -> str:
    return "\n".join(
        p.read_text(errors="replace") for f in folders for p in sorted(f.rglob("*_log.err"))
    )


def _kill_an_engine(out: Path, prefix: str) -> str | None:
    """``kill -9`` of the first running engine whose id begins with ``prefix``; its id,
    once the run has taken it out (None: no such engine runs)."""
    ids = _engine_ids(prefix)
    if not ids:
        return None
    _kill(f"engine {ids[0]}", "serve", "--engine-id", ids[0])
    wait_for(lambda: _gone_without_stop(out, ids[0]), 30, f"{ids[0]} out of the state")
    return ids[0]


def _diagnosis(out: Path, jobs: Path) -> str:
    logs = [
        f"--- {p}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(jobs.glob("*_log.err"))
    ]
    steps = [json.dumps(s) for s in _events(out, "plan_step")][-12:]
    return "\n".join(["plan steps:", *steps, *logs])


def test_pearl_run_on_slurm_survives_a_preemption_kills_and_a_requeue(
    cluster: DevCluster, tmp_path: Path
) -> None:
    config = tmp_path / "dev-cluster.yaml"
    shutil.copy(EXAMPLE, config)
    out, jobs = tmp_path / "out", tmp_path / "jobs"
    submit = subprocess.run(
        [
            *(sys.executable, "-m", "pearl.cli.main", "run", str(config), "--submit"),
            *("--folder", str(jobs), "--run-dir", str(out), "--steps", str(STEPS)),
        ],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().splitlines()[-1]
    try:
        # 1. a grant, its agent, its engines serving turns
        wait_for(lambda: _elastic_nodes(out), 180, "an elastic grant's GPUs", cluster)
        ((first, node),) = _elastic_nodes(out).items()
        try:  # decide() may leave a grant unused (it weighs the current batch only: issue 18)
            wait_for(lambda: _served_on(out, node) > 0, 60, f"a turn served on {node}")
        except AssertionError:
            print(f"decide() started no engine on {first} ({node}) within 60 s")
        served_before = _served_on(out, node)
        print(f"granted {first} on {node}: {served_before} turns served there")
        # 2. kill -9 of one of the job's own engines, and of an elastic one if there is one
        killed = [_kill_an_engine(out, "e-rollout-"), _kill_an_engine(out, f"e-{node}-")]
        assert killed[0] is not None, "no engine of the job's own ran"
        print(f"killed engines {killed} (None: decide() had started no elastic one)")
        # 3. its owner takes the node back mid-batch
        cluster.sbatch(
            "-p", "owner", "-w", node, "--gres=gpu:h20:2", "-o", "/dev/null", "--wrap", "sleep 300"
        )

        def ended() -> list[dict[str, Any]]:
            return [r for r in _events(out, "allocation") if r["status"] == "ended"]

        wait_for(ended, 60, "the preemption's end", cluster)
        assert ended()[0]["allocation_id"] == first and ended()[0]["reason"] == "preempted"
        # 4. the next grant (the other node); kill -9 of its agent and of the trainer
        wait_for(lambda: set(_elastic_nodes(out)) - {first}, 90, "a second grant", cluster)
        ((second, other),) = _elastic_nodes(out).items()
        wait_for(lambda: _alive_agents(out, other), 60, f"{other}'s agent", cluster)
        agents_before = _alive_agents(out, other)
        _kill(f"{other}'s agent", "pearl.cli.agent", "--node", other)
        _kill("the trainer's process", "trainer", "serve")
        wait_for(
            lambda: "agent payload: the agent on" in _job_logs(out, jobs),
            30,
            "the agent started again",
            cluster,
        )
        wait_for(
            lambda: _alive_agents(out, other) - agents_before, 60, f"{other}'s new agent", cluster
        )
        wait_for(
            lambda: "the trainer's process was lost" in _job_logs(jobs),
            120,
            "the trainer's process started again",
            cluster,
        )
        # 5. the run's job requeued mid-run
        steps_before = len(
            [r for r in _records(out / "rollout.jsonl") if r["type"] == "train_step"]
        )
        assert steps_before < STEPS, "the run ended before its requeue: too fast to test"
        requeued_t = time.time()
        agents_before = _alive_agents(out, other)
        cluster.run("scontrol", "requeue", job_id)
        cluster.start_requeued(job_id)
        # the elastic allocation held across the requeue: its agent joins the next incarnation
        wait_for(
            lambda: _alive_agents(out, other) - agents_before,
            120,
            f"{other}'s agent rejoining",
            cluster,
        )
        # 6. kill -9 of the run's process (rollout manager, router, coordinator)
        steps_at_kill = len(
            [r for r in _records(out / "rollout.jsonl") if r["type"] == "train_step"]
        )
        assert steps_at_kill < STEPS, "the run ended before its kill: too fast to test"
        _kill("the run", "pearl.cli.main", "run", "--cluster")
        state = cluster.wait_sacct(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=400)
        assert state == "COMPLETED", _diagnosis(out, jobs)
    finally:
        cluster.run("scancel", "-u", "root", check=False)

    rollout = _records(out / "rollout.jsonl")
    kinds = Counter(r["type"] for r in rollout)
    # every update once, in order, across the two incarnations
    updates = [r for r in rollout if r["type"] == "train_step"]
    assert [u["policy_version"] for u in updates] == list(range(1, STEPS + 1)), updates
    # every trajectory finished once, or again after an update took it back (the staleness
    # rule: restarted from its prompt, counted in past_bound; one taken back may still be
    # in flight at the end, or lost at the requeue), or lost with a record when its
    # manager stopped (started again from its prompt)
    finished = [r["traj_id"] for r in rollout if r["type"] == "trajectory_finished"]
    taken_back = sum(r["taken_back"] for r in rollout if r["type"] == "past_bound")
    assert len(finished) - len(set(finished)) <= taken_back
    lost = Counter(r["reason"] for r in rollout if r["type"] == "trajectory_lost")
    assert set(lost) <= {"manager_restart"}, lost  # none to the preemption, the engines
    logs = _job_logs(jobs)
    assert "pearl run killed by SIGKILL: starting it again" in logs
    # a lend of the trainer's slot, where decide() made one: its return left no turn there
    served_on_slot, moved = check_returns(_events(out, "plan_step"), rollout)
    consumed = [r for r in rollout if r["type"] == "batch_consumed"]
    assert sum(b["trajectories"] for b in consumed[-STEPS:]) == STEPS * 512
    # the trainer's wait for lent devices, within the policy's bound (its default where the
    # config sets none: a lend's cold start that the batch outruns is waited for, and took
    # 8.3 s of a 2.8 s estimate once on a loaded machine, past a 5 s this test assumed)
    bound_s = yaml.safe_load(config.read_text())["coordinator"]["policy"].get("borrowing", {})
    default_s = BorrowingConfig().max_return_delay_s
    max_wait_s = float(bound_s.get("max_return_delay_s", default_s))
    assert max(u["waited_for_gpus_s"] for u in updates) <= max_wait_s
    # the allocation held across the requeue was not asked for again, nor another one
    allocations = {r["allocation_id"] for r in _events(out, "allocation")}
    assert allocations == {first, second}, allocations
    report = subprocess.run(
        [sys.executable, "-m", "pearl.cli.main", "analyze", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    print(
        f"checked: versions 1..{STEPS} once each; {len(finished)} trajectories finished once, "
        f"{sum(lost.values())} lost at the requeue and the run's kill and restarted, none "
        f"at the preemption or the engines' kills ({killed}); "
        f"allocations {sorted(allocations)} ({second} held across the requeue); "
        f"{served_before} turns served on {first}'s node before its preemption; "
        f"{served_on_slot} on the trainer's lent slot, {moved} of them moved at a return; "
        f"{kinds['turn_ended']} turns; the run ended {time.time() - requeued_t:.0f} s after "
        f"its requeue (its incarnation {steps_before} updates in, killed {steps_at_kill} in)"
    )
