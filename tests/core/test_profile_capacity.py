"""Derived KV capacity: memory left after weights, over KV bytes per token and GPU."""

from __future__ import annotations

from pearl.io.documents import load_profile


def test_capacity_follows_memory_and_head_replication() -> None:
    profile = load_profile("qwen3-30b-a3b")  # 4 KV heads
    gpu, model = profile.gpus["h20"], profile.model
    for tp in (2, 4, 8):
        free_gb = tp * (gpu.memory_gb * gpu.gpu_memory_utilization - gpu.activation_reserve_gb)
        free_gb -= model.weights_gb
        replicas = 2 if tp == 8 else 1  # tp 8 over 4 KV heads: every head on two GPUs
        expected = int(free_gb * 1e9 / (model.kv_bytes_per_token * replicas))
        assert profile.kv_capacity_tokens("h20", tp) == expected


def test_unknown_engine_has_no_capacity() -> None:
    profile = load_profile("qwen3-8b")
    assert profile.kv_capacity_tokens("h100", 16) == 0
    assert profile.kv_capacity_tokens("tpu", 1) == 0
    assert profile.feasible_tps("tpu") == ()
