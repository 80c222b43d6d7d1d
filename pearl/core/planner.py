"""Incremental transition planner: the fewest worker changes from a state to a target.

A plan (``pearl.core.plan``) is a diff: workers that already fit the target are in no step.
1. Pool: base-rollout and elastic GPUs of granted allocations, plus the base-train GPUs the
   target lends. Engines active outside the pool leave: to sleep on base-train GPUs (they
   stay co-resident with the trainer for cheap re-lending), stopped elsewhere. Asleep
   engines on GPUs of an allocation that is not granted are stopped. A trainer ends
   ``idle`` when any of its GPUs is lent (offload, before engines wake or start there) and
   ``train`` otherwise (onload, after the engines on its GPUs left).
2. Keep every engine in the pool whose (role, GPU type, tp) the target still wants, up to
   the wanted count, ready ones first.
3. Per (GPU type, tp) class, assign the remaining target instances to the remaining engines
   of the class (switch an active one, wake an asleep one) or to a new start, by a min-cost
   assignment: fewest changes (a big-M term), then fewest seconds. Unmatched active engines
   leave as in 1; unmatched asleep ones stay asleep.
4. Place new instances (``pearl.core.placement``), then order the steps with dependencies
   (``pearl.core.plan_steps``).

Conventions: ``draining``/``stopping`` engines count as nothing: the plan finishes them
(stop, or sleep on base-train GPUs). ``starting``/``switching`` engines hold no requests
and change without a drain. An asleep engine that shares a GPU with another engine is
never woken; a new engine never lands on an asleep engine's GPU unless that engine is
stopped first (one more change). GPU deadlines: a borrowed GPU returned by this plan
(``borrow.return_by_s``) and a GPU of a preempting or ended allocation (``end_by_s``, or
now when unknown) must be vacated (drain, then sleep or stop) in time; a drain of
``drain_estimate_s`` that would miss it becomes a migration, and a miss anyway a problem.

Invariants (asserted by ``tests/core/test_planner.py``):
- applying the plan yields ``target.config`` and the targeted trainer and lending state,
  unless ``problems`` says why not;
- ``num_role_changes`` is the minimum number of workers created, stopped or given another
  role; each worker is in at most one such step;
- a state that already matches the target gets an empty plan; equal inputs, equal plans;
- steps are in topological order and each starts when its last dependency ends.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
from scipy.optimize import linear_sum_assignment

from pearl.core.pd import InstanceSpec
from pearl.core.placement import Hold, Placement, place_instances
from pearl.core.plan import Action, Target, TransitionPlan
from pearl.core.plan_steps import PlanContext, WorkerDecisions, build_steps, is_stale, summarize
from pearl.core.profile import RuntimeProfile
from pearl.core.roles import GpuSource, Phase, Role, WorkerKind
from pearl.core.state import AllocationStatus, ClusterState, Gpu, Worker

_Class = tuple[str, int]  # (GPU type, tp): engines are reusable only within a class
_SETTLING = frozenset({Phase.STARTING, Phase.READY, Phase.SWITCHING})  # end in ready alone


def plan_transition(
    state: ClusterState,
    target: Target,
    profile: RuntimeProfile,
    now_s: float,
    drain_estimate_s: float = 0.0,
) -> TransitionPlan:
    """The plan from ``state`` to ``target`` with the fewest changes, then the lowest cost."""
    ctx = PlanContext(state, target, profile.costs, now_s, drain_estimate_s)
    _check_target(ctx, profile)
    ctx.lent = _valid_lent(ctx)
    ctx.pool = _pool(ctx)
    d = WorkerDecisions()
    _plan_trainers(ctx, d)
    active, asleep = _sort_engines(ctx, d)
    rows, rest = _keep(ctx, d, active)
    for cls in sorted(set(rows) | set(rest) | set(asleep)):
        _assign_class(ctx, d, cls, rows.get(cls, []), rest.get(cls, []), asleep.get(cls, []))
    placement = _place(ctx, d)
    return summarize(ctx, d, build_steps(ctx, d, placement))


def _check_target(ctx: PlanContext, profile: RuntimeProfile) -> None:
    for spec, _ in ctx.target.config.instances:
        if profile.engine(spec.gpu_type, spec.tp) is None:
            ctx.problems.append(f"no engine profile for {spec.label()}")


def _valid_lent(ctx: PlanContext) -> frozenset[str]:
    gpus = ctx.state.gpu_by_id
    lent = set()
    for gid in sorted(ctx.target.lent_gpu_ids):
        if gid in gpus and gpus[gid].source is GpuSource.BASE_TRAIN:
            lent.add(gid)
        else:
            ctx.problems.append(f"cannot lend {gid!r}: not a base-train GPU")
    return frozenset(lent)


def _pool(ctx: PlanContext) -> set[str]:
    """Base-train GPUs lent, and every GPU of the other groups of a granted allocation."""
    allocations = ctx.state.allocation_by_id
    pool: set[str] = set()
    for (allocation_id, source), gpus in ctx.state.gpu_groups.items():
        if source is GpuSource.BASE_TRAIN:
            pool.update(g.gpu_id for g in gpus if g.gpu_id in ctx.lent)
        elif allocations[allocation_id].status is AllocationStatus.GRANTED:
            pool.update(g.gpu_id for g in gpus)
    return pool


def _plan_trainers(ctx: PlanContext, d: WorkerDecisions) -> None:
    """Offload trainers whose GPUs are lent, onload the others; shrink the pool if stuck."""
    for w in ctx.state.trainers:
        if w.kind is not WorkerKind.TRAINER or not w.live:
            continue
        lend = any(g in ctx.lent for g in w.gpu_ids)
        if w.role is (Role.IDLE if lend else Role.TRAIN):
            continue
        if w.phase not in _SETTLING:
            ctx.problems.append(f"trainer {w.worker_id} is {w.phase.value}: cannot change role")
            if lend:
                ctx.pool.difference_update(w.gpu_ids)
            continue
        (d.offload if lend else d.onload).append(w)


def _sort_engines(
    ctx: PlanContext, d: WorkerDecisions
) -> tuple[dict[InstanceSpec, list[Worker]], dict[_Class, list[Worker]]]:
    """Active engines in the pool by spec, wake candidates by class; the rest decided."""
    active: dict[InstanceSpec, list[Worker]] = defaultdict(list)
    asleep: dict[_Class, list[Worker]] = defaultdict(list)
    live = ctx.state.live_engines  # (engine, its GPU type), in the state's order
    engines_on: Counter[str] | None = None  # engines per GPU, counted when first asked
    specs: dict[tuple[Role, str, int], InstanceSpec] = {}  # one object per spec
    for w, gpu_type in live:
        in_pool = ctx.pool.issuperset(w.gpu_ids)
        if w.phase not in _SETTLING:
            d.release[w.worker_id] = (ctx.release_action(w), f"finish {w.phase.value}")
        elif w.role is not Role.IDLE and in_pool:
            key = (w.role, gpu_type, len(w.gpu_ids))
            spec = specs.get(key)
            if spec is None:
                spec = specs[key] = InstanceSpec(*key)
            active[spec].append(w)
        elif w.role is not Role.IDLE:
            d.release[w.worker_id] = (ctx.release_action(w), "GPUs leave the rollout pool")
        elif in_pool:
            if engines_on is None:
                engines_on = Counter(g for v, _ in live for g in v.gpu_ids)
            if all(engines_on[g] == 1 for g in w.gpu_ids):
                asleep[(gpu_type, w.tp)].append(w)
            else:
                d.asleep_left.append(w)
        elif not ctx.on_base_train(w):
            d.release[w.worker_id] = (Action.STOP, "its allocation is going away")
    return active, asleep


def _keep(
    ctx: PlanContext, d: WorkerDecisions, active: dict[InstanceSpec, list[Worker]]
) -> tuple[dict[_Class, list[Role]], dict[_Class, list[Worker]]]:
    """Keep engines that fit; return the unmet instances (roles) and the other engines."""
    wanted = ctx.target.config.counts()
    rows: dict[_Class, list[Role]] = defaultdict(list)
    rest: dict[_Class, list[Worker]] = defaultdict(list)
    unmet = {(s.gpu_type, s.tp) for s, n in wanted.items() if n > len(active.get(s, ()))}
    for spec in sorted(set(wanted) | set(active)):
        cands = active.get(spec, [])
        n = min(wanted[spec], len(cands))
        # The order decides which are kept, and is the assignment's column order where
        # the class has unmet instances; elsewhere (all kept, or none kept and every
        # other engine released) the order of the engines is not read.
        if 0 < n < len(cands) or (spec.gpu_type, spec.tp) in unmet:
            cands = sorted(cands, key=lambda w: (w.phase is not Phase.READY, w.worker_id))
        d.kept += cands[:n]
        rest[(spec.gpu_type, spec.tp)] += cands[n:]
        rows[(spec.gpu_type, spec.tp)] += [spec.role] * (wanted[spec] - n)
    return rows, rest


def _assign_class(
    ctx: PlanContext,
    d: WorkerDecisions,
    cls: _Class,
    rows: list[Role],
    active: list[Worker],
    asleep: list[Worker],
) -> None:
    """One class's unmet instances on its engines or new starts (``_assign_min_cost``).

    Without unmet instances every engine is left over; without engines every instance
    is a new start: what the assignment returns then (``tests/core/test_planner.py``),
    without building a matrix of up to thousands of rows and columns."""
    if rows and (active or asleep):
        _assign_min_cost(ctx, d, cls, rows, active, asleep)
        return
    d.new += [InstanceSpec(role, cls[0], cls[1]) for role in rows]
    why = {a: (a, "not needed by the target") for a in (Action.SLEEP, Action.STOP)}  # shared
    for w in active:
        d.release[w.worker_id] = why[ctx.release_action(w)]
    d.asleep_left += asleep


def _assign_min_cost(
    ctx: PlanContext,
    d: WorkerDecisions,
    cls: _Class,
    rows: list[Role],
    active: list[Worker],
    asleep: list[Worker],
) -> None:
    """Min-cost assignment of one class's unmet instances to its engines or new starts."""
    roles = sorted(set(rows))
    columns: list[Worker | None] = []
    changes: list[list[float]] = []
    seconds: list[list[float]] = []
    per_group: Counter[tuple[object, ...]] = Counter()
    for w, ch, secs in _columns(ctx, roles, active, sorted(asleep, key=_asleep_order), len(rows)):
        group = (w is None, w is not None and w.role is Role.IDLE, *ch, *secs)
        if per_group[group] < len(rows):  # identical columns beyond the row count are useless
            per_group[group] += 1
            columns.append(w)
            changes.append(ch)
            seconds.append(secs)
    matched: set[str] = set()
    if rows:
        secs_arr = np.array(seconds, dtype=float)
        big_m = 1.0 + 2.0 * len(rows) * float(np.abs(secs_arr).max())
        by_role = np.array(changes, dtype=float) * big_m + secs_arr  # columns x roles
        matrix = by_role[:, [roles.index(r) for r in rows]].T
        for i, j in zip(*linear_sum_assignment(matrix), strict=True):
            _take(ctx, d, cls, rows[int(i)], columns[int(j)], matched)
    for w in active:
        if w.worker_id not in matched:
            d.release[w.worker_id] = (ctx.release_action(w), "not needed by the target")
    d.asleep_left += [w for w in asleep if w.worker_id not in matched]


def _asleep_order(w: Worker) -> tuple[int, str]:
    return (-w.weights_version, w.worker_id)


def _columns(
    ctx: PlanContext, roles: list[Role], active: list[Worker], asleep: list[Worker], num_rows: int
) -> list[tuple[Worker | None, list[float], list[float]]]:
    """Candidate columns with their per-role change count and seconds (net of the cost of
    the worker's fate when it stays unmatched)."""
    c = ctx.costs
    cols: list[tuple[Worker | None, list[float], list[float]]] = []
    for w in active:  # a switch (1 change) instead of a release (1 change)
        switch_s = c.role_switch_s - ctx.release_s(w)
        cols.append(
            (w, [-1.0 if r is w.role else 0.0 for r in roles],
             [-ctx.release_s(w) if r is w.role else switch_s for r in roles])
        )  # fmt: skip
    for w in asleep:
        wake_s = c.wake_s + (c.weight_sync_s if is_stale(ctx, w) else 0.0)
        cols.append((w, [1.0] * len(roles), [wake_s] * len(roles)))
    cols += [(None, [1.0] * len(roles), [c.engine_cold_start_s] * len(roles))] * num_rows
    return cols


def _take(
    ctx: PlanContext,
    d: WorkerDecisions,
    cls: _Class,
    role: Role,
    w: Worker | None,
    matched: set[str],
) -> None:
    if w is None:
        d.new.append(InstanceSpec(role, cls[0], cls[1]))
        return
    matched.add(w.worker_id)
    if w.role is Role.IDLE:
        d.wake[w.worker_id] = role
    elif w.role is role:
        d.kept.append(w)
    else:
        d.switch[w.worker_id] = role


def _place(ctx: PlanContext, d: WorkerDecisions) -> Placement:
    """Place the new instances; stop sleepers or asleep engines whose GPUs are needed."""
    if not d.new:
        return Placement()
    workers = ctx.state.worker_by_id
    hold_of: dict[str, Hold] = {}
    for w in d.kept:
        hold_of[w.worker_id] = Hold.KEPT
    for wid in (*d.switch, *d.wake):
        hold_of[wid] = Hold.KEPT
    for w in d.asleep_left:
        hold_of[w.worker_id] = Hold.ASLEEP
    for wid, (action, _) in d.release.items():
        hold_of[wid] = Hold.SLEPT if action is Action.SLEEP else Hold.STOPPED
    workers_on: dict[str, list[str]] = defaultdict(list)  # each list sorted by worker id
    for wid in hold_of:
        for g in workers[wid].gpu_ids:
            if g in ctx.pool:
                workers_on[g].append(wid)
    for wids in workers_on.values():
        if len(wids) > 1:
            wids.sort()
    pool_gpus: list[Gpu] = [g for g in ctx.state.gpus if g.gpu_id in ctx.pool]
    placement = place_instances(d.new, pool_gpus, workers_on, hold_of)
    for wid in sorted(placement.stop_instead_of_sleep | placement.stop_asleep):
        d.release[wid] = (Action.STOP, "its GPUs are needed by a new instance")
    for spec in placement.unplaced:
        ctx.problems.append(f"no room for a new {spec.label()}: no node with {spec.tp} free GPUs")
    return placement
