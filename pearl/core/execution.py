"""Carrying out a decision: what a ``Decision`` does to the world, and in which order (pure).

The simulator and the coordinator carry out decisions through this one piece, each with
its own ``World`` (the simulator's models of Slurm, the engines and the trainer; the real
shell's Slurm backend, journal and control plane). ``Executor.carry_out``:

1. **requests**: each elastic request is submitted under a new allocation id
   (``AllocationIds``: ``el0001``, ``el0002``, ...; never one used before, also across a
   coordinator's restarts);
2. **plan**: a non-empty plan goes to the world, which runs its steps (the simulator on
   its clock at the planner's times, the coordinator over the control plane) and says how
   it ended (``PlanOutcome``) through ``Executor.plan_ended``, at once or later; one plan
   runs at a time. The world adopts the state after the plan (``PlanEnd``). Borrowing
   acts through the plan too (its offload, wake, sleep and onload steps): nothing else
   is carried out for it;
3. **releases**: once the plan has ended (at once without one), the allocations the
   decision gives back are released. After the plan, not before: a released allocation's
   GPUs leave the rollout pool, so the plan drains, migrates and stops the engines on
   them; released first, those engines would be killed with their turns in flight, which
   is what the plan's steps avoid. The cost is holding the GPUs for the plan's makespan.

After the plan the state is the decision's state with the steps that stand applied
(``PlanEnd``): all of them, or the part of a failed plan the world carried out
(``PlanOutcome.carried_out``); a part that is not a consistent plan of its own leaves the
decision's state, and the plan failed.

``STEP_EFFECTS`` says what each plan step does to the serving set, at its start and at its
end; the simulator's fleet follows it (and the router will). Why an allocation ended is
``pearl.core.state.EndReason``, in every part of pearl.

Invariants (``tests/core/test_execution.py``): submissions come before the plan, releases
after its end, each id once; ``carry_out`` while a plan runs is an error; a ``run_plan``
that raises leaves no plan running and releases nothing (the next decision, from the
state as observed, decides again).

Time: the state after a plan is stamped ``max(start + makespan, end)``, the simulator's
clock; a world with a measured end (the coordinator) stamps it with that in ``adopt``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Protocol

from pearl.core.apply import apply_plan
from pearl.core.decision import Decision, ElasticRequest
from pearl.core.plan import Action, TransitionPlan
from pearl.core.roles import TransitionError
from pearl.core.state import ClusterState

ELASTIC_ID_PREFIX = "el"


@dataclass
class AllocationIds:
    """Ids of elastic allocations: ``el`` and four or more digits, counting up."""

    next_number: int = 1

    @classmethod
    def after(cls, used: Iterable[str]) -> AllocationIds:
        """Ids that follow every one in ``used`` (a restarted coordinator's journal)."""
        return cls(1 + max((number(aid) for aid in used), default=0))

    def new(self) -> str:
        aid = f"{ELASTIC_ID_PREFIX}{self.next_number:04d}"
        self.next_number += 1
        return aid


def number(allocation_id: str) -> int:
    """The number of an elastic allocation id (``el0007`` -> 7); 0 for any other id."""
    digits = allocation_id.removeprefix(ELASTIC_ID_PREFIX)
    return int(digits) if allocation_id.startswith(ELASTIC_ID_PREFIX) and digits.isdigit() else 0


class StepEffect(StrEnum):
    """What a plan step does to the serving set (the instances that take turns)."""

    STOP_ADMITTING = "stop_admitting"  # no new turns; queued ones go elsewhere
    LEAVE = "leave"  # out of the serving set; its requests continue elsewhere
    JOIN = "join"  # into the serving set, in the step's role
    PAUSE = "pause"  # takes no step until the step ends (new weights)
    TRAINER_OFF = "trainer_off"  # the trainer gives up its GPUs
    TRAINER_ON = "trainer_on"  # the trainer has its GPUs back


# action -> (effect at the step's start, effect at its end)
STEP_EFFECTS: dict[Action, tuple[StepEffect | None, StepEffect | None]] = {
    Action.DRAIN: (StepEffect.STOP_ADMITTING, None),
    Action.MIGRATE: (StepEffect.LEAVE, None),
    Action.SWITCH: (StepEffect.LEAVE, StepEffect.JOIN),
    Action.SLEEP: (StepEffect.LEAVE, None),
    Action.STOP: (StepEffect.LEAVE, None),
    Action.START: (None, StepEffect.JOIN),
    Action.WAKE: (None, StepEffect.JOIN),
    Action.SYNC_WEIGHTS: (StepEffect.PAUSE, None),
    Action.OFFLOAD: (StepEffect.TRAINER_OFF, None),
    Action.ONLOAD: (None, StepEffect.TRAINER_ON),
}


@dataclass(frozen=True)
class StepOutcome:
    step_id: int
    ok: bool
    error: str
    started_s: float  # seconds after the plan started
    ended_s: float


@dataclass(frozen=True)
class PlanOutcome:
    """What became of a plan: ``carried_out`` are the steps whose effect stands (a failed
    plan's acknowledged part, less the drains that were undone)."""

    ok: bool
    carried_out: frozenset[int]
    steps: tuple[StepOutcome, ...] = ()
    error: str = ""

    @classmethod
    def all_of(cls, plan: TransitionPlan) -> PlanOutcome:
        return cls(True, frozenset(s.step_id for s in plan.steps))


@dataclass(frozen=True)
class PlanEnd:
    """A plan's end: the state with the steps that stand, and whether all of them did."""

    state: ClusterState
    ok: bool
    error: str = ""


class World(Protocol):
    """The effects of a decision, as the simulator or the real shell carries them out."""

    def submit(self, allocation_id: str, request: ElasticRequest, now_s: float) -> None:
        """Ask for an elastic allocation."""
        ...

    def run_plan(self, plan: TransitionPlan, now_s: float) -> None:
        """Run the plan's steps and, once they have ended, call ``Executor.plan_ended``
        (the coordinator before it returns, the simulator at the last step's end)."""
        ...

    def adopt(self, end: PlanEnd, now_s: float) -> None:
        """The state after the plan, before its releases."""
        ...

    def release(self, allocation_id: str, now_s: float) -> None:
        """Give an allocation back."""
        ...


@dataclass(frozen=True)
class _Running:
    decision: Decision
    start_s: float


class Executor:
    """Carries out decisions on one world, in the order of the module docstring."""

    def __init__(self, world: World, ids: AllocationIds) -> None:
        self.world, self.ids = world, ids
        self._running: _Running | None = None

    @property
    def plan_running(self) -> bool:
        return self._running is not None

    def carry_out(self, decision: Decision, now_s: float) -> None:
        """Submit the requests, run the plan; release after it (at once without one)."""
        if self._running is not None:
            raise RuntimeError("a plan is still running; decide again after its end")
        for request in decision.elastic.requests:
            self.world.submit(self.ids.new(), request, now_s)
        if decision.plan.empty:
            self._release(decision, now_s)
            return
        self._running = _Running(decision, now_s)
        try:
            self.world.run_plan(decision.plan, now_s)
        except BaseException:  # the plan did not run to an end: no state, no releases
            self._running = None
            raise

    def plan_ended(self, outcome: PlanOutcome, now_s: float) -> PlanEnd:
        """The running plan has ended at ``now_s``: the world adopts the state after it,
        then the decision's releases follow."""
        running = self._running
        if running is None:
            raise RuntimeError("no plan is running")
        self._running = None
        end = state_after(running.decision, outcome, running.start_s, now_s)
        self.world.adopt(end, now_s)
        self._release(running.decision, now_s)
        return end

    def _release(self, decision: Decision, now_s: float) -> None:
        for allocation_id in decision.elastic.releases:
            self.world.release(allocation_id, now_s)


def state_after(decision: Decision, outcome: PlanOutcome, start_s: float, end_s: float) -> PlanEnd:
    """The decision's state with the steps of its plan that stand applied."""
    plan = decision.plan
    done = plan if outcome.ok else _part(plan, outcome.carried_out)
    if not done.steps:
        return PlanEnd(decision.state, outcome.ok, outcome.error)
    try:
        state = apply_plan(decision.state, done, start_s)
    except TransitionError as err:  # the part is not a consistent plan of its own
        return PlanEnd(decision.state, False, f"{outcome.error}; {err}".lstrip("; "))
    return PlanEnd(state.evolve(time_s=max(state.time_s, end_s)), outcome.ok, outcome.error)


def _part(plan: TransitionPlan, step_ids: frozenset[int]) -> TransitionPlan:
    """The plan's steps in ``step_ids``, in order (a failed plan's part that stands)."""
    return replace(plan, steps=tuple(s for s in plan.steps if s.step_id in step_ids))
