"""A transition plan carried out step by step on the simulator's clock.

Every step starts at the plan's start plus its ``start_s`` and ends ``duration_s`` later,
as the planner scheduled it (its dependencies have ended by then). What a step does to
the simulated engines and trainer:

| action | at its start | at its end |
|---|---|---|
| drain | the instance stops accepting; its queued requests go elsewhere | |
| migrate | the instance leaves; every request on it continues elsewhere | |
| switch | the instance leaves (requests continue elsewhere) | it rejoins in its new role |
| sleep, stop | the instance leaves (requests continue elsewhere) | |
| start, wake | | a new instance joins in the step's role |
| sync_weights | the instance pauses until the step ends | |
| offload | the trainer gives up its GPUs | |
| onload | | the trainer has its GPUs back |

A request taken off an instance keeps the tokens it generated (``Simulation.resubmit``).
A step on a node Slurm reclaimed during the plan is skipped. When the last step ends the
core state becomes ``apply_plan`` of the decision's state, with the weights synced by any
update that finished meanwhile; the elastic allocations the decision released are
released then, once no engine runs on them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pearl.core.apply import apply_plan
from pearl.core.decision import Decision
from pearl.core.plan import Action, PlanStep
from pearl.core.state import ClusterState
from pearl.runlog.schema import PlanStepDone
from pearl.sim.states import synced
from pearl.sim.timeline import P_PLAN, P_STEP, P_TRAIN, Follow

if TYPE_CHECKING:
    from pearl.sim.runner import Simulation


_LEAVE_AT_START = {Action.MIGRATE, Action.SWITCH, Action.SLEEP, Action.STOP}
_JOIN_AT_END = {Action.START, Action.WAKE, Action.SWITCH}


class PlanExecution:
    def __init__(
        self, sim: Simulation, decision: Decision, start_s: float, releases: tuple[str, ...]
    ) -> None:
        self.sim, self.decision, self.start_s = sim, decision, start_s
        self.steps = decision.plan.steps
        self.releases = releases
        self.remaining = len(self.steps)
        self.final_state: ClusterState = decision.state

    @property
    def done(self) -> bool:
        return self.remaining == 0

    def begin(self, now_s: float) -> Follow:
        out: Follow = []
        for i, step in enumerate(self.steps):
            out.append((self.start_s + step.start_s, ("plan", "start", i), P_PLAN))
            out.append((self.start_s + step.end_s, ("plan", "end", i), P_PLAN))
        return out

    def on_event(self, now_s: float, what: str, index: int) -> Follow:
        step = self.steps[index]
        out = self._start(step, now_s) if what == "start" else self._end(step, now_s)
        if what == "end":
            self.sim.log(
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
            if self.remaining == 0:
                self._finish(now_s)
        return out

    def _alive(self, step: PlanStep) -> bool:
        gpus = self.sim.state.gpu_by_id
        return all(g in gpus for g in step.gpu_ids) and step.node not in self.sim.elastic.dead_nodes

    def _start(self, step: PlanStep, now_s: float) -> Follow:
        sim, fleet = self.sim, self.sim.fleet
        a = step.action
        if a is Action.DRAIN:
            inst = fleet.instances.get(step.worker_id)
            version = inst.weights_version if inst else sim.version
            return sim.resubmit(fleet.stop_accepting(step.worker_id), now_s, version)
        if a in _LEAVE_AT_START:
            return sim.take_off(step.worker_id, now_s)
        if a is Action.SYNC_WEIGHTS:
            inst = fleet.instances.get(step.worker_id)
            if inst is not None:
                inst.paused_until_s = self.start_s + step.end_s
                inst.weights_version = sim.version
                return [(inst.paused_until_s, ("kick", inst), P_STEP)]
            return []
        if a is Action.OFFLOAD:
            return sim.trainer_gpus_changed(now_s, -len(step.gpu_ids))
        return []

    def _end(self, step: PlanStep, now_s: float) -> Follow:
        sim = self.sim
        a = step.action
        if a in _JOIN_AT_END and step.role is not None and self._alive(step):
            gpu = sim.state.gpu_by_id[step.gpu_ids[0]]
            sim.fleet.add(
                step.worker_id, step.role, gpu.gpu_type, step.node, len(step.gpu_ids), sim.version
            )
            return [(now_s, ("unpark",), P_TRAIN)]  # once every instance joining now has
        if a is Action.ONLOAD:
            return sim.trainer_gpus_changed(now_s, len(step.gpu_ids))
        return []

    def _finish(self, now_s: float) -> None:
        d = self.decision
        state = apply_plan(d.state, d.plan, self.start_s)
        if self.sim.version > state.policy_version:
            state = synced(state, self.sim.version)
        self.final_state = state.evolve(time_s=max(state.time_s, now_s))
