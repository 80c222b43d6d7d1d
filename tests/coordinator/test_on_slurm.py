"""The coordinator as a real Slurm job on the dev cluster, submitted with submitit from
``launch/submit.py``: its elastic request is granted by Slurm and reaches the journalled
state; requeued, it resumes from the journal without asking twice."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from proc_tree import children, describe, gone
from slurm_cluster import REPO, DevCluster, dev_cluster, wait_for

from pearl.coordinator.journal import replay
from pearl.core.state import AllocationStatus
from pearl.engines.client import call

pytestmark = pytest.mark.fault  # alone: pytest -m fault


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    yield from dev_cluster(tmp_path_factory, port_base="22800")


def _config(tmp_path: Path) -> Path:
    doc = {
        "schema_version": 1,
        "run_id": "slurm1",
        "run_dir": "run",
        "profile": "qwen3-8b",
        "backend": "slurm",
        "gpus_per_node": {"h20": 2},
        "poll_interval_s": 0.5,
        "decision_interval_s": 0.5,
        "base": {"trainer": [{"name": "h800-1", "gpu_type": "h800", "num_gpus": 4}]},
        "policy": {
            "elastic": {
                "rule": "greedy",
                "gpu_type": "h20",
                "partition": "elastic",
                "gpus_per_allocation": 2,
                "max_allocations": 1,
                "time_limit_min": 10,
            },
            "borrowing": {"rule": "never"},
        },
    }
    path = tmp_path / "coordinator.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    run = tmp_path / "run"
    run.mkdir()
    (run / "workload.json").write_text(
        '{"trajectories": [{"traj_id": "q0", "phase": "queued", "context_tokens": 100,'
        ' "remaining_turns": 2}]}',
        encoding="utf-8",
    )
    return path


def _coordinator(cluster: DevCluster, config: Path) -> subprocess.Popen[str]:
    """``pearl coordinator CONFIG`` as its own process, a client of the dev cluster."""
    return subprocess.Popen(
        [sys.executable, "-m", "pearl.cli.main", "coordinator", str(config)],
        env=cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _take_back(cluster: DevCluster, node: str) -> None:
    """Another tenant takes ``node`` back: a job in ``owner`` preempts the elastic one."""
    cluster.sbatch(
        "-p", "owner", "-w", node, "--gres=gpu:h20:2", "-o", "/dev/null", "--wrap", "sleep 60"
    )


def _diagnosis(tmp_path: Path) -> str:
    """The journal's actions and the coordinator job's logs, for a failure message."""
    lines = [
        line
        for line in (tmp_path / "run" / "journal.jsonl").read_text().splitlines()
        if '"kind":"state"' not in line
    ]
    logs = [
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
        for p in sorted((tmp_path / "jobs").glob("**/*_log.*"))
    ]
    return "\n".join(["journal (no states):", *lines[-20:], *logs])


def _ended(journal: Path, allocation_id: str) -> bool:
    state = replay(journal).state if journal.exists() else None
    alloc = None if state is None else state.allocation_by_id.get(allocation_id)
    return alloc is not None and alloc.status is AllocationStatus.ENDED


def _granted(journal: Path) -> list[str]:
    state = replay(journal).state if journal.exists() else None
    if state is None:
        return []
    return [
        a.allocation_id
        for a in state.allocations
        if a.status is AllocationStatus.GRANTED and a.allocation_id != "base"
    ]


def test_coordinator_job_gets_a_grant_and_resumes_after_a_requeue(
    cluster: DevCluster, tmp_path: Path
) -> None:
    config = _config(tmp_path)
    journal = tmp_path / "run" / "journal.jsonl"
    submit = subprocess.run(
        [
            sys.executable,
            str(REPO / "launch" / "submit.py"),
            "--coordinator",
            str(config),
            "--folder",
            str(tmp_path / "jobs"),
            "--time-min",
            "10",
        ],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().splitlines()[-1]
    wait_for(lambda: _granted(journal) == ["el0001"], 60, "the elastic grant", cluster)
    state = replay(journal).state
    assert state is not None
    nodes = {g.node for g in state.gpus if g.allocation_id == "el0001"}
    assert nodes <= {"h20-1", "h20-2"} and len(nodes) == 1
    records = replay(journal).num_records
    cluster.run("scontrol", "requeue", job_id)
    cluster.start_requeued(job_id)
    try:
        wait_for(
            lambda: cluster.restarts(job_id) >= 1 and cluster.job_state(job_id) == "RUNNING",
            90,
            "the requeued coordinator",
            cluster,
        )
    except AssertionError as err:
        job = cluster.run("scontrol", "show", "job", job_id, check=False)
        why = f"{err}\n{job}\n{_diagnosis(tmp_path)}\n{cluster.logs()}"
        raise AssertionError(why) from None
    # each incarnation journals its first state
    wait_for(lambda: replay(journal).num_records > records, 60, "the new incarnation", cluster)
    time.sleep(3)  # a few ticks of it
    why = _diagnosis(tmp_path)
    assert _granted(journal) == ["el0001"], why
    assert "el0002" not in journal.read_text(), why  # resumed, did not ask again
    # the resumed coordinator watches the job its predecessor submitted: when another
    # tenant takes the node, the allocation ends in its state
    state = replay(journal).state
    assert state is not None
    (node,) = {g.node for g in state.gpus if g.allocation_id == "el0001"}
    _take_back(cluster, node)
    wait_for(lambda: "el0001" not in _granted(journal), 60, "the end seen after resuming", cluster)

    # post hoc, Slurm's accounting of the run: the coordinator's job (requeued once) and
    # the elastic job (preempted), found by the run's name and run.json's job ids
    answers: list[subprocess.CompletedProcess[str]] = []

    def accounting() -> dict[str, Any] | None:
        argv = ["analyze", str(tmp_path / "run"), "--sacct-query", "--json"]
        done = subprocess.run(
            [sys.executable, "-m", "pearl.cli.main", *argv, "--out", str(tmp_path / "report")],
            env=cluster.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        answers.append(done)
        return dict(json.loads(done.stdout)["accounting"]) if done.returncode == 0 else None

    def preempted_in_accounting() -> bool:
        acc = accounting()  # slurmdbd may lag, or be briefly busy: ask again
        return acc is not None and acc["preemptions"]["count"] == 1

    try:
        wait_for(preempted_in_accounting, 60, "the accounting", cluster)
    except AssertionError as err:
        raise AssertionError(f"{err}\nlast answer: {answers[-1].stderr[-2000:]}") from None
    acc = accounting()
    # the coordinator may have asked for the next allocation since (the cap is free again)
    assert acc is not None and acc["roles"]["coordinator"] == 1, acc
    assert acc["roles"]["elastic"] in (1, 2) and set(acc["roles"]) == {"coordinator", "elastic"}
    assert acc["requeues"]["jobs"] == 1 and acc["gpu_hours"]["by_role"]["elastic"] > 0, acc
    cluster.run("scancel", job_id)
    cluster.run("scancel", "-u", "root")


def _serving_engine(agent_pid: int) -> str | None:
    """The URL of one of the agent's reference engines that answers ``/health``."""
    for pid in children(agent_pid, b"serve"):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
        if call(lambda c: c.health(), url, 2.0):
            return url
    return None


def test_an_elastic_grant_brings_its_agent_and_a_preemption_takes_it_away(
    cluster: DevCluster, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The elastic allocation's agent starts the decision's engines (pearl's reference
    engine, `agents.engine`), which serve; the coordinator restarts without disturbing
    them; a preemption drains the agent within its grace period."""
    config = _config(tmp_path)
    doc = yaml.safe_load(config.read_text())
    engine = {"backend": "reference", "model": str(tiny_model_dir), "kv_cache_tokens": 4096}
    doc["agents"] = {"engine": engine, "grace_s": 5}
    config.write_text(yaml.safe_dump(doc), encoding="utf-8")
    run = tmp_path / "run"
    journal, agents_file = run / "journal.jsonl", run / "agents.json"
    coordinator = _coordinator(cluster, config)

    def agents() -> list[dict[str, object]]:
        try:
            return list(json.loads(agents_file.read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return []

    def elastic_gpus() -> list[str]:
        state = replay(journal).state if journal.exists() else None
        return sorted(g.gpu_id for g in state.gpus if g.allocation_id == "el0001") if state else []

    try:
        # agents.json shows the agent alive at the tick that journals its GPUs, a moment
        # before the journal does
        wait_for(
            lambda: any(a["state"] == "alive" for a in agents()) and elastic_gpus(),
            60,
            "the agent and its GPUs in the state",
            cluster,
        )
        (agent,) = agents()
        assert sorted(agent["gpus"]) == elastic_gpus()  # type: ignore[arg-type]
        node = str(agent["node"])
        url: list[str] = []

        def serving() -> bool:
            found = _serving_engine(_pid(agent))
            url[:] = [found] if found else []
            return bool(url)

        wait_for(serving, 90, "an engine that serves", cluster)
        answer = call(lambda c: c.completions({"prompt": "hello", "max_tokens": 4}), url[0], 30)
        assert answer["usage"]["completion_tokens"] == 4
        # the coordinator dies and comes back: the allocation holds, its agent reconnects
        coordinator.kill()
        coordinator.wait()
        agents_file.unlink()
        coordinator = _coordinator(cluster, config)
        wait_for(lambda: any(a["state"] == "alive" for a in agents()), 60, "the reconnect", cluster)
        assert _granted(journal) == ["el0001"] and agents()[0]["node"] == node
        # another tenant takes the node back: the agent reports, drains and leaves
        _take_back(cluster, node)
        wait_for(lambda: agents()[0]["state"] in ("preempted", "gone"), 30, "the drain", cluster)
        wait_for(lambda: _ended(journal, "el0001"), 40, "the allocation's end", cluster)
        assert coordinator.poll() is None  # the coordinator carries on
        # the agent left within the grace period (5 s), and its workers left the state
        logs = "".join(p.read_text(errors="replace") for p in run.glob("logs/agent-*.log"))
        left = re.search(r"preempted by (SIG\w+), left after ([\d.]+) s", logs)
        assert left is not None and float(left.group(2)) < 5, logs[-2000:]
        state = replay(journal).state
        assert state is not None and not [w for w in state.workers if w.node == node]
        assert state.allocation_by_id["el0001"].end_reason == "preempted"
    finally:
        coordinator.terminate()
        coordinator.communicate(timeout=30)
        cluster.run("scancel", "-u", "root")


def _agents(agents_file: Path) -> list[dict[str, object]]:
    try:
        return list(json.loads(agents_file.read_text()))
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def _pid(agent: dict[str, object]) -> int:
    return int(str(agent["agent_id"]).rsplit("-", 1)[1])  # NODE-JOBID-PID


def _open_plans(journal: Path) -> set[str]:
    """Plans announced in the journal and not closed yet."""
    open_ = set()
    for line in journal.read_text().splitlines():
        rec = json.loads(line)
        data = rec["data"]
        if rec["kind"] == "intent" and data.get("action") == "plan":
            open_.add(data["id"])
        elif rec["kind"] == "done":
            open_.discard(data.get("id"))
    return open_


def _plans(journal: Path) -> list[dict[str, object]]:
    """The plans' closing records: ok, error."""
    plans = set()
    out = []
    for line in journal.read_text().splitlines():
        rec = json.loads(line)
        data = rec["data"]
        if rec["kind"] == "intent" and data.get("action") == "plan":
            plans.add(data["id"])
        elif rec["kind"] == "done" and data.get("id") in plans:
            out.append(data)
    return out


def _starting_engines(agent: dict[str, object]) -> list[int]:
    """The agent's fake engines that do not listen yet (``--start-delay-s``)."""
    out = []
    for pid in children(_pid(agent), b"pearl.engines.fake"):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:  # it exited meanwhile
            continue
        port = int(argv[argv.index(b"--port") + 1])
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                out.append(pid)
    return out


def test_an_agent_killed_mid_plan_leaves_the_others_and_the_state_consistent(
    cluster: DevCluster, tmp_path: Path
) -> None:
    """Two elastic allocations, one agent each, engines that take 4 s to start. While a
    plan starts an engine, its agent is killed (SIGKILL). The coordinator keeps going, the
    plan is closed as failed, the other agent and its engines are untouched, no worker of
    the state is left on the killed allocation, and the next plans go on without it."""
    config = _config(tmp_path)
    doc = yaml.safe_load(config.read_text())
    doc["policy"]["elastic"]["max_allocations"] = 2
    doc["policy"]["switching"] = {"min_dwell_s": 0}
    engine = f"{sys.executable} -m pearl.engines.fake --port {{port}} --start-delay-s 4"
    doc["agents"] = {"engines": [f"*={engine}"], "grace_s": 5}
    config.write_text(yaml.safe_dump(doc), encoding="utf-8")
    run = tmp_path / "run"
    trajs = [  # a batch that wants every GPU
        {"traj_id": f"q{i}", "phase": "queued", "context_tokens": 6000, "remaining_turns": 8}
        for i in range(2000)
    ]
    (run / "workload.json").write_text(json.dumps({"trajectories": trajs}), encoding="utf-8")
    journal, agents_file = run / "journal.jsonl", run / "agents.json"
    coordinator = _coordinator(cluster, config)
    found: list[dict[str, object]] = []

    def mid_plan() -> bool:
        alive = [a for a in _agents(agents_file) if a["state"] == "alive"]
        starting = [a for a in alive if _starting_engines(a)]
        if len(alive) == 2 and starting and _open_plans(journal):
            found[:] = [starting[0], next(a for a in alive if a is not starting[0])]
            return True
        return False

    try:
        wait_for(mid_plan, 90, "two agents and a plan starting an engine", cluster, poll_s=0.1)
        victim, survivor = found
        doomed = children(_pid(victim), b"pearl.engines.fake")
        serving = children(_pid(survivor), b"pearl.engines.fake")
        failed_before = sum(not p["ok"] for p in _plans(journal))
        os.kill(_pid(victim), signal.SIGKILL)
        survivors = [e for e in doomed if not gone(e, 10)]
        assert not survivors, [describe(e) for e in survivors]  # no engine outlives its agent
        wait_for(
            lambda: sum(not p["ok"] for p in _plans(journal)) > failed_before,
            60,
            "the failed plan",
            cluster,
        )

        def victim_dead() -> bool:  # dead, or gone: replaced by the agent its job restarted
            states = {a["agent_id"]: a["state"] for a in _agents(agents_file)}
            return states.get(victim["agent_id"]) in ("dead", "gone")

        wait_for(victim_dead, 30, "the killed agent declared dead or replaced", cluster)
        killed_node = str(victim["node"])

        def consistent() -> bool:
            state = replay(journal).state
            assert state is not None
            gpus = state.gpu_by_id
            on_killed = [  # the killed agent's allocation is one of the first two
                w
                for w in state.workers
                if w.node == killed_node
                and gpus[w.gpu_ids[0]].allocation_id in ("el0001", "el0002")
            ]
            on_survivor = [w for w in state.workers if w.node == survivor["node"]]
            return not on_killed and bool(on_survivor)

        wait_for(consistent, 60, "a state without the killed agent's workers", cluster)
        why = _diagnosis(tmp_path)
        assert coordinator.poll() is None, why  # the coordinator carries on
        states = {a["agent_id"]: a["state"] for a in _agents(agents_file)}
        assert states[survivor["agent_id"]] == "alive", why
        assert not any(gone(e, 0.1) for e in serving), why  # its engines still serve
    finally:
        coordinator.terminate()
        coordinator.communicate(timeout=30)
        cluster.run("scancel", "-u", "root")


def test_a_partition_slurm_refuses_is_one_clear_line(cluster: DevCluster, tmp_path: Path) -> None:
    config = _config(tmp_path)
    doc = yaml.safe_load(config.read_text())
    doc["policy"]["elastic"]["partition"] = "nope"
    config.write_text(yaml.safe_dump(doc), encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "pearl.cli.main", "coordinator", str(config)],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "coordinator.yaml: policy.elastic.partition: Slurm refused partition 'nope'" in lines[0]
