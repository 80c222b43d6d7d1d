"""Run-log records of decisions and of what changed between two cluster states (pure).

``decision_record`` and ``BorrowRecords`` turn a ``Decision`` into records (a return is
logged once, when decided, not at every decision while it is under way).

``state_records(before, after, t)`` is how the simulator and the coordinator log the GPU
and worker timeline the same way: a GPU that appears is ``gpu_added`` (with its source
and allocation), one that disappears ``gpu_removed`` (the reason: why its allocation
ended, else its status, else ``gone``); a worker that appears, or changes phase or role,
is ``worker_phase``, and one that disappears is ``worker_phase`` with phase ``gone``; an
elastic allocation whose status changed is ``allocation``. Records come in that order
(GPUs before the workers placed on them), each list sorted by id, so equal inputs give
identical logs.

Cost: one pass over each state's GPUs, workers and allocations; states that share their
tuples (``ClusterState.evolve``) are recognised and skipped.
"""

from __future__ import annotations

import math
from typing import Literal

from pearl.core.decision import BorrowKind, Decision
from pearl.core.state import AllocationKind, ClusterState, Worker
from pearl.rollout.ledger import ConsumedBatch, PastBoundOutcome
from pearl.rollout.rules import PastBound
from pearl.runlog.schema import (
    AllocationChanged,
    BatchConsumed,
    BorrowChanged,
    DecisionMade,
    GpuAdded,
    GpuRemoved,
    PastBoundApplied,
    Record,
    WorkerPhase,
)

PhaseName = Literal["starting", "ready", "draining", "switching", "stopping", "gone"]
_LOGGED_BORROWS: dict[BorrowKind, Literal["lend", "return", "force_return"]] = {
    BorrowKind.LEND: "lend",
    BorrowKind.RETURN: "return",
    BorrowKind.FORCE_RETURN: "force_return",
}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def batch_consumed_record(now_s: float, batch: ConsumedBatch) -> BatchConsumed:
    """The trainer took ``batch`` (the simulator's trainer, or the rollout manager's)."""
    return BatchConsumed.model_construct(
        t=now_s,
        batch_id=batch.batch_id,
        policy_version=batch.version,
        trajectories=len(batch.traj_ids),
        output_tokens=batch.tokens,
        off_policy_tokens=batch.off_policy_tokens,
        max_staleness_versions=batch.max_staleness_versions,
        mean_staleness_versions=batch.mean_staleness_versions,
    )


def past_bound_record(now_s: float, outcome: PastBoundOutcome, mode: PastBound) -> PastBoundApplied:
    """What an update's past-bound rule did (logged when it did anything)."""
    return PastBoundApplied.model_construct(
        t=now_s,
        policy_version=outcome.version,
        mode=mode.value,
        interrupted=len(outcome.interrupted),
        restarted=len(outcome.restarted),
        dropped=len(outcome.dropped),
        wasted_tokens=outcome.wasted_tokens,
        taken_back=outcome.taken_back,
    )


def decision_record(
    now_s: float,
    policy: str,
    d: Decision,
    decide_s: float | None = None,
    decide_calls: int = 1,
) -> DecisionMade:
    return DecisionMade.model_construct(
        t=now_s,
        policy=policy,
        pd_mode=d.plan.target.config.mode.value,
        target=d.plan.target.config.label(),
        switch=d.switch.switch,
        mandatory=d.switch.mandatory,
        predicted_current_s=_finite(d.current.completion_s),
        predicted_target_s=_finite(d.selection.best.completion_s),
        transition_s=d.plan.makespan_s,
        num_steps=len(d.plan.steps),
        borrow=d.borrow.kind.value,
        num_elastic_requests=len(d.elastic.requests),
        reasons=d.reasons,
        decide_s=decide_s,
        decide_calls=decide_calls,
    )


class BorrowRecords:
    def __init__(self) -> None:
        self._return_logged_for: float | None = None  # lent_at_s of the window

    def record(self, now_s: float, d: Decision) -> BorrowChanged | None:
        kind = _LOGGED_BORROWS.get(d.borrow.kind)
        if kind is None:
            return None
        window = d.state.borrow
        if kind != "lend":
            if window is None or self._return_logged_for == window.lent_at_s:
                return None  # a return already logged, repeated while under way
            self._return_logged_for = window.lent_at_s
        by_s = d.borrow.return_by_s
        return BorrowChanged.model_construct(
            t=now_s,
            kind=kind,
            gpu_ids=d.borrow.gpu_ids,
            return_by_t=_finite(by_s) if by_s is not None else None,
        )


def state_records(
    before: ClusterState | None, after: ClusterState, t: float, allocations: bool = True
) -> list[Record]:
    """The records of the change from ``before`` (None: nothing logged yet) to ``after``;
    ``allocations=False`` leaves out the allocation records (the simulator writes its own,
    from its Slurm model: ``requested``, ``released``)."""
    out: list[Record] = []
    old_gpus = {} if before is None else before.gpu_by_id
    old_workers = {} if before is None else before.worker_by_id
    old_allocs = {} if before is None else before.allocation_by_id
    if before is None or before.gpus is not after.gpus:
        new_gpus = after.gpu_by_id
        for gid in sorted(new_gpus.keys() - old_gpus.keys()):
            g = new_gpus[gid]
            out.append(
                GpuAdded.model_construct(
                    t=t,
                    gpu_id=gid,
                    node=g.node,
                    gpu_type=g.gpu_type,
                    source=g.source.value,
                    allocation_id=g.allocation_id,
                )
            )
        for gid in sorted(old_gpus.keys() - new_gpus.keys()):
            alloc = after.allocation_by_id.get(old_gpus[gid].allocation_id)
            reason = (alloc.end_reason or alloc.status).value if alloc is not None else "gone"
            out.append(GpuRemoved.model_construct(t=t, gpu_id=gid, reason=reason))
    if before is None or before.workers is not after.workers:
        new_workers = after.worker_by_id
        for wid in sorted(new_workers):
            w, old = new_workers[wid], old_workers.get(wid)
            if old is None or old.phase is not w.phase or old.role is not w.role:
                out.append(_phase(w, t, w.phase.value))
        for wid in sorted(old_workers.keys() - new_workers.keys()):
            out.append(_phase(old_workers[wid], t, "gone"))
    if allocations and (before is None or before.allocations is not after.allocations):
        for aid, a in sorted(after.allocation_by_id.items()):
            old_a = old_allocs.get(aid)
            if a.kind is AllocationKind.ELASTIC and (old_a is None or old_a.status is not a.status):
                out.append(
                    AllocationChanged.model_construct(
                        t=t,
                        allocation_id=aid,
                        status=a.status.value,
                        gpu_type=a.gpu_type or "",
                        num_gpus=a.num_gpus,
                        reason=a.end_reason.value if a.end_reason else "",
                    )
                )
    return out


def _phase(w: Worker, t: float, phase: PhaseName) -> WorkerPhase:
    return WorkerPhase.model_construct(
        t=t,
        worker_id=w.worker_id,
        kind=w.kind.value,
        gpu_ids=w.gpu_ids,
        role=w.role.value,
        phase=phase,
    )
