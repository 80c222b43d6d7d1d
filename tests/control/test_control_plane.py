"""The MPI control plane with real processes: a coordinator harness and agents, each its
own ``mpiexec -n 1`` run, on loopback. No Slurm."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from control_procs import Coordinator, fake_engine_args, start_agent, stop_all
from proc_tree import children, gone

from pearl.control.portfile import read_port_file
from pearl.control.rendezvous import knock


@pytest.fixture
def coord(tmp_path: Path) -> Iterator[Coordinator]:
    c = Coordinator(tmp_path)
    yield c
    c.close()


def _steps(nodes: list[str], n: int) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for w in range(n // 2):
        node = nodes[w % len(nodes)]
        sid = len(out)
        out.append({"step_id": sid, "action": "drain", "worker_id": f"w{w}", "node": node})
        out.append(
            {
                "step_id": sid + 1,
                "action": "switch",
                "worker_id": f"w{w}",
                "node": node,
                "role": "decode",
                "depends_on": [sid],
            }
        )
    return out


def test_agent_registers_its_gpus(coord: Coordinator, tmp_path: Path) -> None:
    assert (tmp_path / "control" / "port.json").stat().st_mode & 0o777 == 0o600
    procs = [
        start_agent(tmp_path, "a0", "n0", "--gpus", "0,1", "--gpu-type", "a100", "--null-workers")
    ]
    try:
        agents = coord.call("wait", n=1)
        assert agents["a0"]["node"] == "n0"
        assert agents["a0"]["gpus"] == ["n0/0", "n0/1"]
        assert [e[:2] for e in coord.call("events")] == [["joined", "a0"]]
    finally:
        coord.close()
        for p in procs:
            assert p.wait(timeout=10) == 0  # the agent leaves on the coordinator's Bye


def test_wrong_token_is_refused_and_others_stay(coord: Coordinator, tmp_path: Path) -> None:
    good = start_agent(tmp_path, "good", "n0", "--null-workers")
    procs = [good]
    try:
        coord.call("wait", n=1)
        evil = tmp_path / "evil"
        (evil / "control").mkdir(parents=True)
        pf = (tmp_path / "control" / "port.json").read_text().replace('"token": "', '"token": "x')
        fd = os.open(evil / "control" / "port.json", os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, pf.encode())
        os.close(fd)
        bad = start_agent(evil, "bad", "n1", "--null-workers", stderr=subprocess.PIPE)
        procs.append(bad)
        _, err = bad.communicate(timeout=20)
        assert bad.returncode == 2
        assert "wrong token" in err
        res = coord.call("execute", steps=_steps(["n0"], 4))
        assert res["ok"], res
        agents = coord.call("agents")
        assert set(agents) == {"good"} and agents["good"]["state"] == "alive"
    finally:
        stop_all(procs)


def test_a_peer_that_knocks_and_dies_does_not_block_the_next(
    coord: Coordinator, tmp_path: Path
) -> None:
    """Admitted, it never connects: the pending Accept is completed by the watchdog (2 s
    in the harness) and the next agent connects and works."""
    info = read_port_file(tmp_path)
    sock = knock(info.knock_host, info.knock_port, info.token, "ghost")
    sock.close()  # admitted, and gone before Connect
    t0 = time.monotonic()
    procs = [start_agent(tmp_path, "a0", "n0", "--null-workers")]
    try:
        coord.call("wait", n=1, timeout=30)
        assert time.monotonic() - t0 < 20
        assert coord.call("execute", steps=_steps(["n0"], 4))["ok"]
        assert set(coord.call("agents")) == {"a0"}  # the unblocker never registers
    finally:
        stop_all(procs)


def test_hostile_knocks_leave_the_listener_admitting_an_agent_at_once(
    coord: Coordinator, tmp_path: Path
) -> None:
    """A knock of ~3 KB of nested JSON (once a ``RecursionError`` in the parser), silent peers
    holding their connections, a flood of garbage lines, all at once: each is refused on
    its own, and a knock with the right token is admitted within 1 s; an agent then
    joins and works."""
    import socket
    import threading

    info = read_port_file(tmp_path)
    address = (info.knock_host, info.knock_port)
    nested = b"[" * 1500 + b"]" * 1500 + b"\n"
    with socket.create_connection(address, timeout=5) as s:
        s.sendall(nested)
        assert b"not a knock line" in s.recv(4096)
    with socket.create_connection(address, timeout=5) as s:  # the token before the rest
        s.sendall(b"pearl-knock wrong 2 " + b"[" * 2000 + b"\n")
        assert b"wrong token" in s.recv(4096)
    silent = [socket.create_connection(address, timeout=5) for _ in range(20)]
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError), socket.create_connection(address, timeout=5) as s:
                s.sendall(b"\x00\xffnot a knock\n")
                s.recv(4096)

    flooders = [threading.Thread(target=flood, daemon=True) for _ in range(4)]
    for t in flooders:
        t.start()
    procs: list[subprocess.Popen[str]] = []
    try:
        time.sleep(0.5)  # the flood under way
        t0 = time.monotonic()
        sock = knock(info.knock_host, info.knock_port, info.token, "probe")
        admitted_s = time.monotonic() - t0
        sock.close()  # admitted and gone: the harness's watchdog completes its Accept
        assert admitted_s < 1.0, admitted_s
        procs.append(start_agent(tmp_path, "a0", "n0", "--null-workers"))
        coord.call("wait", n=1, timeout=30)
        assert coord.call("execute", steps=_steps(["n0"], 2))["ok"]
    finally:
        stop.set()
        for t in flooders:
            t.join()
        for s in silent:
            s.close()
        stop_all(procs)
    print(f"a knock admitted {admitted_s * 1000:.0f} ms into the flood")


def test_64_step_plan_over_4_agents(coord: Coordinator, tmp_path: Path) -> None:
    nodes = [f"n{i}" for i in range(4)]
    procs = [start_agent(tmp_path, f"a{i}", n, "--null-workers") for i, n in enumerate(nodes)]
    try:
        coord.call("wait", n=4)
        res = coord.call("execute", steps=_steps(nodes, 64))
        assert res["ok"], res
        assert len(res["steps"]) == 64
        assert {s["agent_id"] for s in res["steps"].values()} == {"a0", "a1", "a2", "a3"}
        assert all(s["status"] == "ok" for s in res["steps"].values())
        # a step for a node without an agent is reported, not hung on
        res = coord.call(
            "execute",
            steps=[{"step_id": 0, "action": "sleep", "worker_id": "x", "node": "nowhere"}],
        )
        assert res["steps"]["0"]["status"] == "lost"
    finally:
        stop_all(procs)


def test_sigkill_mid_plan(coord: Coordinator, tmp_path: Path) -> None:
    """The killed agent's steps fail, its drained workers stay, the others complete, and the
    coordinator keeps serving. The plan's engine 'starts' on the victim block long enough
    (its engine command for prefill never becomes healthy, so its start blocks)."""
    nodes = ["n0", "n1", "n2"]
    procs = [
        start_agent(
            tmp_path, f"a{i}", n, "--gpus", "0", *fake_engine_args(), "--engine", "prefill=sleep 60"
        )
        for i, n in enumerate(nodes)
    ]
    try:
        agents = coord.call("wait", n=3)
        victim = agents["a2"]["pid"]
        steps = [
            {
                "step_id": 0,
                "action": "start",
                "worker_id": "v",
                "node": "n2",
                "role": "prefill",
                "duration_s": 10.0,
            },
            {
                "step_id": 1,
                "action": "switch",
                "worker_id": "v",
                "node": "n2",
                "role": "decode",
                "depends_on": [0],
            },
            {
                "step_id": 2,
                "action": "start",
                "worker_id": "e0",
                "node": "n0",
                "role": "colocated",
                "gpu_ids": ["n0/0"],
                "duration_s": 5.0,
            },
            {
                "step_id": 3,
                "action": "sleep",
                "worker_id": "e0",
                "node": "n0",
                "role": "idle",
                "depends_on": [2],
            },
            {"step_id": 4, "action": "stop", "worker_id": "e0", "node": "n0", "depends_on": [3]},
        ]
        assert coord.proc.stdin is not None
        t0 = time.monotonic()
        coord.proc.stdin.write(json.dumps({"op": "execute", "steps": steps}) + "\n")
        coord.proc.stdin.flush()
        time.sleep(1.0)
        (engine,) = children(victim, b"sleep")  # the victim's engine, still starting
        os.kill(victim, signal.SIGKILL)
        res = coord.read()
        took = time.monotonic() - t0
        assert (
            res["steps"]["0"]["status"] == "lost" and "no heartbeat" in res["steps"]["0"]["error"]
        )
        assert res["steps"]["1"]["status"] == "aborted"
        assert [res["steps"][k]["status"] for k in "234"] == ["ok", "ok", "ok"], res
        assert took < 8, took  # heartbeat timeout (1 s), not the 30 s command deadline
        agents = coord.call("agents")
        assert agents["a2"]["state"] == "dead"
        assert gone(engine, 5.0)  # no engine outlives its agent
        res = coord.call(
            "execute",
            steps=[
                {
                    "step_id": 0,
                    "action": "start",
                    "worker_id": "e1",
                    "node": "n1",
                    "role": "decode",
                    "gpu_ids": ["n1/0"],
                    "duration_s": 5.0,
                },
                {
                    "step_id": 1,
                    "action": "stop",
                    "worker_id": "e1",
                    "node": "n1",
                    "depends_on": [0],
                },
            ],
        )
        assert res["ok"], res
    finally:
        stop_all(procs)


def _fake_children(pid: int) -> list[int]:
    return children(pid, b"pearl.engines.fake")


def test_sigusr2_preemption(coord: Coordinator, tmp_path: Path) -> None:
    procs = [
        start_agent(
            tmp_path,
            "p0",
            "n0",
            "--gpus",
            "0,1",
            "--grace-s",
            "5",
            *fake_engine_args(),
            stderr=subprocess.PIPE,
        ),
        start_agent(tmp_path, "p1", "n1", "--null-workers"),
    ]
    try:
        agents = coord.call("wait", n=2)
        res = coord.call(
            "execute",
            steps=[
                {
                    "step_id": 0,
                    "action": "start",
                    "worker_id": "e0",
                    "node": "n0",
                    "role": "colocated",
                    "gpu_ids": ["n0/1"],
                    "duration_s": 5.0,
                }
            ],
        )
        assert res["ok"], res
        pid = agents["p0"]["pid"]
        assert len(_fake_children(pid)) == 1
        t0 = time.monotonic()
        os.kill(pid, signal.SIGUSR2)
        _, err = procs[0].communicate(timeout=10)
        took = time.monotonic() - t0
        assert procs[0].returncode == 0, err
        assert took < 5, took  # within the grace period, mpiexec teardown included
        assert "preempted by SIGUSR2" in err
        assert _fake_children(pid) == []
        time.sleep(0.3)
        agents = coord.call("agents")
        assert agents["p0"]["state"] == "gone" and agents["p0"]["grace_s"] == 5.0
        kinds = [e[:2] for e in coord.call("events")]
        assert ["preempted", "p0"] in kinds and ["gone", "p0"] in kinds
        assert coord.call("execute", steps=_steps(["n1"], 4))["ok"]
    finally:
        stop_all(procs)


def test_an_engine_killed_under_its_agent_is_reported_exited(
    coord: Coordinator, tmp_path: Path
) -> None:
    procs = [start_agent(tmp_path, "k0", "n0", "--gpus", "0,1", *fake_engine_args())]
    try:
        agents = coord.call("wait", n=1)
        coord.call("events")
        start = {"action": "start", "node": "n0", "role": "colocated", "duration_s": 5.0}
        steps = [
            {"step_id": i, "worker_id": f"e{i}", "gpu_ids": [f"n0/{i}"], **start} for i in (0, 1)
        ]
        assert coord.call("execute", steps=steps[:1])["ok"]
        first = _fake_children(agents["k0"]["pid"])
        assert coord.call("execute", steps=steps[1:])["ok"]
        engines = _fake_children(agents["k0"]["pid"])
        assert len(engines) == 2
        (killed,) = set(engines) - set(first)  # e1's (not the larger pid: pids wrap)
        os.kill(killed, signal.SIGKILL)
        end, events = time.monotonic() + 10, []
        while not any(e[0] == "exited" for e in events):
            assert time.monotonic() < end, f"no exit reported: {events}"
            time.sleep(0.1)
            events += coord.call("events")
        (exited,) = [e for e in events if e[0] == "exited"]
        assert exited[1] == "k0" and exited[3] == ["e1"] and "e1 (-9)" in exited[2], exited
        assert _fake_children(agents["k0"]["pid"]) == first
        assert coord.call("agents")["k0"]["state"] == "alive"  # the agent goes on
        again = [{**steps[1], "step_id": 2}]  # its id and GPU are free again
        assert coord.call("execute", steps=again)["ok"]
    finally:
        stop_all(procs)


def test_an_agent_restarted_under_a_new_id_retires_the_old_one(
    coord: Coordinator, tmp_path: Path
) -> None:
    """The job's payload restarts a dead agent under a new id, maybe before the old one
    has missed its heartbeats: the old one is retired at the new one's hello, so its
    death, noticed later, reports nothing (it would take the new one's workers)."""
    procs = [start_agent(tmp_path, "old", "n0", "--gpus", "0", "--null-workers")]
    try:
        pid = coord.call("wait", n=1)["old"]["pid"]
        os.kill(pid, signal.SIGSTOP)  # hung: alive to the coordinator for 1 s more
        procs.append(start_agent(tmp_path, "new", "n0", "--gpus", "0", "--null-workers"))
        end = time.monotonic() + 10
        while coord.call("agents").get("new", {}).get("state") != "alive":
            assert time.monotonic() < end, "the new agent never joined"
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        time.sleep(2.0)  # past the old one's heartbeats (5 x 0.2 s)
        agents = coord.call("agents")
        assert agents["old"]["state"] == "gone" and agents["old"]["reason"] == "replaced by new"
        assert agents["new"]["state"] == "alive"
        kinds = [e[:2] for e in coord.call("events")]
        assert kinds == [["joined", "old"], ["joined", "new"]], kinds
    finally:
        stop_all(procs)


def test_failed_plan_aborts_its_drains(coord: Coordinator, tmp_path: Path) -> None:
    """Two-phase role change: when the switch cannot happen, the drain is undone."""
    procs = [start_agent(tmp_path, "a0", "n0", "--null-workers")]
    try:
        coord.call("wait", n=1)
        res = coord.call(
            "execute",
            steps=[
                {"step_id": 0, "action": "drain", "worker_id": "w0", "node": "n0"},
                {"step_id": 1, "action": "sleep", "worker_id": "x", "node": "gone-node"},
                {
                    "step_id": 2,
                    "action": "switch",
                    "worker_id": "w0",
                    "node": "n0",
                    "role": "decode",
                    "depends_on": [0, 1],
                },
            ],
        )
        assert not res["ok"]
        assert [res["steps"][k]["status"] for k in "012"] == ["ok", "lost", "aborted"]
        assert res["compensations"]["w0"]["status"] == "ok"
    finally:
        stop_all(procs)


def test_an_illegal_command_is_a_failed_step_and_the_agent_serves_on(
    coord: Coordinator, tmp_path: Path
) -> None:
    """The agent checks every command against the core's transition table; one the table
    refuses comes back as a failed ack with the error, and the agent keeps serving."""
    procs = [start_agent(tmp_path, "a0", "n0", "--null-workers")]
    try:
        coord.call("wait", n=1)
        start = {"action": "start", "worker_id": "w0", "node": "n0", "role": "decode"}
        res = coord.call(
            "execute",
            steps=[
                {"step_id": 0, **start},
                {"step_id": 1, **start, "depends_on": [0]},  # the same worker again
                {
                    "step_id": 2,
                    "action": "drain",
                    "worker_id": "w0",
                    "node": "n0",
                    "depends_on": [0],
                },
                {
                    "step_id": 3,
                    "action": "switch",
                    "worker_id": "w0",
                    "node": "n0",
                    "role": "prefill",
                    "depends_on": [1, 2],
                },
            ],
        )
        assert [res["steps"][k]["status"] for k in "0123"] == ["ok", "failed", "ok", "aborted"]
        assert res["steps"]["1"]["error"].startswith("TransitionError: w0 already runs")
        assert res["compensations"]["w0"]["status"] == "ok"  # abort_drain: ready again
        res = coord.call(
            "execute",
            steps=[
                {"step_id": 0, "action": "onload", "worker_id": "w0", "node": "n0", "role": "train"}
            ],
        )
        assert res["steps"]["0"]["status"] == "failed"
        assert "engine workers cannot take role train" in res["steps"]["0"]["error"]
        assert coord.call("execute", steps=_steps(["n0"], 4))["ok"]
        assert coord.call("agents")["a0"]["state"] == "alive"
    finally:
        stop_all(procs)


def test_the_plan_listener_hears_each_step_sent_in_order(
    coord: Coordinator, tmp_path: Path
) -> None:
    """``execute_plan(..., listener=...)``: each step sent is heard just before its command
    goes out and when its result comes (a start's and a wake's with the engine's URL from
    the agent's ack); a step never sent is not heard; a compensation is heard as
    ``drain_undone``; a listener that raises breaks no plan."""
    procs = [start_agent(tmp_path, "a0", "n0", "--gpus", "0", *fake_engine_args())]
    try:
        coord.call("wait", n=1)
        e0 = {"worker_id": "e0", "node": "n0"}
        steps: list[dict[str, object]] = [
            {"step_id": 0, "action": "start", **e0, "role": "colocated", "gpu_ids": ["n0/0"]},
            {"step_id": 1, "action": "drain", **e0, "depends_on": [0]},
            {"step_id": 2, "action": "switch", **e0, "role": "decode", "depends_on": [1]},
            {"step_id": 3, "action": "sleep", **e0, "role": "idle", "depends_on": [2]},
            {"step_id": 4, "action": "wake", **e0, "role": "decode", "depends_on": [3]},
            {"step_id": 5, "action": "sleep", "worker_id": "x", "node": "nowhere"},
        ]
        for s in steps:
            s["duration_s"] = 5.0
        res = coord.call("execute", steps=steps, listen="record")
        assert [res["steps"][str(k)]["status"] for k in range(6)] == [*["ok"] * 5, "lost"]
        url = res["steps"]["0"]["url"]
        assert url.startswith("http://127.0.0.1:") and res["steps"]["4"]["url"] == url
        actions = ["start", "drain", "switch", "sleep", "wake"]
        expected = []
        for sid, action in enumerate(actions):
            step_url = url if action in ("start", "wake") else None
            expected += [
                ["step_started", sid, action, "e0", None, None],
                ["step_ended", sid, action, "e0", "ok", step_url],
            ]
        assert res["heard"] == expected
        # a failed plan: the drain is undone, and a listener that raises changes nothing
        res = coord.call(
            "execute",
            steps=[
                {"step_id": 0, "action": "drain", **e0},
                {"step_id": 1, "action": "sleep", "worker_id": "x", "node": "nowhere"},
                {"step_id": 2, "action": "switch", **e0, "role": "prefill", "depends_on": [0, 1]},
            ],
            listen="raise",
        )
        assert [res["steps"][k]["status"] for k in "012"] == ["ok", "lost", "aborted"]
        assert res["compensations"]["e0"]["status"] == "ok"
        assert res["heard"] == [
            ["step_started", 0, "drain", "e0", None, None],
            ["step_ended", 0, "drain", "e0", "ok", None],
            ["drain_undone", 0, "drain", "e0", "ok", None],
        ]
        res = coord.call("execute", steps=[{"step_id": 0, "action": "stop", **e0}], listen="raise")
        assert res["ok"] and [h[0] for h in res["heard"]] == ["step_started", "step_ended"]
    finally:
        stop_all(procs)
