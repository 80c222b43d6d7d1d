r"""The coordinator's loop: observe -> ``pearl.core.decide()`` -> journal -> act.

Each tick (every ``decision_interval_s`` of the injected clock):

1. observe: the allocation backend's events since the last tick, what happened to the
   node agents (``pearl.coordinator.reconcile``: workers lost with an agent; a grant held
   back until its agents have joined, released if they never do), the trainer's status
   (``TrainerSource``: training or waiting, and whether it wants its GPUs back; a default
   status where none is given) and the rollout workload (``WorkloadSource``: until the
   rollout manager exists, the snapshot it will write to ``run_dir/workload.json``; none
   means an empty batch);
2. decide, and journal the resulting state *before* acting;
3. carry the decision out through the core's ``Executor`` (``pearl.core.execution``, the
   order the simulator follows too: requests, the plan, then the releases), the
   coordinator being its ``World``: each action announced in the journal (``intent``)
   and closed (``done``); a non-empty plan is handed to the control plane. A plan that
   fails part-way leaves the state with the steps whose effect stands
   (``PlanOutcome.carried_out``), so the next decision starts from what runs. Without a
   control plane (``control=None``, no agents) a plan is journalled as not executed and
   the state stays the observed one.

Every new state, decision and plan step also goes to the run log (``events.jsonl``,
``pearl.coordinator.runlog``), the records the simulator writes.

``Coordinator.open`` starts an incarnation: it replays the journal (the last state is the
starting state; ``resume``, pure), opens the journal and the run log, and ``reattach``\ es:
every allocation the journal holds live, and every submission announced but never
closed, is found again in Slurm by its job name and watched (``backend.reattach``); one
Slurm no longer knows ends, reason ``lost``, in the first observation. The constructor
itself takes all of that as data and does no I/O. The clock is injected; nothing here
sleeps except ``run``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from pearl.cluster.backend import AllocationBackend, AllocationConfigError
from pearl.coordinator.config import CoordinatorConfig, initial_state
from pearl.coordinator.control_plane import write_agents
from pearl.coordinator.journal import Journal, Replay, replay
from pearl.coordinator.reconcile import (
    AgentEvent,
    GrantGate,
    LiveAgent,
    agent_observations,
    suspended_grants,
)
from pearl.coordinator.runlog import CoordinatorLog
from pearl.core.decide import decide
from pearl.core.decision import Decision, ElasticRequest
from pearl.core.execution import AllocationIds, Executor, PlanEnd, PlanOutcome
from pearl.core.observation import (
    AllocationEnded,
    AllocationGranted,
    Event,
    Observation,
    TrainerStatus,
    WorkersLost,
    event_problems,
)
from pearl.core.plan import TransitionPlan
from pearl.core.profile import RuntimeProfile
from pearl.core.state import AllocationKind, AllocationStatus, ClusterState, EndReason
from pearl.core.workload import WorkloadSnapshot
from pearl.io.documents import parse, read_document

log = logging.getLogger(__name__)
WorkloadSource = Callable[[], WorkloadSnapshot]
TrainerSource = Callable[[], TrainerStatus]  # the trainer's phase (``pearl.run.control``)
Clock = Callable[[], float]


class ControlPlane(Protocol):
    def execute(self, plan: TransitionPlan) -> PlanOutcome:
        """Carry out the steps on the agents; say which were acknowledged."""
        ...

    def events(self) -> list[AgentEvent]:
        """What happened to agents since the last call."""
        ...

    def agents(self) -> list[dict[str, Any]]:
        """The agents known: id, node, GPU ids, state."""
        ...

    def workers_lost(self, worker_ids: tuple[str, ...], reason: str) -> None:
        """The state dropped these workers (died, or their agent left): the router that
        routes to them forgets them."""
        ...


def workload_file(path: Path) -> WorkloadSource:
    """The rollout manager's latest snapshot at ``path`` (empty while there is none)."""

    def read() -> WorkloadSnapshot:
        if not path.exists():
            return WorkloadSnapshot()
        return parse(WorkloadSnapshot, read_document(path), path)

    return read


@dataclass(frozen=True)
class Resumed:
    """Where an incarnation starts: the journal's last state (or the run's initial one),
    the submissions it announced whose allocation that state does not hold yet (made,
    maybe, just before a stop), and the ids and intent numbers used so far."""

    state: ClusterState
    unfinished: tuple[dict[str, Any], ...]
    ids: AllocationIds
    next_intent: int


def resume(past: Replay, config: CoordinatorConfig) -> Resumed:
    """What a replayed journal leaves for the next incarnation (pure)."""
    state = past.state or initial_state(config)
    known = {a.allocation_id for a in state.allocations}
    unfinished = tuple(i for aid, i in past.submitted.items() if aid not in known)
    ids = AllocationIds.after([*known, *past.submitted])  # never an id used before
    return Resumed(state, unfinished, ids, past.next_seq)


class Coordinator:
    def __init__(
        self,
        config: CoordinatorConfig,
        profile: RuntimeProfile,
        backend: AllocationBackend,
        clock: Clock,
        workload: WorkloadSource,
        journal: Journal,
        log: CoordinatorLog,
        resumed: Resumed,
        control: ControlPlane | None = None,
        agents_path: Path | None = None,
        trainer: TrainerSource = TrainerStatus,
    ) -> None:
        """From data only; ``Coordinator.open`` replays, opens and reattaches."""
        self.config, self.profile, self.backend = config, profile, backend
        self.clock, self.workload, self.control = clock, workload, control
        self.journal, self.log, self.agents_path = journal, log, agents_path
        self.trainer = trainer
        self.state: ClusterState = resumed.state
        self.unfinished = list(resumed.unfinished)
        self.executor = Executor(self, resumed.ids)
        self._next_intent = resumed.next_intent  # plan and release intents: unique ids
        self.decisions = 0
        # told of every decision, the observation and the profile it was made with
        self.on_decision: Callable[[Decision, Observation, RuntimeProfile], None] | None = None
        self._journalled: ClusterState | None = None  # each incarnation writes its first
        self._lost: list[Event] = []
        self._plan_intent: str | None = None  # the intent of the plan running
        join_timeout_s = config.agents.join_timeout_s if config.agents else 0.0
        self.gate = GrantGate(join_timeout_s) if control is not None else None
        if self.gate is not None:  # resumed allocations count once their agents rejoin
            self.state, grants = suspended_grants(self.state)
            self.gate.hold(grants, clock())

    @classmethod
    def open(
        cls,
        config: CoordinatorConfig,
        profile: RuntimeProfile,
        run_dir: Path,
        backend: AllocationBackend,
        clock: Clock,
        workload: WorkloadSource,
        control: ControlPlane | None = None,
        trainer: TrainerSource = TrainerStatus,
    ) -> Coordinator:
        """An incarnation of the run in ``run_dir``: the journal replayed, the journal and
        the run log opened, the allocations it holds watched again."""
        path = run_dir / "journal.jsonl"
        past = replay(path)
        resumed = resume(past, config)
        journal = Journal(path, past.next_seq, past.valid_bytes, past.submitted)
        try:
            log = CoordinatorLog(
                run_dir / "events.jsonl",
                config.run_id,
                config.profile,
                past.state,
                clock(),
                config.policy.borrowing.max_return_delay_s,
            )
        except BaseException:
            journal.close()
            raise
        agents_path = run_dir / "agents.json"
        coordinator = cls(
            config,
            profile,
            backend,
            clock,
            workload,
            journal,
            log,
            resumed,
            control,
            agents_path,
            trainer,
        )
        try:
            coordinator.reattach()
        except BaseException:  # a failed start leaves no journal lock and no open log
            coordinator.close()
            raise
        return coordinator

    def reattach(self) -> None:
        """After a restart: watch again every allocation the journal says is live, and
        every submission announced but never closed; one that Slurm no longer knows ends
        (``lost``) in the first observation."""
        cfg = self.config.policy.elastic
        live = (AllocationStatus.PENDING, AllocationStatus.GRANTED, AllocationStatus.PREEMPTING)
        wanted = {
            a.allocation_id: ElasticRequest(
                a.num_gpus, a.gpu_type or cfg.gpu_type, cfg.partition, cfg.time_limit_min
            )
            for a in self.state.allocations
            if a.kind is AllocationKind.ELASTIC and a.status in live
        }
        for intent in self.unfinished:
            wanted.setdefault(
                str(intent["id"]),
                ElasticRequest(
                    int(intent.get("num_gpus", cfg.gpus_per_allocation)),
                    str(intent.get("gpu_type", cfg.gpu_type)),
                    str(intent.get("partition", cfg.partition)),
                    cfg.time_limit_min,
                ),
            )
        for aid, request in wanted.items():
            if not self.backend.reattach(request, aid):
                self._lost.append(AllocationEnded(allocation_id=aid, reason=EndReason.LOST))
                if self.gate is not None:  # a held grant of it must not come back
                    self.gate.drop(aid)

    def tick(self) -> Decision:
        now_s = self.clock()
        lost, self._lost = self._lost, []
        obs = Observation(
            # what agents said comes first: Slurm's end of a job the agent saw preempted
            # is then the preemption's end
            events=(*lost, *self._agent_events(now_s), *self._allocation_events(now_s)),
            trainer=self.trainer(),
            workload=self.workload(),
        )
        for problem in event_problems(self.state, obs):  # observe() ignores each of them
            level = logging.INFO if problem.late else logging.WARNING
            log.log(level, "ignored %s: %s", problem.field, problem.problem)
        self._write_agents()  # before a plan that may take a while, and after it
        profile = self.profile  # once: another thread may replace it (pearl run's calibration)
        t0 = time.perf_counter()
        d = decide(self.state, obs, self.config.policy, profile, now_s)
        decide_s = time.perf_counter() - t0
        self._forget_lost(self.state, d.state, obs.events)
        self.decisions += 1
        self._record(d.state, now_s)
        self.log.decision(d, now_s, decide_s)
        if self.on_decision is not None:
            self.on_decision(d, obs, profile)
        self.executor.carry_out(d, now_s)
        self._write_agents()
        if self.journal.size_bytes() > self.config.journal_max_bytes:
            self.journal.compact(self.state, now_s)
            self._journalled = self.state
        return d

    # --- the world of the core's executor (pearl.core.execution.World) -------------------

    def submit(self, allocation_id: str, request: ElasticRequest, now_s: float) -> None:
        self.journal.intent(
            allocation_id,
            "submit",
            now_s,
            gpu_type=request.gpu_type,
            num_gpus=request.num_gpus,
            partition=request.partition,
        )
        self._act(
            allocation_id,
            now_s,
            partial(self.backend.submit, request, allocation_id),
            retry=partial(self.backend.reattach, request, allocation_id),
        )

    def release(self, allocation_id: str, now_s: float) -> None:
        intent = f"release-{allocation_id}-{self._new_intent()}"
        self.journal.intent(intent, "release", now_s, allocation_id=allocation_id)
        self._act(intent, now_s, partial(self.backend.release, allocation_id))

    def run_plan(self, plan: TransitionPlan, now_s: float) -> None:
        """Hand the plan to the agents and wait for it; the executor learns its end."""
        intent = f"plan-{self._new_intent()}"
        self.journal.intent(intent, "plan", now_s, num_steps=len(plan.steps))
        self._plan_intent = intent
        if self.control is None:
            self.executor.plan_ended(PlanOutcome(False, frozenset(), (), "no control plane"), now_s)
            return
        start_s = max(now_s, self.clock())  # after this tick's journal writes and Slurm calls
        outcome = self.control.execute(plan)
        end_s = max(start_s, self.clock())
        self.log.plan(plan, outcome, start_s)
        self.executor.plan_ended(outcome, end_s)

    def adopt(self, end: PlanEnd, now_s: float) -> None:
        """The state with the plan's steps that stand, at the measured end ``now_s``; the
        plan's intent closed."""
        intent, self._plan_intent = self._plan_intent, None
        if intent is None:
            raise RuntimeError("adopt without a plan of this coordinator's")
        if end.state is not self.state:
            self._record(end.state.evolve(time_s=now_s), now_s)
        if end.ok:
            self.journal.done(intent, now_s)
        else:
            self.journal.done(intent, now_s, ok=False, error=end.error or "not acknowledged")

    # --- observing ------------------------------------------------------------------------

    def _write_agents(self) -> None:
        if self.control is not None and self.agents_path is not None:
            write_agents(self.agents_path, self.control.agents())

    def _allocation_events(self, now_s: float) -> list[Event]:
        """The backend's events; with agents, a grant waits for its agents to join."""
        events = self.backend.poll(now_s)
        if self.gate is None or self.control is None:
            return events
        alive = [
            LiveAgent(str(a["node"]), None if a.get("job_id") is None else str(a["job_id"]))
            for a in self.control.agents()
            if a["state"] == "alive"
        ]
        held = set(self.gate.held)
        for ev in events:  # Slurm's grant starts the billed hours, agents or not
            if isinstance(ev, AllocationGranted) and ev.allocation_id not in held:
                self.log.granted(ev, now_s)
        events, give_up = self.gate.filter(events, alive, now_s, self._job_of)
        for aid in give_up:  # a grant no agent joined: not a decision's, given back now
            self.release(aid, now_s)
        return events

    def _job_of(self, allocation_id: str) -> str | None:
        """The Slurm job of an allocation, if the backend knows it."""
        try:
            return self.backend.job_id(allocation_id)
        except KeyError:
            return None

    def _forget_lost(
        self, before: ClusterState, after: ClusterState, events: Iterable[Event]
    ) -> None:
        """The router forgets the workers the observation dropped from the state: their
        engines died, their agent left (``WorkersLost``, with its reason), their
        allocation ended (preempted, lost, timed out)."""
        if self.control is None:
            return
        gone = {w.worker_id for w in before.workers} - {w.worker_id for w in after.workers}
        told: list[tuple[tuple[str, ...], str]] = []
        for ev in events:
            if isinstance(ev, WorkersLost) and gone.intersection(ev.worker_ids):
                told.append((tuple(w for w in ev.worker_ids if w in gone), ev.reason))
                gone.difference_update(ev.worker_ids)
        if gone:
            told.append((tuple(sorted(gone)), "their allocation ended"))
        for worker_ids, reason in told:
            try:
                self.control.workers_lost(worker_ids, reason)
            except Exception:  # the router finds them failing, later; the run goes on
                log.exception("telling the router %s are lost failed", ", ".join(worker_ids))

    def _agent_events(self, now_s: float) -> list[Event]:
        if self.control is None:
            return []
        return agent_observations(self.state, self.control.events(), now_s, self._job_of)

    def _record(self, state: ClusterState, now_s: float) -> None:
        """The new state: logged, then journalled (unless unchanged). In that order, a
        crash between the two makes the next incarnation, which diffs from the journalled
        state, log the change again rather than never."""
        self.state = state
        self.log.state(state, now_s)
        if not _same(state, self._journalled):  # an unchanged state is not written again
            self.journal.state(state, now_s)
            self._journalled = state

    def _new_intent(self) -> int:
        self._next_intent += 1
        return self._next_intent

    def _act(
        self,
        intent: str,
        now_s: float,
        action: Callable[[], object],
        retry: Callable[[], bool] | None = None,
    ) -> None:
        """Run an announced action and close its intent. A configuration Slurm refuses
        ends the coordinator (the caller maps it to exit 2); any other failure (slurmctld
        busy, a timeout) is journalled and the run goes on: the next decision asks again.
        A submission that failed may still have reached Slurm: ``retry`` looks for it."""
        try:
            action()
        except AllocationConfigError:
            self.journal.done(intent, now_s, ok=False, error="refused by Slurm")
            raise
        except Exception as err:  # any other backend failure is journalled, not fatal
            if retry is not None and retry():
                self.journal.done(intent, now_s)
                return
            self.journal.done(intent, now_s, ok=False, error=f"{type(err).__name__}: {err}")
            return
        self.journal.done(intent, now_s)

    def run(self, max_runtime_s: float | None = None, stop: Callable[[], bool] = bool) -> None:
        """Tick every ``decision_interval_s`` until ``max_runtime_s`` (None: forever) or
        until ``stop()`` (a signal handler's flag) says so, checked between ticks and
        while waiting (a signal never buys another tick)."""
        start_s = self.clock()
        while not stop() and (max_runtime_s is None or self.clock() - start_s < max_runtime_s):
            self.tick()
            wake_s = time.monotonic() + self.config.decision_interval_s
            while not stop() and time.monotonic() < wake_s:
                time.sleep(min(0.1, self.config.decision_interval_s))

    def close(self, ended: str | None = None) -> None:
        """Close the journal and the run log; ``ended``: why the run ended (None: it goes
        on in the next incarnation)."""
        self.log.close(self.clock(), ended)
        self.journal.close()


def _same(a: ClusterState, b: ClusterState | None) -> bool:
    """Equal but for the clock and the version counter (every decision moves both)."""
    still = {"time_s": 0.0, "version": 0}
    return b is not None and a.model_copy(update=still) == b.model_copy(update=still)
