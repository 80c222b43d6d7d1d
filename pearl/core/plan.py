"""Transition plans: the data a planner returns and a shell (or the simulator) executes.

A plan is an ordered list of steps on workers, each with the steps it waits for, an
estimated duration and its earliest start relative to the start of the plan. Steps are
expressed as a diff against the current state: workers that already fit the target do
not appear in the plan at all.

Invariants (asserted by the planner's tests):
- ``depends_on`` only names earlier steps, so the order is a topological order;
- ``start_s`` of a step is the latest ``start_s + duration_s`` of the steps it depends on;
- ``makespan_s`` is the latest finish of any step (0 for an empty plan).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from pearl.core.pd import PDConfig
from pearl.core.roles import Role


class Action(StrEnum):
    START = "start"  # launch a new engine on free GPUs: cold start + weight load
    WAKE = "wake"  # an asleep engine (role idle) takes an inference role
    SLEEP = "sleep"  # an engine goes to sleep (role idle), freeing its GPU memory
    DRAIN = "drain"  # stop admitting requests; in-flight turns finish where they are
    MIGRATE = "migrate"  # abort in-flight requests and hand them to other instances
    SWITCH = "switch"  # change the PD role of a drained (or migrated) engine
    STOP = "stop"  # stop a drained engine; its GPUs become free
    SYNC_WEIGHTS = "sync_weights"  # load the trainer's latest weights into an engine
    OFFLOAD = "offload"  # trainer moves its state to host memory and lends its GPUs
    ONLOAD = "onload"  # trainer takes its GPUs back and reloads its state


@dataclass(frozen=True)
class PlanStep:
    step_id: int
    action: Action
    worker_id: str
    node: str
    gpu_ids: tuple[str, ...]
    role: Role | None  # role after the step (start, wake, switch, sleep, offload, onload)
    depends_on: tuple[int, ...]
    duration_s: float
    start_s: float  # earliest start, relative to the start of the plan
    reason: str
    # the GPU type of an engine a step brings into serving (start, wake), which the router
    # weighs its load by; "" for the other steps (not needed, not looked up)
    gpu_type: str = ""

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True)
class Target:
    """What a plan must reach.

    ``config``: the engine instances to run on rollout GPUs.
    ``lent_gpu_ids``: the base-train GPUs lent to rollout once the plan is done; every
    other base-train GPU is the trainer's (its trainer group active there).
    """

    config: PDConfig
    lent_gpu_ids: frozenset[str] = frozenset()


@dataclass(frozen=True)
class TransitionPlan:
    target: Target
    steps: tuple[PlanStep, ...] = ()
    num_role_changes: int = 0  # workers created, removed or given another role
    makespan_s: float = 0.0  # time until the last step ends
    gpu_busy_s: float = 0.0  # sum over steps of duration x GPUs held unusable
    reason: str = ""
    problems: tuple[str, ...] = field(default=())  # why the target cannot be fully reached

    @property
    def empty(self) -> bool:
        return not self.steps

    @property
    def feasible(self) -> bool:
        return not self.problems
