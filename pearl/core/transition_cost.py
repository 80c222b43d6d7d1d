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

Invariant: a target equal to the inventory's configuration costs 0. For the moves the
planner makes without placement trouble (switches, wakes, starts on free or freed GPUs,
lending), the estimate equals the planner's makespan (``tests/core/test_transition_cost``).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from pearl.core.pd import PDConfig
from pearl.core.profile import TransitionCosts
from pearl.core.roles import INFERENCE_ROLES, Phase, Role, WorkerKind
from pearl.core.state import ClusterState

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
    active: defaultdict[GpuClass, Counter[Role]] = defaultdict(Counter)
    asleep: Counter[GpuClass] = Counter()
    stale: set[GpuClass] = set()
    for w in state.workers:
        if w.kind is not WorkerKind.ENGINE or not w.live or not pool.issuperset(w.gpu_ids):
            continue
        cls = (state.gpu_by_id[w.gpu_ids[0]].gpu_type, w.tp)
        if w.role in INFERENCE_ROLES and w.phase not in (Phase.DRAINING, Phase.STOPPING):
            active[cls][w.role] += 1
        elif w.role is Role.IDLE:
            asleep[cls] += 1
            if w.weights_version < state.policy_version:
                stale.add(cls)
    return Inventory(dict(active), asleep, frozenset(stale), lending)


def estimate_transition_s(
    inv: Inventory, target: PDConfig, costs: TransitionCosts, drain_s: float
) -> float:
    want: defaultdict[GpuClass, dict[Role, int]] = defaultdict(dict)
    for spec, n in target.instances:
        want[(spec.gpu_type, spec.tp)][spec.role] = n
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
