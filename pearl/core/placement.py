"""Placement of new engine instances on the GPUs of the rollout pool.

Each GPU of the pool is described by the workers on it and what the plan does to them
(``Hold``). A new instance of tp k takes k GPUs of its type on one node, chosen best fit:
the node with the fewest usable GPUs that still has k. Instances are placed largest tp
first, then in spec order, so the result is deterministic.

GPUs are tried in tiers, each tier only when the cheaper ones cannot host the instance:
1. free, or freed by a worker the plan stops anyway (the start waits for that stop);
2. also GPUs of engines the plan puts to sleep: they are stopped instead (no extra change);
3. also GPUs of asleep engines the plan leaves alone: they are stopped first (one more
   change each). An asleep engine is never woken, started over or shared with a new one.

Invariants (asserted by ``tests/core/test_planner.py``):
- a GPU goes to at most one new instance, and never to one held by a worker that stays
  active after the plan (``Hold.KEPT``);
- every GPU of a placed instance is of its type, on its node, and in the pool;
- ``placed[i].after_workers`` names every worker that must be gone before the start.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from pearl.core.pd import InstanceSpec
from pearl.core.state import Gpu


class Hold(IntEnum):
    """What a worker on a GPU means for placement, cheapest to free first."""

    STOPPED = 1  # the plan stops it: free once the stop is done
    SLEPT = 2  # the plan puts it to sleep: stopping it instead costs no extra change
    ASLEEP = 3  # asleep and left alone: stopping it costs one more change
    KEPT = 4  # active after the plan: never free


FREE = 0  # tier of a GPU with no worker on it


@dataclass(frozen=True)
class Placed:
    spec: InstanceSpec
    node: str
    gpu_ids: tuple[str, ...]
    after_workers: tuple[str, ...]  # workers whose stop must end before the start


@dataclass
class Placement:
    placed: list[Placed] = field(default_factory=list)
    unplaced: list[InstanceSpec] = field(default_factory=list)
    stop_instead_of_sleep: set[str] = field(default_factory=set)  # worker ids
    stop_asleep: set[str] = field(default_factory=set)  # worker ids: extra changes


class _Nodes:
    """Per GPU type, nodes bucketed by their count of tier-1 GPUs (free or freed by a stop)."""

    def __init__(self, counts: Mapping[tuple[str, str], int]) -> None:
        self.count = dict(counts)
        self.buckets: dict[str, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
        for (gpu_type, node), n in sorted(counts.items()):
            self.buckets[gpu_type][n].append(node)

    def best_fit(self, gpu_type: str, tp: int) -> str | None:
        by_count = self.buckets.get(gpu_type, {})
        for n in sorted(c for c, nodes in by_count.items() if c >= tp and nodes):
            return by_count[n][0]
        return None

    def add(self, gpu_type: str, node: str, delta: int) -> None:
        n = self.count[(gpu_type, node)]
        bucket = self.buckets[gpu_type]
        bucket[n].remove(node)
        self.count[(gpu_type, node)] = n + delta
        bisect.insort(bucket[n + delta], node)


class _Placer:
    def __init__(
        self,
        pool_gpus: Sequence[Gpu],
        workers_on: Mapping[str, Sequence[str]],
        hold_of: Mapping[str, Hold],
    ) -> None:
        self.hold_of = dict(hold_of)
        self.workers_on = workers_on
        # GPUs of the workers that may yet be stopped instead (``convert_to_stop``)
        self.gpus_of_worker: dict[str, list[Gpu]] = defaultdict(list)
        self.gpus_of: dict[tuple[str, str], list[Gpu]] = defaultdict(list)
        self.tier_of: dict[str, int] = {}  # GPU id -> ``tier``, kept as holds change
        tier1: dict[tuple[str, str], int] = {}
        for g in pool_gpus:
            key = (g.gpu_type, g.node)
            self.gpus_of[key].append(g)
            workers = workers_on.get(g.gpu_id, ())
            tier = FREE
            for w in workers:
                hold = self.hold_of[w]
                tier = max(tier, hold)
                if hold > Hold.STOPPED:
                    self.gpus_of_worker[w].append(g)
            self.tier_of[g.gpu_id] = tier
            tier1[key] = tier1.get(key, 0) + (tier <= Hold.STOPPED)
        self.taken: set[str] = set()
        self.result = Placement()
        self.nodes = _Nodes(tier1)

    def tier(self, gpu_id: str) -> int:
        return max((self.hold_of[w] for w in self.workers_on.get(gpu_id, ())), default=FREE)

    def usable(self, gpu_type: str, node: str, max_tier: int) -> list[Gpu]:
        """Untaken GPUs of the node at or below the tier, cheapest first, in pool order."""
        tier_of, taken = self.tier_of, self.taken
        gpus = [g for g in self.gpus_of[(gpu_type, node)] if g.gpu_id not in taken]
        tiers = [tier_of[g.gpu_id] for g in gpus]
        if tiers and min(tiers) == max(tiers):  # one tier: pool order (what the sort keeps)
            return gpus if tiers[0] <= max_tier else []
        ranked = sorted(zip(tiers, range(len(gpus)), strict=True))
        return [gpus[i] for t, i in ranked if t <= max_tier]

    def place(self, spec: InstanceSpec) -> None:
        node = self.nodes.best_fit(spec.gpu_type, spec.tp)
        if node is not None:
            self.commit(spec, node, self.usable(spec.gpu_type, node, Hold.STOPPED)[: spec.tp])
            return
        for max_tier in (Hold.SLEPT, Hold.ASLEEP):
            choice = self.fallback(spec, max_tier)
            if choice is not None:
                self.commit(spec, choice[0], choice[1])
                return
        self.result.unplaced.append(spec)

    def fallback(self, spec: InstanceSpec, max_tier: int) -> tuple[str, list[Gpu]] | None:
        """Best node when GPUs of sleeping or asleep engines may be stopped: fewest extra
        stops, then best fit, then node name."""
        best: tuple[int, int, str] | None = None
        chosen: list[Gpu] = []
        for gpu_type, node in sorted(self.gpus_of):
            if gpu_type != spec.gpu_type:
                continue
            usable = self.usable(gpu_type, node, max_tier)
            if len(usable) < spec.tp:
                continue
            extra = sum(
                1 for w in self.to_stop(usable[: spec.tp]) if self.hold_of[w] is Hold.ASLEEP
            )
            key = (extra, len(usable), node)
            if best is None or key < best:
                best, chosen = key, usable[: spec.tp]
        return None if best is None else (best[2], chosen)

    def to_stop(self, gpus: Iterable[Gpu]) -> set[str]:
        """Workers on the GPUs that the plan does not stop yet."""
        return {
            w
            for g in gpus
            for w in self.workers_on.get(g.gpu_id, ())
            if self.hold_of[w] > Hold.STOPPED
        }

    def commit(self, spec: InstanceSpec, node: str, gpus: list[Gpu]) -> None:
        ids = tuple(g.gpu_id for g in gpus)
        on = {w for gid in ids for w in self.workers_on.get(gid, ())}
        for w in sorted(w for w in on if self.hold_of[w] > Hold.STOPPED):  # to_stop
            if self.hold_of[w] is Hold.SLEPT:
                self.result.stop_instead_of_sleep.add(w)
            else:
                self.result.stop_asleep.add(w)
            self.convert_to_stop(w)
        self.taken.update(ids)
        self.nodes.add(spec.gpu_type, node, -len(ids))
        self.result.placed.append(Placed(spec, node, ids, tuple(sorted(on))))

    def convert_to_stop(self, worker_id: str) -> None:
        """The worker is stopped instead: its GPUs that become tier 1 count as usable."""
        self.hold_of[worker_id] = Hold.STOPPED
        for g in self.gpus_of_worker[worker_id]:
            before, after = self.tier_of[g.gpu_id], self.tier(g.gpu_id)
            self.tier_of[g.gpu_id] = after
            if g.gpu_id not in self.taken and before > Hold.STOPPED >= after:
                self.nodes.add(g.gpu_type, g.node, 1)


def place_instances(
    specs: Iterable[InstanceSpec],
    pool_gpus: Sequence[Gpu],
    workers_on: Mapping[str, Sequence[str]],
    hold_of: Mapping[str, Hold],
) -> Placement:
    """Place new instances on pool GPUs.

    ``pool_gpus``: the pool, in state order. ``workers_on``: GPU id -> ids of the engines
    on it after the plan's changes (trainers excluded: in the pool they are offloaded).
    ``hold_of``: worker id -> what the plan does to it.
    """
    placer = _Placer(pool_gpus, workers_on, hold_of)
    for spec in sorted(specs, key=lambda s: (-s.tp, s)):
        placer.place(spec)
    return placer.result
