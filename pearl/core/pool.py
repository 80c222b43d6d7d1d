"""The rollout pool: the GPUs rollout may use, kept as the groups they come in.

A pool is made of whole groups of a state's GPUs (one group per allocation and source:
the base rollout GPUs, each granted elastic allocation) and a subset of the trainer's
(the lent ones). A decision derives a GPU budget, an engine inventory and node sizes
from its pools several times; per group those are read from the state's indexes
(computed once per snapshot), so none of it scans every GPU or engine (``bench decide``
at 8,192 GPUs). A pool is a sequence of its GPUs, in the order of the state's groups.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import overload

from pearl.core.roles import GpuSource, Role
from pearl.core.state import AllocationStatus, ClusterState, Gpu, Worker

Group = tuple[str, GpuSource]  # (allocation id, source)


@dataclass(frozen=True, eq=False)
class Pool(Sequence[Gpu]):
    gpus: tuple[Gpu, ...]
    whole_groups: frozenset[Group]  # every GPU of these groups is in the pool
    lent_ids: frozenset[str]  # and these of the trainer's
    node_counts: Mapping[tuple[str, str], int]  # (GPU type, node) -> GPUs in the pool

    @overload
    def __getitem__(self, index: int) -> Gpu: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Gpu]: ...
    def __getitem__(self, index: int | slice) -> Gpu | Sequence[Gpu]:
        return self.gpus[index]

    def __len__(self) -> int:
        return len(self.gpus)

    def __iter__(self) -> Iterator[Gpu]:
        return iter(self.gpus)

    def holds(self, state: ClusterState, worker: Worker) -> bool:
        """Whether every GPU of ``worker`` is in the pool."""
        group = state.worker_groups[worker.worker_id]
        if group is None:  # GPUs of several groups (no state the planner makes)
            return all(
                _group_of(state, gid) in self.whole_groups or gid in self.lent_ids
                for gid in worker.gpu_ids
            )
        if group in self.whole_groups:
            return True
        return group[1] is GpuSource.BASE_TRAIN and self.lent_ids.issuperset(worker.gpu_ids)

    def holds_group(self, state: ClusterState, group: Group | None) -> bool | None:
        """Whether ``holds`` is true for every worker of ``state.worker_groups``'s
        ``group`` (True), for none (False), or must be asked per worker (None)."""
        if group is None:
            return None
        if group in self.whole_groups:
            return True
        if group[1] is not GpuSource.BASE_TRAIN or not self.lent_ids:
            return False
        if self.lent_ids.issuperset(g.gpu_id for g in state.gpu_groups[group]):
            return True
        return None

    def holds_active_engines(self, state: ClusterState) -> bool:
        """Whether every active engine of ``state`` is in the pool, read per group."""
        for group, kinds in state.engine_kinds_by_group.items():
            held = self.holds_group(state, group)
            if held is True or not any(role is not Role.IDLE for role, *_ in kinds):
                continue
            if held is False:
                return False
            engines = state.live_engines_by_group[group]
            if any(w.active and not self.holds(state, w) for w, _ in engines):
                return False
        return True


def rollout_pool(state: ClusterState, lent: Iterable[str], excluded: Iterable[str]) -> Pool:
    """Base rollout GPUs, the granted elastic ones of allocations not ``excluded``, and
    the trainer's GPUs in ``lent``."""
    lent_ids = frozenset(lent)
    skip = set(excluded)
    allocations = state.allocation_by_id
    gpus: list[Gpu] = []
    whole: set[Group] = set()
    chosen_ids: set[str] = set()
    counts: Counter[tuple[str, str]] = Counter()
    for group, members in state.gpu_groups.items():
        allocation_id, source = group
        if source is GpuSource.BASE_TRAIN:
            if lent_ids:
                chosen = [g for g in members if g.gpu_id in lent_ids]
                gpus += chosen
                chosen_ids.update(g.gpu_id for g in chosen)
                if len(chosen) == len(members):  # the whole group is lent
                    counts.update(state.group_node_counts[group])
                else:
                    counts.update((g.gpu_type, g.node) for g in chosen)
        elif allocations[allocation_id].status is AllocationStatus.GRANTED and (
            allocation_id not in skip
        ):
            gpus += members
            whole.add(group)
            counts.update(state.group_node_counts[group])
    return Pool(tuple(gpus), frozenset(whole), frozenset(chosen_ids), dict(counts))


def node_counts(gpus: Iterable[Gpu]) -> Mapping[tuple[str, str], int]:
    """(GPU type, node) -> how many of ``gpus``: read off a pool, counted otherwise."""
    if isinstance(gpus, Pool):
        return gpus.node_counts
    return Counter((g.gpu_type, g.node) for g in gpus)


def _group_of(state: ClusterState, gpu_id: str) -> Group:
    g = state.gpu_by_id[gpu_id]
    return g.allocation_id, g.source
