"""Synthetic but realistic cluster states and rollout batches, for examples and benchmarks.

The layout follows a typical pearl deployment: a base job whose first quarter of nodes
trains (one trainer group per node, with an asleep engine per GPU co-resident for cheap
lending), whose other nodes serve rollout, plus elastic allocations of 8-GPU nodes.
Randomness comes only from the ``numpy.random.Generator`` passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pearl.core.apply import apply_plan
from pearl.core.config import PolicyConfig
from pearl.core.decide import decide
from pearl.core.observation import Observation
from pearl.core.profile import RuntimeProfile
from pearl.core.roles import GpuSource, Phase, Role, WorkerKind
from pearl.core.state import (
    Allocation,
    AllocationKind,
    AllocationStatus,
    ClusterState,
    Gpu,
    Worker,
)
from pearl.core.workload import TrajectoryProgress, TrajPhase, WorkloadSnapshot

GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Layout:
    num_train_nodes: int
    num_rollout_nodes: int
    num_elastic_nodes: int
    gpu_type: str = "h100"
    elastic_gpu_type: str = "h100"
    rollout_tp: int = 1
    rollout_role: Role = Role.COLOCATED

    @staticmethod
    def for_gpus(num_gpus: int, **kw: object) -> Layout:
        """A quarter training, half base rollout, a quarter elastic (at least one node each)."""
        nodes = max(3, num_gpus // GPUS_PER_NODE)
        train = max(1, nodes // 4)
        elastic = max(1, nodes // 4)
        return Layout(train, nodes - train - elastic, elastic, **kw)  # type: ignore[arg-type]


def build_state(layout: Layout, time_s: float = 0.0) -> ClusterState:
    gpus: list[Gpu] = []
    workers: list[Worker] = []
    allocations = [
        Allocation(
            allocation_id="base",
            kind=AllocationKind.BASE,
            status=AllocationStatus.GRANTED,
            granted_at_s=0.0,
        )
    ]
    for n in range(layout.num_train_nodes):
        node = f"train{n:04d}"
        ids = _add_node(gpus, node, layout.gpu_type, GpuSource.BASE_TRAIN, "base")
        workers.append(
            Worker(
                worker_id=f"t-{node}",
                kind=WorkerKind.TRAINER,
                node=node,
                gpu_ids=ids,
                role=Role.TRAIN,
                phase=Phase.READY,
            )
        )
        workers += _engines(node, ids, layout.rollout_tp, Role.IDLE)
    for n in range(layout.num_rollout_nodes):
        node = f"roll{n:04d}"
        ids = _add_node(gpus, node, layout.gpu_type, GpuSource.BASE_ROLLOUT, "base")
        workers += _engines(node, ids, layout.rollout_tp, layout.rollout_role)
    for n in range(layout.num_elastic_nodes):
        node = f"elas{n:04d}"
        alloc = f"el{n:04d}"
        allocations.append(
            Allocation(
                allocation_id=alloc,
                kind=AllocationKind.ELASTIC,
                status=AllocationStatus.GRANTED,
                gpu_type=layout.elastic_gpu_type,
                num_gpus=GPUS_PER_NODE,
                granted_at_s=0.0,
            )
        )
        ids = _add_node(gpus, node, layout.elastic_gpu_type, GpuSource.ELASTIC, alloc)
        workers += _engines(node, ids, layout.rollout_tp, layout.rollout_role)
    return ClusterState(
        time_s=time_s, gpus=tuple(gpus), workers=tuple(workers), allocations=tuple(allocations)
    )


def _add_node(
    gpus: list[Gpu], node: str, gpu_type: str, source: GpuSource, alloc: str
) -> tuple[str, ...]:
    ids = tuple(f"{node}/{i}" for i in range(GPUS_PER_NODE))
    gpus += [
        Gpu(gpu_id=g, node=node, gpu_type=gpu_type, source=source, allocation_id=alloc) for g in ids
    ]
    return ids


def _engines(node: str, ids: tuple[str, ...], tp: int, role: Role) -> list[Worker]:
    return [
        Worker(
            worker_id=f"e-{node}-{i}",
            kind=WorkerKind.ENGINE,
            node=node,
            gpu_ids=ids[i : i + tp],
            role=role,
            phase=Phase.READY,
        )
        for i in range(0, len(ids), tp)
    ]


def build_workload(
    rng: np.random.Generator,
    num_trajectories: int,
    *,
    mean_turns: float = 12.0,
    prompt_tokens: float = 2_000.0,
    tokens_per_turn: float = 900.0,
    not_started: int = 0,
) -> WorkloadSnapshot:
    """A batch in progress: trajectories at random turns and phases, long-tailed lengths."""
    phases = list(TrajPhase)
    total_turns = 1 + rng.geometric(1.0 / mean_turns, size=num_trajectories)
    done = np.floor(rng.uniform(0, 1, size=num_trajectories) * total_turns).astype(int)
    trajectories = []
    for i in range(num_trajectories):
        phase = phases[int(rng.integers(len(phases)))]
        remaining = int(total_turns[i] - done[i])
        if phase is TrajPhase.ENV:
            remaining = max(remaining - 1, 1)
        trajectories.append(
            TrajectoryProgress(
                traj_id=f"traj{i:06d}",
                phase=phase,
                context_tokens=int(prompt_tokens + done[i] * tokens_per_turn),
                remaining_turns=float(remaining),
                turn_output_tokens=int(rng.integers(0, 300)) if phase is TrajPhase.DECODE else 0,
                env_remaining_s=float(rng.exponential(2.0)) if phase is TrajPhase.ENV else 0.0,
            )
        )
    return WorkloadSnapshot(trajectories=tuple(trajectories), not_started=not_started)


def settle(
    state: ClusterState,
    obs: Observation,
    cfg: PolicyConfig,
    profile: RuntimeProfile,
    now_s: float,
    max_rounds: int = 5,
) -> ClusterState:
    """Decide and carry out each plan at once until a decision plans nothing.

    The state a coordinator reaches after a few ticks on an unchanging workload.
    Raises ``RuntimeError`` if it has not settled after ``max_rounds`` decisions.
    """
    for i in range(max_rounds):
        decision = decide(state, obs, cfg, profile, now_s + i)
        if decision.plan.empty:
            return decision.state
        state = apply_plan(decision.state, decision.plan, now_s + i)
    raise RuntimeError(f"decisions did not settle in {max_rounds} rounds")
