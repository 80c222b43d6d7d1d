"""The cluster state a simulated run starts from, and the windows its elastic GPUs follow.

The base job holds the trainer nodes (one trainer group per node, with an asleep engine
per GPU co-resident, so lending wakes an engine rather than cold-starting one) and the
rollout nodes, empty: the run's first decision starts the engines, every policy paying
the same cold starts. Elastic nodes join only when Slurm grants them.
"""

from __future__ import annotations

from pearl.core.roles import GpuSource, Phase, Role, WorkerKind
from pearl.core.state import (
    Allocation,
    AllocationKind,
    AllocationStatus,
    ClusterState,
    Gpu,
    Worker,
)
from pearl.sim.availability import Window
from pearl.sim.scenario import Scenario

BASE = "base"


def initial_state(scenario: Scenario) -> ClusterState:
    c = scenario.cluster
    gpus: list[Gpu] = []
    workers: list[Worker] = []
    version = scenario.rollout.initial_policy_version
    for n in range(c.trainer.nodes):
        node = f"train{n:03d}"
        ids = tuple(f"{node}/{i}" for i in range(c.trainer.gpus_per_node))
        gpus += [
            Gpu(
                gpu_id=g,
                node=node,
                gpu_type=c.trainer.gpu_type,
                source=GpuSource.BASE_TRAIN,
                allocation_id=BASE,
            )
            for g in ids
        ]
        workers.append(
            Worker(
                worker_id=f"t-{node}",
                kind=WorkerKind.TRAINER,
                node=node,
                gpu_ids=ids,
                role=Role.TRAIN,
                phase=Phase.READY,
                weights_version=version,
            )
        )
        workers += [
            Worker(
                worker_id=f"e-{node}-{i}",
                kind=WorkerKind.ENGINE,
                node=node,
                gpu_ids=(g,),
                role=Role.IDLE,
                phase=Phase.READY,
                weights_version=version,
            )
            for i, g in enumerate(ids)
        ]
    for n in range(c.rollout.nodes):
        node = f"roll{n:03d}"
        gpus += [
            Gpu(
                gpu_id=f"{node}/{i}",
                node=node,
                gpu_type=c.rollout.gpu_type,
                source=GpuSource.BASE_ROLLOUT,
                allocation_id=BASE,
            )
            for i in range(c.rollout.gpus_per_node)
        ]
    base = Allocation(
        allocation_id=BASE,
        kind=AllocationKind.BASE,
        status=AllocationStatus.GRANTED,
        granted_at_s=0.0,
    )
    return ClusterState(
        policy_version=version, gpus=tuple(gpus), workers=tuple(workers), allocations=(base,)
    )


def clip_windows(
    windows: tuple[Window, ...], offset_s: float, duration_s: float, max_gpus: int | None
) -> tuple[Window, ...]:
    """Trace windows moved to run time (trace ``offset_s`` is run time 0), clipped to the
    run, and capped: windows that would open more than ``max_gpus`` at once are dropped."""
    out: list[Window] = []
    for w in sorted(windows):
        start_s, end_s = max(w.start_s - offset_s, 0.0), min(w.end_s - offset_s, duration_s)
        if end_s <= start_s:
            continue
        clipped = Window(start_s, end_s, w.num_gpus, w.gpu_type)
        open_now = sum(o.num_gpus for o in out if o.start_s <= start_s < o.end_s)
        if max_gpus is not None and open_now + w.num_gpus > max_gpus:
            continue
        out.append(clipped)
    return tuple(out)


def synced(state: ClusterState, version: int) -> ClusterState:
    """After an update the simulator syncs every active engine: the state says so."""
    workers = tuple(
        w.model_copy(update={"weights_version": version})
        if w.kind is WorkerKind.ENGINE and w.role is not Role.IDLE and w.live
        else w
        for w in state.workers
    )
    return state.replace(policy_version=version, workers=workers)
