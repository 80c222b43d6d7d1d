"""apply_plan: runs plans through the transition table and returns the next state."""

from __future__ import annotations

from dataclasses import replace

import pytest
from planner_states import IDLE, C, D, P, cluster, engine, make_profile, node_gpus, spec, target
from planner_states import trainer as trainer_worker

import pearl.core.apply as apply_module
from pearl.core.apply import apply_plan
from pearl.core.pd import config_of
from pearl.core.plan import Action, PlanStep, Target, TransitionPlan
from pearl.core.planner import plan_transition
from pearl.core.roles import GpuSource, Phase, Role, TransitionError, WorkerKind
from pearl.core.state import ClusterState

PROFILE = make_profile()
NOW_S = 50.0


def _plan(state: ClusterState, tgt: Target) -> TransitionPlan:
    return plan_transition(state, tgt, PROFILE, NOW_S, drain_estimate_s=20.0)


def _step(action: Action, worker_id: str, gpu_ids: tuple[str, ...], role: Role | None) -> PlanStep:
    return PlanStep(0, action, worker_id, "n0", gpu_ids, role, (), 1.0, 0.0, "test")


def _one_step_plan(state: ClusterState, step: PlanStep) -> TransitionPlan:
    return TransitionPlan(Target(config_of(state)), (step,), 1, step.end_s)


@pytest.fixture
def recorded_edges(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    edges: list[tuple[str, str]] = []
    real = apply_module.check_phase_edge

    def record(before: Phase, after: Phase) -> None:
        real(before, after)
        edges.append((before.value, after.value))

    monkeypatch.setattr(apply_module, "check_phase_edge", record)
    return edges


def test_switch_goes_through_draining_and_switching(recorded_edges: list[tuple[str, str]]) -> None:
    state = cluster(node_gpus("n0"), [engine("n0", [0], C)])
    after = apply_plan(state, _plan(state, target({spec(P): 1})), NOW_S)
    assert recorded_edges == [
        ("ready", "draining"),
        ("draining", "switching"),
        ("switching", "ready"),
    ]
    (w,) = after.workers
    assert (w.role, w.phase, w.since_s) == (P, Phase.READY, NOW_S + 20.0 + 2.0)
    assert after.time_s == NOW_S + 22.0 and after.version == state.version + 1


def test_stop_then_start_drops_gone_workers(recorded_edges: list[tuple[str, str]]) -> None:
    state = cluster(node_gpus("n0", num_gpus=2), [engine("n0", [0, 1], D)], policy_version=4)
    after = apply_plan(state, _plan(state, target({spec(D): 2})), NOW_S)
    assert ("stopping", "gone") in recorded_edges
    assert ("starting", "ready") in recorded_edges
    assert sorted(w.worker_id for w in after.workers) == ["e-n0-0-2", "e-n0-1"]
    assert all(w.weights_version == 4 and w.phase is Phase.READY for w in after.workers)


def test_starting_worker_settles_before_switching(recorded_edges: list[tuple[str, str]]) -> None:
    state = cluster(node_gpus("n0"), [engine("n0", [0], C, Phase.STARTING)])
    after = apply_plan(state, _plan(state, target({spec(D): 1})), NOW_S)
    assert recorded_edges == [("starting", "ready"), ("ready", "switching"), ("switching", "ready")]
    assert after.workers[0].role is D


def test_offload_lends_and_onload_returns() -> None:
    gpus = node_gpus("t0", source=GpuSource.BASE_TRAIN)
    asleep = engine("t0", [0, 1], IDLE, weights_version=1)
    state = cluster(gpus, [trainer_worker("t0"), asleep], policy_version=2)
    lend = target({spec(D, tp=2): 1}, lent=[g.gpu_id for g in gpus])
    lent_state = apply_plan(state, _plan(state, lend), NOW_S)
    assert all(g.lent for g in lent_state.gpus)
    by_id = lent_state.worker_by_id
    assert by_id["t-t0"].role is IDLE and by_id["e-t0-0"].role is D
    assert by_id["e-t0-0"].weights_version == 2, "synced after the wake"
    back = apply_plan(lent_state, _plan(lent_state, target({})), NOW_S)
    assert not any(g.lent for g in back.gpus)
    assert back.worker_by_id["t-t0"].role is Role.TRAIN
    assert back.worker_by_id["e-t0-0"].role is IDLE


def test_partially_lent_trainer_keeps_unlent_gpus_unlent() -> None:
    gpus = node_gpus("t0", source=GpuSource.BASE_TRAIN)
    state = cluster(gpus, [trainer_worker("t0")])
    tgt = target({spec(D, tp=2): 1}, lent=["t0/0", "t0/1"])
    after = apply_plan(state, _plan(state, tgt), NOW_S)
    assert {g.gpu_id for g in after.gpus if g.lent} == {"t0/0", "t0/1"}
    assert after.worker_by_id["t-t0"].role is IDLE


@pytest.mark.parametrize(
    ("step", "message"),
    [
        pytest.param(
            _step(Action.WAKE, "e-n0-0", ("n0/0",), D), "not asleep", id="wake-active-engine"
        ),
        pytest.param(
            _step(Action.START, "e-n0-9", ("n0/0",), D), "still held", id="start-on-busy-gpu"
        ),
        pytest.param(_step(Action.STOP, "nobody", ("n0/0",), None), "no live", id="unknown"),
        pytest.param(
            _step(Action.OFFLOAD, "e-n0-0", ("n0/0",), IDLE), "trainer", id="offload-engine"
        ),
        pytest.param(
            _step(Action.SWITCH, "e-n0-0", ("n0/0",), Role.TRAIN), "cannot take", id="bad-role"
        ),
        pytest.param(_step(Action.START, "e-n0-0", ("n0/1",), D), "new worker", id="id-taken"),
    ],
)
def test_illegal_steps_raise(step: PlanStep, message: str) -> None:
    state = cluster(node_gpus("n0"), [engine("n0", [0], C)])
    with pytest.raises(TransitionError, match=message):
        apply_plan(state, _one_step_plan(state, step), NOW_S)


def test_out_of_order_plan_is_rejected() -> None:
    """Starting on a GPU before its previous engine stopped breaks the one-active rule."""
    state = cluster(node_gpus("n0", num_gpus=2), [engine("n0", [0, 1], D)])
    p = _plan(state, target({spec(D): 2}))
    starts = [s for s in p.steps if s.action is Action.START]
    others = [s for s in p.steps if s.action is not Action.START]
    reordered = replace(p, steps=tuple(starts + others))
    with pytest.raises(TransitionError, match="still held"):
        apply_plan(state, reordered, NOW_S)


def test_state_without_changes_is_returned_as_next_version() -> None:
    state = cluster(node_gpus("n0"), [engine("n0", [0], C)])
    p = _plan(state, target({spec(C): 1}))
    assert p.empty
    after = apply_plan(state, p, NOW_S)
    assert after.workers == state.workers and after.version == state.version + 1


def test_engines_never_hold_trainer_gpus_after_return() -> None:
    gpus = node_gpus("t0", source=GpuSource.BASE_TRAIN)
    workers = [trainer_worker("t0", IDLE), engine("t0", [0], D, Phase.DRAINING)]
    state = cluster(gpus, workers, lent=[g.gpu_id for g in gpus])
    after = apply_plan(state, _plan(state, target({})), NOW_S)
    active = [w for w in after.workers if w.active]
    assert [w.kind for w in active] == [WorkerKind.TRAINER]
