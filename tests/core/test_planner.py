"""The transition planner: reaches the target with the fewest changes, in a legal order."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_states import (
    COSTS,
    IDLE,
    C,
    D,
    P,
    actions_of,
    check_plan,
    cluster,
    elastic,
    engine,
    make_profile,
    node_gpus,
    spec,
    target,
    trainer,
)

from pearl.core.apply import apply_plan
from pearl.core.pd import InstanceSpec, config_of
from pearl.core.plan import Action, Target
from pearl.core.planner import plan_transition
from pearl.core.roles import GpuSource, Phase, Role, WorkerKind
from pearl.core.state import AllocationStatus, BorrowWindow, ClusterState, Gpu, Worker

PROFILE = make_profile()
NOW_S = 100.0
DRAIN_S = 30.0


def plan(state: ClusterState, tgt: Target, drain_s: float = DRAIN_S):  # type: ignore[no-untyped-def]
    return plan_transition(state, tgt, PROFILE, NOW_S, drain_s)


def assert_reaches(state: ClusterState, tgt: Target, drain_s: float = DRAIN_S) -> ClusterState:
    """Plan, check the plan's invariants, apply it, check the target is reached and that
    planning again is empty; return the state after."""
    p = plan(state, tgt, drain_s)
    assert p == plan(state, tgt, drain_s), "deterministic"
    assert not p.problems, p.problems
    check_plan(state, p)
    after = apply_plan(state, p, NOW_S)
    assert config_of(after) == tgt.config
    for g in after.gpus:
        if g.source is GpuSource.BASE_TRAIN:
            assert g.lent == (g.gpu_id in tgt.lent_gpu_ids), g
    for w in after.workers:
        if w.kind is WorkerKind.TRAINER:
            lent = any(g in tgt.lent_gpu_ids for g in w.gpu_ids)
            assert w.role is (Role.IDLE if lent else Role.TRAIN), w
    again = plan(after, tgt, drain_s)
    assert again.empty and again.num_role_changes == 0 and again.makespan_s == 0.0, again
    return after


# ---------------------------------------------------------------- property-based tests


@dataclass
class Scenario:
    state: ClusterState
    target: Target
    min_changes: int
    notes: list[str] = field(default_factory=list)


_SLOT = st.sampled_from([None, C, P, D, IDLE])


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    """Nodes of 8 GPUs of one or two types; per type, engines of one tp on aligned slots;
    rollout nodes (base, granted or preempting elastic) and trainer nodes (lent or not);
    a random target feasible on the pool after the plan, with that tp per type."""
    types = draw(st.sampled_from([("h100",), ("h20",), ("h100", "h20")]))
    policy_version = draw(st.integers(0, 2))
    gpus: list[Gpu] = []
    workers: list[Worker] = []
    allocations = []
    lent_target: set[str] = set()
    lent_state: set[str] = set()
    min_changes = 0
    wanted: dict[InstanceSpec, int] = {}
    for t in types:
        tp = draw(st.sampled_from([1, 2]))
        pool_active: Counter[Role] = Counter()
        pool_slots = 0
        for k in range(draw(st.integers(0, 3))):
            node = f"{t}-r{k}"
            kind = draw(st.sampled_from(["base", "granted", "preempting"]))
            alloc = "base" if kind == "base" else f"job-{node}"
            src = GpuSource.BASE_ROLLOUT if kind == "base" else GpuSource.ELASTIC
            if kind == "preempting":
                allocations.append(elastic(alloc, AllocationStatus.PREEMPTING, end_by_s=1e4))
            gpus += node_gpus(node, t, src, alloc)
            in_pool = kind != "preempting"
            pool_slots += 8 // tp if in_pool else 0
            for slot in range(8 // tp):
                w = _slot_engine(draw, node, slot, tp, policy_version)
                if w is None:
                    continue
                workers.append(w)
                if in_pool and w.active:
                    pool_active[w.role] += 1
                elif not in_pool:
                    min_changes += 1  # stopped: its allocation goes away
        for k in range(draw(st.integers(0, 2))):
            node = f"{t}-t{k}"
            lent_now, lent_next = draw(st.booleans()), draw(st.booleans())
            gpus += node_gpus(node, t, GpuSource.BASE_TRAIN)
            workers.append(trainer(node, IDLE if lent_now else Role.TRAIN))
            min_changes += lent_now != lent_next  # offload or onload
            if lent_now:
                lent_state.update(f"{node}/{i}" for i in range(8))
            if lent_next:
                lent_target.update(f"{node}/{i}" for i in range(8))
                pool_slots += 8 // tp
            for slot in range(8 // tp):
                w = _slot_engine(draw, node, slot, tp, policy_version, active_ok=lent_now)
                if w is None:
                    continue
                workers.append(w)
                if w.active and lent_next:
                    pool_active[w.role] += 1
                elif w.active:
                    min_changes += 1  # sleeps: the trainer takes its GPUs back
        left = pool_slots
        target_counts: Counter[Role] = Counter()
        for role in (C, P, D):
            target_counts[role] = draw(st.integers(0, left))
            left -= target_counts[role]
            wanted[spec(role, t, tp)] = target_counts[role]
        kept = sum(min(pool_active[r], target_counts[r]) for r in (C, P, D))
        rows, cols = target_counts.total() - kept, pool_active.total() - kept
        min_changes += rows + cols - min(rows, cols)
    state = cluster(gpus, workers, allocations, policy_version, lent=lent_state)
    return Scenario(state, target(wanted, lent_target), min_changes)


def _slot_engine(
    draw: st.DrawFn, node: str, slot: int, tp: int, policy_version: int, active_ok: bool = True
) -> Worker | None:
    role = draw(_SLOT if active_ok else st.sampled_from([None, IDLE]))
    if role is None:
        return None
    phase = Phase.READY if role is IDLE else draw(st.sampled_from([Phase.READY, Phase.STARTING]))
    version = draw(st.integers(0, policy_version))
    return engine(node, range(slot * tp, slot * tp + tp), role, phase, version)


_PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_PROPS
@given(scenarios())
def test_plan_reaches_target_with_fewest_changes(sc: Scenario) -> None:
    p = plan(sc.state, sc.target)
    assert p.num_role_changes == sc.min_changes, (p.reason, p.steps)
    assert_reaches(sc.state, sc.target)


@_PROPS
@given(scenarios(), st.sampled_from([0.0, 30.0]))
def test_planning_from_the_target_is_empty(sc: Scenario, drain_s: float) -> None:
    after = apply_plan(sc.state, plan(sc.state, sc.target, drain_s), NOW_S)
    again = plan(after, sc.target, drain_s)
    assert again.empty, again.steps
    assert again.reason.startswith("already at")
    assert again == plan(after, sc.target, drain_s)


# ---------------------------------------------------------------- example-based tests


def _colocated_to_disaggregated() -> tuple[ClusterState, Target, dict[Action, int]]:
    state = cluster(node_gpus("n0"), [engine("n0", [i], C) for i in range(4)])
    return state, target({spec(C): 1, spec(P): 1, spec(D): 2}), {Action.SWITCH: 3}


def _lend_trainer_gpus() -> tuple[ClusterState, Target, dict[Action, int]]:
    gpus = node_gpus("r0") + node_gpus("t0", source=GpuSource.BASE_TRAIN)
    asleep = [engine("t0", [2 * i, 2 * i + 1], IDLE, weights_version=1) for i in range(4)]
    state = cluster(gpus, [*asleep, trainer("t0"), engine("r0", [0, 1], D)], policy_version=2)
    tgt = target({spec(D, tp=2): 5}, lent=(g.gpu_id for g in gpus if g.node == "t0"))
    return state, tgt, {Action.OFFLOAD: 1, Action.WAKE: 4}


def _return_trainer_gpus() -> tuple[ClusterState, Target, dict[Action, int]]:
    gpus = node_gpus("r0") + node_gpus("t0", source=GpuSource.BASE_TRAIN)
    lent = [engine("t0", [2 * i, 2 * i + 1], D) for i in range(4)]
    borrow = BorrowWindow(gpu_ids=tuple(f"t0/{i}" for i in range(8)), lent_at_s=0.0,
                          return_by_s=1e4)  # fmt: skip
    state = cluster(gpus, [*lent, trainer("t0", IDLE), engine("r0", [0, 1], D)], borrow=borrow)
    return state, target({spec(D, tp=2): 1}), {Action.SLEEP: 4, Action.ONLOAD: 1}


def _elastic_grant() -> tuple[ClusterState, Target, dict[Action, int]]:
    gpus = node_gpus("r0") + node_gpus("x0", "h20", GpuSource.ELASTIC, "job-1")
    state = cluster(gpus, [engine("r0", [i], C) for i in range(8)])
    return state, target({spec(C): 8, spec(C, "h20"): 8}), {Action.START: 8}


def _tp_change() -> tuple[ClusterState, Target, dict[Action, int]]:
    state = cluster(node_gpus("n0"), [engine("n0", [i, i + 1], D) for i in range(0, 8, 2)])
    return state, target({spec(D): 8}), {Action.STOP: 4, Action.START: 8}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(_colocated_to_disaggregated, id="colocated-to-disaggregated-reuses"),
        pytest.param(_lend_trainer_gpus, id="lend-trainer-gpus-offload-then-wake"),
        pytest.param(_return_trainer_gpus, id="return-trainer-gpus-drain-sleep-onload"),
        pytest.param(_elastic_grant, id="elastic-grant-starts-engines"),
        pytest.param(_tp_change, id="tp-change-stops-then-starts"),
    ],
)
def test_examples(case) -> None:  # type: ignore[no-untyped-def]
    state, tgt, expected = case()
    p = plan(state, tgt)
    changes = Counter(s.action for s in p.steps if s.action not in _NOT_CHANGES)
    assert changes == Counter(expected), p.steps
    assert p.num_role_changes == sum(expected.values())
    assert_reaches(state, tgt)


_NOT_CHANGES = (Action.DRAIN, Action.MIGRATE, Action.SYNC_WEIGHTS)


def test_colocated_switch_drains_then_switches() -> None:
    state, tgt, _ = _colocated_to_disaggregated()
    p = plan(state, tgt)
    switches = [s for s in p.steps if s.action is Action.SWITCH]
    assert Counter(s.role for s in switches) == {P: 1, D: 2}
    assert all(s.start_s == DRAIN_S for s in switches)
    assert p.makespan_s == DRAIN_S + COSTS.role_switch_s


def test_lending_offloads_before_waking_and_syncs_stale_weights() -> None:
    state, tgt, _ = _lend_trainer_gpus()
    p = plan(state, tgt)
    offload = next(s for s in p.steps if s.action is Action.OFFLOAD)
    for s in p.steps:
        if s.action is Action.WAKE:
            assert s.depends_on == (offload.step_id,)
            assert actions_of(p, s.worker_id) == [Action.WAKE, Action.SYNC_WEIGHTS]
    expected_s = COSTS.trainer_offload_s + COSTS.wake_s + COSTS.weight_sync_s
    assert p.makespan_s == expected_s


def test_returning_sleeps_before_onload() -> None:
    state, tgt, _ = _return_trainer_gpus()
    p = plan(state, tgt)
    onload = next(s for s in p.steps if s.action is Action.ONLOAD)
    sleeps = {s.step_id for s in p.steps if s.action is Action.SLEEP}
    assert set(onload.depends_on) == sleeps
    assert onload.start_s == DRAIN_S + COSTS.sleep_s
    after = apply_plan(state, p, NOW_S)
    asleep = [w for w in after.workers if w.node == "t0" and w.kind is WorkerKind.ENGINE]
    assert len(asleep) == 4 and all(w.role is IDLE for w in asleep), "stay co-resident"


def test_new_engines_get_deterministic_ids() -> None:
    state, tgt, _ = _tp_change()
    p = plan(state, tgt)
    starts = [s for s in p.steps if s.action is Action.START]
    ids = sorted(s.worker_id for s in starts)
    assert ids == sorted(
        [f"e-n0-{i}-2" for i in range(0, 8, 2)] + [f"e-n0-{i}" for i in range(1, 8, 2)]
    )
    for s in starts:  # each start waits for the stop of the engine that held its GPU
        (old,) = {w.worker_id for w in state.workers if set(w.gpu_ids) & set(s.gpu_ids)}
        stop = next(x for x in p.steps if x.worker_id == old and x.action is Action.STOP)
        assert stop.step_id in s.depends_on


def test_keeps_ready_engines_before_starting_ones() -> None:
    workers = [engine("n0", [0], C, Phase.STARTING), engine("n0", [1], C)]
    p = plan(cluster(node_gpus("n0"), workers), target({spec(C): 1}))
    assert [(s.worker_id, s.action) for s in p.steps] == [("e-n0-0", Action.STOP)]


def test_prefers_waking_a_fresh_engine_over_a_stale_one() -> None:
    workers = [
        engine("n0", [0], IDLE, weights_version=0),
        engine("n0", [1], IDLE, weights_version=3),
    ]
    p = plan(cluster(node_gpus("n0"), workers, policy_version=3), target({spec(D): 1}))
    assert [(s.worker_id, s.action) for s in p.steps] == [("e-n0-1", Action.WAKE)]


def test_switch_reuses_an_active_engine_rather_than_waking() -> None:
    workers = [engine("n0", [0], C), engine("n0", [1], IDLE)]
    p = plan(cluster(node_gpus("n0"), workers), target({spec(D): 1}))
    assert [s.action for s in p.steps] == [Action.DRAIN, Action.SWITCH]
    assert p.num_role_changes == 1


def test_fewest_changes_beat_fewer_seconds() -> None:
    """A role switch slower than stop + cold start is still chosen: one change, not two."""
    slow_switch = PROFILE.model_copy(
        update={"costs": COSTS.model_copy(update={"role_switch_s": 500.0})}
    )
    state = cluster(node_gpus("n0"), [engine("n0", [0], C)])
    p = plan_transition(state, target({spec(D): 1}), slow_switch, NOW_S, DRAIN_S)
    assert [s.action for s in p.steps] == [Action.DRAIN, Action.SWITCH]
    assert p.num_role_changes == 1


def test_asleep_engine_is_stopped_when_its_gpus_are_needed() -> None:
    workers = [engine("n0", [i, i + 1], IDLE) for i in range(0, 8, 2)]
    p = plan(cluster(node_gpus("n0"), workers), target({spec(C, tp=1): 8}))
    assert Counter(s.action for s in p.steps) == {Action.STOP: 4, Action.START: 8}
    assert_reaches(cluster(node_gpus("n0"), workers), target({spec(C, tp=1): 8}))


def test_asleep_engines_sharing_a_gpu_are_not_woken() -> None:
    workers = [engine("n0", [0], IDLE), engine("n0", [1], IDLE)]
    workers.append(engine("n0", [1, 2], IDLE).model_copy(update={"worker_id": "e-big"}))
    state = cluster(node_gpus("n0", num_gpus=4), workers)
    p = plan(state, target({spec(D): 2}))
    assert [(s.action, s.worker_id) for s in p.steps] == [
        (Action.WAKE, "e-n0-0"),
        (Action.START, "e-n0-3"),
    ]
    assert_reaches(state, target({spec(D): 2}))


def test_unplaceable_instances_are_problems() -> None:
    state = cluster(node_gpus("n0", num_gpus=4), [])
    p = plan(state, target({spec(D, tp=2): 3}))
    assert [s.action for s in p.steps] == [Action.START, Action.START]
    assert p.problems == ("no room for a new decode:h100x2: no node with 2 free GPUs",)
    assert not p.feasible


def test_draining_and_stopping_engines_are_finished() -> None:
    workers = [engine("n0", [0], D, Phase.DRAINING), engine("n0", [1], D, Phase.STOPPING)]
    state = cluster(node_gpus("n0"), workers)
    p = plan(state, target({spec(D): 1}))
    assert actions_of(p, "e-n0-0") == [Action.DRAIN, Action.STOP]
    assert actions_of(p, "e-n0-1") == [Action.STOP]
    assert [s.action for s in p.steps if s.worker_id not in ("e-n0-0", "e-n0-1")] == [Action.START]
    assert_reaches(state, target({spec(D): 1}))


def test_bad_lent_gpu_is_a_problem() -> None:
    p = plan(cluster(node_gpus("n0"), []), target({}, lent=["n0/0"]))
    assert p.problems == ("cannot lend 'n0/0': not a base-train GPU",)


# ---------------------------------------------------------------- deadlines


def _borrowed(return_by_s: float) -> tuple[ClusterState, Target]:
    gpus = node_gpus("r0") + node_gpus("t0", source=GpuSource.BASE_TRAIN)
    borrow = BorrowWindow(gpu_ids=tuple(f"t0/{i}" for i in range(8)), lent_at_s=0.0,
                          return_by_s=return_by_s)  # fmt: skip
    workers = [engine("t0", [0, 1], D), trainer("t0", IDLE), engine("r0", [0, 1], D)]
    return cluster(gpus, workers, borrow=borrow), target({spec(D, tp=2): 1})


@pytest.mark.parametrize(
    ("return_by_s", "leave", "problem"),
    [
        pytest.param(NOW_S + 1000, Action.DRAIN, False, id="long-deadline-drains"),
        pytest.param(NOW_S + DRAIN_S + COSTS.sleep_s, Action.DRAIN, False, id="drain-just-fits"),
        pytest.param(NOW_S + 10, Action.MIGRATE, False, id="short-deadline-migrates"),
        pytest.param(NOW_S + 5, Action.MIGRATE, True, id="too-short-is-a-problem"),
    ],
)
def test_borrowed_gpu_deadline(return_by_s: float, leave: Action, problem: bool) -> None:
    state, tgt = _borrowed(return_by_s)
    p = plan(state, tgt)
    assert actions_of(p, "e-t0-0") == [leave, Action.SLEEP]
    assert bool(p.problems) == problem
    check_plan(state, p)
    assert config_of(apply_plan(state, p, NOW_S)) == tgt.config


@pytest.mark.parametrize(
    ("end_by_s", "leave"),
    [
        pytest.param(NOW_S + 1000, Action.DRAIN, id="long-grace-drains"),
        pytest.param(NOW_S + 12, Action.MIGRATE, id="short-grace-migrates"),
    ],
)
def test_preempting_allocation_engines_move_off(end_by_s: float, leave: Action) -> None:
    gpus = node_gpus("r0") + node_gpus("x0", source=GpuSource.ELASTIC, allocation_id="job-1")
    workers = [engine("x0", [i], C) for i in range(3)] + [engine("x0", [3], IDLE)]
    workers += [engine("r0", [0], C)]
    alloc = elastic("job-1", AllocationStatus.PREEMPTING, end_by_s=end_by_s)
    state = cluster(gpus, workers, [alloc])
    tgt = target({spec(C): 4})
    p = plan(state, tgt)
    for i in range(3):
        assert actions_of(p, f"e-x0-{i}") == [leave, Action.STOP]
    assert actions_of(p, "e-x0-3") == [Action.STOP]
    assert {s.node for s in p.steps if s.action is Action.START} == {"r0"}
    assert not p.problems
    after = assert_reaches(state, tgt)
    assert not [w for w in after.workers if w.node == "x0"]


# ---------------------------------------------------------------- scale


def big_state(num_nodes: int = 1024) -> tuple[ClusterState, Target]:
    """8 GPUs a node: 1/8 trainer nodes with asleep engines, 1/16 elastic, the rest base
    rollout; about 2,000 workers; the target moves a few instances and lends 4 nodes."""
    gpus: list[Gpu] = []
    workers: list[Worker] = []
    n_train, n_elastic = num_nodes // 8, num_nodes // 16
    for k in range(num_nodes):
        node = f"n{k:04d}"
        if k < n_train:
            gpus += node_gpus(node, source=GpuSource.BASE_TRAIN)
            workers += [trainer(node), engine(node, [0, 1], IDLE), engine(node, [2, 3], IDLE)]
        elif k < n_train + n_elastic:
            gpus += node_gpus(node, source=GpuSource.ELASTIC, allocation_id=f"job-{k}")
        elif k % 2 == 0:
            workers += [engine(node, [2 * i, 2 * i + 1], P if i == 0 else D) for i in range(4)]
            gpus += node_gpus(node)
        else:
            gpus += node_gpus(node)
    state = cluster(gpus, workers)
    wanted = config_of(state).counts()
    wanted[spec(D, tp=2)] -= 16
    wanted[spec(P, tp=2)] += 16  # 16 switches
    wanted[spec(C, tp=2)] += 32  # 8 wakes on the 4 lent nodes and 24 starts
    lent = [g.gpu_id for g in gpus if g.node in {f"n{k:04d}" for k in range(4)}]
    return state, target(wanted, lent)


def test_plan_at_8k_gpus_is_fast() -> None:
    import time

    state, tgt = big_state()
    assert len(state.gpus) == 8192 and len(state.workers) > 1500
    plan_transition(state, tgt, PROFILE, NOW_S, DRAIN_S)  # warm the state's indexes
    t0 = time.perf_counter()
    p = plan_transition(state, tgt, PROFILE, NOW_S, DRAIN_S)
    elapsed_s = time.perf_counter() - t0
    assert not p.problems
    assert Counter(s.action for s in p.steps if s.action not in _NOT_CHANGES) == {
        Action.SWITCH: 16, Action.OFFLOAD: 4, Action.WAKE: 8, Action.START: 24,
    }  # fmt: skip
    assert elapsed_s < 0.5, elapsed_s  # typically ~0.02 s; the bound leaves room for slow CI
    assert config_of(apply_plan(state, p, NOW_S)) == tgt.config
