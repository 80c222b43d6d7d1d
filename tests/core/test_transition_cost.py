"""The quick transition estimate agrees with the planner's makespan."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pearl.bench.synth import Layout, build_state
from pearl.core.pd import InstanceSpec, PDConfig, config_of
from pearl.core.plan import Target
from pearl.core.planner import plan_transition
from pearl.core.profile import RuntimeProfile
from pearl.core.roles import GpuSource, Role
from pearl.core.state import ClusterState
from pearl.core.transition_cost import (
    effective_completion_s,
    estimate_transition_s,
    inventory,
    kept_gpu_share,
)
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


def test_the_kept_share_counts_the_engines_the_target_keeps_in_their_role(
    profile: RuntimeProfile,
) -> None:
    state = build_state(Layout(1, 2, 1))  # 24 colocated TP-1 engines
    pool = [g.gpu_id for g in state.gpus if g.source is not GpuSource.BASE_TRAIN]
    inv = inventory(state, pool, lending=False)
    running_gpus = config_of(state).num_gpus
    assert running_gpus == 24
    assert kept_gpu_share(inv, _config((Role.COLOCATED, 1, 24)), running_gpus) == 1.0
    half = _config((Role.COLOCATED, 1, 12), (Role.PREFILL, 1, 4), (Role.DECODE, 1, 8))
    assert kept_gpu_share(inv, half, running_gpus) == 0.5
    assert kept_gpu_share(inv, _config((Role.COLOCATED, 2, 12)), running_gpus) == 0.0
    assert kept_gpu_share(inv, half, 0) == 0.0  # nothing runs: nothing serves meanwhile


@given(
    transition_s=st.floats(0.0, 1e4),
    kept=st.floats(0.0, 1.0),
    target_s=st.floats(1e-3, 1e4),
    current_s=st.one_of(st.floats(1e-3, 1e4), st.just(math.inf)),
)
def test_the_effective_completion_lies_between_its_bounds(
    transition_s: float, kept: float, target_s: float, current_s: float
) -> None:
    """No better than the faster of staying and an instant move, no worse than the
    transition as a stall; exactly that stall when nothing is kept, the target's own time
    when the move is instant."""
    eff = effective_completion_s(transition_s, kept, target_s, current_s)
    assert min(target_s, current_s) * (1 - 1e-12) <= eff <= (transition_s + target_s) * (1 + 1e-12)
    if kept == 0.0:
        assert eff == transition_s + target_s
    if transition_s == 0.0:
        assert eff == target_s


def test_kept_engines_finishing_the_batch_make_the_move_cost_nothing() -> None:
    # the batch ends in 10 s on the running engines, all kept; the new ones serve at 40 s
    assert effective_completion_s(40.0, 1.0, 8.0, 10.0) == 10.0
    # half the batch is done on the kept engines by the time the target serves
    assert effective_completion_s(40.0, 1.0, 60.0, 80.0) == pytest.approx(40.0 + 0.5 * 60.0)
