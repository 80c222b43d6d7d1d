"""The rollout pool read per group equals the pool counted GPU by GPU (and engine by engine)."""

from __future__ import annotations

from collections import Counter
from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pearl.bench.synth import Layout, build_state
from pearl.core.pool import node_counts, rollout_pool
from pearl.core.roles import GpuSource, Phase, Role, WorkerKind
from pearl.core.state import AllocationStatus, ClusterState, Gpu, Worker
from pearl.core.transition_cost import inventory_where, pool_inventory


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


_PHASES = list(Phase)


def _varied_state(data: st.DataObject) -> ClusterState:
    """Engines in every phase and weights version, and one spanning two groups."""
    tp = data.draw(st.sampled_from([1, 2]))
    base = build_state(Layout(2, 2, 3, rollout_tp=tp))
    workers = [
        w.model_copy(
            update={
                "phase": data.draw(st.sampled_from(_PHASES)),
                "weights_version": data.draw(st.integers(0, 2)),
            }
        )
        if w.kind is WorkerKind.ENGINE
        else w
        for w in base.workers
    ]
    mixed = [
        Gpu(gpu_id="mix/0", node="mix", gpu_type="h100", source=GpuSource.BASE_ROLLOUT,
            allocation_id="base"),
        Gpu(gpu_id="mix/1", node="mix", gpu_type="h100", source=GpuSource.ELASTIC,
            allocation_id="el0000"),
    ]  # fmt: skip
    spanning = Worker(
        worker_id="e-mix",
        kind=WorkerKind.ENGINE,
        node="mix",
        gpu_ids=("mix/0", "mix/1"),
        role=Role.COLOCATED,
        phase=Phase.READY,
    )
    return base.replace(
        gpus=(*base.gpus, *mixed),
        workers=(*workers, spanning),
        policy_version=data.draw(st.integers(0, 2)),
    )


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_pool_reads_per_group_equal_engine_by_engine(data: st.DataObject) -> None:
    """The pool's inventory and its hold on the active engines, read per group of
    engines, equal the same asked engine by engine (an engine spanning two groups too)."""
    state = _varied_state(data)
    trainer = list(state.base_train_gpu_ids)
    elastic = sorted({g.allocation_id for g in state.gpus if g.source is GpuSource.ELASTIC})
    lend = data.draw(st.sampled_from([0, 1, 3, 8, len(trainer)]))
    exclude = data.draw(st.integers(0, 2))
    pool = rollout_pool(state, trainer[:lend], elastic[:exclude])
    for lending in (False, True):
        per_engine = inventory_where(state, partial(pool.holds, state), lending)
        assert pool_inventory(state, pool, lending) == per_engine
    every = all(pool.holds(state, w) for w in state.active_engines)
    assert pool.holds_active_engines(state) == every


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_state_indexes_equal_their_definitions(data: st.DataObject) -> None:
    """The state's indexes derived from one another equal their plain definitions."""
    state = _varied_state(data)
    engines = [w for w in state.workers if w.kind is WorkerKind.ENGINE]
    assert state.active_engines == tuple(w for w in engines if w.active)
    assert state.trainers == tuple(w for w in state.workers if w.kind is WorkerKind.TRAINER)
    on = state.gpu_by_id
    for name, holds in (("allocations_hosting_active", True), ("allocations_hosting_live", False)):
        hosting = {
            on[g].allocation_id
            for w in state.workers
            if (w.active if holds else w.live)
            for g in w.gpu_ids
        }
        assert getattr(state, name) == hosting
    serving: Counter[tuple[Role, str, int]] = Counter()
    for w in engines:
        if w.live and w.role is not Role.IDLE and w.phase not in (Phase.DRAINING, Phase.STOPPING):
            serving[(w.role, on[w.gpu_ids[0]].gpu_type, w.tp)] += 1
    assert state.serving_engine_counts == dict(serving)
