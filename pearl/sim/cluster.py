"""The cluster state a simulated run starts from, and the windows its elastic GPUs follow.

The base job holds the trainer nodes (one trainer group per node, with an asleep engine
per GPU co-resident, so lending wakes an engine rather than cold-starting one) and the
rollout nodes, empty: the run's first decision starts the engines, every policy paying
the same cold starts. Elastic nodes join only when Slurm grants them.
"""

from __future__ import annotations

from pearl.core.base_job import BaseNode, base_job_state
from pearl.core.roles import Role, WorkerKind
from pearl.core.state import ClusterState
from pearl.sim.availability import Window
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
