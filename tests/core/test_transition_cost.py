"""The quick transition estimate agrees with the planner's makespan."""

from __future__ import annotations

import pytest

from pearl.bench.synth import Layout, build_state
from pearl.core.pd import InstanceSpec, PDConfig
from pearl.core.plan import Target
from pearl.core.planner import plan_transition
from pearl.core.profile import RuntimeProfile
from pearl.core.roles import GpuSource, Role
from pearl.core.state import ClusterState
from pearl.core.transition_cost import estimate_transition_s, inventory
from pearl.io.documents import load_profile

DRAIN_S = 2.0


def _config(*specs: tuple[Role, int, int]) -> PDConfig:
    return PDConfig.of({InstanceSpec(role, "h100", tp): n for role, tp, n in specs})


@pytest.fixture(scope="module")
def profile() -> RuntimeProfile:
    return load_profile("qwen3-8b")


CASES = [
    pytest.param(_config((Role.COLOCATED, 1, 24)), False, id="already-there"),
    pytest.param(_config((Role.PREFILL, 1, 8), (Role.DECODE, 1, 16)), False, id="role-switch"),
    pytest.param(_config((Role.COLOCATED, 2, 12)), False, id="tp-change"),
    pytest.param(_config((Role.PREFILL, 2, 4), (Role.DECODE, 1, 16)), False, id="mixed"),
    pytest.param(_config((Role.COLOCATED, 1, 32)), True, id="lend-and-wake"),
    pytest.param(_config((Role.PREFILL, 1, 8), (Role.DECODE, 1, 24)), True, id="lend-and-switch"),
]


@pytest.mark.parametrize(("config", "lend"), CASES)
@pytest.mark.parametrize("stale", [False, True], ids=["fresh", "stale-weights"])
def test_estimate_equals_planned_makespan(
    profile: RuntimeProfile, config: PDConfig, lend: bool, stale: bool
) -> None:
    state: ClusterState = build_state(Layout(1, 2, 1))
    if stale:
        state = state.evolve(policy_version=3)
    trainer = [g.gpu_id for g in state.gpus if g.source is GpuSource.BASE_TRAIN]
    pool = [g.gpu_id for g in state.gpus if g.source is not GpuSource.BASE_TRAIN]
    lent = frozenset(trainer if lend else ())
    plan = plan_transition(state, Target(config, lent), profile, 0.0, DRAIN_S)
    assert not plan.problems
    inv = inventory(state, [*pool, *lent], lend)
    estimate_s = estimate_transition_s(inv, config, profile.costs, DRAIN_S)
    assert estimate_s == pytest.approx(plan.makespan_s, abs=1e-9)


def test_surplus_engines_run_off_in_the_background(profile: RuntimeProfile) -> None:
    """Stopping engines the target does not need delays no one: the estimate is 0 while
    the plan's makespan includes their drain and stop."""
    state = build_state(Layout(1, 2, 1))
    pool = [g.gpu_id for g in state.gpus if g.source is not GpuSource.BASE_TRAIN]
    config = _config((Role.COLOCATED, 1, 16))
    plan = plan_transition(state, Target(config), profile, 0.0, DRAIN_S)
    inv = inventory(state, pool, lending=False)
    assert estimate_transition_s(inv, config, profile.costs, DRAIN_S) == 0.0
    assert plan.makespan_s == pytest.approx(DRAIN_S + profile.costs.stop_s)
