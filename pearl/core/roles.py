"""Roles, lifecycle phases and the one table of legal worker transitions.

A *worker* is an engine instance or a trainer rank group on k GPUs of one node. Its
``kind`` never changes; its ``role`` and ``phase`` change only along the edges below.

Invariants (asserted by ``tests/core/test_roles.py``):
- every edge in ``PHASE_EDGES`` has a comment saying what happens on it;
- ``gone`` is terminal: no edge leaves it;
- a role changes only on entry into ``switching`` and only to a role legal for the kind;
- a worker is born in ``starting``.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    TRAIN = "train"
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"
    IDLE = "idle"  # asleep engine (vLLM sleep mode) or offloaded trainer: holds no GPU memory


class Phase(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    SWITCHING = "switching"
    STOPPING = "stopping"
    GONE = "gone"


class WorkerKind(StrEnum):
    ENGINE = "engine"  # a vLLM (or CPU reference) inference instance
    TRAINER = "trainer"  # a Megatron-core (or CPU torch) rank group


class GpuSource(StrEnum):
    BASE_TRAIN = "base-train"  # the trainer's own GPUs; lent to rollout between updates
    BASE_ROLLOUT = "base-rollout"  # the base job's rollout GPUs
    ELASTIC = "elastic"  # GPUs of a preemptible allocation that come and go


INFERENCE_ROLES = frozenset({Role.COLOCATED, Role.PREFILL, Role.DECODE})

ROLES_BY_KIND: dict[WorkerKind, frozenset[Role]] = {
    WorkerKind.ENGINE: INFERENCE_ROLES | {Role.IDLE},
    WorkerKind.TRAINER: frozenset({Role.TRAIN, Role.IDLE}),
}

# (from, to) -> what happens on the edge. The only legal phase changes.
PHASE_EDGES: dict[tuple[Phase, Phase], str] = {
    (Phase.STARTING, Phase.READY): "process up, weights loaded, health check passed",
    (Phase.STARTING, Phase.STOPPING): "start cancelled by a newer plan",
    (Phase.READY, Phase.DRAINING): "stop admitting requests, let in-flight turns finish",
    (Phase.READY, Phase.SWITCHING): "role change with nothing in flight (idle worker, wake, "
    "sleep, offload, onload, or after migrating its requests away)",
    (Phase.READY, Phase.STOPPING): "stop a worker that holds no requests",
    (Phase.DRAINING, Phase.READY): "drain cancelled: the plan was aborted, keep serving",
    (Phase.DRAINING, Phase.SWITCHING): "drained: now change role",
    (Phase.DRAINING, Phase.STOPPING): "drained: now stop the process",
    (Phase.SWITCHING, Phase.READY): "new role in effect; the router may send it traffic",
    (Phase.STOPPING, Phase.GONE): "process exited, GPUs free",
    # Losing the node (preemption kill, crash, allocation end) can happen in any live phase.
    (Phase.STARTING, Phase.GONE): "lost while starting (crash or allocation ended)",
    (Phase.READY, Phase.GONE): "lost while serving; in-flight requests are re-queued",
    (Phase.DRAINING, Phase.GONE): "lost while draining; remaining requests are re-queued",
    (Phase.SWITCHING, Phase.GONE): "lost while switching",
}

LIVE_PHASES = frozenset(p for p in Phase if p is not Phase.GONE)


class TransitionError(ValueError):
    """A worker change that the transition table does not allow."""


def check_phase_edge(before: Phase, after: Phase) -> None:
    if before is after:
        return
    if (before, after) not in PHASE_EDGES:
        raise TransitionError(f"illegal phase change {before.value} -> {after.value}")


def check_role(kind: WorkerKind, role: Role) -> None:
    if role not in ROLES_BY_KIND[kind]:
        raise TransitionError(f"{kind.value} workers cannot take role {role.value}")


def check_role_change(before_phase: Phase, after_phase: Phase, before: Role, after: Role) -> None:
    """A role changes only when the worker enters ``switching``."""
    if before is after:
        return
    if after_phase is not Phase.SWITCHING or before_phase is Phase.SWITCHING:
        raise TransitionError(
            f"role {before.value} -> {after.value} must happen on entry into switching, "
            f"not on {before_phase.value} -> {after_phase.value}"
        )
