"""Benchmark of full ``decide()`` calls on a realistic state of N GPUs (8 per node).

The state: a quarter of the nodes train (the trainer waiting for its batch, so lending is
weighed), half serve base rollout colocated, a quarter are elastic; a rollout batch of
N/2 trajectories in progress. Each call folds an empty observation at a later time.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from pearl.core.config import PolicyConfig
from pearl.core.decide import decide
from pearl.core.observation import Observation, TrainerPhase, TrainerStatus
from pearl.io.documents import load_profile
from pearl.synth import Layout, build_state, build_workload


def bench_decide(num_gpus: int, repeats: int, profile_name: str, seed: int = 0) -> dict[str, Any]:
    profile = load_profile(profile_name)
    state = build_state(Layout.for_gpus(num_gpus))
    workload = build_workload(np.random.default_rng(seed), max(8, num_gpus // 2))
    obs = Observation(trainer=TrainerStatus(phase=TrainerPhase.WAITING), workload=workload)
    cfg = PolicyConfig()
    decide(state, obs, cfg, profile, 1.0)  # warm-up (imports, caches)
    times_ms = []
    for i in range(repeats):
        t0 = time.perf_counter()
        decide(state, obs, cfg, profile, 2.0 + i)
        times_ms.append((time.perf_counter() - t0) * 1e3)
    times_ms.sort()
    p99 = times_ms[min(len(times_ms) - 1, int(0.99 * len(times_ms)))]
    return {
        "gpus": len(state.gpus),
        "median_ms": round(statistics.median(times_ms), 3),
        "p99_ms": round(p99, 3),
        "repeats": repeats,
        "trajectories": workload.num_unfinished,
    }
