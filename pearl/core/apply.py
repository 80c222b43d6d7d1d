"""Execute a transition plan to completion: the next state, as tests and the simulator see it.

Each step moves its worker through the phases of ``pearl.core.roles`` one legal edge at a
time, each checked against the transition table (``check_phase_edge``, ``check_role``,
``check_role_change``). A worker still ``starting`` or ``switching`` first settles to
``ready``. Per action:

- drain, migrate: ready -> draining (a draining worker stays draining);
- switch, sleep (role idle), wake, offload (trainer to idle), onload (trainer to train):
  ready or draining -> switching (new role) -> ready;
- stop: (starting | ready | draining) -> stopping -> gone; gone workers are dropped;
- start: a new engine, starting -> ready, with the policy's weights;
- sync_weights: the worker's weights become the state's ``policy_version``.

Invariants (violations raise ``TransitionError``):
- no GPU hosts two active workers at any point of the sequence (a worker becoming active
  on a GPU requires the previous one to have left by an earlier step);
- offload lends the trainer GPUs that the target lends, onload takes them back; at the
  end every base-train GPU is lent exactly when the target lends it and no active trainer
  holds it;
- the result is validated once (``ClusterState.replace``); its ``time_s`` is
  ``now_s + plan.makespan_s`` and every changed worker's ``since_s`` is the end of its
  step. The borrow window and ``last_pd_switch_s`` are the caller's to update.
"""

from __future__ import annotations

from collections.abc import Callable

from pearl.core.plan import Action, PlanStep, TransitionPlan
from pearl.core.roles import (
    GpuSource,
    Phase,
    Role,
    TransitionError,
    WorkerKind,
    check_phase_edge,
    check_role,
    check_role_change,
)
from pearl.core.state import ClusterState, Gpu, Worker

_ROLE_CHANGES = {
    Action.SWITCH: WorkerKind.ENGINE,
    Action.SLEEP: WorkerKind.ENGINE,
    Action.WAKE: WorkerKind.ENGINE,
    Action.OFFLOAD: WorkerKind.TRAINER,
    Action.ONLOAD: WorkerKind.TRAINER,
}


def apply_plan(state: ClusterState, plan: TransitionPlan, now_s: float) -> ClusterState:
    """Run every step of ``plan`` in order, to completion; return the next state."""
    run = _Run(state, plan, now_s)
    for step in plan.steps:
        run.do(step)
    return run.result()


class _Run:
    def __init__(self, state: ClusterState, plan: TransitionPlan, now_s: float) -> None:
        self.state, self.plan, self.now_s = state, plan, now_s
        self.workers: dict[str, Worker] = dict(state.worker_by_id)
        self.gpus: dict[str, Gpu] = dict(state.gpu_by_id)
        self.active_on = {g: w.worker_id for g, w in state.active_worker_on().items()}
        self.handlers: dict[Action, Callable[[PlanStep], None]] = {
            Action.START: self.start,
            Action.DRAIN: self.drain,
            Action.MIGRATE: self.drain,
            Action.STOP: self.stop,
            Action.SYNC_WEIGHTS: self.sync_weights,
            **dict.fromkeys(_ROLE_CHANGES, self.change_role),
        }

    def do(self, step: PlanStep) -> None:
        self.handlers[step.action](step)

    def worker(self, step: PlanStep) -> Worker:
        w = self.workers.get(step.worker_id)
        if w is None or not w.live:
            raise TransitionError(f"step {step.step_id}: no live worker {step.worker_id!r}")
        return w

    def move(self, w: Worker, phase: Phase, at_s: float, role: Role | None = None) -> Worker:
        """One edge of the transition table, checked."""
        new_role = w.role if role is None else role
        check_phase_edge(w.phase, phase)
        check_role(w.kind, new_role)
        check_role_change(w.phase, phase, w.role, new_role)
        moved = w.model_copy(update={"phase": phase, "role": new_role, "since_s": at_s})
        self.workers[w.worker_id] = moved
        return moved

    def settle(self, w: Worker, at_s: float) -> Worker:
        if w.phase in (Phase.STARTING, Phase.SWITCHING):
            return self.move(w, Phase.READY, at_s)
        return w

    def start(self, step: PlanStep) -> None:
        if step.role is None or step.worker_id in self.workers:
            raise TransitionError(f"step {step.step_id}: start needs a role and a new worker id")
        w = Worker(
            worker_id=step.worker_id,
            kind=WorkerKind.ENGINE,
            node=step.node,
            gpu_ids=step.gpu_ids,
            role=step.role,
            phase=Phase.STARTING,
            since_s=self.now_s + step.start_s,
            weights_version=self.state.policy_version,
        )
        check_role(w.kind, w.role)
        self.occupy(step, w)
        self.move(w, Phase.READY, self.now_s + step.end_s)

    def drain(self, step: PlanStep) -> None:
        w = self.settle(self.worker(step), self.now_s + step.start_s)
        if w.phase is not Phase.DRAINING:  # an engine already draining keeps its since_s
            self.move(w, Phase.DRAINING, self.now_s + step.start_s)

    def stop(self, step: PlanStep) -> None:
        w = self.worker(step)
        if w.phase is Phase.SWITCHING:
            w = self.settle(w, self.now_s + step.start_s)
        if w.phase is not Phase.STOPPING:
            w = self.move(w, Phase.STOPPING, self.now_s + step.start_s)
        self.vacate(w)
        self.move(w, Phase.GONE, self.now_s + step.end_s)

    def sync_weights(self, step: PlanStep) -> None:
        w = self.worker(step)
        self.workers[w.worker_id] = w.model_copy(
            update={"weights_version": self.state.policy_version}
        )

    def change_role(self, step: PlanStep) -> None:
        w = self.settle(self.worker(step), self.now_s + step.start_s)
        kind = _ROLE_CHANGES[step.action]
        if step.role is None or w.kind is not kind:
            raise TransitionError(
                f"step {step.step_id}: {step.action.value} needs a role and a {kind.value} worker"
            )
        if step.action is Action.WAKE and w.role is not Role.IDLE:
            raise TransitionError(f"step {step.step_id}: {w.worker_id} is not asleep")
        self.vacate(w)
        w = self.move(w, Phase.SWITCHING, self.now_s + step.start_s, step.role)
        if step.action is Action.OFFLOAD:
            self.set_lent(w, lambda gid: gid in self.plan.target.lent_gpu_ids)
        elif step.action is Action.ONLOAD:
            self.set_lent(w, lambda gid: False)
        if w.active:
            self.occupy(step, w)
        self.move(w, Phase.READY, self.now_s + step.end_s)

    def occupy(self, step: PlanStep, w: Worker) -> None:
        for gid in w.gpu_ids:
            holder = self.active_on.get(gid)
            if holder is not None and holder != w.worker_id:
                raise TransitionError(
                    f"step {step.step_id}: {w.worker_id} on GPU {gid!r} still held by {holder!r}"
                )
            self.active_on[gid] = w.worker_id
            gpu = self.gpus[gid]
            if w.kind is WorkerKind.ENGINE and gpu.source is GpuSource.BASE_TRAIN:
                self.gpus[gid] = gpu.model_copy(update={"lent": True})

    def vacate(self, w: Worker) -> None:
        for gid in w.gpu_ids:
            if self.active_on.get(gid) == w.worker_id:
                del self.active_on[gid]

    def set_lent(self, w: Worker, lent: Callable[[str], bool]) -> None:
        for gid in w.gpu_ids:
            self.gpus[gid] = self.gpus[gid].model_copy(update={"lent": lent(gid)})

    def result(self) -> ClusterState:
        trainer_on = {
            g for g, wid in self.active_on.items() if self.workers[wid].kind is WorkerKind.TRAINER
        }
        lent_ids = self.plan.target.lent_gpu_ids
        gpus = []
        for g in self.gpus.values():
            if g.source is GpuSource.BASE_TRAIN:
                lent = g.gpu_id in lent_ids and g.gpu_id not in trainer_on
                g = g if g.lent == lent else g.model_copy(update={"lent": lent})
            gpus.append(g)
        return self.state.replace(
            time_s=self.now_s + self.plan.makespan_s,
            gpus=tuple(gpus),
            workers=tuple(w for w in self.workers.values() if w.live),
        )
