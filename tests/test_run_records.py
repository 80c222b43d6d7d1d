"""The run-log records of a state change: GPUs, workers and elastic allocations."""

from __future__ import annotations

from pearl.bench.synth import Layout, build_state
from pearl.core.observation import (
    AllocationEnded,
    AllocationGranted,
    GrantedNode,
    Observation,
    WorkersLost,
    observe,
)
from pearl.core.state import Phase, Role
from pearl.runlog.records import state_records
from pearl.runlog.schema import AllocationChanged, GpuAdded, GpuRemoved, WorkerPhase


def test_the_first_state_logs_every_gpu_and_worker() -> None:
    state = build_state(Layout(1, 1, 0))
    records = state_records(None, state, 0.0)
    gpus = [r for r in records if isinstance(r, GpuAdded)]
    workers = [r for r in records if isinstance(r, WorkerPhase)]
    assert sorted(r.gpu_id for r in gpus) == sorted(g.gpu_id for g in state.gpus)
    assert sorted(r.worker_id for r in workers) == sorted(w.worker_id for w in state.workers)
    assert records.index(gpus[-1]) < records.index(workers[0])  # GPUs before their workers
    assert state_records(state, state, 1.0) == []
    assert state_records(state, state.evolve(time_s=5.0), 5.0) == []


def test_a_grant_a_role_change_a_loss_and_an_end() -> None:
    before = build_state(Layout(1, 1, 0))
    grant = AllocationGranted(
        allocation_id="el0001", nodes=(GrantedNode(node="x1", gpu_type="h100", num_gpus=2),)
    )
    granted = observe(before, Observation(events=(grant,)), 10.0)
    records = state_records(before, granted, 10.0)
    assert [(type(r), getattr(r, "gpu_id", None)) for r in records] == [
        (GpuAdded, "x1/0"),
        (GpuAdded, "x1/1"),
        (AllocationChanged, None),
    ]
    assert isinstance(records[2], AllocationChanged) and records[2].status == "granted"

    rollout = {g.gpu_id for g in before.gpus if g.source.value == "base-rollout"}
    engine = next(w for w in before.workers if set(w.gpu_ids) <= rollout)
    switched = granted.replace(
        workers=tuple(
            w.model_copy(update={"role": Role.DECODE, "phase": Phase.READY})
            if w.worker_id == engine.worker_id
            else w
            for w in granted.workers
        )
    )
    (change,) = state_records(granted, switched, 20.0)
    assert isinstance(change, WorkerPhase)
    assert (change.worker_id, change.role, change.phase) == (engine.worker_id, "decode", "ready")

    lost = observe(switched, Observation(events=(WorkersLost(worker_ids=(engine.worker_id,)),)), 30)
    (gone,) = state_records(switched, lost, 30.0)
    assert isinstance(gone, WorkerPhase) and (gone.worker_id, gone.phase) == (
        engine.worker_id,
        "gone",
    )

    end = AllocationEnded(allocation_id="el0001", reason="preempted")
    ended = observe(lost, Observation(events=(end,)), 40.0)
    records = state_records(lost, ended, 40.0)
    assert [(type(r), getattr(r, "reason", None)) for r in records] == [
        (GpuRemoved, "preempted"),
        (GpuRemoved, "preempted"),
        (AllocationChanged, "preempted"),
    ]
