"""A transition plan carried out step by step on the simulator's clock.

The simulator's ``run_plan`` (``pearl.core.execution.World``): every step starts at the
plan's start plus its ``start_s`` and ends ``duration_s`` later, as the planner scheduled it
(its dependencies have ended by then). What a step does to the simulated engines and
trainer is the core's ``STEP_EFFECTS``:

| effect | here |
|---|---|
| stop_admitting (drain) | the instance stops accepting; its queued requests go elsewhere |
| leave (migrate, switch, sleep, stop) | the instance leaves; its requests continue elsewhere |
| join (start, wake, switch) | a new instance joins in the step's role |
| pause (sync_weights) | the instance pauses until the step ends |
| trainer_off (offload), trainer_on (onload) | the trainer gives up, or has back, its GPUs |

A request taken off an instance keeps the tokens it generated (``PlanHost.resubmit``). A
step that joins an instance on a node Slurm reclaimed during the plan is skipped. Every
step is carried out (``PlanOutcome.all_of``): the state after the plan, and the releases
that follow it, are the core executor's (``Executor.plan_ended``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from pearl.core.execution import STEP_EFFECTS, StepEffect
from pearl.core.plan import PlanStep, TransitionPlan
from pearl.core.state import ClusterState
from pearl.runlog.schema import PlanStepDone, Record
from pearl.serving.requests import PartialOutput
from pearl.sim.fleet import Fleet, Instance
from pearl.sim.timeline import Follow, Kick, PlanStepEnds, PlanStepStarts, Unpark


class PlanHost(Protocol):
    """What a plan's steps act on: the simulation's state, fleet, trainer and log."""

    state: ClusterState
    fleet: Fleet
    version: int

    @property
    def dead_nodes(self) -> set[str]:
        """Nodes Slurm reclaimed (or pearl released) and did not grant again since."""
        ...

    def resubmit(self, partials: Iterable[PartialOutput], now_s: float, version: int) -> Follow:
        """Requests taken off an instance continue elsewhere with what they generated."""
        ...

    def take_off(self, worker_id: str, now_s: float) -> Follow:
        """The instance leaves the fleet; its requests continue elsewhere."""
        ...

    def trainer_gpus_changed(self, now_s: float, delta: int) -> Follow:
        """The trainer gives up (``delta`` < 0) or has back GPUs."""
        ...

    def load_weights(self, inst: Instance) -> None:
        """The instance takes the trainer's current weights (the tokens it generated so
        far stay its old weights')."""
        ...

    def log(self, record: Record) -> None: ...


class PlanExecution:
    def __init__(self, host: PlanHost, plan: TransitionPlan, start_s: float) -> None:
        self.host, self.plan, self.start_s = host, plan, start_s
        self.steps = plan.steps
        self.remaining = len(self.steps)

    @property
    def done(self) -> bool:
        return self.remaining == 0

    def begin(self) -> Follow:
        out: Follow = []
        for i, step in enumerate(self.steps):
            out.append((self.start_s + step.start_s, PlanStepStarts(i)))
            out.append((self.start_s + step.end_s, PlanStepEnds(i)))
        return out

    def on_start(self, index: int, now_s: float) -> Follow:
        step = self.steps[index]
        effect = STEP_EFFECTS[step.action][0]
        host, fleet = self.host, self.host.fleet
        if effect is StepEffect.STOP_ADMITTING:
            inst = fleet.instances.get(step.worker_id)
            version = inst.weights_version if inst else host.version
            return host.resubmit(fleet.stop_accepting(step.worker_id), now_s, version)
        if effect is StepEffect.LEAVE:
            return host.take_off(step.worker_id, now_s)
        if effect is StepEffect.PAUSE:
            inst = fleet.instances.get(step.worker_id)
            if inst is None:
                return []
            inst.paused_until_s = self.start_s + step.end_s
            host.load_weights(inst)
            return [(inst.paused_until_s, Kick(inst))]
        if effect is StepEffect.TRAINER_OFF:
            return host.trainer_gpus_changed(now_s, -len(step.gpu_ids))
        return []

    def on_end(self, index: int, now_s: float) -> Follow:
        step = self.steps[index]
        out = self._end(step, now_s)
        self.host.log(
            PlanStepDone.model_construct(
                t=now_s,
                action=step.action.value,
                worker_id=step.worker_id,
                started_t=self.start_s + step.start_s,
                ok=True,
                error="",
            )
        )
        self.remaining -= 1
        return out

    def _end(self, step: PlanStep, now_s: float) -> Follow:
        effect = STEP_EFFECTS[step.action][1]
        host = self.host
        if effect is StepEffect.JOIN and step.role is not None and self._alive(step):
            gpu = host.state.gpu_by_id[step.gpu_ids[0]]
            host.fleet.add(
                step.worker_id, step.role, gpu.gpu_type, step.node, len(step.gpu_ids), host.version
            )
            return [(now_s, Unpark())]  # once every instance joining now has
        if effect is StepEffect.TRAINER_ON:
            return host.trainer_gpus_changed(now_s, len(step.gpu_ids))
        return []

    def _alive(self, step: PlanStep) -> bool:
        gpus = self.host.state.gpu_by_id
        return all(g in gpus for g in step.gpu_ids) and step.node not in self.host.dead_nodes
