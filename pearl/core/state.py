"""The unified GPU-worker-role state: one versioned, immutable snapshot of the cluster.

Invariants (checked on every construction from a document and by ``tests/core/test_state.py``):
- GPU, worker and allocation ids are unique; every worker's GPUs exist and sit on its node;
  every GPU's allocation exists.
- A GPU hosts at most one *active* worker (live and not ``idle``); asleep engines and
  offloaded trainers (role ``idle``) may share GPUs with the active one.
- Only ``base-train`` GPUs can be lent. A ``base-train`` GPU under an active engine is
  lent; one under an active trainer is not.
- Every worker's role is legal for its kind (see ``pearl.core.roles``).

A state is never changed in place: ``replace`` returns the next version.
"""

from __future__ import annotations

from collections import Counter
from enum import StrEnum
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pearl.core.limits import (
    MAX_ALLOCATIONS,
    MAX_GPUS,
    GpuCount,
    Id,
    NonNegInt,
    Seconds,
    SecondsOrNever,
)
from pearl.core.roles import (
    INFERENCE_ROLES,
    LIVE_PHASES,
    GpuSource,
    Phase,
    Role,
    WorkerKind,
    check_role,
)


class Frozen(BaseModel):
    """Base of every document model: immutable, unknown fields rejected, every number
    finite (bounds per field: ``pearl.core.limits``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class Gpu(Frozen):
    gpu_id: Id = Field(description="Unique id, conventionally NODE/INDEX.")
    node: Id = Field(description="Host name of the node the GPU sits on.")
    gpu_type: Id = Field(description="GPU type as named in the runtime profile, e.g. h100.")
    source: GpuSource = Field(description="Where the GPU comes from.")
    allocation_id: Id = Field(description="Slurm job id (or local id) that owns the GPU.")
    lent: bool = Field(False, description="A base-train GPU currently lent to rollout.")


class Worker(Frozen):
    worker_id: Id = Field(description="Unique id of the engine instance or trainer group.")
    kind: WorkerKind = Field(description="engine or trainer; never changes.")
    node: Id = Field(description="Node all of the worker's GPUs sit on.")
    gpu_ids: tuple[Id, ...] = Field(min_length=1, description="GPUs; their count is the TP degree.")
    role: Role = Field(description="Current role; while switching, the role being switched to.")
    phase: Phase = Field(description="Lifecycle phase.")
    since_s: Seconds = Field(0.0, description="Time the worker entered its phase.")
    weights_version: NonNegInt = Field(0, description="Policy version of the loaded weights.")

    @property
    def tp(self) -> int:
        return len(self.gpu_ids)

    @property
    def live(self) -> bool:
        return self.phase in LIVE_PHASES

    @property
    def active(self) -> bool:
        """Live and holding GPU memory (not asleep, not offloaded)."""
        return self.live and self.role is not Role.IDLE


class AllocationKind(StrEnum):
    BASE = "base"  # the persistent base job: trainer and base rollout nodes
    ELASTIC = "elastic"  # a preemptible allocation


class AllocationStatus(StrEnum):
    PENDING = "pending"  # submitted, waiting in the Slurm queue
    GRANTED = "granted"  # running; its GPUs are usable
    PREEMPTING = "preempting"  # Slurm sent the preemption signal; grace period running
    ENDED = "ended"  # gone (preempted, time limit, released)


class EndReason(StrEnum):
    """Why an allocation ended: one vocabulary for the simulator, the Slurm shell and the
    coordinator (``AllocationEnded.reason``, ``Allocation.end_reason``, the run log)."""

    PREEMPTED = "preempted"  # the owner took the GPUs back (Slurm preemption, a window's end)
    RELEASED = "released"  # pearl gave them back
    TIMEOUT = "timeout"  # the time limit (or deadline) ran out
    NODE_FAIL = "node_fail"  # a node failed, or did not boot
    CANCELLED = "cancelled"  # someone else cancelled the job
    COMPLETED = "completed"  # the job ended by itself
    FAILED = "failed"  # non-zero exit, out of memory, ...
    LOST = "lost"  # the scheduler no longer knows the job (found missing after a restart)
    NO_AGENT = "no agent"  # granted, but no node agent joined in time: given back


class Allocation(Frozen):
    allocation_id: Id = Field(description="Slurm job id (or local id).")
    kind: AllocationKind = Field(description="base or elastic.")
    status: AllocationStatus = Field(description="Where the allocation is in its life.")
    gpu_type: Id | None = Field(None, description="GPU type requested, if any.")
    num_gpus: GpuCount = Field(0, description="GPUs requested or held.")
    submitted_at_s: Seconds | None = Field(None, description="Time of submission.")
    granted_at_s: Seconds | None = Field(None, description="Time the GPUs became usable.")
    end_by_s: Seconds | None = Field(
        None, description="Time the GPUs must be free: preemption deadline or time limit."
    )
    end_reason: EndReason | None = Field(None, description="Why it ended; None while it lives.")

    @field_validator("end_reason", mode="before")
    @classmethod
    def _no_reason(cls, value: object) -> object:
        return None if value == "" else value  # journals written before EndReason: ""


class BorrowWindow(Frozen):
    gpu_ids: tuple[Id, ...] = Field(min_length=1, description="The trainer GPUs lent.")
    lent_at_s: Seconds = Field(description="When the lending started.")
    return_by_s: SecondsOrNever = Field(
        description="When rollout must have vacated the GPUs, so the trainer can onload in time."
    )
    returning: bool = Field(False, description="The return has been decided and is under way.")
    forced: bool = Field(
        False,
        description="The trainer is waiting for them (a forced return): they are vacated at "
        "once, their in-flight turns migrated, however long a drain is predicted to take.",
    )


EngineKind = tuple[Role, Phase, str, int, int]  # role, phase, GPU type, TP, weights version


class ClusterState(Frozen):
    schema_version: Literal[1] = Field(1, description="Version of this document's schema.")
    version: NonNegInt = Field(0, description="Increments with every applied change.")
    time_s: Seconds = Field(0.0, description="Time this snapshot describes.")
    policy_version: NonNegInt = Field(0, description="The trainer's latest weights version.")
    gpus: tuple[Gpu, ...] = Field((), max_length=MAX_GPUS)
    workers: tuple[Worker, ...] = Field((), max_length=MAX_GPUS)
    allocations: tuple[Allocation, ...] = Field((), max_length=MAX_ALLOCATIONS)
    borrow: BorrowWindow | None = Field(None, description="Open borrow window, if any.")
    last_pd_switch_s: Seconds | None = Field(
        None, description="When the PD configuration last changed (for the dwell time)."
    )

    @model_validator(mode="after")
    def _check_invariants(self) -> ClusterState:
        problems = state_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # Indexes are derived once per snapshot; snapshots are immutable.
    @cached_property
    def gpu_by_id(self) -> dict[str, Gpu]:
        return {g.gpu_id: g for g in self.gpus}

    @cached_property
    def worker_by_id(self) -> dict[str, Worker]:
        return {w.worker_id: w for w in self.workers}

    @cached_property
    def allocation_by_id(self) -> dict[str, Allocation]:
        return {a.allocation_id: a for a in self.allocations}

    @cached_property
    def gpu_groups(self) -> dict[tuple[str, GpuSource], tuple[Gpu, ...]]:
        """The GPUs by (allocation, source), each group in the order of the state: the
        units the rollout pool is made of (a decision reads it many times)."""
        groups: dict[tuple[str, GpuSource], list[Gpu]] = {}
        for g in self.gpus:
            key = (g.allocation_id, g.source)
            members = groups.get(key)
            if members is None:
                members = groups[key] = []
            members.append(g)
        return {key: tuple(gpus) for key, gpus in groups.items()}

    @cached_property
    def group_node_counts(self) -> dict[tuple[str, GpuSource], Counter[tuple[str, str]]]:
        """Per group of ``gpu_groups``: (GPU type, node) -> its GPUs there."""
        return {
            key: Counter((g.gpu_type, g.node) for g in gpus)
            for key, gpus in self.gpu_groups.items()
        }

    @cached_property
    def group_of_gpu(self) -> dict[str, tuple[str, GpuSource]]:
        """GPU id -> its group of ``gpu_groups``."""
        return {g.gpu_id: key for key, gpus in self.gpu_groups.items() for g in gpus}

    @cached_property
    def worker_groups(self) -> dict[str, tuple[str, GpuSource] | None]:
        """Worker id -> the group of ``gpu_groups`` all its GPUs are in (None: several)."""
        group_of = self.group_of_gpu
        out: dict[str, tuple[str, GpuSource] | None] = {}
        for w in self.workers:
            if len(w.gpu_ids) == 1:
                out[w.worker_id] = group_of[w.gpu_ids[0]]
                continue
            groups = {group_of[gid] for gid in w.gpu_ids}
            out[w.worker_id] = groups.pop() if len(groups) == 1 else None
        return out

    @cached_property
    def live_engines_by_group(
        self,
    ) -> dict[tuple[str, GpuSource] | None, tuple[tuple[Worker, str], ...]]:
        """``live_engines`` by their group of ``worker_groups``, each in the state's order."""
        groups = self.worker_groups
        out: dict[tuple[str, GpuSource] | None, list[tuple[Worker, str]]] = {}
        for engine in self.live_engines:
            out.setdefault(groups[engine[0].worker_id], []).append(engine)
        return {group: tuple(engines) for group, engines in out.items()}

    @cached_property
    def engine_kinds_by_group(
        self,
    ) -> dict[tuple[str, GpuSource] | None, Counter[EngineKind]]:
        """Per group of ``live_engines_by_group``: its live engines counted by (role,
        phase, GPU type, TP, weights version): what a pool's engine inventory reads."""
        return {
            group: Counter(
                (w.role, w.phase, gpu_type, len(w.gpu_ids), w.weights_version) for w, gpu_type in ws
            )
            for group, ws in self.live_engines_by_group.items()
        }

    @cached_property
    def base_train_gpu_ids(self) -> tuple[str, ...]:
        """The trainer's GPUs, in the order of the state."""
        base_train = GpuSource.BASE_TRAIN
        return tuple([g.gpu_id for g in self.gpus if g.source is base_train])

    @cached_property
    def lent_gpu_ids(self) -> frozenset[str]:
        return frozenset(g.gpu_id for g in self.gpus if g.lent)

    @cached_property
    def trainers(self) -> tuple[Worker, ...]:
        """The trainer workers (every worker that is not an engine), in the state's order."""
        engine = WorkerKind.ENGINE
        return tuple([w for w in self.workers if w.kind is not engine])

    @cached_property
    def active_engines(self) -> tuple[Worker, ...]:
        """The live engines (``live_engines``) not asleep, in the state's order."""
        idle = Role.IDLE
        return tuple([w for w, _ in self.live_engines if w.role is not idle])

    @cached_property
    def allocations_hosting_active(self) -> frozenset[str]:
        """Allocations with an active worker on one of their GPUs."""
        return self._allocations_hosting(active=True)

    @cached_property
    def allocations_hosting_live(self) -> frozenset[str]:
        """Allocations with a live worker (asleep ones too) on one of their GPUs."""
        return self._allocations_hosting(active=False)

    def _allocations_hosting(self, active: bool) -> frozenset[str]:
        """The allocations of the live (or active) workers' GPUs: engines read per group
        (``engine_kinds_by_group``), trainers and engines spanning groups one by one."""
        hosting = {
            group[0]
            for group, kinds in self.engine_kinds_by_group.items()
            if group is not None and any(not active or role is not Role.IDLE for role, *_ in kinds)
        }
        spanning = self.live_engines_by_group.get(None, ())
        for w in (*(w for w, _ in spanning), *self.trainers):
            if w.active if active else w.live:
                hosting.update(self.gpu_by_id[gid].allocation_id for gid in w.gpu_ids)
        return frozenset(hosting)

    @cached_property
    def live_engines(self) -> tuple[tuple[Worker, str], ...]:
        """Every live engine with its GPU type."""
        gpus, engine, live = self.gpu_by_id, WorkerKind.ENGINE, LIVE_PHASES
        return tuple(
            [
                (w, gpus[w.gpu_ids[0]].gpu_type)
                for w in self.workers
                if w.kind is engine and w.phase in live  # w.live
            ]
        )

    @cached_property
    def serving_engine_counts(self) -> dict[tuple[Role, str, int], int]:
        """(role, GPU type, TP) -> how many live engines serve or are becoming that role
        (draining and stopping ones are leaving it): ``pd.config_of``'s counts."""
        counts: Counter[tuple[Role, str, int]] = Counter()
        for kinds in self.engine_kinds_by_group.values():
            for (role, phase, gpu_type, tp, _), n in kinds.items():
                if role in INFERENCE_ROLES and phase not in (Phase.DRAINING, Phase.STOPPING):
                    counts[(role, gpu_type, tp)] += n
        return dict(counts)

    def live_workers(self) -> tuple[Worker, ...]:
        return tuple(w for w in self.workers if w.live)

    def active_worker_on(self) -> dict[str, Worker]:
        """GPU id -> the active worker on it."""
        return {g: w for w in self.workers if w.active for g in w.gpu_ids}

    def evolve(self, **changes: Any) -> ClusterState:
        """The next version, unvalidated: only for fields no invariant involves.

        Used on every tick (the clock moves), where re-validating thousands of GPUs and
        workers would dominate the decision's cost. The cached indexes carry over: the
        GPUs, workers and allocations are the same objects.
        """
        unchecked = set(changes) - _FIELDS_WITHOUT_INVARIANTS
        if unchecked:
            raise ValueError(f"evolve() cannot change {sorted(unchecked)}; use replace()")
        return self.model_copy(update={**changes, "version": self.version + 1})

    def replace(self, **changes: Any) -> ClusterState:
        """The next version of this state, validated."""
        data = {name: getattr(self, name) for name in type(self).model_fields}
        data.update(changes, version=self.version + 1)
        return ClusterState.model_validate(data)


_FIELDS_WITHOUT_INVARIANTS = frozenset({"time_s", "policy_version", "last_pd_switch_s"})


def state_problems(state: ClusterState) -> list[str]:
    """Cross-reference problems of a state, each as 'field: problem'."""
    problems: list[str] = []
    problems += _duplicates("gpus", [g.gpu_id for g in state.gpus])
    problems += _duplicates("workers", [w.worker_id for w in state.workers])
    problems += _duplicates("allocations", [a.allocation_id for a in state.allocations])
    gpus = {g.gpu_id: g for g in state.gpus}
    allocation_ids = {a.allocation_id for a in state.allocations}
    for i, g in enumerate(state.gpus):
        if g.allocation_id not in allocation_ids:
            problems.append(f"gpus[{i}].allocation_id: unknown allocation {g.allocation_id!r}")
        if g.lent and g.source is not GpuSource.BASE_TRAIN:
            problems.append(f"gpus[{i}].lent: only base-train GPUs can be lent")
    active_on: dict[str, str] = {}
    for i, w in enumerate(state.workers):
        try:
            check_role(w.kind, w.role)
        except ValueError as err:
            problems.append(f"workers[{i}].role: {err}")
        for gid in w.gpu_ids:
            gpu = gpus.get(gid)
            if gpu is None:
                problems.append(f"workers[{i}].gpu_ids: unknown GPU {gid!r}")
                continue
            if gpu.node != w.node:
                problems.append(f"workers[{i}].gpu_ids: GPU {gid!r} is on {gpu.node}, not {w.node}")
            if not w.active:
                continue
            if gid in active_on:
                problems.append(
                    f"workers[{i}].gpu_ids: GPU {gid!r} already hosts active {active_on[gid]!r}"
                )
            active_on[gid] = w.worker_id
            if gpu.source is GpuSource.BASE_TRAIN and w.kind is WorkerKind.ENGINE and not gpu.lent:
                problems.append(f"workers[{i}]: engine active on base-train GPU {gid!r} not lent")
            if w.kind is WorkerKind.TRAINER and gpu.lent:
                problems.append(f"workers[{i}]: trainer active on lent GPU {gid!r}")
    if state.borrow is not None:
        for gid in state.borrow.gpu_ids:
            if gid not in gpus or gpus[gid].source is not GpuSource.BASE_TRAIN:
                problems.append(f"borrow.gpu_ids: {gid!r} is not a base-train GPU")
    return problems


def _duplicates(field: str, ids: list[str]) -> list[str]:
    return [f"{field}: duplicate id {i!r}" for i, n in Counter(ids).items() if n > 1]
