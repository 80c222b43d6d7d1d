"""Inputs for the oracle tests (a plain module): a toy profile whose costs are round
numbers, small scenarios on it, and hand-made trajectories; and the shipped scenarios,
cut short or varied (``variant``).

The toy engine (one GPU type ``toy``, tp 1): prefill costs nothing; a decode step lasts
0.01 s whatever its batch (at most 4 sequences) and context. So a trajectory of ``o``
output tokens and no tool has own time ``0.01 o`` s and work ``0.0025 o`` GPU-s (the
step's 0.01 GPU-s shared by 4), and the first engine is up after ``F = 2`` s (the
trainer's 1 s offload and a 1 s wake, cheaper than the 5 s cold start).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
from pearl.io.scenarios import load_scenario_and_profile
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


# --- the shipped scenarios and variants of them -------------------------------------------

SCENARIOS = Path(__file__).resolve().parents[2] / "benchmarks" / "scenarios"
SHIPPED = {"8b": "qwen3-8b", "30b": "qwen3-30b-a3b"}

LARGE_ELASTIC = {  # synthetic grants of 8 GPUs, about 4 open at once, up to 64
    "gpu_type": "h800",
    "arrivals_per_h": 12.0,
    "lifetime_median_s": 3000.0,
    "lifetime_sigma": 1.0,
    "gpus_per_allocation": 8,
    "max_gpus": 64,
}


def shipped(model: str, duration_s: float) -> tuple[Scenario, RuntimeProfile]:
    """A shipped scenario (``benchmarks/scenarios``), cut to ``duration_s``."""
    sc, prof = load_scenario_and_profile(SCENARIOS / f"{SHIPPED[model]}.yaml")
    return sc.model_copy(update={"duration_s": duration_s}), prof


def variant(
    model: str,
    *,
    duration_s: float,
    output_tokens_per_turn: float | None = None,
    env_latency_s: float | None = None,
    elastic: str = "none",
    batch: int = 64,
    **rollout: Any,
) -> tuple[Scenario, RuntimeProfile]:
    """A shipped scenario on one trainer and one rollout node with a batch of ``batch``:
    these workload means (None: the data's), elastic GPUs ``none`` or ``large``
    (``LARGE_ELASTIC``), and these rollout fields (group_size, batching, past_bound,
    max_in_flight)."""
    sc, prof = shipped(model, duration_s)
    doc = sc.model_dump()
    doc["cluster"]["trainer"]["nodes"] = doc["cluster"]["rollout"]["nodes"] = 1
    doc["rollout"].update(batch_trajectories=batch, **rollout)
    doc["rollout"]["workload"].update(
        output_tokens_per_turn=output_tokens_per_turn, env_latency_s=env_latency_s
    )
    el = doc["elastic"]
    el.update(trace=None, synthetic=None)
    if elastic == "large":
        el.update(source="synthetic", synthetic=LARGE_ELASTIC)
        doc["policy"]["elastic"].update(gpus_per_allocation=8, max_allocations=8)
    else:
        el["source"] = "none"
    return Scenario.model_validate(doc), prof
