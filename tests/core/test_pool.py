"""The rollout pool read per group equals the pool counted GPU by GPU."""

from __future__ import annotations

from collections import Counter

import pytest

from pearl.bench.synth import Layout, build_state
from pearl.core.pool import node_counts, rollout_pool
from pearl.core.roles import GpuSource
from pearl.core.state import AllocationStatus, ClusterState


def _counted(state: ClusterState, lent: set[str], excluded: set[str]) -> list[str]:
    """The pool's definition, one GPU at a time (``DecisionContext.rollout_gpus``)."""
    allocations = state.allocation_by_id
    out = []
    for g in state.gpus:
        if g.source is GpuSource.BASE_TRAIN:
            usable = g.gpu_id in lent
        else:
            granted = allocations[g.allocation_id].status is AllocationStatus.GRANTED
            usable = granted and g.allocation_id not in excluded
        if usable:
            out.append(g.gpu_id)
    return out


@pytest.mark.parametrize("lend", [0, 3, 8, 16], ids=lambda n: f"lend{n}")
@pytest.mark.parametrize("exclude", [0, 1, 2], ids=lambda n: f"exclude{n}")
def test_the_pool_read_per_group_is_the_pool_counted_per_gpu(lend: int, exclude: int) -> None:
    state = build_state(Layout(2, 2, 3, rollout_tp=2))
    trainer = [g.gpu_id for g in state.gpus if g.source is GpuSource.BASE_TRAIN]
    elastic = sorted({g.allocation_id for g in state.gpus if g.source is GpuSource.ELASTIC})
    lent, excluded = set(trainer[:lend]), set(elastic[:exclude])
    pool = rollout_pool(state, lent, excluded)
    expected = _counted(state, lent, excluded)
    assert sorted(g.gpu_id for g in pool) == sorted(expected) and len(pool) == len(expected)
    assert node_counts(pool) == Counter((g.gpu_type, g.node) for g in pool)
    in_pool = set(expected)
    for w in state.workers:
        assert pool.holds(state, w) == in_pool.issuperset(w.gpu_ids), w.worker_id
