"""Speed of ``EngineModel.step()`` on a realistic decode-dominated load.

One colocated Qwen3-8B instance on an H20 serves 64 agentic trajectories: each turn has
a prompt of about 5,000 tokens (growing by the output and an observation per turn) and
about 260 output tokens; the next turn of a trajectory arrives an environment latency
after its previous one finished. The driver calls ``step(4096, bound)`` as the simulator
does, bounding each call by the next arrival, and submits arrivals as the clock reaches
them. All random draws come from a seeded generator made before the timed loop.

Usage::

    .venv/bin/python benchmarks/engine_speed.py [--calls N] [--module pearl.sim.engine]

``--module`` (with ``--path`` prepended to ``sys.path``) times another copy of the engine
module, e.g. a reference copy kept outside the repository. Prints JSON with the number of
calls, the wall time of the timed loop, microseconds per call and a digest of every
result (equal digests: equal results).
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import importlib
import json
import math
import sys
import time
from types import ModuleType

import numpy as np

from pearl.core.roles import Role
from pearl.io.documents import load_profile

MAX_STEPS_PER_CALL = 4096  # as pearl.sim.fleet calls it
NUM_TRAJECTORIES = 64
TURNS_PER_TRAJECTORY = 8


def run(module: ModuleType, calls: int, seed: int = 0) -> dict[str, float | int | str]:
    profile = load_profile("qwen3-8b")
    engine = module.EngineModel.from_profile(Role.COLOCATED, profile, "h20", 1)
    rng = np.random.default_rng(seed)
    # pre-drawn per-turn randomness (cycled), so the timed loop does little but step()
    draws = 1 << 14
    prompts = rng.integers(4000, 6000, draws).tolist()
    outputs = rng.integers(100, 420, draws).tolist()
    observations = rng.integers(50, 400, draws).tolist()
    latencies = rng.exponential(2.0, draws).tolist()

    arrivals: list[tuple[float, int, object]] = []  # (time, seq, Request)
    context: dict[str, int] = {}
    turn: dict[str, int] = {}
    owner: dict[str, str] = {}  # request id -> trajectory id
    counter = 0

    def new_request(traj: str, at_s: float) -> None:
        nonlocal counter
        k = counter % draws
        counter += 1
        if traj not in context or turn[traj] >= TURNS_PER_TRAJECTORY:
            traj = f"{traj.split('#')[0]}#{counter}"
            context[traj] = prompts[k]
            turn[traj] = 0
        rid = f"r{counter}"
        owner[rid] = traj
        turn[traj] += 1
        req = module.Request(rid, traj, context[traj], outputs[k])
        heapq.heappush(arrivals, (at_s, counter, req))

    for i in range(NUM_TRAJECTORIES):
        new_request(f"t{i}", latencies[i] * 0.5)

    results = []
    now_s = 0.0
    done = 0
    start = time.perf_counter()
    while done < calls:
        while arrivals and arrivals[0][0] <= now_s:
            _, _, req = heapq.heappop(arrivals)
            engine.submit(req)
        if not engine.has_work:
            now_s = arrivals[0][0]
            continue
        bound_s = arrivals[0][0] - now_s if arrivals else math.inf
        result = engine.step(MAX_STEPS_PER_CALL, max(bound_s, 0.0))
        done += 1
        results.append(result)
        for f in result.finished:
            r = f.request
            traj = owner.pop(r.request_id)
            k = counter % draws
            context[traj] = r.context_tokens + r.output_tokens + observations[k]
            new_request(traj, now_s + f.finish_offset_s + latencies[k])
        now_s += result.duration_s
    wall_s = time.perf_counter() - start
    digest = hashlib.sha256(repr(results).encode())
    return {
        "calls": calls,
        "wall_s": round(wall_s, 4),
        "us_per_call": round(wall_s / calls * 1e6, 2),
        "sim_s": round(now_s, 3),
        "digest": digest.hexdigest()[:16],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30_000)
    parser.add_argument("--module", default="pearl.sim.engine")
    parser.add_argument("--path", default=None, help="prepended to sys.path")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.path:
        sys.path.insert(0, args.path)
    module = importlib.import_module(args.module)
    print(json.dumps(run(module, args.calls, args.seed)))


if __name__ == "__main__":
    main()
