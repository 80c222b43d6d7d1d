"""The agent's worker management against real processes over real HTTP: pearl's reference
engine (``pearl engine serve``) and, where a test needs an engine that misbehaves on
purpose or reports what the agent did to it, the documented fake (``pearl.engines.fake``),
each started by :class:`ProcessWorkers` and driven through the engine client; the
bookkeeping of :class:`NullWorkers`; both checked against the core's transition table."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from pearl.control import pdeath
from pearl.control.agent import Agent
from pearl.control.messages import Command, ControlAction
from pearl.control.workers import NullWorkers, ProcessWorkers, WorkerError, WorkerState, moved
from pearl.core.plan import Action
from pearl.core.roles import PHASE_EDGES, Phase, Role, TransitionError, WorkerKind
from pearl.engines.client import call

FAKE = [sys.executable, "-m", "pearl.engines.fake", "--port", "{port}"]
A, R = Action, Role


def _cmd(
    action: Action | ControlAction, worker: str = "w0", role: Role | None = None, **kw: object
) -> Command:
    return Command(
        cmd_id=f"{action.value}-{worker}",
        step_id=0,
        action=action,
        worker_id=worker,
        role=role,
        deadline_s=kw.pop("deadline_s", 10.0),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def _metric(workers: ProcessWorkers, worker: str, name: str) -> str:
    """A sample of the worker's ``/metrics`` as the fake writes it (an integer)."""
    values = call(lambda c: c.metrics(), workers.base_url(worker), 2.0)
    assert name in values, values
    return f"{values[name]:g}"


def test_a_reference_engine_serves_and_obeys_every_action(tiny_model_dir: Path) -> None:
    """The real engine: sleep and wake show in ``/is_sleeping``, each weight sync reloads
    the weights (the served version goes up), a drain returns only once the request in
    flight has finished, and a stop ends the process."""
    serve = [sys.executable, "-m", "pearl.cli.main", "engine", "serve"]
    argv = [*serve, "--model", str(tiny_model_dir), "--port", "{port}", "--kv-port", "{kv_port}"]
    workers = ProcessWorkers({"*": [*argv, "--engine-id", "{worker_id}"]}, {"n0/0": 0})
    pool = ThreadPoolExecutor(1)
    try:
        workers.execute(_cmd(A.START, role=R.DECODE, gpu_ids=("n0/0",), deadline_s=60.0))
        url = workers.base_url("w0")
        workers.execute(_cmd(A.SLEEP, role=R.IDLE))
        assert call(lambda c: c.is_sleeping(), url, 5.0)
        workers.execute(_cmd(A.WAKE, role=R.DECODE))
        assert not call(lambda c: c.is_sleeping(), url, 5.0)
        workers.execute(_cmd(A.SYNC_WEIGHTS))
        workers.execute(_cmd(A.SYNC_WEIGHTS))
        assert call(lambda c: c.metrics(), url, 5.0)["pearl:weight_version"] == 2
        body = {"prompt": "the drain waits for me", "max_tokens": 300, "ignore_eos": True}
        answer = pool.submit(call, lambda c: c.completions(body), url, 60.0)
        end = time.monotonic() + 20
        while call(lambda c: c.num_requests_running(), url, 5.0) == 0:
            assert time.monotonic() < end and not answer.done()
            time.sleep(0.02)
        workers.execute(_cmd(A.DRAIN, deadline_s=60.0))
        assert answer.done(), "the drain returned while the request was still running"
        assert answer.result()["choices"][0]["finish_reason"] == "length"
        workers.execute(_cmd(A.SWITCH, role=R.PREFILL))
        assert workers.procs["w0"].state == WorkerState(
            WorkerKind.ENGINE, R.PREFILL, Phase.READY, weight_syncs=2
        )
        proc = workers.procs["w0"].proc
        workers.execute(_cmd(A.STOP))
        assert proc.poll() is not None and workers.worker_ids() == ()
    finally:
        workers.stop_all(5.0)
        pool.shutdown()


@pytest.fixture
def workers() -> Iterator[ProcessWorkers]:
    w = ProcessWorkers({"*": FAKE}, {"n0/0": 0, "n0/1": 1, "n0/2": 2})
    yield w
    w.stop_all(5.0)


def test_an_engine_runs_on_its_gpus_and_obeys_every_action(workers: ProcessWorkers) -> None:
    workers.execute(_cmd(A.START, role=R.DECODE, gpu_ids=("n0/2", "n0/1")))
    assert workers.worker_ids() == ("w0",)
    assert workers.procs["w0"].state == WorkerState(WorkerKind.ENGINE, R.DECODE, Phase.READY)
    info = call(lambda c: c.metrics_text(), workers.base_url("w0"), 2.0)
    assert 'cuda_visible_devices="2,1"' in info  # the local indices of its GPUs, in order
    workers.execute(_cmd(A.SLEEP, role=R.IDLE))
    assert _metric(workers, "w0", "pearl_fake_sleeping") == "1"
    workers.execute(_cmd(A.WAKE, role=R.PREFILL))
    assert _metric(workers, "w0", "pearl_fake_sleeping") == "0"
    workers.execute(_cmd(A.SYNC_WEIGHTS))
    workers.execute(_cmd(A.SYNC_WEIGHTS))
    assert _metric(workers, "w0", "pearl_fake_weight_reloads") == "2"
    workers.execute(_cmd(A.DRAIN))
    assert workers.procs["w0"].state.phase is Phase.DRAINING
    workers.execute(_cmd(ControlAction.ABORT_DRAIN))
    assert workers.procs["w0"].state == WorkerState(
        WorkerKind.ENGINE, R.PREFILL, Phase.READY, weight_syncs=2
    )
    workers.execute(_cmd(A.DRAIN))
    workers.execute(_cmd(A.SWITCH, role=R.DECODE))
    state = workers.procs["w0"].state
    assert (state.role, state.phase, state.weight_syncs) == (R.DECODE, Phase.READY, 2)
    proc = workers.procs["w0"].proc
    workers.execute(_cmd(A.STOP))
    assert proc.poll() is not None and workers.worker_ids() == ()


def test_a_worker_that_dies_by_itself_is_reported_once_and_forgotten(
    workers: ProcessWorkers,
) -> None:
    for w in ("w0", "w1", "w2"):
        workers.execute(_cmd(A.START, w, role=R.DECODE, gpu_ids=(f"n0/{w[1]}",)))
    assert workers.exited() == {}
    workers.execute(_cmd(A.STOP, "w2"))  # stopped: not an exit of its own
    workers.procs["w0"].proc.kill()
    workers.procs["w0"].proc.wait()
    assert workers.exited() == {"w0": -9}
    assert workers.worker_ids() == ("w1",) and workers.exited() == {}
    with pytest.raises(WorkerError, match="no worker w0"):
        workers.execute(_cmd(A.DRAIN, "w0"))
    assert NullWorkers().exited() == {}


def test_an_engine_killed_by_kill_9_takes_its_children_with_it(tmp_path: Path) -> None:
    """vLLM's API server runs its engine core as a child, which holds the GPU: a
    ``kill -9`` of the server leaves it running, so ``exited`` kills what is left of the
    worker's process group."""
    child_pid = tmp_path / "child.pid"
    script = tmp_path / "engine.py"
    script.write_text(
        "import subprocess, sys, runpy\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(child_pid)!r}, 'w').write(str(child.pid))\n"
        "sys.argv = ['fake', '--port', sys.argv[1]]\n"
        "runpy.run_module('pearl.engines.fake', run_name='__main__')\n"
    )
    w = ProcessWorkers({"*": [sys.executable, str(script), "{port}"]}, {"n0/0": 0})
    try:
        w.execute(_cmd(A.START, role=R.DECODE, gpu_ids=("n0/0",)))
        pid = int(child_pid.read_text())
        w.procs["w0"].proc.kill()
        w.procs["w0"].proc.wait()
        assert _alive(pid)  # the leader's death alone leaves the child running
        assert w.exited() == {"w0": -9}
        end = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < end:
            time.sleep(0.02)
        assert not _alive(pid)
    finally:
        w.stop_all(2.0)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped by init, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_trainer_offloads_and_onloads(workers: ProcessWorkers) -> None:
    workers.execute(_cmd(A.START, "t0", role=R.TRAIN, gpu_ids=("n0/0",)))
    assert workers.procs["t0"].state.kind is WorkerKind.TRAINER
    workers.execute(_cmd(A.OFFLOAD, "t0", role=R.IDLE))
    assert _metric(workers, "t0", "pearl_fake_sleeping") == "1"
    workers.execute(_cmd(A.ONLOAD, "t0", role=R.TRAIN))
    assert _metric(workers, "t0", "pearl_fake_sleeping") == "0"
    assert workers.procs["t0"].state.role is R.TRAIN


def test_failures_are_worker_errors(workers: ProcessWorkers) -> None:
    with pytest.raises(WorkerError, match="not on this node"):
        workers.execute(_cmd(A.START, role=R.DECODE, gpu_ids=("n9/0",)))
    with pytest.raises(WorkerError, match="no worker w1"):
        workers.execute(_cmd(A.SLEEP, "w1", role=R.IDLE))
    slow = ProcessWorkers({"*": [*FAKE, "--start-delay-s", "5"]}, {"n0/0": 0})
    try:
        with pytest.raises(WorkerError, match="not healthy within"):
            slow.execute(_cmd(A.START, role=R.DECODE, gpu_ids=("n0/0",), deadline_s=0.5))
        assert slow.worker_ids() == ()  # the half-started process was stopped
    finally:
        slow.stop_all(2.0)
    dead = ProcessWorkers({"*": [sys.executable, "-c", "raise SystemExit(4)"]}, {"n0/0": 0})
    with pytest.raises(WorkerError, match="exited with 4 on start"):
        dead.execute(_cmd(A.START, role=R.DECODE, gpu_ids=("n0/0",)))


def test_an_engine_error_is_a_worker_error_with_the_engines_message() -> None:
    failing = ProcessWorkers({"*": [*FAKE, "--fail-reload"]}, {"n0/0": 0})
    try:
        failing.execute(_cmd(A.START, role=R.DECODE, gpu_ids=("n0/0",)))
        with pytest.raises(WorkerError) as err:
            failing.execute(_cmd(A.SYNC_WEIGHTS))
        assert str(err.value) == (
            "w0: POST /collective_rpc: HTTP 500: reload_weights failed (--fail-reload)"
        )
        assert failing.procs["w0"].state.weight_syncs == 0  # a failed command changes nothing
    finally:
        failing.stop_all(5.0)


def test_the_kv_port_is_a_second_free_port(tmp_path: Path) -> None:
    """``{kv_port}`` is filled with a port other than ``{port}``, both free."""
    out = tmp_path / "ports"
    script = tmp_path / "engine.py"
    script.write_text(
        "import sys, runpy\n"
        f"open({str(out)!r}, 'w').write(' '.join(sys.argv[1:4]))\n"
        "sys.argv = ['fake', '--port', sys.argv[1]]\n"
        "runpy.run_module('pearl.engines.fake', run_name='__main__')\n"
    )
    w = ProcessWorkers(
        {"*": [sys.executable, str(script), "{port}", "{kv_port}", "{worker_id}"]}, {"n0/0": 0}
    )
    try:
        w.execute(_cmd(A.START, role=R.DECODE, gpu_ids=("n0/0",)))
        port, kv_port, worker = out.read_text().split()
        assert int(port) == w.procs["w0"].port and int(kv_port) == w.procs["w0"].kv_port
        assert port != kv_port and worker == "w0"
    finally:
        w.stop_all(5.0)


def test_illegal_commands_on_an_engine_raise_before_touching_it(workers: ProcessWorkers) -> None:
    workers.execute(_cmd(A.START, role=R.DECODE, gpu_ids=("n0/0",)))
    workers.execute(_cmd(A.SLEEP, role=R.IDLE))
    before = workers.procs["w0"].state
    with pytest.raises(TransitionError, match="engine workers cannot take role train"):
        workers.execute(_cmd(A.ONLOAD, role=R.TRAIN))
    with pytest.raises(TransitionError, match="wake of w0 needs a role"):
        workers.execute(_cmd(A.WAKE))
    with pytest.raises(TransitionError, match="w0 already runs"):
        workers.execute(_cmd(A.START, role=R.DECODE, gpu_ids=("n0/1",)))
    assert _metric(workers, "w0", "pearl_fake_sleeping") == "1"  # no /wake_up was sent
    assert workers.procs["w0"].state == before
    assert workers.worker_ids() == ("w0",)


def _start_in_background(workers: ProcessWorkers, pool: ThreadPoolExecutor) -> Future[None]:
    """A start on a pool thread, as the agent runs commands; returns once it is starting.
    (The thread must outlive the engine: its parent-death signal is the thread's.)"""
    started = pool.submit(workers.execute, _cmd(A.START, role=R.PREFILL, gpu_ids=("n0/0",)))
    end = time.monotonic() + 10
    while "w0" not in workers.procs and time.monotonic() < end:
        time.sleep(0.01)
    assert workers.procs["w0"].state.phase is Phase.STARTING
    return started


def test_a_starting_engine_cannot_drain_or_switch_but_can_stop() -> None:
    """While its start waits for /health the engine is ``starting``: the table has no edge
    to draining or switching from there, only to stopping (the start is cancelled)."""
    workers = ProcessWorkers({"*": [*FAKE, "--start-delay-s", "1.5"]}, {"n0/0": 0})
    pool = ThreadPoolExecutor(1)
    try:
        start = _start_in_background(workers, pool)
        with pytest.raises(TransitionError, match="illegal phase change starting -> draining"):
            workers.execute(_cmd(A.DRAIN))
        with pytest.raises(TransitionError, match="illegal phase change starting -> switching"):
            workers.execute(_cmd(A.SWITCH, role=R.DECODE))
        start.result(timeout=30)
        assert workers.procs["w0"].state.phase is Phase.READY
        workers.execute(_cmd(A.DRAIN))  # now legal
        workers.execute(_cmd(A.STOP))
        start = _start_in_background(workers, pool)
        proc = workers.procs["w0"].proc
        workers.execute(_cmd(A.STOP))
        with pytest.raises(WorkerError, match="w0 stopped while starting"):
            start.result(timeout=30)
        assert proc.poll() is not None and workers.worker_ids() == ()
    finally:
        workers.stop_all(5.0)
        pool.shutdown()


@pytest.mark.parametrize(("before", "after"), list(itertools.product(Phase, Phase)), ids=str)
def test_every_phase_change_is_the_core_table(before: Phase, after: Phase) -> None:
    w = WorkerState(WorkerKind.ENGINE, R.DECODE, before)
    if before is after or (before, after) in PHASE_EDGES:
        assert moved(w, after).phase is after
    else:
        with pytest.raises(TransitionError, match="illegal phase change"):
            moved(w, after)


def test_a_role_changes_only_on_entry_into_switching() -> None:
    w = WorkerState(WorkerKind.ENGINE, R.DECODE, Phase.READY)
    assert moved(w, Phase.SWITCHING, R.PREFILL).role is R.PREFILL
    with pytest.raises(TransitionError, match="must happen on entry into switching"):
        moved(w, Phase.DRAINING, R.PREFILL)
    with pytest.raises(TransitionError, match="trainer workers cannot take role decode"):
        moved(WorkerState(WorkerKind.TRAINER, R.TRAIN), Phase.SWITCHING, R.DECODE)


def test_null_workers_keep_the_table() -> None:
    nw = NullWorkers()
    nw.execute(_cmd(A.START, role=R.DECODE))
    assert nw.workers["w0"] == WorkerState(WorkerKind.ENGINE, R.DECODE, Phase.READY)
    with pytest.raises(TransitionError, match="w0 already runs"):
        nw.execute(_cmd(A.START, role=R.DECODE))
    nw.execute(_cmd(A.DRAIN))
    assert nw.workers["w0"].phase is Phase.DRAINING
    with pytest.raises(TransitionError, match="engine workers cannot take role train"):
        nw.execute(_cmd(A.ONLOAD, role=R.TRAIN))
    with pytest.raises(TransitionError, match="switch of w0 needs a role"):
        nw.execute(_cmd(A.SWITCH))
    assert nw.workers["w0"].phase is Phase.DRAINING  # a refused command changes nothing
    nw.execute(_cmd(ControlAction.ABORT_DRAIN))
    assert nw.workers["w0"] == WorkerState(WorkerKind.ENGINE, R.DECODE, Phase.READY)
    nw.execute(_cmd(A.SLEEP, role=R.IDLE))
    assert nw.workers["w0"] == WorkerState(WorkerKind.ENGINE, R.IDLE, Phase.READY, asleep=True)
    nw.execute(_cmd(A.STOP))
    assert nw.worker_ids() == ()
    # a worker it never started is adopted as a ready one: an engine, or a trainer
    nw.execute(_cmd(A.DRAIN, "e9"))
    nw.execute(_cmd(A.SWITCH, "e9", role=R.DECODE))
    assert nw.workers["e9"] == WorkerState(WorkerKind.ENGINE, R.DECODE, Phase.READY)
    nw.execute(_cmd(A.OFFLOAD, "t9", role=R.IDLE))
    assert nw.workers["t9"].kind is WorkerKind.TRAINER
    with pytest.raises(TransitionError, match="trainer workers cannot take role decode"):
        nw.execute(_cmd(A.WAKE, "t9", role=R.DECODE))


def test_an_illegal_command_is_a_failed_ack_and_the_agent_goes_on(tmp_path: Path) -> None:
    """How the agent turns a command's exception into its Ack (no MPI involved here)."""
    agent = Agent(tmp_path, "a0", "n0", [], NullWorkers())
    agent._run_cmd(_cmd(A.START, role=R.DECODE))
    agent._run_cmd(_cmd(A.START, role=R.DECODE))
    agent._run_cmd(_cmd(A.DRAIN))
    acks = [agent._acks.get_nowait() for _ in range(3)]
    assert [a.ok for a in acks] == [True, False, True]
    assert acks[1].error is not None
    assert acks[1].error.startswith("TransitionError: w0 already runs (ready)")


def test_the_ack_of_a_start_or_a_wake_carries_the_engines_url(tmp_path: Path) -> None:
    workers = ProcessWorkers({"*": FAKE}, {"n0/0": 0})
    agent = Agent(tmp_path, "a0", "n0", [], workers)
    try:
        for cmd in (
            _cmd(A.START, role=R.DECODE, gpu_ids=("n0/0",)),
            _cmd(A.SLEEP, role=R.IDLE),
            _cmd(A.WAKE, role=R.DECODE),
            _cmd(A.DRAIN),
        ):
            agent._run_cmd(cmd)
        acks = [agent._acks.get_nowait() for _ in range(4)]
        assert all(a.ok for a in acks), acks
        url = workers.base_url("w0")
        assert url.startswith("http://127.0.0.1:")
        assert [a.url for a in acks] == [url, None, url, None]
        assert NullWorkers().engine_url("w0") is None
    finally:
        workers.stop_all(5.0)
        agent._pool.shutdown()


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


def test_an_engine_on_the_nodes_name_listens_there_and_its_url_says_so(tmp_path: Path) -> None:
    """``pearl agent --engine-host NAME`` (``agents.engine_host: node``): the engine is
    told to listen on ``{host}``, and the URL the agent reports names it, so that a router
    on another node reaches it."""
    import socket

    from pearl.cluster.agent_payload import AgentPayload

    host = socket.gethostname()
    workers = ProcessWorkers({"*": [*FAKE, "--host", "{host}"]}, {"n0/0": 0}, host=host)
    try:
        workers.execute(_cmd(A.START, role=R.DECODE, gpu_ids=("n0/0",)))
        url = workers.base_url("w0")
        assert url.startswith(f"http://{host}:")
        assert call(lambda c: c.health(), url, 5.0)
    finally:
        workers.stop_all(5.0)
    argv = AgentPayload(str(tmp_path), "h20", engine_host="node").command("n1", "0")
    assert argv[argv.index("--engine-host") + 1] == host
    assert "--engine-host" not in AgentPayload(str(tmp_path), "h20").command("n1", "0")


def test_a_workers_gpus_are_positions_in_the_jobs_visible_devices() -> None:
    """Slurm lists the job's devices (``4,5`` on a node without device cgroups): the
    worker on the job's second GPU gets device 5, not 1; without a list, the number."""
    from pearl.control.workers import visible_devices

    assert visible_devices(["1"], {"CUDA_VISIBLE_DEVICES": "4,5"}) == ["5"]
    assert visible_devices(["0", "1"], {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}) == [
        "GPU-a",
        "GPU-b",
    ]
    assert visible_devices(["1"], {}) == ["1"]
