"""Test-only runtime profiles shared by the core and simulator tests (importable as
``testing_profiles``: pytest puts tests/ on the path, see pyproject.toml)."""

from __future__ import annotations

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


def make_profile(
    *,
    kv_transfer_gb_per_s: float = 25.0,
    kv_capacity_tokens: int | None = None,
    max_num_seqs: int = 256,
    prefill_c_s_per_token2: float = 1e-10,
    decode_per_ctx_token_s: float = 1e-8,
) -> RuntimeProfile:
    """A small two-GPU-type profile (predictor tests): an 8B-like model on h100 and a100,
    engines for tp 1 and 2. Coefficients are plausible round numbers, not measurements."""

    def engine(tp: int, speed: float) -> EngineProfile:
        # speed: relative throughput; tp 2 on h100 is the fastest engine.
        return EngineProfile(
            tp=tp,
            prefill=PrefillCoeffs(
                a_s=0.01, b_s_per_token=5e-5 / speed, c_s_per_token2=prefill_c_s_per_token2 / speed
            ),
            decode=DecodeCoeffs(
                small=DecodeRegime(
                    base_s=0.010 / speed,
                    per_seq_s=5e-5 / speed,
                    per_ctx_token_s=decode_per_ctx_token_s / speed,
                ),
                large=DecodeRegime(
                    base_s=0.008 / speed,
                    per_seq_s=8e-5 / speed,
                    per_ctx_token_s=decode_per_ctx_token_s / speed,
                ),
                large_batch_from=64,
            ),
            max_num_seqs=max_num_seqs,
            kv_capacity_tokens=None if kv_capacity_tokens is None else kv_capacity_tokens * tp,
        )

    def gpu(speed: float, bandwidth_gb_per_s: float) -> GpuProfile:
        return GpuProfile(
            memory_gb=80.0,
            kv_transfer_gb_per_s=bandwidth_gb_per_s,
            kv_transfer_intra_node_gb_per_s=300.0,
            engines=(engine(1, speed), engine(2, 1.8 * speed)),
        )

    return RuntimeProfile(
        model=ModelSpec(
            name="test-8b", num_layers=36, num_kv_heads=8, head_dim=128, weights_gb=16.0
        ),
        gpus={
            "h100": gpu(1.0, kv_transfer_gb_per_s),
            "a100": gpu(0.6, 0.5 * kv_transfer_gb_per_s),
        },
        costs=TransitionCosts(
            engine_cold_start_s=60.0,
            wake_s=5.0,
            sleep_s=3.0,
            role_switch_s=2.0,
            migrate_s=1.0,
            stop_s=5.0,
            weight_sync_s=10.0,
            trainer_offload_s=20.0,
            trainer_onload_s=20.0,
            train_step_s=120.0,
        ),
        workload=WorkloadDefaults(
            prompt_tokens=1024,
            output_tokens_per_turn=256,
            observation_tokens_per_turn=256,
            env_latency_s=2.0,
            turns_per_trajectory=4,
        ),
    )
