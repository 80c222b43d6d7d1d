"""States, a runtime profile and plan checks shared by the planner and apply tests.

A plain module (not a conftest) so it cannot clash with other test helpers. Nothing is
faked: the states are real ``ClusterState`` documents and the profile a real
``RuntimeProfile`` with small, round numbers (wake + weight sync is cheaper than a cold
start, as on real hardware).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from pearl.core.pd import InstanceSpec, PDConfig
from pearl.core.plan import Action, PlanStep, Target, TransitionPlan
from pearl.core.profile import (
    DecodeCoeffs,
    DecodeRegime,
    EngineProfile,
    GpuProfile,
    ModelSpec,
    PrefillCoeffs,
    RuntimeProfile,
    TransitionCosts,
    WorkloadDefaults,
)
from pearl.core.roles import GpuSource, Phase, Role, WorkerKind
from pearl.core.state import (
    Allocation,
    AllocationKind,
    AllocationStatus,
    BorrowWindow,
    ClusterState,
    Gpu,
    Worker,
)

COSTS = TransitionCosts(
    engine_cold_start_s=60.0,
    wake_s=5.0,
    sleep_s=3.0,
    role_switch_s=2.0,
    migrate_s=4.0,
    stop_s=5.0,
    weight_sync_s=8.0,
    trainer_offload_s=10.0,
    trainer_onload_s=12.0,
    train_step_s=30.0,
)
CHANGE_ACTIONS = frozenset(
    {Action.START, Action.STOP, Action.SLEEP, Action.WAKE, Action.SWITCH, Action.OFFLOAD}
    | {Action.ONLOAD}
)
C, P, D, IDLE = Role.COLOCATED, Role.PREFILL, Role.DECODE, Role.IDLE


def make_profile(tps: Iterable[int] = (1, 2)) -> RuntimeProfile:
    """Profile of a tiny model on h100 and h20, engines for the given tp degrees."""

    def engine(tp: int) -> EngineProfile:
        regime = DecodeRegime(base_s=0.01, per_seq_s=1e-4, per_ctx_token_s=1e-8)
        return EngineProfile(
            tp=tp,
            prefill=PrefillCoeffs(a_s=0.01, b_s_per_token=1e-4 / tp, c_s_per_token2=1e-9),
            decode=DecodeCoeffs(small=regime, large=regime, large_batch_from=64),
            kv_capacity_tokens=100_000 * tp,
        )

    def gpu(memory_gb: float) -> GpuProfile:
        return GpuProfile(
            memory_gb=memory_gb,
            kv_transfer_gb_per_s=25.0,
            kv_transfer_intra_node_gb_per_s=300.0,
            engines=tuple(engine(tp) for tp in tps),
        )

    return RuntimeProfile(
        model=ModelSpec(name="tiny", num_layers=4, num_kv_heads=2, head_dim=64, weights_gb=1.0),
        gpus={"h100": gpu(80.0), "h20": gpu(96.0)},
        costs=COSTS,
        workload=WorkloadDefaults(
            prompt_tokens=512,
            output_tokens_per_turn=128,
            observation_tokens_per_turn=64,
            env_latency_s=1.0,
            turns_per_trajectory=4,
        ),
    )


def node_gpus(
    node: str,
    gpu_type: str = "h100",
    source: GpuSource = GpuSource.BASE_ROLLOUT,
    allocation_id: str = "base",
    num_gpus: int = 8,
) -> list[Gpu]:
    return [
        Gpu(gpu_id=f"{node}/{i}", node=node, gpu_type=gpu_type, source=source,
            allocation_id=allocation_id)
        for i in range(num_gpus)
    ]  # fmt: skip


def engine(
    node: str,
    indices: Sequence[int],
    role: Role,
    phase: Phase = Phase.READY,
    weights_version: int = 0,
) -> Worker:
    return Worker(
        worker_id=f"e-{node}-{indices[0]}",
        kind=WorkerKind.ENGINE,
        node=node,
        gpu_ids=tuple(f"{node}/{i}" for i in indices),
        role=role,
        phase=phase,
        weights_version=weights_version,
    )


def trainer(node: str, role: Role = Role.TRAIN, num_gpus: int = 8) -> Worker:
    return Worker(
        worker_id=f"t-{node}",
        kind=WorkerKind.TRAINER,
        node=node,
        gpu_ids=tuple(f"{node}/{i}" for i in range(num_gpus)),
        role=role,
        phase=Phase.READY,
    )


def elastic(
    allocation_id: str, status: AllocationStatus, end_by_s: float | None = None
) -> Allocation:
    return Allocation(
        allocation_id=allocation_id, kind=AllocationKind.ELASTIC, status=status, end_by_s=end_by_s
    )


def cluster(
    gpus: Iterable[Gpu],
    workers: Iterable[Worker],
    allocations: Iterable[Allocation] = (),
    policy_version: int = 0,
    borrow: BorrowWindow | None = None,
    lent: Iterable[str] = (),
) -> ClusterState:
    """A state; allocations not given are granted (``base`` is the base job), and a
    base-train GPU is lent when listed in ``lent`` or under an active engine."""
    gpus, workers = list(gpus), list(workers)
    given = {a.allocation_id: a for a in allocations}
    for g in gpus:
        if g.allocation_id not in given:
            kind = AllocationKind.BASE if g.allocation_id == "base" else AllocationKind.ELASTIC
            given[g.allocation_id] = Allocation(
                allocation_id=g.allocation_id, kind=kind, status=AllocationStatus.GRANTED
            )
    engine_on = {g for w in workers if w.active and w.kind is WorkerKind.ENGINE for g in w.gpu_ids}
    lent_ids = set(lent) | engine_on
    gpus = [
        g.model_copy(update={"lent": g.source is GpuSource.BASE_TRAIN and g.gpu_id in lent_ids})
        for g in gpus
    ]
    return ClusterState(
        policy_version=policy_version,
        gpus=tuple(gpus),
        workers=tuple(workers),
        allocations=tuple(given.values()),
        borrow=borrow,
    )


def spec(role: Role, gpu_type: str = "h100", tp: int = 1) -> InstanceSpec:
    return InstanceSpec(role, gpu_type, tp)


def target(counts: Mapping[InstanceSpec, int], lent: Iterable[str] = ()) -> Target:
    return Target(PDConfig.of(counts), frozenset(lent))


def change_steps(plan: TransitionPlan) -> list[PlanStep]:
    return [s for s in plan.steps if s.action in CHANGE_ACTIONS]


def actions_of(plan: TransitionPlan, worker_id: str) -> list[Action]:
    return [s.action for s in plan.steps if s.worker_id == worker_id]


def check_plan(state: ClusterState, plan: TransitionPlan) -> None:
    """The structural invariants of ``pearl.core.plan`` and ``pearl.core.planner``."""
    ends = [s.end_s for s in plan.steps]
    for i, s in enumerate(plan.steps):
        assert s.step_id == i
        assert all(d < i for d in s.depends_on), s
        assert abs(s.start_s - max((ends[d] for d in s.depends_on), default=0.0)) < 1e-9, s
    assert abs(plan.makespan_s - max(ends, default=0.0)) < 1e-9
    busy = sum(s.duration_s * len(s.gpu_ids) for s in plan.steps)
    assert abs(plan.gpu_busy_s - busy) < 1e-6
    changed = [s.worker_id for s in change_steps(plan)]
    assert len(changed) == len(set(changed)), "a worker changes at most once"
    assert plan.num_role_changes == len(changed)
    _check_drains(state, plan)
    _check_gpu_handover(state, plan)


def _check_drains(state: ClusterState, plan: TransitionPlan) -> None:
    """An engine with requests drains (or migrates) before it switches, sleeps or stops;
    a woken engine with stale weights syncs after the wake."""
    by_id = {s.step_id: s for s in plan.steps}
    for s in change_steps(plan):
        w = state.worker_by_id.get(s.worker_id)
        if w is None or w.kind is WorkerKind.TRAINER or not w.active:
            continue
        if w.phase in (Phase.READY, Phase.DRAINING) and s.action is not Action.WAKE:
            leave = [by_id[d] for d in s.depends_on if by_id[d].worker_id == w.worker_id]
            assert [x.action for x in leave] in ([Action.DRAIN], [Action.MIGRATE]), s
    for s in plan.steps:
        if s.action is Action.WAKE and state.worker_by_id[s.worker_id].weights_version < (
            state.policy_version
        ):
            syncs = [
                x for x in plan.steps if x.worker_id == s.worker_id and s.step_id in x.depends_on
            ]
            assert [x.action for x in syncs] == [Action.SYNC_WEIGHTS]


def _check_gpu_handover(state: ClusterState, plan: TransitionPlan) -> None:
    """A worker becomes active on GPUs only after every other worker that must leave them
    (active ones, and asleep engines under a new start) has left, in plan time."""
    leave_end: dict[str, float] = {}
    for s in plan.steps:
        if s.action in (Action.STOP, Action.SLEEP, Action.OFFLOAD):
            leave_end[s.worker_id] = s.end_s
    for s in plan.steps:
        if s.action not in (Action.START, Action.WAKE, Action.ONLOAD):
            continue
        for w in state.workers:
            if w.worker_id == s.worker_id or not w.live or not set(w.gpu_ids) & set(s.gpu_ids):
                continue
            must_leave = w.active or (s.action is Action.START and w.kind is WorkerKind.ENGINE)
            if must_leave:
                assert w.worker_id in leave_end, (s, w.worker_id)
                assert leave_end[w.worker_id] <= s.start_s + 1e-9, (s, w.worker_id)
