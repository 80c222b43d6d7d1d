"""Benchmark of full ``decide()`` calls on a realistic state of N GPUs (8 per node).

The state: a quarter of the nodes train (the trainer waits for its batch, so lending is
weighed on every call), half serve base rollout, a quarter are elastic (at the request
cap); a rollout batch of N/2 trajectories in progress. Two figures:
- ``median_ms``/``p99_ms``: the steady state, the calls a coordinator makes on every tick
  once its plans are carried out (the state is first settled: decide and apply until a
  decision plans nothing);
- ``reconfigure_ms``: the median of ``RECONFIGURE_CALLS`` calls, each on a freshly built
  state (a state keeps the indexes a call builds, so each call needs its own), whose
  configuration is far from the best one, so the decision carries a full reconfiguration
  plan; ``reconfigure_min_ms`` the least of them. One call varies by tens of
  milliseconds from run to run at 8,192 GPUs.

Garbage is collected before each reconfiguration call: building its state leaves the
collector's counters where a full collection of everything the benchmark built (~50 ms at
8,192 GPUs) could fall inside the timed call or not, by the count of objects allocated
before it. The collections the calls' own allocations trigger are counted.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import numpy as np

from pearl.bench.synth import Layout, build_state, build_workload, settle
from pearl.core.config import PolicyConfig
from pearl.core.decide import decide
from pearl.core.observation import Observation, TrainerPhase, TrainerStatus
from pearl.io.documents import load_profile

RECONFIGURE_CALLS = 5


def bench_decide(num_gpus: int, repeats: int, profile_name: str, seed: int = 0) -> dict[str, Any]:
    profile = load_profile(profile_name)
    cfg = PolicyConfig()
    layout = Layout.for_gpus(num_gpus)
    workload = build_workload(np.random.default_rng(seed), max(8, num_gpus // 2))
    obs = Observation(trainer=TrainerStatus(phase=TrainerPhase.WAITING), workload=workload)
    reconfigure_ms = []
    for _ in range(RECONFIGURE_CALLS):
        fresh = build_state(layout)
        gc.collect()
        t0 = time.perf_counter()
        reconfigure = decide(fresh, obs, cfg, profile, 1.0)
        reconfigure_ms.append((time.perf_counter() - t0) * 1e3)
    state = settle(fresh, obs, cfg, profile, 2.0)
    times_ms = []
    for i in range(repeats):
        t0 = time.perf_counter()
        decide(state, obs, cfg, profile, 10.0 + i)
        times_ms.append((time.perf_counter() - t0) * 1e3)
    times_ms.sort()
    p99 = times_ms[min(len(times_ms) - 1, int(0.99 * len(times_ms)))]
    return {
        "gpus": len(fresh.gpus),
        "median_ms": round(statistics.median(times_ms), 3),
        "p99_ms": round(p99, 3),
        "reconfigure_ms": round(statistics.median(reconfigure_ms), 3),
        "reconfigure_min_ms": round(min(reconfigure_ms), 3),
        "reconfigure_plan_steps": len(reconfigure.plan.steps),
        "repeats": repeats,
        "trajectories": workload.num_unfinished,
    }
