"""The event loop's order is total and deterministic."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pytest

from pearl.sim.events import EventLoop


def _trace(loop: EventLoop[str], follow: dict[str, list[tuple[float, str, int]]]) -> list[str]:
    seen: list[str] = []

    def handle(event: str, now_s: float) -> Iterable[tuple[float, str, int]]:
        seen.append(f"{now_s:g}:{event}")
        return [(now_s + dt, ev, pr) for dt, ev, pr in follow.get(event, [])]

    loop.run(handle)
    return seen


def test_same_time_ties_break_by_priority_then_scheduling_order() -> None:
    loop: EventLoop[str] = EventLoop()
    loop.schedule(5.0, "decide", priority=1)
    loop.schedule(5.0, "finish-a", priority=0)
    loop.schedule(5.0, "finish-b", priority=0)
    loop.schedule(1.0, "start")
    assert _trace(loop, {}) == ["1:start", "5:finish-a", "5:finish-b", "5:decide"]


def test_follow_ups_are_scheduled_and_the_clock_moves_forward() -> None:
    loop: EventLoop[str] = EventLoop()
    loop.schedule(0.0, "a")
    follow = {"a": [(2.0, "b", 0), (1.0, "c", 0)], "c": [(0.0, "d", 0)]}
    assert _trace(loop, follow) == ["0:a", "1:c", "1:d", "2:b"]
    assert loop.now_s == 2.0 and loop.num_processed == 4 and len(loop) == 0


def test_run_until_leaves_later_events_queued() -> None:
    loop: EventLoop[str] = EventLoop()
    for t in (1.0, 2.0, 3.0):
        loop.schedule(t, f"e{t:g}")
    seen: list[str] = []
    loop.run(lambda ev, now: seen.append(ev) or [], until_s=2.0)
    assert seen == ["e1", "e2"] and loop.peek_time_s() == 3.0 and loop.now_s == 2.0


def test_the_past_is_refused() -> None:
    loop: EventLoop[str] = EventLoop(start_s=10.0)
    with pytest.raises(ValueError, match="in the past"):
        loop.schedule(9.0, "late")


def _random_run(seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    loop: EventLoop[int] = EventLoop()
    for i in range(50):
        loop.schedule(float(rng.integers(0, 5)), i, priority=int(rng.integers(0, 2)))
    seen: list[str] = []

    def handle(event: int, now_s: float) -> Iterable[tuple[float, int, int]]:
        seen.append(f"{now_s:g}:{event}")
        if event < 200:
            return [(now_s + float(rng.integers(0, 3)), event + 100, int(rng.integers(0, 2)))]
        return []

    loop.run(handle)
    return seen


def test_same_seed_same_run_bit_for_bit() -> None:
    assert _random_run(3) == _random_run(3)
    assert _random_run(3) != _random_run(4)


def test_every_simulator_event_has_its_priority_and_a_handler() -> None:
    """The priorities and control flags of the run's events, as they were when events were
    tuples (pearl.sim.timeline); a new event needs a handler in the runner."""
    import sim_fixtures as F

    from pearl.sim.baselines import make_policy
    from pearl.sim.runner import Simulation
    from pearl.sim.timeline import SimEvent

    events = {e.__name__: (e.PRIORITY, e.CONTROL) for e in SimEvent.__subclasses__()}
    assert events == {
        "StepEnds": (0, False),
        "Kick": (0, False),
        "StartTrajectories": (1, False),
        "Arrive": (1, False),
        "SlurmChange": (2, True),
        "Eligible": (2, False),
        "PlanStepStarts": (3, True),
        "PlanStepEnds": (3, True),
        "Unpark": (4, False),
        "TrainDone": (4, True),
        "Decide": (5, True),
    }
    sc = F.scenario()
    sim = Simulation(F.inputs(sc), make_policy("pearl", sc.policy, sc.cluster.trainer.nodes))
    # by name: dataclass(slots=True) replaces each class, its first version stays a subclass
    assert {e.__name__ for e in sim.handlers} == set(events)
