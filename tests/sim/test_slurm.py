"""The Slurm model: queueing delay, grants inside windows, FIFO, preemption, release."""

from __future__ import annotations

import numpy as np
import pytest

from pearl.sim.availability import Window
from pearl.sim.slurm import SlurmEvent, SlurmModel


def _slurm(
    windows: tuple[Window, ...],
    *,
    delay_s: float = 30.0,
    sigma: float = 0.0,
    grace_s: float = 60.0,
    seed: int = 0,
) -> SlurmModel:
    return SlurmModel.from_windows(
        windows,
        queue_delay_median_s=delay_s,
        queue_delay_sigma=sigma,
        grace_s=grace_s,
        rng=np.random.default_rng(seed),
    )


def _kinds(events: list[SlurmEvent]) -> list[tuple[float, str, str]]:
    return [(e.time_s, e.kind, e.allocation_id) for e in events]


def test_nodes_are_whole_windows_of_eight_gpus() -> None:
    s = _slurm((Window(0.0, 100.0, 16, "h800"), Window(50.0, 80.0, 8, "h20")))
    assert [(n.gpu_type, n.opens_s, n.closes_s) for n in s.nodes] == [
        ("h800", 0.0, 100.0),
        ("h800", 0.0, 100.0),
        ("h20", 50.0, 80.0),
    ]
    assert len({n.name for n in s.nodes}) == 3
    assert s.wakeups() == [0.0, 50.0]


def test_grant_only_after_the_queue_delay() -> None:
    s = _slurm((Window(0.0, 1000.0, 8, "h800"),), delay_s=30.0)
    assert s.submit(10.0, "a", "h800", 8) == 40.0  # sigma 0: the median exactly
    assert s.schedule(39.999) == []
    assert s.jobs["a"].status == "pending"
    assert _kinds(s.schedule(40.0)) == [
        (40.0, "granted", "a"),
        (940.0, "preempting", "a"),
        (1000.0, "ended", "a"),
    ]
    assert s.jobs["a"].status == "granted"


def test_grant_only_inside_a_window_of_its_gpu_type() -> None:
    s = _slurm((Window(100.0, 500.0, 8, "h800"), Window(0.0, 500.0, 8, "h20")), delay_s=5.0)
    s.submit(0.0, "a", "h800", 8)
    assert s.schedule(5.0) == []  # eligible, but no h800 node is open yet (the h20 is)
    assert s.schedule(99.0) == []
    granted = s.schedule(100.0)
    assert _kinds(granted)[0] == (100.0, "granted", "a")
    assert [n.gpu_type for n in s.jobs["a"].nodes] == ["h800"]


def test_no_grant_after_the_window_closed() -> None:
    s = _slurm((Window(0.0, 50.0, 8, "h800"),), delay_s=60.0)
    s.submit(0.0, "a", "h800", 8)
    assert s.schedule(60.0) == []
    assert s.jobs["a"].status == "pending"


def test_a_request_larger_than_the_open_nodes_waits() -> None:
    s = _slurm((Window(0.0, 1000.0, 8, "h800"), Window(200.0, 1000.0, 8, "h800")), delay_s=1.0)
    s.submit(0.0, "a", "h800", 16)
    assert s.schedule(1.0) == []
    assert _kinds(s.schedule(200.0))[0] == (200.0, "granted", "a")
    assert len(s.jobs["a"].nodes) == 2


def test_fifo_without_overtaking() -> None:
    s = _slurm((Window(0.0, 1000.0, 8, "h800"),), delay_s=10.0)
    s.submit(0.0, "big", "h800", 16)  # can never fit on one node
    s.submit(1.0, "small", "h800", 8)  # would fit, but is behind "big"
    assert s.schedule(20.0) == []
    assert s.jobs["small"].status == "pending"


def test_fifo_order_of_grants() -> None:
    s = _slurm((Window(0.0, 1000.0, 8, "h800"),), delay_s=10.0)
    s.submit(5.0, "second", "h800", 8)
    s.submit(0.0, "first", "h800", 8)
    assert [e.allocation_id for e in s.schedule(20.0) if e.kind == "granted"] == ["first"]
    assert s.jobs["second"].status == "pending"


def test_release_frees_the_node_for_the_next_request() -> None:
    s = _slurm((Window(0.0, 1000.0, 8, "h800"),), delay_s=10.0)
    s.submit(0.0, "a", "h800", 8)
    s.submit(0.0, "b", "h800", 8)
    assert [e.allocation_id for e in s.schedule(10.0) if e.kind == "granted"] == ["a"]
    assert s.schedule(50.0) == []  # the node is busy
    s.release("a")
    assert s.jobs["a"].status == "ended"
    granted = s.schedule(60.0)
    assert _kinds(granted)[0] == (60.0, "granted", "b")
    assert s.jobs["b"].nodes == s.jobs["a"].nodes
    s.release("a")  # releasing twice changes nothing
    assert s.jobs["b"].status == "granted"


def test_the_end_of_an_allocation_frees_its_nodes() -> None:
    s = _slurm((Window(0.0, 100.0, 8, "h800"), Window(0.0, 1000.0, 8, "h800")), delay_s=1.0)
    s.submit(0.0, "a", "h800", 8)
    s.submit(0.0, "b", "h800", 8)
    s.submit(0.0, "c", "h800", 8)
    events = s.schedule(1.0)
    granted = [e.allocation_id for e in events if e.kind == "granted"]
    assert granted == ["a", "b"]
    # the longest-lived node goes first: "a" gets the node open until 1000 s
    assert s.jobs["a"].ends_s == 1000.0 and s.jobs["b"].ends_s == 100.0
    for ev in events:
        if ev.allocation_id == "b":
            assert s.apply(ev)
    assert s.jobs["b"].status == "ended"
    assert s.schedule(100.0) == []  # b's node closed at 100 s: nothing to grant on it
    # after a's end its node is free again for c
    for ev in events:
        if ev.allocation_id == "a":
            s.apply(ev)
    assert _kinds(s.schedule(999.0))[0] == (999.0, "granted", "c")


@pytest.mark.parametrize(
    ("grant_s", "grace_s", "warn_s"), [(0.0, 60.0, 940.0), (980.0, 60.0, 980.0)]
)
def test_preempting_grace_before_the_end_or_at_the_grant(
    grant_s: float, grace_s: float, warn_s: float
) -> None:
    s = _slurm((Window(0.0, 1000.0, 8, "h800"),), delay_s=1.0, grace_s=grace_s)
    s.submit(grant_s - 1.0 if grant_s else 0.0, "a", "h800", 8)
    events = s.schedule(max(grant_s, 1.0))
    by_kind = {e.kind: e.time_s for e in events}
    assert by_kind["preempting"] == warn_s
    assert by_kind["ended"] == 1000.0
    assert by_kind["ended"] - by_kind["preempting"] == min(grace_s, 1000.0 - by_kind["granted"])


def test_an_allocation_ends_with_its_earliest_node() -> None:
    s = _slurm((Window(0.0, 300.0, 8, "h800"), Window(0.0, 700.0, 8, "h800")), grace_s=10.0)
    s.submit(0.0, "a", "h800", 16)
    by_kind = {e.kind: e.time_s for e in s.schedule(30.0)}
    assert by_kind == {"granted": 30.0, "preempting": 290.0, "ended": 300.0}


def test_apply_moves_the_status_and_ignores_stale_events() -> None:
    s = _slurm((Window(0.0, 1000.0, 8, "h800"),), delay_s=1.0)
    s.submit(0.0, "a", "h800", 8)
    granted, warn, end = s.schedule(1.0)
    assert s.apply(granted) and s.jobs["a"].status == "granted"
    assert s.apply(warn) and s.jobs["a"].status == "preempting"
    s.release("a")
    assert not s.apply(end)  # released before its end: the end is stale
    assert s.jobs["a"].status == "ended"


def test_a_node_belongs_to_one_live_allocation() -> None:
    s = _slurm((Window(0.0, 1000.0, 24, "h800"),), delay_s=1.0)
    for i in range(5):
        s.submit(float(i), f"j{i}", "h800", 8)
    s.schedule(10.0)
    live = [j for j in s.jobs.values() if j.status == "granted"]
    assert len(live) == 3
    names = [n.name for j in live for n in j.nodes]
    assert len(names) == len(set(names)) == 3


def _eligible_times(seed: int) -> list[float]:
    s = _slurm((Window(0.0, 1000.0, 8, "h800"),), delay_s=30.0, sigma=1.2, seed=seed)
    return [s.submit(float(i), f"j{i}", "h800", 8) for i in range(20)]


def test_queue_delays_are_deterministic_for_a_seed() -> None:
    a, b = _eligible_times(7), _eligible_times(7)
    assert a == b
    assert a != _eligible_times(8)
    delays = [t - i for i, t in enumerate(a)]
    assert all(d > 0 for d in delays) and len(set(delays)) == len(delays)  # lognormal spread
