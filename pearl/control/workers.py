"""The worker processes of one node's GPUs, as the agent manages them.

:class:`ProcessWorkers` launches the engine command configured for a role (an argv
template; ``{port}``, ``{role}``, ``{worker_id}`` are filled in) with
``CUDA_VISIBLE_DEVICES`` set to the local indices of the worker's GPUs, waits for
``GET /health``, and drives it over vLLM's HTTP endpoints: ``POST /sleep``,
``POST /wake_up``, ``GET /metrics`` (``vllm:num_requests_running`` for drains), and
``POST /collective_rpc`` with ``{"method": "reload_weights"}`` for ``sync_weights`` (vLLM's
dev-mode route, ``VLLM_SERVER_DEV_MODE=1``: the engine reloads the weights the trainer
exported to its model path). A trainer worker answers the same routes: ``offload`` is
``/sleep`` (state to host memory, GPUs free), ``onload`` is ``/wake_up``. Stop is SIGTERM to
the process group, then SIGKILL; an engine also gets SIGTERM when its agent dies
(``PR_SET_PDEATHSIG``, armed by ``pearl.control.pdeath``), so none outlives the agent
that manages its GPUs.
:class:`NullWorkers` only records roles and phases; the control-plane benchmark and
protocol tests use it.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Protocol

from pearl.control import pdeath
from pearl.control.messages import ABORT_DRAIN, Command

RELOAD_WEIGHTS = b'{"method": "reload_weights"}'


class WorkerError(RuntimeError):
    """A worker operation that failed; the message goes into the Ack."""


class Workers(Protocol):
    def execute(self, cmd: Command) -> None: ...
    def stop_all(self, budget_s: float) -> None: ...
    def worker_ids(self) -> tuple[str, ...]: ...


@dataclass
class WorkerState:
    role: str | None
    phase: str = "ready"
    asleep: bool = False
    weight_syncs: int = 0


class NullWorkers:
    """Bookkeeping only: every supported action succeeds at once."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerState] = {}

    def execute(self, cmd: Command) -> None:
        w = self.workers.setdefault(cmd.worker_id, WorkerState(cmd.role))
        _apply(w, cmd)
        if cmd.action == "stop":
            del self.workers[cmd.worker_id]

    def stop_all(self, budget_s: float) -> None:
        self.workers.clear()

    def worker_ids(self) -> tuple[str, ...]:
        return tuple(self.workers)


def _apply(w: WorkerState, cmd: Command) -> None:
    a = cmd.action
    if a in ("drain", "migrate"):
        w.phase = "draining"
    elif a == ABORT_DRAIN:
        w.phase = "ready"
    elif a in ("switch", "wake", "sleep", "start", "offload", "onload"):
        w.role, w.phase, w.asleep = cmd.role, "ready", a in ("sleep", "offload")
    elif a == "sync_weights":
        w.weight_syncs += 1
    elif a == "stop":
        w.phase = "gone"
    else:
        raise WorkerError(f"action {a!r} is not supported by this agent")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class _Proc:
    proc: subprocess.Popen[bytes]
    port: int
    state: WorkerState
    log: object = None


@dataclass
class ProcessWorkers:
    engine_commands: dict[str, list[str]]  # role (or "*") -> argv template
    gpu_index: dict[str, int]  # GPU id -> local CUDA index
    log_dir: str | None = None
    host: str = "127.0.0.1"
    procs: dict[str, _Proc] = field(default_factory=dict)

    def url(self, worker_id: str, path: str) -> str:
        return f"http://{self.host}:{self.procs[worker_id].port}{path}"

    def worker_ids(self) -> tuple[str, ...]:
        return tuple(self.procs)

    def _http(
        self, worker_id: str, path: str, method: str, timeout: float, body: bytes | None = None
    ) -> str:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        req = urllib.request.Request(
            self.url(worker_id, path), data=body, headers=headers, method=method
        )
        try:
            with urllib.request.urlopen(req, timeout=max(0.05, timeout)) as r:
                reply: bytes = r.read()
                return reply.decode()
        except (urllib.error.URLError, OSError) as e:
            raise WorkerError(f"{worker_id}: {method} {path}: {e}") from None

    def healthy(self, worker_id: str, timeout: float = 1.0) -> bool:
        try:
            self._http(worker_id, "/health", "GET", timeout)
            return True
        except WorkerError:
            return False

    def execute(self, cmd: Command) -> None:
        end = time.monotonic() + cmd.deadline_s
        if cmd.action == "start":
            self._start(cmd, end)
            return
        p = self.procs.get(cmd.worker_id)
        if p is None:
            raise WorkerError(f"no worker {cmd.worker_id} on this node")
        if p.proc.poll() is not None:
            raise WorkerError(f"{cmd.worker_id} exited with {p.proc.returncode}")

        def left() -> float:
            return end - time.monotonic()

        if cmd.action in ("sleep", "offload"):
            self._http(cmd.worker_id, "/sleep?level=1", "POST", left())
        elif cmd.action in ("wake", "onload") or (cmd.action == "switch" and p.state.asleep):
            self._http(cmd.worker_id, "/wake_up", "POST", left())
        elif cmd.action == "sync_weights":
            self._http(cmd.worker_id, "/collective_rpc", "POST", left(), RELOAD_WEIGHTS)
        elif cmd.action == "drain":
            self._drain(cmd.worker_id, end)
        elif cmd.action == "stop":
            self._stop(cmd.worker_id, left())
            return
        _apply(p.state, cmd)

    def _start(self, cmd: Command, end: float) -> None:
        if cmd.worker_id in self.procs:
            raise WorkerError(f"worker {cmd.worker_id} already runs")
        role = cmd.role or "idle"
        argv = self.engine_commands.get(role) or self.engine_commands.get("*")
        if not argv:
            raise WorkerError(f"no engine command configured for role {role!r}")
        try:
            idx = [str(self.gpu_index[g]) for g in cmd.gpu_ids]
        except KeyError as e:
            raise WorkerError(f"GPU {e.args[0]} is not on this node") from None
        port = free_port()
        args = [a.format(port=port, role=role, worker_id=cmd.worker_id) for a in argv]
        args = pdeath.command(args)  # the engine dies with the agent
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(idx)}
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
        self.procs[cmd.worker_id] = _Proc(proc, port, WorkerState(role, "starting"), out)
        while time.monotonic() < end:
            if proc.poll() is not None:
                del self.procs[cmd.worker_id]
                raise WorkerError(f"{cmd.worker_id} exited with {proc.returncode} on start")
            if self.healthy(cmd.worker_id, timeout=0.5):
                self.procs[cmd.worker_id].state = WorkerState(role, "ready", role == "idle")
                return
            time.sleep(0.05)
        self._stop(cmd.worker_id, 2.0)
        raise WorkerError(f"{cmd.worker_id} not healthy within {cmd.deadline_s} s")

    def _drain(self, worker_id: str, end: float) -> None:
        while True:
            text = self._http(worker_id, "/metrics", "GET", end - time.monotonic())
            m = re.search(r"^vllm:num_requests_running(?:\{[^}]*\})?\s+(\S+)", text, re.M)
            if m is None or float(m.group(1)) == 0:
                return
            if time.monotonic() > end:
                raise WorkerError(f"{worker_id} still has {m.group(1)} requests running")
            time.sleep(0.05)

    def _stop(self, worker_id: str, budget_s: float) -> None:
        p = self.procs.pop(worker_id)
        if p.proc.poll() is None:
            os.killpg(p.proc.pid, signal.SIGTERM)
            try:
                p.proc.wait(timeout=max(0.05, budget_s * 0.8))
            except subprocess.TimeoutExpired:
                os.killpg(p.proc.pid, signal.SIGKILL)
                p.proc.wait()

    def stop_all(self, budget_s: float) -> None:
        end = time.monotonic() + budget_s
        for wid in list(self.procs):
            if self.procs[wid].proc.poll() is None:
                os.killpg(self.procs[wid].proc.pid, signal.SIGTERM)
        for wid in list(self.procs):
            self._stop(wid, max(0.05, end - time.monotonic()))
