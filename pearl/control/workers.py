"""The worker processes of one node's GPUs, as the agent manages them.

:class:`ProcessWorkers` launches the engine command configured for a role (an argv
template; ``{port}`` (its HTTP port), ``{kv_port}`` (a second free port, for the
engine's KV side channel: NIXL's handshake), ``{host}`` (the address it listens on, ``host``),
``{role}`` and ``{worker_id}`` are filled in by
``str.format``, so literal braces are doubled) with ``CUDA_VISIBLE_DEVICES`` set to the
worker's GPUs (their local indices, as positions in the agent's own
``CUDA_VISIBLE_DEVICES`` where Slurm set one: ``visible_devices``), waits for
``GET /health``, and drives it over vLLM's HTTP routes through the one engine client
(:mod:`pearl.engines.client`; one ``asyncio.run`` per operation, as the agent's command
threads are synchronous):
``POST /sleep``, ``POST /wake_up``, ``GET /metrics`` (``vllm:num_requests_running`` for
drains), and ``POST /collective_rpc`` with ``{"method": "reload_weights"}`` for
``sync_weights`` (vLLM's dev-mode route, ``VLLM_SERVER_DEV_MODE=1``: the engine reloads the
weights the trainer exported to its model path). An engine's error answer, or none, is a
``WorkerError`` naming the worker and the route. A trainer worker answers the same
routes: ``offload`` is ``/sleep`` (state to host memory, GPUs free), ``onload`` is
``/wake_up``. Stop is SIGTERM to the process group, then SIGKILL; an engine also gets
SIGTERM when its agent dies (``PR_SET_PDEATHSIG``, armed by ``pearl.control.pdeath``), so
none outlives the agent that manages its GPUs.
:class:`NullWorkers` only records roles and phases; the control-plane benchmark and
protocol tests use it.

Both keep each worker's kind, role and phase in the core's vocabulary
(:mod:`pearl.core.roles`), and every phase change goes through the core's one table
(``check_phase_edge``, with ``check_role`` and ``check_role_change`` where the role
changes), as ``pearl.core.apply`` does in the simulator: an illegal command raises
``TransitionError`` before the worker is touched, and the agent acknowledges it as failed
with that error. Per action (:func:`after`): drain, migrate: ready -> draining;
abort_drain: draining -> ready; switch, wake, sleep, offload, onload (each needs a role):
ready or draining -> switching (new role) -> ready; stop: -> stopping -> gone; start: a new
worker, starting -> ready once healthy (a trainer if its role is ``train``, else an
engine); sync_weights changes no phase. A command's changes are recorded once it has
succeeded (a failed one leaves the worker's recorded role and phase as they were), except
that a worker is ``starting`` while its start waits for ``/health`` and ``stopping`` while
its process is stopped. A worker still starting cannot be drained or switched: the table
has no such edge. ``engine_url`` is a worker's base URL (``http://HOST:PORT``, ``host``
127.0.0.1 unless the agent is given its node's name: ``pearl agent --engine-host``), which
the agent's ack of a start or a wake reports for the router. A worker whose process ends
by itself (a crash, an OOM kill, ``kill -9``) is found by ``exited`` (polled by the agent
every heartbeat) and forgotten: the agent reports it (``WorkersExited``) and the coordinator
takes it out of its state and of the router. What is left of its process group (vLLM's
engine core outlives an API server killed by ``kill -9``, and holds the GPU) is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar

from pearl.control import pdeath
from pearl.control.messages import Command, ControlAction
from pearl.core.plan import Action
from pearl.core.roles import (
    Phase,
    Role,
    TransitionError,
    WorkerKind,
    check_phase_edge,
    check_role,
    check_role_change,
)
from pearl.engines.client import EngineClient, EngineError, call

T = TypeVar("T")


class WorkerError(RuntimeError):
    """A worker operation that failed; the message goes into the Ack."""


class Workers(Protocol):
    def execute(self, cmd: Command) -> None: ...
    def stop_all(self, budget_s: float) -> None: ...
    def worker_ids(self) -> tuple[str, ...]: ...

    def engine_url(self, worker_id: str) -> str | None:
        """The base URL of the worker's HTTP server, as the agent reaches it (the one its
        ``Ack`` of a start or wake reports); None without one."""
        ...

    def exited(self) -> dict[str, int]:
        """The workers that have exited by themselves since the last call (a crash, a
        ``kill -9``), each with its exit status, forgotten here: the agent reports them."""
        ...


ROLE_CHANGES = frozenset({Action.SWITCH, Action.WAKE, Action.SLEEP, Action.OFFLOAD, Action.ONLOAD})
_SLEEPS = frozenset({Action.SLEEP, Action.OFFLOAD})


@dataclass(frozen=True)
class WorkerState:
    """One worker as its agent knows it. ``role`` is None only for a worker that
    :class:`NullWorkers` adopted from a command that names no role."""

    kind: WorkerKind
    role: Role | None
    phase: Phase = Phase.READY
    asleep: bool = False
    weight_syncs: int = 0


def moved(w: WorkerState, phase: Phase, role: Role | None = None) -> WorkerState:
    """``w`` after one edge of the core's transition table (and a new role, if given);
    ``TransitionError`` if the table does not allow it."""
    new_role = w.role if role is None else role
    check_phase_edge(w.phase, phase)
    if new_role is not None:
        check_role(w.kind, new_role)
        if w.role is not None:
            check_role_change(w.phase, phase, w.role, new_role)
    return replace(w, phase=phase, role=new_role)


def started(cmd: Command) -> WorkerState:
    """The worker a start command creates, in ``starting`` (role ``idle`` if it names none)."""
    role = cmd.role or Role.IDLE
    kind = WorkerKind.TRAINER if role is Role.TRAIN else WorkerKind.ENGINE
    return WorkerState(kind, role, Phase.STARTING, asleep=role is Role.IDLE)


def after(w: WorkerState, cmd: Command) -> WorkerState:
    """``w`` once ``cmd`` (any action but start) has succeeded, each phase change checked
    against the core's table: ``TransitionError`` if one is illegal."""
    a = cmd.action
    if a in (Action.DRAIN, Action.MIGRATE):
        return moved(w, Phase.DRAINING)
    if a is ControlAction.ABORT_DRAIN:
        return moved(w, Phase.READY)
    if a in ROLE_CHANGES:
        if cmd.role is None:
            raise TransitionError(f"{a.value} of {cmd.worker_id} needs a role")
        w = moved(w, Phase.SWITCHING, cmd.role)
        return replace(moved(w, Phase.READY), asleep=a in _SLEEPS)
    if a is Action.SYNC_WEIGHTS:
        return replace(w, weight_syncs=w.weight_syncs + 1)
    if a is Action.STOP:
        return moved(moved(w, Phase.STOPPING), Phase.GONE)
    raise WorkerError(f"action {a.value!r} is not supported here")


def _already_runs(worker_id: str, w: WorkerState) -> TransitionError:
    return TransitionError(f"{worker_id} already runs ({w.phase.value}): a start needs a new id")


class NullWorkers:
    """Bookkeeping only: every action the transition table allows succeeds at once.

    A worker it did not start (the benchmark's and the protocol tests' plans drive workers
    that exist only in the plan) is adopted on its first command as a ready worker in the
    command's role: a trainer for offload, onload or role ``train``, else an engine."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerState] = {}

    def execute(self, cmd: Command) -> None:
        wid = cmd.worker_id
        w = self.workers.get(wid)
        if cmd.action is Action.START:
            if w is not None:
                raise _already_runs(wid, w)
            self.workers[wid] = moved(started(cmd), Phase.READY)
            return
        if w is None:
            trainer = cmd.action in (Action.OFFLOAD, Action.ONLOAD) or cmd.role is Role.TRAIN
            w = WorkerState(WorkerKind.TRAINER if trainer else WorkerKind.ENGINE, cmd.role)
        w = after(w, cmd)
        if w.phase is Phase.GONE:
            self.workers.pop(wid, None)
        else:
            self.workers[wid] = w

    def stop_all(self, budget_s: float) -> None:
        self.workers.clear()

    def worker_ids(self) -> tuple[str, ...]:
        return tuple(self.workers)

    def engine_url(self, worker_id: str) -> str | None:
        return None  # nothing runs

    def exited(self) -> dict[str, int]:
        return {}  # nothing runs, so nothing dies


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on this host now (held open together while chosen)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


@dataclass
class _Proc:
    proc: subprocess.Popen[bytes]
    port: int
    state: WorkerState
    log: object = None
    kv_port: int = 0


@dataclass
class ProcessWorkers:
    engine_commands: dict[str, list[str]]  # role (or "*") -> argv template
    gpu_index: dict[str, int]  # GPU id -> local CUDA index
    log_dir: str | None = None
    host: str = "127.0.0.1"  # where the agent reaches its engines: the URLs its acks report
    procs: dict[str, _Proc] = field(default_factory=dict)
    # guards ``procs`` against ``exited`` (the agent's main thread) and a stop (a command
    # thread) taking the same worker
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def url(self, worker_id: str, path: str) -> str:
        return f"http://{self.host}:{self.procs[worker_id].port}{path}"

    def base_url(self, worker_id: str) -> str:
        return self.url(worker_id, "")

    def engine_url(self, worker_id: str) -> str | None:
        return self.base_url(worker_id) if worker_id in self.procs else None

    def worker_ids(self) -> tuple[str, ...]:
        return tuple(self.procs)

    def _engine(
        self,
        worker_id: str,
        route: str,
        op: Callable[[EngineClient], Awaitable[T]],
        timeout_s: float,
    ) -> T:
        """``op`` on the worker's engine; an error answer or none is a ``WorkerError``
        naming the worker and ``route`` (``POST /sleep``)."""
        try:
            return call(op, self.base_url(worker_id), max(0.05, timeout_s))
        except EngineError as err:
            raise WorkerError(f"{worker_id}: {route}: {err}") from None

    def exited(self) -> dict[str, int]:
        """Ready (or asleep, draining, switching) workers whose process has ended without a
        stop; one that exits while it starts fails its start instead."""
        out: dict[str, int] = {}
        with self._lock:
            for wid, p in list(self.procs.items()):
                code = p.proc.poll()
                if code is None or p.state.phase is Phase.STARTING:
                    continue
                del self.procs[wid]
                p.state = replace(p.state, phase=Phase.GONE)
                out[wid] = code
                _kill_group(p.proc.pid)  # its children (vLLM's engine core) hold the GPU
        return out

    def healthy(self, worker_id: str, timeout: float = 1.0) -> bool:
        return call(lambda c: c.health(), self.base_url(worker_id), max(0.05, timeout))

    def execute(self, cmd: Command) -> None:
        end = time.monotonic() + cmd.deadline_s
        if cmd.action is Action.START:
            self._start(cmd, end)
            return
        wid = cmd.worker_id
        p = self.procs.get(wid)
        if p is None:
            raise WorkerError(f"no worker {wid} on this node")
        if p.proc.poll() is not None:
            raise WorkerError(f"{wid} exited with {p.proc.returncode}")
        new = after(p.state, cmd)  # checked before the worker is touched

        def left() -> float:
            return end - time.monotonic()

        a = cmd.action
        if a in _SLEEPS:
            self._engine(wid, "POST /sleep", lambda c: c.sleep(1), left())
        elif a in (Action.WAKE, Action.ONLOAD) or (a is Action.SWITCH and p.state.asleep):
            self._engine(wid, "POST /wake_up", lambda c: c.wake_up(), left())
        elif a is Action.SYNC_WEIGHTS:
            self._engine(wid, "POST /collective_rpc", lambda c: c.reload_weights(), left())
        elif a is Action.DRAIN:
            self._drain(wid, end)
        elif a is Action.STOP:
            self._stop(wid, left())
            return
        p.state = new

    def _start(self, cmd: Command, end: float) -> None:
        wid = cmd.worker_id
        if wid in self.procs:
            raise _already_runs(wid, self.procs[wid].state)
        state = started(cmd)
        role = cmd.role or Role.IDLE
        argv = self.engine_commands.get(role.value) or self.engine_commands.get("*")
        if not argv:
            raise WorkerError(f"no engine command configured for role {role.value!r}")
        try:
            idx = [str(self.gpu_index[g]) for g in cmd.gpu_ids]
        except KeyError as e:
            raise WorkerError(f"GPU {e.args[0]} is not on this node") from None
        port, kv_port = free_ports(2)
        fill = {"port": port, "kv_port": kv_port, "role": role.value, "worker_id": wid}
        fill["host"] = self.host  # the address it listens on: the one its URL names
        args = [a.format(**fill) for a in argv]
        args = pdeath.command(args)  # the engine dies with the agent
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(visible_devices(idx))}
        out = (
            open(os.path.join(self.log_dir, f"{cmd.worker_id}.log"), "ab")  # noqa: SIM115
            if self.log_dir
            else subprocess.DEVNULL
        )
        proc = subprocess.Popen(
            args,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        p = self.procs[wid] = _Proc(proc, port, state, out, kv_port)
        try:
            healthy = call(lambda c: self._until_healthy(c, wid, p, end), self.base_url(wid))
        except WorkerError:
            raise
        except BaseException:
            if self.procs.get(wid) is p:
                self._stop(wid, 2.0)
            raise
        if healthy:
            p.state = moved(p.state, Phase.READY)
            return
        if self.procs.get(wid) is p:
            self._stop(wid, 2.0)
        raise WorkerError(f"{wid} not healthy within {cmd.deadline_s} s")

    async def _until_healthy(self, client: EngineClient, wid: str, p: _Proc, end: float) -> bool:
        """Polls ``/health`` until it answers (True) or ``end`` passes (False); a
        ``WorkerError`` if the process exits or is stopped meanwhile."""
        while time.monotonic() < end:
            if self.procs.get(wid) is not p:  # a stop came meanwhile (start cancelled)
                raise WorkerError(f"{wid} stopped while starting")
            if p.proc.poll() is not None:
                self.procs.pop(wid, None)
                p.state = moved(p.state, Phase.GONE)
                raise WorkerError(f"{wid} exited with {p.proc.returncode} on start")
            client.timeout_s = max(0.05, min(0.5, end - time.monotonic()))
            if await client.health():
                return True
            await asyncio.sleep(0.05)
        return False

    def _drain(self, worker_id: str, end: float) -> None:
        """Waits until ``vllm:num_requests_running`` is 0 (or absent), polling ``/metrics``."""

        async def until_idle(client: EngineClient) -> float:
            while True:
                running = await client.num_requests_running()
                if running == 0 or time.monotonic() > end:
                    return running
                await asyncio.sleep(0.05)

        running = self._engine(worker_id, "GET /metrics", until_idle, end - time.monotonic())
        if running:
            raise WorkerError(f"{worker_id} still has {running:g} requests running")

    def _stop(self, worker_id: str, budget_s: float) -> None:
        with self._lock:
            p = self.procs.get(worker_id)
            if p is None:  # ``exited`` took it meanwhile
                raise WorkerError(f"no worker {worker_id} on this node")
            p.state = moved(p.state, Phase.STOPPING)
            del self.procs[worker_id]
        if p.proc.poll() is None:
            _signal_group(p.proc.pid, signal.SIGTERM)
            try:
                p.proc.wait(timeout=max(0.05, budget_s * 0.8))
            except subprocess.TimeoutExpired:
                _signal_group(p.proc.pid, signal.SIGKILL)
                p.proc.wait()
        _kill_group(p.proc.pid)  # what its leader left behind
        p.state = moved(p.state, Phase.GONE)

    def stop_all(self, budget_s: float) -> None:
        end = time.monotonic() + budget_s
        with self._lock:
            procs = list(self.procs.values())
        for p in procs:
            if p.proc.poll() is None:
                _signal_group(p.proc.pid, signal.SIGTERM)
        for wid in list(self.procs):
            with contextlib.suppress(WorkerError):  # ``exited`` took it meanwhile
                self._stop(wid, max(0.05, end - time.monotonic()))


def visible_devices(positions: list[str], environ: dict[str, str] | None = None) -> list[str]:
    """The devices at ``positions`` of this process's ``CUDA_VISIBLE_DEVICES`` (what Slurm
    gave the job: ``4,5`` on a node without device cgroups, ``0,1`` with them, or UUIDs);
    a position past its end, or with none set, is the device of that number."""
    env = os.environ if environ is None else environ
    given = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    return [given[int(p)] if int(p) < len(given) else p for p in positions]


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    """``sig`` to a worker's process group (its leader is the worker), if any is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _kill_group(pgid: int) -> None:
    """SIGKILL to what is left of an ended worker's process group: a leader killed by
    ``kill -9`` leaves its children (vLLM's engine core, holding the GPU) running."""
    _signal_group(pgid, signal.SIGKILL)
