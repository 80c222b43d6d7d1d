"""A quick estimate of how long reaching a PD configuration takes, without planning it.

Selection ranks hundreds of candidates; planning each would cost too much, and ranking by
predicted completion alone would pick targets whose transition eats their gain (a TP
change means cold starts). The estimate mirrors the planner's choices per (GPU type, TP)
class: keep engines whose role fits, switch the surplus ones (drain, switch), wake asleep
ones, and cold-start the rest (after draining and stopping engines in the way). Classes
change in parallel, so the estimate is the slowest class, after the trainer's offload
when the transition lends its GPUs.

It estimates the time until the target serves: surplus engines that only need to stop
run off in the background and cost nothing here (the plan's makespan includes them).

Plans are incremental: engines the target keeps in their role serve on through the
transition. ``effective_completion_s`` credits them: a target that only adds engines
(a grant, a lend) reaches the batch's end sooner by what the kept engines do meanwhile,
where charging its whole start-up as a stall would never add a node to a busy fleet.

Invariant: a target equal to the inventory's configuration costs 0. For the moves the
planner makes without placement trouble (switches, wakes, starts on free or freed GPUs,
lending), the estimate equals the planner's makespan (``tests/core/test_transition_cost``).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pearl.core.pd import PDConfig
from pearl.core.pool import Pool
from pearl.core.profile import TransitionCosts
from pearl.core.roles import INFERENCE_ROLES, Phase, Role
from pearl.core.state import ClusterState, Worker

GpuClass = tuple[str, int]  # (gpu_type, tp)


@dataclass(frozen=True)
class Inventory:
    """Engines on a GPU pool: active ones by class and role, asleep ones by class."""

    active: dict[GpuClass, Counter[Role]]
    asleep: Counter[GpuClass]
    stale: frozenset[GpuClass]  # classes with an asleep engine behind the policy version
    lending: bool  # the move starts with the trainer's offload


def inventory(state: ClusterState, pool_gpu_ids: Iterable[str], lending: bool) -> Inventory:
    pool = set(pool_gpu_ids)
    return inventory_where(state, lambda w: pool.issuperset(w.gpu_ids), lending)


def inventory_where(
    state: ClusterState, in_pool: Callable[[Worker], bool], lending: bool
) -> Inventory:
    """The inventory of the live engines ``in_pool`` says are in the pool."""
    active: defaultdict[GpuClass, Counter[Role]] = defaultdict(Counter)
    asleep: Counter[GpuClass] = Counter()
    stale: set[GpuClass] = set()
    for w, gpu_type in state.live_engines:
        if not in_pool(w):
            continue
        cls = (gpu_type, w.tp)
        if w.role in INFERENCE_ROLES and w.phase not in (Phase.DRAINING, Phase.STOPPING):
            active[cls][w.role] += 1
        elif w.role is Role.IDLE:
            asleep[cls] += 1
            if w.weights_version < state.policy_version:
                stale.add(cls)
    return Inventory(dict(active), asleep, frozenset(stale), lending)


def pool_inventory(state: ClusterState, pool: Pool, lending: bool) -> Inventory:
    """``inventory_where(state, partial(pool.holds, state), lending)``, read per group of
    the state's engines (``ClusterState.engine_kinds_by_group``) where the pool holds a
    group whole or not at all (``tests/core/test_transition_cost.py``)."""
    active: defaultdict[GpuClass, Counter[Role]] = defaultdict(Counter)
    asleep: Counter[GpuClass] = Counter()
    stale: set[GpuClass] = set()
    for group, kinds in state.engine_kinds_by_group.items():
        held = pool.holds_group(state, group)
        if held is False:
            continue
        if held is None:  # engine by engine
            kinds = Counter(
                (w.role, w.phase, gpu_type, w.tp, w.weights_version)
                for w, gpu_type in state.live_engines_by_group[group]
                if pool.holds(state, w)
            )
        for (role, phase, gpu_type, tp, weights_version), n in kinds.items():
            cls = (gpu_type, tp)
            if role in INFERENCE_ROLES and phase not in (Phase.DRAINING, Phase.STOPPING):
                active[cls][role] += n
            elif role is Role.IDLE:
                asleep[cls] += n
                if weights_version < state.policy_version:
                    stale.add(cls)
    return Inventory(dict(active), asleep, frozenset(stale), lending)


def estimate_transition_s(
    inv: Inventory, target: PDConfig, costs: TransitionCosts, drain_s: float
) -> float:
    want = _wanted(target)
    none: Counter[Role] = Counter()
    moves = []  # per class: (engines to switch, to wake, to start)
    surplus = 0  # active engines the target does not keep as they are
    for cls in want.keys() | inv.active.keys():
        wanted, have = want.get(cls, {}), inv.active.get(cls, none)
        kept = sum(min(n, have[r]) for r, n in wanted.items())
        needed = sum(wanted.values()) - kept
        movable = sum(have.values()) - kept
        switched = min(needed, movable)
        woken = min(needed - switched, inv.asleep[cls])
        moves.append((cls, switched, woken, needed - switched - woken))
        surplus += movable
    offload_s = costs.trainer_offload_s if inv.lending else 0.0
    slowest_s = offload_s
    for cls, switched, woken, started in moves:
        if switched:
            slowest_s = max(slowest_s, drain_s + costs.role_switch_s)
        if woken:
            sync_s = costs.weight_sync_s if cls in inv.stale else 0.0
            slowest_s = max(slowest_s, offload_s + costs.wake_s + sync_s)
        if started:
            clear_s = drain_s + costs.stop_s if surplus else 0.0
            slowest_s = max(slowest_s, max(offload_s, clear_s) + costs.engine_cold_start_s)
    return slowest_s


def kept_gpu_share(inv: Inventory, target: PDConfig, running_gpus: int) -> float:
    """The share of the running configuration's GPUs (``running_gpus``) whose engines the
    target keeps in their role: they serve on while the rest of the transition runs."""
    if running_gpus <= 0:
        return 0.0
    kept_gpus = 0
    want = _wanted(target)
    for cls, have in inv.active.items():
        wanted = want.get(cls, {})
        kept_gpus += cls[1] * sum(min(n, have[r]) for r, n in wanted.items())
    return min(1.0, kept_gpus / running_gpus)


def _wanted(target: PDConfig) -> dict[GpuClass, dict[Role, int]]:
    """The target's instances by class and role."""
    want: defaultdict[GpuClass, dict[Role, int]] = defaultdict(dict)
    for spec, n in target.instances:
        want[(spec.gpu_type, spec.tp)][spec.role] = n
    return want


def effective_completion_s(
    transition_s: float, kept_share: float, target_s: float, current_s: float
) -> float:
    """Predicted completion when the transition takes ``transition_s`` and the engines
    kept through it (``kept_share`` of the running configuration) serve meanwhile, as a
    fluid: they do ``kept_share * transition_s / current_s`` of the remaining work, the
    target the rest at its own pace (``target_s`` for all of it). Never more than
    ``transition_s + target_s`` (nothing kept), never less than ``min(target_s,
    current_s)``."""
    if transition_s <= 0.0:
        return target_s
    if kept_share <= 0.0 or not math.isfinite(current_s) or current_s <= 0.0:
        return transition_s + target_s
    done = kept_share * transition_s / current_s
    if done >= 1.0:  # the kept engines finish it before the target serves
        return current_s / kept_share
    return transition_s + (1.0 - done) * target_s
