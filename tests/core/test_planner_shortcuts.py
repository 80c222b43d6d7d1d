"""The planner's shortcuts equal the plain computations they stand in for.

- a class with unmet instances and no engine: every instance is a new start, as the
  min-cost assignment makes it; a class with engines and no unmet instance: every engine
  is left over, as the assignment leaves it;
- steps built without the frozen ``__init__`` equal ``PlanStep(...)``.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_states import IDLE, C, D, P, cluster, engine, make_profile, node_gpus, spec, target

from pearl.core.plan import PlanStep
from pearl.core.plan_steps import PlanContext, WorkerDecisions
from pearl.core.planner import _assign_class, _assign_min_cost, plan_transition
from pearl.core.roles import GpuSource, Phase, Role
from pearl.core.state import Worker

PROFILE = make_profile()
_ENGINE = st.tuples(
    st.sampled_from([C, P, D, IDLE]), st.sampled_from([Phase.READY, Phase.STARTING])
)


def _context(engines: list[tuple[Role, Phase]]) -> tuple[PlanContext, list[Worker]]:
    """A base rollout node and a trainer node (asleep engines sleep there), an engine a GPU."""
    gpus = node_gpus("r0") + node_gpus("t0", source=GpuSource.BASE_TRAIN)
    workers = []
    for i, (role, phase) in enumerate(engines):
        node = "r0" if i < 8 and role is not IDLE else "t0"
        if any(w.worker_id == f"e-{node}-{i % 8}" for w in workers):
            continue
        workers.append(engine(node, [i % 8], role, phase if role is not IDLE else Phase.READY))
    state = cluster(gpus, workers)
    ctx = PlanContext(state, target({}), PROFILE.costs, 100.0, 30.0)
    ctx.pool = {g.gpu_id for g in gpus}
    return ctx, workers


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([C, P, D]), max_size=12), st.lists(_ENGINE, max_size=12))
def test_one_sided_classes_as_the_assignment_makes_them(
    rows: list[Role], engines: list[tuple[Role, Phase]]
) -> None:
    ctx, workers = _context(engines)
    active = [w for w in workers if w.role is not IDLE]
    asleep = [w for w in workers if w.role is IDLE]
    for case_rows, case_active, case_asleep in ((rows, [], []), ([], active, asleep)):
        short, full = WorkerDecisions(), WorkerDecisions()
        _assign_class(ctx, short, ("h100", 1), case_rows, case_active, case_asleep)
        _assign_min_cost(ctx, full, ("h100", 1), case_rows, case_active, case_asleep)
        assert short == full


@pytest.mark.parametrize("tp", [1, 2], ids=["switches", "tp-change"])
def test_steps_equal_constructed_ones(tp: int) -> None:
    gpus = node_gpus("r0") + node_gpus("r1")
    workers = [engine(n, [i], C) for n in ("r0", "r1") for i in range(8)]
    state = cluster(gpus, workers)
    plan = plan_transition(
        state, target({spec(P, tp=tp): 8 // tp, spec(D, tp=tp): 8 // tp}), PROFILE, 100.0, 30.0
    )
    assert len(plan.steps) >= 16
    for step in plan.steps:
        built = PlanStep(**{f.name: getattr(step, f.name) for f in dataclasses.fields(PlanStep)})
        assert step == built and hash(step) == hash(built) and repr(step) == repr(built)
        assert step.__dict__ == built.__dict__
        with pytest.raises(dataclasses.FrozenInstanceError):
            step.reason = "changed"  # type: ignore[misc]
