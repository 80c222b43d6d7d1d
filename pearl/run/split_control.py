"""The control plane of ``pearl run`` on Slurm: the run's own job in-process, elastic
nodes over MPI.

The run's job holds the trainer's and the base rollout's devices and runs the data plane
(router, rollout manager, the trainer's process, the base engines); the elastic
allocations are Slurm jobs of their own whose node agents connect to the run's
``ControlServer`` (``pearl.control``), as they connect to the bare coordinator. So one plan
has steps of both kinds, and :class:`SplitServer` is what ``execute_plan`` walks over: a
step on one of the job's nodes runs on :class:`~pearl.run.control.LocalServer` (threads of
this process, as in a local run), a step on any other node goes to that node's agent. One
walk, one set of deadlines and one compensation of failed drains for both (the reason
``LocalServer`` exists, docs/architecture.md).

Weights: an engine an agent starts serves the model it was started with, so before the
router hears of a start or a wake on an elastic node (:class:`ElasticWeights`, the
listener in front of the router's), the engine reloads the trainer's latest published
weights over HTTP; one that fails is not added to the router (it would serve old
weights), and the plan goes on. A ``sync_weights`` step on an elastic node is the same
reload, run here (the agent's own reload would read the base model's path).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from pearl.control.coordinator_side import CommandResult, CommandStatus, ControlServer
from pearl.control.execute import PlanStepResult
from pearl.control.messages import Command
from pearl.control.workers import WorkerError
from pearl.coordinator.control_plane import MpiControl, plan_outcome
from pearl.coordinator.reconcile import AgentEvent
from pearl.core.execution import PlanOutcome
from pearl.core.plan import Action, PlanStep, TransitionPlan
from pearl.run.control import (
    LocalControl,
    LocalServer,
    RouterListener,
    Weights,
    reload_latest,
    walk,
)

log = logging.getLogger(__name__)
RELOADED_ON = frozenset({Action.START, Action.WAKE})


@dataclass
class ElasticEngines:
    """The elastic nodes' engines as this process reaches them: their URLs (from their
    agents' acks of a start or a wake) and the reload of the latest weights."""

    weights: Weights
    timeout_s: float = 60.0
    urls: dict[str, str] = field(default_factory=dict)  # worker id -> base URL
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def learn(self, worker_id: str, url: str) -> None:
        with self._lock:
            self.urls[worker_id] = url

    def forget(self, worker_ids: Iterable[str]) -> None:
        with self._lock:
            for wid in worker_ids:
                self.urls.pop(wid, None)

    def reload(self, worker_id: str) -> None:
        """The latest published weights into ``worker_id`` (none published: nothing)."""
        with self._lock:
            url = self.urls.get(worker_id)
        if url is None:
            if self.weights() is None:
                return
            raise WorkerError(f"{worker_id}: no URL known (not started by this run)")
        reload_latest(self.weights, worker_id, url, self.timeout_s)

    # the ``Workers`` of a sync_weights step on an elastic node (LocalServer runs it)
    def execute(self, cmd: Command) -> None:
        if cmd.action is not Action.SYNC_WEIGHTS:
            raise WorkerError(f"{cmd.worker_id}: {cmd.action} is its agent's, not this run's")
        self.reload(cmd.worker_id)

    def stop_all(self, budget_s: float) -> None:
        return None

    def worker_ids(self) -> tuple[str, ...]:
        return ()

    def engine_url(self, worker_id: str) -> str | None:
        with self._lock:
            return self.urls.get(worker_id)

    def exited(self) -> dict[str, int]:
        return {}  # no process of its own (the agents report their engines')


class ElasticWeights:
    """The router's listener, with an elastic engine's weights reloaded before a start or
    a wake reaches the router (the module docstring)."""

    def __init__(
        self, router: RouterListener, engines: ElasticEngines, local_nodes: Iterable[str]
    ) -> None:
        self.router, self.engines = router, engines
        self.local_nodes = frozenset(local_nodes)

    def step_started(self, step: PlanStep) -> None:
        self.router.step_started(step)

    def step_ended(self, step: PlanStep, result: PlanStepResult) -> None:
        elastic = step.node not in self.local_nodes
        if elastic and result.ok and step.action in RELOADED_ON and result.url:
            self.engines.learn(step.worker_id, result.url)
            try:
                self.engines.reload(step.worker_id)
            except WorkerError as err:  # serving old weights would break the staleness books
                log.warning("%s left out of the router: %s", step.worker_id, err)
                failed = CommandStatus.FAILED
                result = replace(result, status=failed, url=None, error=str(err))
        self.router.step_ended(step, result)

    def drain_undone(self, step: PlanStep, result: PlanStepResult) -> None:
        self.router.drain_undone(step, result)

    def workers_lost(self, worker_ids: tuple[str, ...], reason: str) -> None:
        self.engines.forget(worker_ids)
        self.router.workers_lost(worker_ids, reason)


class SplitServer:
    """``execute_plan``'s server over the job's own nodes (``local``) and the agents'
    (``remote``); an elastic ``sync_weights`` runs on ``reloads`` (the module docstring)."""

    def __init__(self, local: LocalServer, remote: ControlServer, reloads: LocalServer) -> None:
        self.local, self.remote, self.reloads = local, remote, reloads
        self._ids = itertools.count(1)
        self._side: dict[str, Any] = {}  # command id -> the server it went to

    def agent_for_node(self, node: str) -> str | None:
        return self.local.agent_for_node(node) or self.remote.agent_for_node(node)

    def new_cmd_id(self) -> str:
        return f"s{next(self._ids)}"

    def send_commands(self, cmds: Iterable[tuple[str, Command]]) -> None:
        by_side: dict[int, tuple[Any, list[tuple[str, Command]]]] = {}
        for agent_id, cmd in cmds:
            side = self._server_of(agent_id, cmd)
            self._side[cmd.cmd_id] = side
            by_side.setdefault(id(side), (side, []))[1].append((agent_id, cmd))
        for side, batch in by_side.values():
            side.send_commands(batch)

    def _server_of(self, agent_id: str, cmd: Command) -> Any:
        if self.local.agent_for_node(agent_id.removeprefix("local:")) == agent_id:
            return self.local
        return self.reloads if cmd.action is Action.SYNC_WEIGHTS else self.remote

    def wait_results(
        self, cmd_ids: Iterable[str], timeout_s: float | None = None, any_: bool = False
    ) -> dict[str, CommandResult]:
        """Until all (with ``any_``, one) of ``cmd_ids`` have a result, whichever server
        runs them, or ``timeout_s``."""
        left = list(cmd_ids)
        end = None if timeout_s is None else time.monotonic() + timeout_s
        done: dict[str, CommandResult] = {}
        while left:
            for side in (self.local, self.reloads, self.remote):
                mine = [c for c in left if self._side[c] is side]
                if mine:
                    done.update(side.wait_results(mine, timeout_s=0.02, any_=True))
            left = [c for c in left if c not in done]
            if (any_ and done) or (end is not None and time.monotonic() > end):
                break
        for c in done:
            self._side.pop(c, None)
        return done


class SplitControl:
    """The coordinator's ``ControlPlane`` of a run on Slurm (the module docstring)."""

    def __init__(
        self,
        local: LocalControl,
        remote: MpiControl,
        engines: ElasticEngines,
        *,
        min_deadline_s: float = 60.0,
        deadline_factor: float = 3.0,
    ) -> None:
        self.local, self.remote, self.engines = local, remote, engines
        nodes = local.server.nodes
        reloads = LocalServer([], engines, engines, max_threads=4)
        self.server = SplitServer(local.server, remote.server, reloads)
        router = local.listener
        self.listener = ElasticWeights(router, engines, nodes) if router is not None else None
        self.min_deadline_s, self.deadline_factor = min_deadline_s, deadline_factor

    def execute(self, plan: TransitionPlan) -> PlanOutcome:
        result = walk(self.server, plan, self.listener, self.min_deadline_s, self.deadline_factor)
        return plan_outcome(result)

    def events(self) -> list[AgentEvent]:
        return [*self.local.events(), *self.remote.events()]

    def agents(self) -> list[dict[str, Any]]:
        return [*self.local.agents(), *self.remote.agents()]

    def workers_lost(self, worker_ids: tuple[str, ...], reason: str) -> None:
        if self.listener is not None:
            self.listener.workers_lost(worker_ids, reason)

    def close(self, budget_s: float = 30.0, restarting: bool = False) -> None:
        """Close both; ``restarting``: the elastic agents wait for the next incarnation."""
        try:
            self.remote.close(restarting)
        finally:
            self.server.reloads.close()
            self.local.close(budget_s)
