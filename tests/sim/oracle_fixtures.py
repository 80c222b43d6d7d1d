"""Inputs for the oracle tests (a plain module): a toy profile whose costs are round
numbers, small scenarios on it, hand-made trajectories, and a frozen copy of the in-order
bound as it was before first-completed batching (``pearl/sim/oracle.py`` at 25fccb2), so
that a test can show the in-order bound unchanged bit for bit.

The toy engine (one GPU type ``toy``, tp 1): prefill costs nothing; a decode step lasts
0.01 s whatever its batch (at most 4 sequences) and context. So a trajectory of ``o``
output tokens and no tool has own time ``0.01 o`` s and work ``0.0025 o`` GPU-s (the
step's 0.01 GPU-s shared by 4), and the first engine is up after ``F = 2`` s (the
trainer's 1 s offload and a 1 s wake, cheaper than the 5 s cold start).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from pearl.core.profile import (
    DecodeCoeffs,
    DecodeRegime,
    EngineProfile,
    GpuProfile,
    ModelSpec,
    PrefillCoeffs,
    RuntimeProfile,
    TransitionCosts,
    WorkloadDefaults,
)
from pearl.sim.availability import Window
from pearl.sim.scenario import Scenario
from pearl.sim.trajectories import TrajectorySpec

FIRST_ENGINE_S = 2.0
STEP_S = 0.01  # one decode step of the toy engine
SEQS = 4  # the toy engine's max_num_seqs


def toy_profile() -> RuntimeProfile:
    step = DecodeRegime(base_s=STEP_S, per_seq_s=0.0, per_ctx_token_s=0.0)
    engine = EngineProfile(
        tp=1,
        prefill=PrefillCoeffs(a_s=0.0, b_s_per_token=0.0, c_s_per_token2=0.0),
        decode=DecodeCoeffs(small=step, large=step, large_batch_from=SEQS + 1),
        max_num_seqs=SEQS,
        kv_capacity_tokens=1_000_000,
    )
    return RuntimeProfile(
        model=ModelSpec(name="toy", num_layers=1, num_kv_heads=1, head_dim=8, weights_gb=1.0),
        gpus={
            "toy": GpuProfile(
                memory_gb=80.0,
                kv_transfer_gb_per_s=10.0,
                kv_transfer_intra_node_gb_per_s=100.0,
                engines=(engine,),
            )
        },
        costs=TransitionCosts(
            engine_cold_start_s=5.0,
            wake_s=1.0,
            sleep_s=1.0,
            role_switch_s=0.1,
            migrate_s=0.1,
            stop_s=1.0,
            weight_sync_s=0.5,
            trainer_offload_s=1.0,
            trainer_onload_s=1.0,
            train_step_s=10.0,
        ),
        workload=WorkloadDefaults(
            prompt_tokens=1,
            output_tokens_per_turn=100,
            observation_tokens_per_turn=0,
            env_latency_s=0.0,
            turns_per_trajectory=1,
        ),
    )


def toy_scenario(
    *, duration_s: float, batch: int, staleness: int, train_step_s: float = 10.0, **rollout: Any
) -> Scenario:
    """One toy trainer node and one toy rollout node (16 GPUs), no elastic GPUs;
    ``rollout``: more rollout fields (group_size, past_bound, max_in_flight, batching)."""
    return Scenario.model_validate(
        {
            "schema_version": 1,
            "name": "toy",
            "profile": "toy",
            "duration_s": duration_s,
            "cluster": {
                "trainer": {"nodes": 1, "gpu_type": "toy"},
                "rollout": {"nodes": 1, "gpu_type": "toy"},
            },
            "elastic": {"source": "none"},
            "rollout": {
                "batch_trajectories": batch,
                "staleness_versions": staleness,
                "max_context_tokens": 1_000_000,
                **rollout,
            },
            "training": {"train_step_s": train_step_s},
        }
    )


def spec(own_s: float) -> TrajectorySpec:
    """A one-turn trajectory of one prompt token whose own time on the toy engine is
    ``own_s`` (``100 own_s`` output tokens, no tool)."""
    return TrajectorySpec(1, (0,), (round(own_s / STEP_S),), ())


def reference_in_order_bound(
    scenario: Scenario,
    profile: RuntimeProfile,
    windows: tuple[Window, ...],
    stream: Iterable[TrajectorySpec],
) -> tuple[int, int, int, float]:
    """``oracle_bound`` of 25fccb2 (in-order semantics only), as (trajectories,
    by_critical_path, by_capacity, capacity_gpu_s). Frozen: do not edit."""
    T = scenario.duration_s
    c = scenario.cluster
    types = {c.trainer.gpu_type, c.rollout.gpu_type} | {w.gpu_type for w in windows}
    engines = [e for t in types if t in profile.gpus for e in profile.gpus[t].engines]
    batch_sizes = np.arange(1, max(e.max_num_seqs for e in engines) + 1)
    decode_token_s = min(
        float(np.min(e.decode.step_s(batch_sizes[: e.max_num_seqs], 0))) for e in engines
    )
    decode_gpu_s = min(
        float(
            np.min(
                e.tp
                * e.decode.step_s(batch_sizes[: e.max_num_seqs], 0)
                / batch_sizes[: e.max_num_seqs]
            )
        )
        for e in engines
    )
    prefill_gpu_s = min(e.tp * e.prefill.b_s_per_token for e in engines)
    costs = profile.costs
    first_engine_s = min(costs.engine_cold_start_s, costs.trainer_offload_s + costs.wake_s)
    step_s = scenario.training.train_step_s
    train_s = step_s if step_s is not None else costs.train_step_s
    B, k = scenario.rollout.batch_trajectories, scenario.rollout.staleness_versions

    def own_s(spec: TrajectorySpec) -> float:
        new = [spec.prompt_tokens, *spec.new_tokens[1:]]
        prefill = sum(
            min(e.prefill.a_s + e.prefill.b_s_per_token * n for e in engines) for n in new
        )
        return prefill + sum(spec.output_tokens) * decode_token_s + sum(spec.tool_latency_s)

    batch_start: list[float] = []
    batch_end: list[float] = []
    finish_bounds: list[float] = []
    specs: list[TrajectorySpec] = []
    for j, s in enumerate(stream):
        b = j // B
        if b == len(batch_start):
            start = first_engine_s if b <= k else batch_end[b - k - 1] + train_s
            if start > T:
                break
            batch_start.append(start)
            batch_end.append(start)
        specs.append(s)
        done = batch_start[b] + own_s(s)
        batch_end[b] = max(batch_end[b], done)
        finish_bounds.append(done)
    by_path = int(sum(1 for f in finish_bounds if f <= T))
    gpu_s = scenario.base_gpus * T + sum(
        w.num_gpus * (min(w.end_s, T) - max(w.start_s, 0.0)) for w in windows if w.start_s < T
    )
    work = np.sort(
        [
            prefill_gpu_s * (s.prompt_tokens + sum(s.new_tokens))
            + decode_gpu_s * sum(s.output_tokens)
            for s in specs
        ]
    )
    by_capacity = int(np.searchsorted(np.cumsum(work), gpu_s, side="right"))
    return min(by_path, by_capacity), by_path, by_capacity, gpu_s
