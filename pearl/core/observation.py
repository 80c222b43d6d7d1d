"""Observations: what the shell saw since the last ``decide()``, as data.

Events are a tagged union on ``kind``. ``observe()`` folds them into the state (the
passive step): it mirrors what Slurm, the agents and the trainer report and plans
nothing. Folding the same observation into its own result changes nothing but the
clock (a test shows it).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field

from pearl.core.limits import MAX_GPUS, MAX_GPUS_PER_NODE, MAX_NODES, Id, PositiveGpuCount, Seconds
from pearl.core.roles import GpuSource
from pearl.core.state import (
    Allocation,
    AllocationKind,
    AllocationStatus,
    ClusterState,
    EndReason,
    Frozen,
    Gpu,
)
from pearl.core.workload import WorkloadSnapshot


class GrantedNode(Frozen):
    node: Id
    gpu_type: Id
    num_gpus: Annotated[int, Field(ge=1, le=MAX_GPUS_PER_NODE)]


class AllocationGranted(Frozen):
    kind: Literal["allocation_granted"] = "allocation_granted"
    allocation_id: Id
    nodes: tuple[GrantedNode, ...] = Field(min_length=1, max_length=MAX_NODES)
    end_by_s: Seconds | None = Field(None, description="Time limit, if Slurm gave one.")


class AllocationPreempting(Frozen):
    kind: Literal["allocation_preempting"] = "allocation_preempting"
    allocation_id: Id
    deadline_s: Seconds = Field(description="End of the grace period.")


class AllocationEnded(Frozen):
    kind: Literal["allocation_ended"] = "allocation_ended"
    allocation_id: Id
    reason: EndReason


class AllocationPending(Frozen):
    kind: Literal["allocation_pending"] = "allocation_pending"
    allocation_id: Id
    gpu_type: Id
    num_gpus: PositiveGpuCount


class WorkersLost(Frozen):
    """Workers that are gone while their allocation lives on: their node agent died, or
    came back (after its own or the coordinator's restart) without them. Their GPUs stay
    in the state, free for the next plan."""

    kind: Literal["workers_lost"] = "workers_lost"
    worker_ids: tuple[Id, ...] = Field(min_length=1)
    reason: str = ""


AllocationEvent = AllocationGranted | AllocationPreempting | AllocationEnded | AllocationPending
Event = Annotated[AllocationEvent | WorkersLost, Field(discriminator="kind")]


class TrainerPhase(StrEnum):
    TRAINING = "training"  # running an update on its GPUs
    WAITING = "waiting"  # update done; waiting for the next rollout batch


class TrainerStatus(Frozen):
    phase: TrainerPhase = TrainerPhase.TRAINING
    needs_gpus: bool = Field(
        False, description="The next batch is ready: the trainer wants its GPUs back now."
    )
    step_ends_at_s: Seconds | None = Field(None, description="End of the running update.")


class Observation(Frozen):
    schema_version: Literal[1] = 1
    events: tuple[Event, ...] = ()
    trainer: TrainerStatus = TrainerStatus()
    workload: WorkloadSnapshot = WorkloadSnapshot()


def observe(state: ClusterState, obs: Observation, now_s: float) -> ClusterState:
    """Fold the observation's events into the state; the clock moves to ``now_s``."""
    allocations = {a.allocation_id: a for a in state.allocations}
    gpus = list(state.gpus)
    workers = list(state.workers)
    for ev in obs.events:
        if isinstance(ev, WorkersLost):
            gone = set(ev.worker_ids)
            workers = [w for w in workers if w.worker_id not in gone]
            continue
        old = allocations.get(ev.allocation_id)
        if isinstance(ev, AllocationPending):
            if old is None:
                allocations[ev.allocation_id] = _pending(ev, now_s)
        elif isinstance(ev, AllocationGranted):
            if old is not None and old.status in (AllocationStatus.GRANTED, AllocationStatus.ENDED):
                continue  # granted already, or ended: a late grant does not revive it
            known = {g.gpu_id for g in gpus}
            new = [g for g in _gpus_of(ev) if g.gpu_id not in known]
            if len(gpus) + len(new) > MAX_GPUS:
                continue  # past the largest cluster pearl is built for (event_problems)
            allocations[ev.allocation_id] = _granted(ev, old, now_s)
            gpus += new
        elif isinstance(ev, AllocationPreempting):
            if old is not None and old.status is not AllocationStatus.ENDED:
                allocations[ev.allocation_id] = old.model_copy(
                    update={"status": AllocationStatus.PREEMPTING, "end_by_s": ev.deadline_s}
                )
        elif old is not None and old.status is not AllocationStatus.ENDED:  # AllocationEnded
            allocations[ev.allocation_id] = old.model_copy(
                update={"status": AllocationStatus.ENDED, "end_reason": _end_reason(old, ev)}
            )
            lost = {g.gpu_id for g in gpus if g.allocation_id == ev.allocation_id}
            gpus = [g for g in gpus if g.gpu_id not in lost]
            workers = [w for w in workers if not lost.intersection(w.gpu_ids)]
    if not obs.events:
        return state if now_s == state.time_s else state.evolve(time_s=now_s)
    return state.replace(
        time_s=now_s,
        allocations=tuple(allocations.values()),
        gpus=tuple(gpus),
        workers=tuple(workers),
    )


@dataclass(frozen=True)
class EventProblem:
    """An event that names what the state does not hold. ``late``: it can legitimately
    arrive after what it names is gone (``observe`` ignores it; the shell logs the reason);
    otherwise it is impossible, and a document holding it is refused."""

    field: str  # events[i]...
    problem: str
    late: bool


def event_problems(state: ClusterState, obs: Observation) -> list[EventProblem]:
    """What each event of ``obs`` names that ``state`` (with the events before it) does
    not hold, per event:

    - ``allocation_pending`` for an id the state holds: late (a repeated poll);
    - ``allocation_granted`` for the base job, or with a GPU another allocation holds:
      impossible; for a granted or ended allocation: late (``observe`` keeps the first);
    - ``allocation_preempting`` / ``allocation_ended`` for an unknown id: late (ended
      allocations leave the state, their events may trail);
    - ``workers_lost`` naming an unknown worker: late (its allocation's end took it).
    """
    problems: list[EventProblem] = []
    allocations = {a.allocation_id: a for a in state.allocations}
    gpu_owner = {g.gpu_id: g.allocation_id for g in state.gpus}  # grows with the grants
    workers = {w.worker_id for w in state.workers}
    for i, ev in enumerate(obs.events):
        where = f"events[{i}]"
        if isinstance(ev, WorkersLost):
            for j, wid in enumerate(ev.worker_ids):
                if wid not in workers:
                    problem = f"unknown worker {wid!r}"
                    problems.append(EventProblem(f"{where}.worker_ids[{j}]", problem, True))
            continue
        old = allocations.get(ev.allocation_id)
        named = f"allocation {ev.allocation_id!r}"
        if isinstance(ev, AllocationPending):
            if old is None:
                allocations[ev.allocation_id] = _pending(ev)
            else:
                problem = f"{named} is known already ({old.status.value})"
                problems.append(EventProblem(f"{where}.allocation_id", problem, True))
        elif isinstance(ev, AllocationGranted):
            problems += _grant_problems(ev, where, old, gpu_owner)
            if old is None or old.status is AllocationStatus.PENDING:
                allocations[ev.allocation_id] = _granted(ev, old, 0.0)
        elif old is None:
            problem = f"unknown {named} ({ev.kind})"
            problems.append(EventProblem(f"{where}.allocation_id", problem, True))
    return problems


def _grant_problems(
    ev: AllocationGranted, where: str, old: Allocation | None, gpu_owner: dict[str, str]
) -> list[EventProblem]:
    named = f"allocation {ev.allocation_id!r}"
    if old is not None and old.kind is AllocationKind.BASE:
        return [EventProblem(f"{where}.allocation_id", f"{named} is the base job", False)]
    if old is not None and old.status is not AllocationStatus.PENDING:
        problem = f"{named} is {old.status.value} already: a late grant"
        return [EventProblem(f"{where}.allocation_id", problem, True)]
    gpus = _gpus_of(ev)
    for gpu in gpus:
        owner = gpu_owner.get(gpu.gpu_id)
        if owner is not None and owner != ev.allocation_id:
            problem = f"GPU {gpu.gpu_id!r} is held by allocation {owner!r}"
            return [EventProblem(f"{where}.nodes", problem, False)]
    if len(gpu_owner) + len(gpus) > MAX_GPUS:
        problem = f"{len(gpus)} GPUs more: more than the {MAX_GPUS} pearl is built for"
        return [EventProblem(f"{where}.nodes", problem, False)]
    gpu_owner.update((gpu.gpu_id, ev.allocation_id) for gpu in gpus)
    return []


def _pending(ev: AllocationPending, now_s: float = 0.0) -> Allocation:
    return Allocation(
        allocation_id=ev.allocation_id,
        kind=AllocationKind.ELASTIC,
        status=AllocationStatus.PENDING,
        gpu_type=ev.gpu_type,
        num_gpus=ev.num_gpus,
        submitted_at_s=now_s,
    )


def _end_reason(old: Allocation, ev: AllocationEnded) -> EndReason:
    """A preempted job that leaves within its grace period ends "completed" in Slurm: an
    end during a preemption is the preemption's, unless it was released or ran out."""
    if old.status is AllocationStatus.PREEMPTING and ev.reason not in OWN_END_REASONS:
        return EndReason.PREEMPTED
    return ev.reason


OWN_END_REASONS = frozenset(
    {EndReason.RELEASED, EndReason.TIMEOUT, EndReason.NODE_FAIL, EndReason.PREEMPTED}
)


def _granted(ev: AllocationGranted, old: Allocation | None, now_s: float) -> Allocation:
    return Allocation(
        allocation_id=ev.allocation_id,
        kind=AllocationKind.ELASTIC,
        status=AllocationStatus.GRANTED,
        gpu_type=ev.nodes[0].gpu_type,
        num_gpus=sum(n.num_gpus for n in ev.nodes),
        submitted_at_s=old.submitted_at_s if old else None,
        granted_at_s=now_s,
        end_by_s=ev.end_by_s,
    )


def _gpus_of(ev: AllocationGranted) -> list[Gpu]:
    return [
        Gpu(
            gpu_id=f"{n.node}/{i}",
            node=n.node,
            gpu_type=n.gpu_type,
            source=GpuSource.ELASTIC,
            allocation_id=ev.allocation_id,
        )
        for n in ev.nodes
        for i in range(n.num_gpus)
    ]
