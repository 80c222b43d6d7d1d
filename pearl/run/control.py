"""The coordinator's control plane on one machine: plans carried out in-process.

``pearl run`` has no node agents: its coordinator's plans act on this machine's processes
directly. :class:`LocalControl` implements the coordinator's ``ControlPlane``
(``pearl.coordinator.loop``) and reuses the cluster's pieces rather than copying them:

- the dependency walk, the deadlines, the aborts and the compensations of a failed plan
  are ``pearl.control.execute.execute_plan``'s, run over :class:`LocalServer` (the part of
  the MPI ``ControlServer`` it uses, each command run in a thread of this process instead
  of being sent to an agent);
- an engine's steps are ``pearl.control.workers.ProcessWorkers``' (:class:`LocalEngines`):
  start launches ``pearl engine serve`` on the step's slot and waits for ``/health``;
  drain waits until no request runs; sleep, wake go to the engine's HTTP routes; stop is
  SIGTERM, then SIGKILL. ``sync_weights`` and every start load the trainer's latest
  published weights (``weights()``: the directory and version the ``WeightPublisher``
  wrote last), not the base model;
- the trainer's steps (offload, onload) go to :class:`TrainerSlot`, the trainer's
  ``offload()``/``onload()`` under the lock its updates hold (never in the middle of one);
- the router hears of each step through :class:`RouterListener`: the steps'
  ``pearl.router.plan_steps.PlanSteps`` on the router's event loop, reached from the
  coordinator's thread with ``asyncio.run_coroutine_threadsafe``.

A "device" here is a slot the run accounts for: on a machine with enough cores each slot
gets its own cores (``slot_cores``: the engine started with ``taskset -c``); otherwise the
engines share the machine's cores, unpinned (docs/run.md).

Every node is this machine: one local agent per node the run knows (the base job's and
``localhost``, where ``LocalBackend`` grants elastic allocations), always alive.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import shutil
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pearl.cluster.local_backend import LOCAL_NODE
from pearl.control.coordinator_side import CommandResult, CommandStatus
from pearl.control.execute import PlanResult, PlanStepResult, StepListener, execute_plan
from pearl.control.messages import Command
from pearl.control.workers import ProcessWorkers, WorkerError, Workers, after
from pearl.coordinator.control_plane import plan_outcome
from pearl.coordinator.reconcile import AgentEvent
from pearl.core.execution import PlanOutcome
from pearl.core.observation import TrainerPhase, TrainerStatus
from pearl.core.plan import Action, PlanStep, TransitionPlan
from pearl.core.roles import Role, TransitionError
from pearl.engines.client import EngineError, call
from pearl.router.plan_steps import PlanSteps
from pearl.trainer.remote import TrainerLost

log = logging.getLogger(__name__)

TRAINER_ACTIONS = frozenset({Action.OFFLOAD, Action.ONLOAD})
Weights = Callable[[], tuple[Path, int] | None]  # the latest published weights, if any


def slot_cores(slots: Sequence[str], cpus: Sequence[int] | None = None) -> dict[str, list[int]]:
    """Each slot's own cores, where the machine has at least two per slot (the rest of
    the run keeps the remainder); none (every process unpinned) otherwise."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
    per = len(cpus) // max(len(slots), 1)
    if not slots or per < 2 or shutil.which("taskset") is None:
        return {}
    return {s: cpus[i * per : (i + 1) * per] for i, s in enumerate(slots)}


@dataclass
class LocalEngines(ProcessWorkers):
    """``ProcessWorkers`` on this machine's slots, with the trainer's published weights:
    a started or woken engine loads them; ``sync_weights`` reloads the latest."""

    weights: Weights = lambda: None
    cores: dict[str, list[int]] = field(default_factory=dict)  # slot (GPU id) -> cores

    def execute(self, cmd: Command) -> None:
        if cmd.action is Action.SYNC_WEIGHTS:
            p = self.procs.get(cmd.worker_id)
            if p is None:
                raise WorkerError(f"no worker {cmd.worker_id} on this node")
            new = after(p.state, cmd)
            self._reload(cmd.worker_id, cmd.deadline_s)
            p.state = new
            return
        if cmd.action is Action.START:
            pinned = [c for g in cmd.gpu_ids for c in self.cores.get(g, [])]
            saved = dict(self.engine_commands)
            if pinned:
                prefix = ["taskset", "-c", ",".join(map(str, pinned))]
                self.engine_commands = {r: [*prefix, *a] for r, a in saved.items()}
            try:
                super().execute(cmd)
            finally:
                self.engine_commands = saved
            self._reload(cmd.worker_id, cmd.deadline_s)
            return
        super().execute(cmd)
        if cmd.action is Action.WAKE:  # it slept through the updates since
            self._reload(cmd.worker_id, cmd.deadline_s)

    def _reload(self, worker_id: str, timeout_s: float) -> None:
        reload_latest(self.weights, worker_id, self.base_url(worker_id), timeout_s)


def reload_latest(weights: Weights, worker_id: str, url: str, timeout_s: float) -> None:
    """The trainer's latest published weights (``weights()``) into the engine at ``url``;
    none published: nothing. An error answer, or none, is a ``WorkerError`` naming the
    worker and the route."""
    latest = weights()
    if latest is None:
        return
    path, version = latest
    try:
        call(
            lambda c: c.reload_weights(weights_path=str(path), weight_version=version),
            url,
            max(0.05, timeout_s),
        )
    except EngineError as err:
        raise WorkerError(f"{worker_id}: POST /collective_rpc: {err}") from None


class TrainerSlot:
    """The trainer's devices, as the plans lend them: ``offload``/``onload`` between
    updates (``update`` holds the same lock for the length of one, and waits while the
    trainer is offloaded); ``status``, if given, hears when the trainer wants them."""

    def __init__(self, trainer: Any, status: TrainerSource | None = None) -> None:
        self.trainer, self.status = trainer, status
        self.lock = threading.Lock()
        self._onloaded = threading.Event()
        self._onloaded.set()
        self.offloads = 0
        self.onloads = 0
        self.last_wait_s = 0.0  # the last update's wait for its devices

    @property
    def offloaded(self) -> bool:
        return not self._onloaded.is_set()

    def offload(self) -> None:
        with self.lock:
            self.trainer.offload()
            self._onloaded.clear()
            self.offloads += 1

    def onload(self) -> None:
        with self.lock:
            try:
                self.trainer.onload()
            except TrainerLost:  # nothing to onload: the run starts a new trainer, onloaded
                self._onloaded.set()  # (the loop's next call finds it lost and restarts it)
                raise
            self._onloaded.set()
            self.onloads += 1

    @contextlib.asynccontextmanager
    async def update(self) -> AsyncIterator[None]:
        """Hold the devices for one update (``pearl.trainer.loop.Devices``): the status
        says the trainer needs them until they are back (``needs_gpus``), training while
        it holds them, waiting after."""
        if self.status is not None:
            self.status.waiting(batch_ready=True)
        t0 = time.monotonic()
        await asyncio.to_thread(self._acquire)
        self.last_wait_s = time.monotonic() - t0
        try:
            if self.status is not None:
                self.status.training()
            yield
        finally:
            self.lock.release()
            if self.status is not None:
                self.status.waiting()

    def _acquire(self) -> None:
        while True:
            self._onloaded.wait()
            self.lock.acquire()
            if self._onloaded.is_set():
                return
            self.lock.release()


@dataclass
class TrainerWorkers:
    """The trainer as a ``Workers``: offload and onload on its :class:`TrainerSlot`."""

    slot: TrainerSlot
    worker_ids_: tuple[str, ...] = ()

    def execute(self, cmd: Command) -> None:
        if cmd.action is Action.OFFLOAD:
            self.slot.offload()
        elif cmd.action is Action.ONLOAD:
            self.slot.onload()
        else:
            raise WorkerError(f"{cmd.worker_id}: the trainer does not {cmd.action}")

    def stop_all(self, budget_s: float) -> None:
        return None

    def worker_ids(self) -> tuple[str, ...]:
        return self.worker_ids_

    def engine_url(self, worker_id: str) -> str | None:
        return None

    def exited(self) -> dict[str, int]:
        return {}  # no process of its own (the trainer's process is the run's to restart)


class TrainerSource:
    """The trainer's status for the coordinator (beside the ``WorkloadSource``): training
    (``step_ends_at_s``: the update's start plus the mean of the last ``window`` updates'
    measured times, the profile's train time before the first) or waiting for its next
    batch, and ``needs_gpus`` once that batch is complete. The trainer's loop tells it
    (thread-safe); the coordinator calls it."""

    def __init__(self, clock: Callable[[], float], train_time_s: float, window: int = 4) -> None:
        self.clock, self.train_time_s = clock, train_time_s
        self._lock = threading.Lock()
        self._status = TrainerStatus(phase=TrainerPhase.WAITING)
        self._started_s: float | None = None
        self._measured_s: collections.deque[float] = collections.deque(maxlen=window)

    def training(self) -> None:
        now = self.clock()
        with self._lock:
            self._started_s = now
            expected_s = statistics.fmean(self._measured_s) if self._measured_s else None
        ends = now + (self.train_time_s if expected_s is None else expected_s)
        self._set(TrainerStatus(phase=TrainerPhase.TRAINING, step_ends_at_s=ends))

    def waiting(self, batch_ready: bool = False) -> None:
        now = self.clock()
        with self._lock:
            if self._started_s is not None:  # an update ended: its time, measured
                self._measured_s.append(now - self._started_s)
                self._started_s = None
        self._set(TrainerStatus(phase=TrainerPhase.WAITING, needs_gpus=batch_ready))

    def _set(self, status: TrainerStatus) -> None:
        with self._lock:
            self._status = status

    def __call__(self) -> TrainerStatus:
        with self._lock:
            return self._status


@dataclass
class _Pending:
    cmd: Command
    deadline: float
    result: CommandResult | None = None


class LocalServer:
    """What ``execute_plan`` needs of a control server, on this machine: every node's
    agent is ``local:NODE``; a command runs in a thread on the engines' or the trainer's
    ``Workers``; one without a result by its deadline is a timeout."""

    def __init__(
        self, nodes: Iterable[str], engines: Workers, trainer: Workers, max_threads: int = 8
    ) -> None:
        self.nodes = list(dict.fromkeys(nodes))
        self.engines, self.trainer = engines, trainer
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="pearl-step")
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._pending: dict[str, _Pending] = {}

    def agent_id(self, node: str) -> str:
        return f"local:{node}"

    def agent_for_node(self, node: str) -> str | None:
        return self.agent_id(node) if node in self.nodes else None

    def new_cmd_id(self) -> str:
        return f"c{next(self._ids)}"

    def workers_for(self, cmd: Command) -> Workers:
        trainer = cmd.action in TRAINER_ACTIONS or cmd.role is Role.TRAIN
        return self.trainer if trainer else self.engines

    def send_commands(self, cmds: Iterable[tuple[str, Command]]) -> None:
        now = time.monotonic()
        for agent_id, cmd in cmds:
            with self._cond:
                self._pending[cmd.cmd_id] = _Pending(cmd, now + cmd.deadline_s)
            self._pool.submit(self._run, agent_id, cmd)

    def _run(self, agent_id: str, cmd: Command) -> None:
        t0 = time.monotonic()
        workers = self.workers_for(cmd)
        error: str | None = None
        try:
            workers.execute(cmd)
        except (TransitionError, WorkerError) as err:
            status, error = CommandStatus.FAILED, str(err)
        except Exception as err:  # any failure is the step's, never the plan thread's
            log.exception("step %s of %s", cmd.action, cmd.worker_id)
            status, error = CommandStatus.FAILED, f"{type(err).__name__}: {err}"
        else:
            status = CommandStatus.OK
        url = workers.engine_url(cmd.worker_id) if status is CommandStatus.OK else None
        result = CommandResult(
            cmd.cmd_id,
            agent_id,
            status is CommandStatus.OK,
            status,
            error,
            time.monotonic() - t0,
            url if cmd.action in (Action.START, Action.WAKE) else None,
        )
        with self._cond:
            p = self._pending.get(cmd.cmd_id)
            if p is not None and p.result is None:
                p.result = result
            self._cond.notify_all()

    def wait_results(
        self, cmd_ids: Iterable[str], timeout_s: float | None = None, any_: bool = False
    ) -> dict[str, CommandResult]:
        """Until all (with ``any_``, one) of ``cmd_ids`` have a result or a timeout."""
        ids = list(cmd_ids)
        end = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                now = time.monotonic()
                for cid in ids:
                    p = self._pending[cid]
                    if p.result is None and now > p.deadline:
                        p.result = CommandResult(
                            cid, "", False, CommandStatus.TIMEOUT, "no result", now - p.deadline
                        )
                done = {c: r for c in ids if (r := self._pending[c].result) is not None}
                if (any_ and done) or len(done) == len(ids) or (end is not None and now > end):
                    for c in done:
                        del self._pending[c]
                    return done
                wake = min(self._pending[c].deadline for c in ids if c not in done)
                self._cond.wait(max(0.01, min(wake, end or wake) - now))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class RouterListener:
    """Each plan step's start and end to the router's ``PlanSteps``, on its event loop."""

    def __init__(
        self, steps: PlanSteps, loop: asyncio.AbstractEventLoop, timeout_s: float = 10.0
    ) -> None:
        self.steps, self.loop, self.timeout_s = steps, loop, timeout_s

    def _on_loop(self, fn: Callable[[], object]) -> None:
        async def call() -> object:
            return fn()

        asyncio.run_coroutine_threadsafe(call(), self.loop).result(self.timeout_s)

    def step_started(self, step: PlanStep) -> None:
        self._on_loop(lambda: self.steps.start(step.action, step.worker_id))

    def step_ended(self, step: PlanStep, result: PlanStepResult) -> None:
        gpu_type, tp = step.gpu_type or None, len(step.gpu_ids) if step.gpu_type else None
        self._on_loop(
            lambda: self.steps.end(
                step.action, step.worker_id, step.role, result.url, result.ok, gpu_type, tp
            )
        )

    def drain_undone(self, step: PlanStep, result: PlanStepResult) -> None:
        self._on_loop(lambda: self.steps.drain_undone(step.worker_id, result.ok))

    def workers_lost(self, worker_ids: tuple[str, ...], reason: str) -> None:
        self._on_loop(lambda: self.steps.lost(worker_ids))


def walk(
    server: Any,
    plan: TransitionPlan,
    listener: StepListener | None,
    min_deadline_s: float,
    deadline_factor: float,
) -> PlanResult:
    """``execute_plan`` over a server that has the part of ``ControlServer`` it uses
    (``LocalServer``, ``pearl.run.split_control.SplitServer``)."""
    return execute_plan(
        server,
        plan,
        deadline_factor=deadline_factor,
        min_deadline_s=min_deadline_s,
        listener=listener,
    )


class LocalControl:
    """The coordinator's ``ControlPlane`` on this machine (the module docstring)."""

    def __init__(
        self,
        server: LocalServer,
        listener: RouterListener | None = None,
        *,
        min_deadline_s: float = 5.0,
        deadline_factor: float = 3.0,
    ) -> None:
        self.server, self.listener = server, listener
        self.min_deadline_s, self.deadline_factor = min_deadline_s, deadline_factor
        self._joined = False
        self.results: list[PlanResult] = []

    def execute(self, plan: TransitionPlan) -> PlanOutcome:
        result = walk(self.server, plan, self.listener, self.min_deadline_s, self.deadline_factor)
        self.results.append(result)
        return plan_outcome(result)

    def events(self) -> list[AgentEvent]:
        """Each node's agent joins once, at the first call, with the trainer's workers and
        the engines this incarnation started before it (the asleep ones on the trainer's
        slots): other engines a journal of an earlier incarnation holds died with it (they
        are lost, and the next plan starts engines again). After that, the engines that
        died by themselves (killed, crashed), reported as ``exited`` by every node's agent
        (the state knows which node each was on); this machine's agents never leave."""
        if self._joined:
            exited = self.server.engines.exited()
            if not exited:
                return []
            codes = ", ".join(f"{w} ({c})" for w, c in sorted(exited.items()))
            log.warning("engines exited by themselves: %s", codes)
            return [
                AgentEvent("exited", self.server.agent_id(n), n, codes, tuple(sorted(exited)))
                for n in self.server.nodes
            ]
        self._joined = True
        keep = (*self.server.trainer.worker_ids(), *self.server.engines.worker_ids())
        return [
            AgentEvent("joined", self.server.agent_id(n), n, workers=keep)
            for n in self.server.nodes
        ]

    def agents(self) -> list[dict[str, Any]]:
        return [
            {
                "agent_id": self.server.agent_id(n),
                "node": n,
                "gpus": [],
                "job_id": None,
                "state": "alive",
            }
            for n in self.server.nodes
        ]

    def workers_lost(self, worker_ids: tuple[str, ...], reason: str) -> None:
        if self.listener is not None:
            self.listener.workers_lost(worker_ids, reason)

    def close(self, budget_s: float = 30.0, restarting: bool = False) -> None:
        """Stop this machine's engines (``restarting`` changes nothing here: the next
        incarnation starts its own)."""
        self.server.close()
        self.server.engines.stop_all(budget_s)


def local_nodes(base_nodes: Iterable[str]) -> list[str]:
    """The nodes of a local run: the base job's, then ``localhost`` (elastic grants)."""
    return list(dict.fromkeys([*base_nodes, LOCAL_NODE]))
