"""Carrying out a decision (pearl.core.execution): the order, the ids, the state after a
plan, the step effects. How the simulator and the coordinator follow it, as its worlds:
``tests/sim/test_runner.py`` and ``tests/coordinator/test_coordinator.py``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pytest

from pearl.bench.synth import Layout, build_state, build_workload
from pearl.core.apply import apply_plan
from pearl.core.config import PolicyConfig
from pearl.core.decide import decide
from pearl.core.decision import Decision, ElasticAction, ElasticRequest
from pearl.core.execution import (
    STEP_EFFECTS,
    AllocationIds,
    Executor,
    PlanEnd,
    PlanOutcome,
    number,
    state_after,
)
from pearl.core.observation import Observation, TrainerPhase, TrainerStatus
from pearl.core.plan import Action, TransitionPlan
from pearl.io.documents import load_profile

REQUEST = ElasticRequest(num_gpus=8, gpu_type="h100", partition="elastic", time_limit_min=60)


@pytest.fixture(scope="module")
def decision() -> Decision:
    """A real decision with a plan (a KV-bound batch while the trainer waits: it lends),
    with elastic requests and releases added, so that every part of the order shows."""
    state = build_state(Layout(1, 2, 1))
    workload = build_workload(np.random.default_rng(3), 512, prompt_tokens=6000, not_started=1536)
    obs = Observation(trainer=TrainerStatus(phase=TrainerPhase.WAITING), workload=workload)
    d = decide(state, obs, PolicyConfig(), load_profile("qwen3-8b"), 10.0)
    assert not d.plan.empty
    elastic = ElasticAction(requests=(REQUEST, REQUEST), releases=("el0007", "el0009"))
    return replace(d, elastic=elastic)


@dataclass
class Recorder:
    """A world that records what it is asked; ``finish_at_once``: the coordinator's way
    (the plan ends before ``run_plan`` returns), else the simulator's (it ends later)."""

    finish_at_once: bool
    executor: Executor | None = None
    calls: list[str] = field(default_factory=list)
    adopted: list[PlanEnd] = field(default_factory=list)

    def submit(self, allocation_id: str, request: ElasticRequest, now_s: float) -> None:
        self.calls.append(f"submit {allocation_id}")

    def run_plan(self, plan: TransitionPlan, now_s: float) -> None:
        self.calls.append(f"run {len(plan.steps)} steps")
        if self.finish_at_once:
            assert self.executor is not None
            self.executor.plan_ended(PlanOutcome.all_of(plan), now_s + 5.0)

    def adopt(self, end: PlanEnd, now_s: float) -> None:
        self.calls.append("adopt")
        self.adopted.append(end)

    def release(self, allocation_id: str, now_s: float) -> None:
        self.calls.append(f"release {allocation_id}")


def _executor(world: Recorder, first: int = 1) -> Executor:
    world.executor = Executor(world, AllocationIds(first))
    return world.executor


@pytest.mark.parametrize(
    "at_once", [pytest.param(True, id="coordinator"), pytest.param(False, id="simulator")]
)
def test_requests_then_the_plan_then_the_releases(decision: Decision, at_once: bool) -> None:
    world = Recorder(at_once)
    ex = _executor(world)
    ex.carry_out(decision, 10.0)
    started = ["submit el0001", "submit el0002", f"run {len(decision.plan.steps)} steps"]
    if not at_once:  # the releases wait for the plan's end
        assert world.calls == started and ex.plan_running
        with pytest.raises(RuntimeError, match="still running"):
            ex.carry_out(decision, 11.0)
        ex.plan_ended(PlanOutcome.all_of(decision.plan), 15.0)
    assert world.calls == [*started, "adopt", "release el0007", "release el0009"]
    assert not ex.plan_running
    (end,) = world.adopted
    assert end.ok and end.state == apply_plan(decision.state, decision.plan, 10.0).evolve(
        time_s=15.0
    )


def test_without_a_plan_the_releases_follow_the_requests(decision: Decision) -> None:
    world = Recorder(False)
    ex = _executor(world, first=42)
    ex.carry_out(replace(decision, plan=replace(decision.plan, steps=())), 10.0)
    assert world.calls == ["submit el0042", "submit el0043", "release el0007", "release el0009"]
    with pytest.raises(RuntimeError, match="no plan"):
        ex.plan_ended(PlanOutcome(True, frozenset()), 11.0)


def test_a_failed_plan_keeps_the_part_that_stands(decision: Decision) -> None:
    steps = decision.plan.steps
    first = frozenset({steps[0].step_id})
    end = state_after(decision, PlanOutcome(False, first, (), "step 2: timeout"), 10.0, 12.0)
    part = replace(decision.plan, steps=steps[:1])
    assert not end.ok and end.error == "step 2: timeout"
    assert end.state == apply_plan(decision.state, part, 10.0).evolve(time_s=12.0)
    nothing = state_after(decision, PlanOutcome(False, frozenset(), (), "lost"), 10.0, 12.0)
    assert nothing.state is decision.state and nothing.error == "lost"


def test_a_part_that_is_no_plan_of_its_own_leaves_the_state(decision: Decision) -> None:
    # a step whose dependency did not stand: its worker does not exist without it
    dependent = next(s for s in decision.plan.steps if s.depends_on)
    outcome = PlanOutcome(False, frozenset({dependent.step_id}), (), "partial")
    end = state_after(decision, outcome, 10.0, 12.0)
    assert end.state is decision.state and not end.ok and end.error.startswith("partial; ")


def test_allocation_ids() -> None:
    ids = AllocationIds.after(["el0003", "base", "el0010", "job-7"])
    assert [ids.new(), ids.new()] == ["el0011", "el0012"]
    assert number("el0007") == 7 and number("base") == 0 and number("elx") == 0
    assert AllocationIds.after([]).new() == "el0001"


def test_every_action_has_its_effect_on_the_serving_set() -> None:
    assert set(STEP_EFFECTS) == set(Action)
    assert all(start or end for start, end in STEP_EFFECTS.values())
