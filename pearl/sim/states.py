"""The cluster states the simulator makes itself: the one a run starts from, and the
state after a weight sync.

The base job holds the trainer nodes (one trainer group per node, with an asleep engine
per GPU co-resident, so lending wakes an engine rather than cold-starting one) and the
rollout nodes, empty: the run's first decision starts the engines, every policy paying
the same cold starts. Elastic nodes join only when Slurm grants them.
"""

from __future__ import annotations

from pearl.core.base_job import BaseNode, base_job_state
from pearl.core.roles import Role, WorkerKind
from pearl.core.state import ClusterState
from pearl.sim.scenario import Scenario


def initial_state(scenario: Scenario) -> ClusterState:
    c = scenario.cluster
    trainer = [
        BaseNode(f"train{n:03d}", c.trainer.gpu_type, c.trainer.gpus_per_node)
        for n in range(c.trainer.nodes)
    ]
    rollout = [
        BaseNode(f"roll{n:03d}", c.rollout.gpu_type, c.rollout.gpus_per_node)
        for n in range(c.rollout.nodes)
    ]
    return base_job_state(
        trainer,
        rollout,
        asleep_engines=True,
        policy_version=scenario.rollout.initial_policy_version,
    )


def synced(state: ClusterState, version: int) -> ClusterState:
    """After an update the simulator syncs every active engine: the state says so."""
    workers = tuple(
        w.model_copy(update={"weights_version": version})
        if w.kind is WorkerKind.ENGINE and w.role is not Role.IDLE and w.live
        else w
        for w in state.workers
    )
    return state.replace(policy_version=version, workers=workers)
