"""The events of a simulated run: small frozen dataclasses, each with its priority.

A handler gets its event and the time and returns its follow-ups, ``(time_s, event)``
pairs (``Follow``); the runner finds the handler by the event's type. At equal times events
run by priority, lowest first: work finishes before it is observed, and decisions come
last, so a decision sees everything that happened at its time. ``CONTROL`` events may take
an instance off, pause it or change its weights: an engine step in flight never runs past
the next of them (``Simulation.horizon_s``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pearl.serving.requests import Request
from pearl.sim.fleet import Instance
from pearl.sim.slurm import SlurmEvent

P_STEP, P_ARRIVE, P_SLURM, P_PLAN, P_TRAIN, P_DECIDE = range(6)


@dataclass(frozen=True, slots=True, eq=False)
class SimEvent:
    PRIORITY: ClassVar[int]
    CONTROL: ClassVar[bool] = False


@dataclass(frozen=True, slots=True, eq=False)
class StartTrajectories(SimEvent):
    """Start every trajectory the staleness bound admits now."""

    PRIORITY = P_ARRIVE


@dataclass(frozen=True, slots=True, eq=False)
class StepEnds(SimEvent):
    """An instance's engine step in flight ends."""

    PRIORITY = P_STEP
    instance: Instance


@dataclass(frozen=True, slots=True, eq=False)
class Kick(SimEvent):
    """An instance may start its next engine step (after a pause)."""

    PRIORITY = P_STEP
    instance: Instance


@dataclass(frozen=True, slots=True, eq=False)
class Arrive(SimEvent):
    """A turn (or what is left of it) reaches its instance, or needs one (None)."""

    PRIORITY = P_ARRIVE
    request: Request
    instance: Instance | None


@dataclass(frozen=True, slots=True, eq=False)
class Unpark(SimEvent):
    """Instances joined: the turns parked for want of one are routed again."""

    PRIORITY = P_TRAIN


@dataclass(frozen=True, slots=True, eq=False)
class SlurmChange(SimEvent):
    """Slurm grants, warns (preempting) or ends an elastic allocation."""

    PRIORITY = P_SLURM
    CONTROL = True
    change: SlurmEvent


@dataclass(frozen=True, slots=True, eq=False)
class Eligible(SimEvent):
    """Capacity may have appeared: pending requests are scheduled again."""

    PRIORITY = P_SLURM


@dataclass(frozen=True, slots=True, eq=False)
class PlanStepStarts(SimEvent):
    PRIORITY = P_PLAN
    CONTROL = True
    index: int


@dataclass(frozen=True, slots=True, eq=False)
class PlanStepEnds(SimEvent):
    PRIORITY = P_PLAN
    CONTROL = True
    index: int


@dataclass(frozen=True, slots=True, eq=False)
class TrainDone(SimEvent):
    """The trainer's update ends."""

    PRIORITY = P_TRAIN
    CONTROL = True
    started_s: float
    waited_s: float


@dataclass(frozen=True, slots=True, eq=False)
class Decide(SimEvent):
    """A decision is due (``why``: ``tick`` every decision interval, or what changed)."""

    PRIORITY = P_DECIDE
    CONTROL = True
    why: str


Follow = list[tuple[float, SimEvent]]
