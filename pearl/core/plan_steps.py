"""The planner's working state, and how its decisions become ordered steps.

``planner.py`` decides what happens to each worker (``WorkerDecisions``); this module
orders those decisions into ``PlanStep``s with dependencies and durations: offloads
first, then drains (or migrations, against deadlines) before switches, sleeps and stops,
onloads after the engines on their GPUs left, wakes after offloads (plus a weight sync
when stale), starts after the previous occupants of their GPUs stopped.

Invariants: steps are appended in topological order, each starting when its last
dependency ends (``_Steps.add``); a step that would vacate GPUs after their deadline is
reported in the plan's ``problems``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple, Protocol

from pearl.core.pd import InstanceSpec
from pearl.core.placement import Placement
from pearl.core.plan import Action, PlanStep, Target, TransitionPlan
from pearl.core.profile import TransitionCosts
from pearl.core.roles import GpuSource, Phase, Role
from pearl.core.state import AllocationStatus, ClusterState, Worker


@dataclass
class PlanContext:
    """Inputs of one planning call, with the derived pool."""

    state: ClusterState
    target: Target
    costs: TransitionCosts
    now_s: float
    drain_estimate_s: float
    lent: frozenset[str] = frozenset()
    pool: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)

    def gpu_type(self, w: Worker) -> str:
        return self.state.gpu_by_id[w.gpu_ids[0]].gpu_type

    def on_base_train(self, w: Worker) -> bool:
        group = self.state.worker_groups[w.worker_id]  # (allocation, source) of its GPUs
        if group is not None:
            return group[1] is GpuSource.BASE_TRAIN
        gpus = self.state.gpu_by_id
        return all(gpus[g].source is GpuSource.BASE_TRAIN for g in w.gpu_ids)

    @cached_property
    def may_have_deadlines(self) -> bool:
        """Whether any GPU can have a vacate deadline (``_deadline_s``): a borrow window
        is open or an allocation is leaving."""
        state = self.state
        return state.borrow is not None or any(a.status in _LEAVING for a in state.allocations)

    def release_action(self, w: Worker) -> Action:
        """How an engine leaves its role: sleep on base-train GPUs, stop elsewhere."""
        if self.on_base_train(w) and w.active and w.phase is not Phase.STOPPING:
            return Action.SLEEP
        return Action.STOP

    def release_s(self, w: Worker) -> float:
        sleep = self.release_action(w) is Action.SLEEP
        return self.costs.sleep_s if sleep else self.costs.stop_s


@dataclass
class WorkerDecisions:
    """What happens to each worker; workers in none of these are left alone."""

    offload: list[Worker] = field(default_factory=list)
    onload: list[Worker] = field(default_factory=list)
    kept: list[Worker] = field(default_factory=list)
    switch: dict[str, Role] = field(default_factory=dict)  # active engine -> new role
    wake: dict[str, Role] = field(default_factory=dict)  # asleep engine -> new role
    release: dict[str, tuple[Action, str]] = field(default_factory=dict)  # STOP/SLEEP, why
    asleep_left: list[Worker] = field(default_factory=list)  # asleep engines in the pool
    new: list[InstanceSpec] = field(default_factory=list)


def is_stale(ctx: PlanContext, w: Worker) -> bool:
    return w.weights_version < ctx.state.policy_version


class _Who(Protocol):
    """The worker a step acts on: an existing ``Worker`` or a new engine (``_NewEngine``)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def node(self) -> str: ...
    @property
    def gpu_ids(self) -> tuple[str, ...]: ...


class _NewEngine(NamedTuple):
    worker_id: str
    node: str
    gpu_ids: tuple[str, ...]


class _Steps:
    """Appends steps in topological order; each starts when its last dependency ends."""

    def __init__(self) -> None:
        self.steps: list[PlanStep] = []
        self.end_s: list[float] = []  # of each step (``PlanStep.end_s``)

    def add(
        self,
        action: Action,
        w: _Who,
        role: Role | None,
        deps: Sequence[int],
        duration_s: float,
        reason: str,
        gpu_type: str = "",
    ) -> int:
        if not deps:
            ordered: tuple[int, ...] = ()
            start_s = 0.0
        elif len(deps) == 1:
            ordered = deps if type(deps) is tuple else (deps[0],)  # one tuple less
            start_s = self.end_s[deps[0]]
        else:
            ordered = tuple(sorted(set(deps)))
            start_s = max([self.end_s[i] for i in ordered])
        step_id = len(self.steps)
        self.steps.append(
            _step(step_id, action, w.worker_id, w.node, w.gpu_ids, role, ordered, duration_s,
                  start_s, reason, gpu_type)
        )  # fmt: skip
        self.end_s.append(start_s + duration_s)
        return step_id


def _step(
    step_id: int,
    action: Action,
    worker_id: str,
    node: str,
    gpu_ids: tuple[str, ...],
    role: Role | None,
    depends_on: tuple[int, ...],
    duration_s: float,
    start_s: float,
    reason: str,
    gpu_type: str,
) -> PlanStep:
    """``PlanStep(...)`` without the frozen ``__init__``'s cost (a frozen dataclass's
    fields live in its ``__dict__``): a third of the time, which counts with tens of
    thousands of steps (``tests/core/test_planner.py`` checks the two are equal)."""
    step = object.__new__(PlanStep)
    fields = step.__dict__
    fields["step_id"] = step_id
    fields["action"] = action
    fields["worker_id"] = worker_id
    fields["node"] = node
    fields["gpu_ids"] = gpu_ids
    fields["role"] = role
    fields["depends_on"] = depends_on
    fields["duration_s"] = duration_s
    fields["start_s"] = start_s
    fields["reason"] = reason
    fields["gpu_type"] = gpu_type
    return step


def build_steps(ctx: PlanContext, d: WorkerDecisions, placement: Placement) -> _Steps:
    """Offloads, drains, releases and switches, onloads, wakes (and syncs), starts."""
    c, workers, s = ctx.costs, ctx.state.worker_by_id, _Steps()
    offload_at: dict[str, int] = {}
    for w in sorted(d.offload, key=_wid):
        i = s.add(Action.OFFLOAD, w, Role.IDLE, (), c.trainer_offload_s, "lend its GPUs to rollout")
        offload_at.update(dict.fromkeys(w.gpu_ids, i))
    released_at: dict[str, int] = {}  # engine -> the step that takes it off its GPUs
    deadlines = ctx.may_have_deadlines
    for wid in sorted({*d.release, *d.switch}):
        w, role = workers[wid], d.switch.get(wid)
        if role is not None:
            action, why = Action.SWITCH, f"reuse as {role.value}"
            duration_s = c.role_switch_s
        else:
            action, why = d.release[wid]
            role = Role.IDLE if action is Action.SLEEP else None
            duration_s = c.sleep_s if action is Action.SLEEP else c.stop_s
        deadline_s = _deadline_s(ctx, w) if deadlines else None
        i = s.add(action, w, role, _leave(ctx, s, w, duration_s, deadline_s), duration_s, why)
        if deadline_s is not None and ctx.now_s + s.end_s[i] > deadline_s + 1e-9:
            ctx.problems.append(f"{wid} leaves its GPUs after their deadline {deadline_s:.1f} s")
        if action is not Action.SWITCH:
            released_at[wid] = i
    freed_at: dict[str, list[int]] = defaultdict(list)  # GPU -> steps that take engines off it
    for wid, i in released_at.items() if d.onload else ():
        for g in workers[wid].gpu_ids:
            freed_at[g].append(i)
    for w in sorted(d.onload, key=_wid):
        deps = [i for g in w.gpu_ids for i in freed_at.get(g, ())]
        s.add(Action.ONLOAD, w, Role.TRAIN, deps, c.trainer_onload_s, "its GPUs return")
    for wid in sorted(d.wake):
        w, role = workers[wid], d.wake[wid]
        deps = [offload_at[g] for g in w.gpu_ids if g in offload_at]
        why = f"reuse asleep engine as {role.value}"
        i = s.add(Action.WAKE, w, role, deps, c.wake_s, why, ctx.gpu_type(w))
        if is_stale(ctx, w):
            why = f"weights v{w.weights_version} < policy v{ctx.state.policy_version}"
            s.add(Action.SYNC_WEIGHTS, w, None, (i,), c.weight_sync_s, why)
    _add_starts(ctx, s, placement, offload_at, released_at)
    return s


def _add_starts(
    ctx: PlanContext,
    s: _Steps,
    placement: Placement,
    offload_at: dict[str, int],
    released_at: dict[str, int],
) -> None:
    taken = set(ctx.state.worker_by_id)
    why: dict[InstanceSpec, str] = {}
    for p in placement.placed:
        w = _NewEngine(_new_worker_id(p.node, p.gpu_ids[0], taken), p.node, p.gpu_ids)
        deps = [offload_at[g] for g in p.gpu_ids if g in offload_at]
        deps += [released_at[v] for v in p.after_workers]
        if p.spec not in why:
            why[p.spec] = f"new {p.spec.label()}"
        cold_s = ctx.costs.engine_cold_start_s
        s.add(Action.START, w, p.spec.role, deps, cold_s, why[p.spec], p.spec.gpu_type)


def _new_worker_id(node: str, first_gpu_id: str, taken: set[str]) -> str:
    """``e-NODE-INDEX`` (INDEX: the part of the GPU id after its last '/'), then ``-2``, ..."""
    base = f"e-{node}-{first_gpu_id.rsplit('/', 1)[-1]}"
    wid, n = base, 2
    while wid in taken:
        wid, n = f"{base}-{n}", n + 1
    taken.add(wid)
    return wid


def _leave(
    ctx: PlanContext, s: _Steps, w: Worker, then_s: float, deadline_s: float | None
) -> tuple[int, ...]:
    """Drain (or migrate, when draining would miss the deadline) an engine with requests."""
    if w.phase not in (Phase.READY, Phase.DRAINING) or w.role is Role.IDLE:  # not active
        return ()
    drain_s = ctx.drain_estimate_s
    if deadline_s is None or ctx.now_s + drain_s + then_s <= deadline_s:
        return (s.add(Action.DRAIN, w, None, (), drain_s, "let in-flight turns finish"),)
    why = f"vacate by {deadline_s:.1f} s: hand in-flight requests to other instances"
    return (s.add(Action.MIGRATE, w, None, (), ctx.costs.migrate_s, why),)


def _deadline_s(ctx: PlanContext, w: Worker) -> float | None:
    """When the worker's GPUs must be vacated, if they must."""
    state, deadlines = ctx.state, []
    borrowed = set(state.borrow.gpu_ids) if state.borrow is not None else set()
    for gid in w.gpu_ids:
        gpu = state.gpu_by_id[gid]
        if gid in borrowed and gid not in ctx.lent and state.borrow is not None:
            # a forced return: the trainer waits now, and a drain predicted to fit may not
            # (a turn's length is a guess): vacate at once
            forced = state.borrow.forced
            deadlines.append(ctx.now_s if forced else state.borrow.return_by_s)
        alloc = state.allocation_by_id[gpu.allocation_id]
        if gpu.source is not GpuSource.BASE_TRAIN and alloc.status in _LEAVING:
            deadlines.append(alloc.end_by_s if alloc.end_by_s is not None else ctx.now_s)
    return min(deadlines, default=None)


_LEAVING = (AllocationStatus.PREEMPTING, AllocationStatus.ENDED)
_CHANGES = frozenset(
    {Action.START, Action.STOP, Action.SLEEP, Action.WAKE, Action.SWITCH, Action.OFFLOAD,
     Action.ONLOAD}
)  # fmt: skip


def _wid(w: Worker) -> str:
    return w.worker_id


def summarize(ctx: PlanContext, d: WorkerDecisions, built: _Steps) -> TransitionPlan:
    steps = built.steps
    changes: Counter[Action] = Counter()
    changed: set[str] = set()  # workers in a change step
    busy_s: float = 0  # GPU-seconds, summed in step order from 0 (as sum() does)
    for s in steps:
        if s.action in _CHANGES:
            changes[s.action] += 1
            changed.add(s.worker_id)
        busy_s += s.duration_s * len(s.gpu_ids)
    goal = ctx.target.config.label() + (f", {len(ctx.lent)} GPUs lent" if ctx.lent else "")
    if not steps:
        reason = f"already at {goal}"
    else:
        done = ", ".join(f"{a.value} {n}" for a, n in sorted(changes.items()))
        reason = f"reach {goal}: keep {len(d.kept)}, {done}"
    return TransitionPlan(
        target=ctx.target,
        steps=tuple(steps),
        num_role_changes=len(changed),
        makespan_s=max(built.end_s, default=0.0),
        gpu_busy_s=busy_s,
        reason=reason,
        problems=tuple(ctx.problems),
    )
