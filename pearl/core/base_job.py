"""The base job as the core sees it at the start of a run (pure).

The base allocation (``"base"``, granted) holds the trainer nodes, one trainer worker
per node on all its GPUs, and the rollout nodes, whose GPUs are free for the first
decision to place engines on. GPU ids are ``NODE/INDEX``, as Slurm nodes number their
GPUs. With ``asleep_engines`` every trainer GPU also hosts an asleep engine (role idle),
so lending wakes an engine rather than cold-starting one (the simulator's setting; on a
cluster the agents report what they run).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pearl.core.roles import GpuSource, Phase, Role, WorkerKind
from pearl.core.state import (
    Allocation,
    AllocationKind,
    AllocationStatus,
    ClusterState,
    Gpu,
    Worker,
)

BASE_ALLOCATION = "base"


class BaseNode(NamedTuple):
    name: str
    gpu_type: str
    num_gpus: int


def base_job_state(
    trainer: Sequence[BaseNode],
    rollout: Sequence[BaseNode],
    *,
    asleep_engines: bool = False,
    policy_version: int = 0,
) -> ClusterState:
    gpus: list[Gpu] = []
    workers: list[Worker] = []
    for source, nodes in ((GpuSource.BASE_TRAIN, trainer), (GpuSource.BASE_ROLLOUT, rollout)):
        for node in nodes:
            ids = tuple(f"{node.name}/{i}" for i in range(node.num_gpus))
            gpus += [
                Gpu(
                    gpu_id=g,
                    node=node.name,
                    gpu_type=node.gpu_type,
                    source=source,
                    allocation_id=BASE_ALLOCATION,
                )
                for g in ids
            ]
            if source is not GpuSource.BASE_TRAIN:
                continue
            workers.append(
                Worker(
                    worker_id=f"t-{node.name}",
                    kind=WorkerKind.TRAINER,
                    node=node.name,
                    gpu_ids=ids,
                    role=Role.TRAIN,
                    phase=Phase.READY,
                    weights_version=policy_version,
                )
            )
            if asleep_engines:
                workers += [
                    Worker(
                        worker_id=f"e-{node.name}-{i}",
                        kind=WorkerKind.ENGINE,
                        node=node.name,
                        gpu_ids=(g,),
                        role=Role.IDLE,
                        phase=Phase.READY,
                        weights_version=policy_version,
                    )
                    for i, g in enumerate(ids)
                ]
    base = Allocation(
        allocation_id=BASE_ALLOCATION,
        kind=AllocationKind.BASE,
        status=AllocationStatus.GRANTED,
        granted_at_s=0.0,
    )
    return ClusterState(
        policy_version=policy_version,
        gpus=tuple(gpus),
        workers=tuple(workers),
        allocations=(base,),
    )
