"""Where a ``pearl bench sim`` run's CPU goes, per part, and what one event costs at least.

Runs ``bench_sim`` (``pearl bench sim``) with a ``time.perf_counter`` around the engine
calls, the routing, the rollout's bookkeeping (``pearl.sim.rollout.Rollout``: the ledger,
the observer) and the decisions, counts the turns (arrivals), and reports the rest (the
event loop and the run loop between the parts) as what is left. The timers add a little
to each part. Then it times the event loop alone (``pearl.sim.events.EventLoop``) with a
handler that does nothing but schedule the next event, 1,000 pending: the least an event
costs.

Usage::

    .venv/bin/python benchmarks/sim_breakdown.py [--gpus 256] [--sim-hours 0.25]
        [--engine-model fluid]

Prints JSON: seconds and shares per part, turns, CPU microseconds per turn (all, and
outside the engine), and microseconds per bare event.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from pearl.bench.simulator import bench_sim
from pearl.sim import engine as step_engine
from pearl.sim import fleet, fluid_engine, rollout, runner
from pearl.sim.events import EventLoop

_seconds: dict[str, float] = {}
_turns = [0]


def _timed(cls: type, name: str, part: str) -> None:
    inner: Callable[..., Any] = getattr(cls, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start_s = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            _seconds[part] = _seconds.get(part, 0.0) + time.perf_counter() - start_s

    setattr(cls, name, timed)


def _count_turns() -> None:
    inner = runner.Simulation._on_arrive

    def counted(self: runner.Simulation, ev: Any, now_s: float) -> Any:
        _turns[0] += 1
        return inner(self, ev, now_s)

    runner.Simulation._on_arrive = counted  # type: ignore[method-assign]


def bare_event_us(num_events: int = 1_000_000) -> float:
    """Microseconds of CPU per event of a loop whose handler only schedules the next."""
    loop: EventLoop[int] = EventLoop()
    for i in range(1000):
        loop.schedule(i * 1e-3, i, 0)
    left = [num_events]

    def handle(event: int, now_s: float) -> list[tuple[float, int, int]]:
        left[0] -= 1
        return [(now_s + 1.0, event, 0)] if left[0] > 0 else []

    start_s = time.process_time()
    loop.run(handle)
    return (time.process_time() - start_s) / (num_events + 999) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=256)
    parser.add_argument("--sim-hours", type=float, default=0.25)
    parser.add_argument("--engine-model", choices=("step", "fluid"), default="fluid")
    args = parser.parse_args()
    for engine_cls in (step_engine.EngineModel, fluid_engine.FluidEngineModel):
        _timed(engine_cls, "step", "engine")
        _timed(engine_cls, "submit", "engine")
    _timed(fleet.Fleet, "route", "routing")
    _timed(fleet.Fleet, "route_decode", "routing")
    # (not ``completed``, which ``finish`` calls, nor ``snapshot``, a decision's part)
    for name in ("start_group", "sent", "turn_generated", "finish_turn", "finish"):
        _timed(rollout.Rollout, name, "rollout")
    for name in ("take_batch", "updated"):
        _timed(rollout.Rollout, name, "rollout")
    _timed(runner.Simulation, "_on_decide", "decisions")
    _count_turns()
    result = bench_sim(args.gpus, args.sim_hours, args.engine_model)
    total_s = result["cpu_s"]
    parts = {k: round(v, 2) for k, v in sorted(_seconds.items())}
    parts["rest"] = round(total_s - sum(_seconds.values()), 2)
    turns = _turns[0]
    print(
        json.dumps(
            {
                "engine_model": args.engine_model,
                "gpus": result["gpus"],
                "sim_hours": args.sim_hours,
                "cpu_s": round(total_s, 2),
                "seconds": parts,
                "shares": {k: round(v / total_s, 3) for k, v in parts.items()},
                "turns": turns,
                "us_per_turn": round(total_s / turns * 1e6, 1),
                "us_per_turn_outside_engine": round(
                    (total_s - _seconds.get("engine", 0.0)) / turns * 1e6, 1
                ),
                "bare_event_us": round(bare_event_us(), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
