"""Runtime profiles: how long things take for one model on each GPU type.

A profile holds, per GPU type and tensor-parallel degree, the cost model of one engine
instance, plus the transition costs the policies weigh. Numbers come from shipped YAML
files (``pearl/profiles/``, each number with its public source) or from
``pearl.core.fitting.fit_engine_profile`` over measurements.

Cost model (documented in ``docs/predictor.md``):
- prefill of a batch of sequences with new-token counts n_i, of which the i-th also
  attends to a cached prefix of p_i tokens:
  ``a + b * sum(n_i) + c * sum((p_i + n_i)**2 - p_i**2)``; with no prefix this is the
  familiar ``a + b*sum(n) + c*sum(n**2)``.
- one decode step of a batch of B sequences holding K context tokens in total, in two
  regimes as DistServe fits them (memory-bound small batches, compute-bound large ones):
  ``base_s + per_seq_s * B + per_ctx_token_s * K`` with the regime's coefficients,
  the large regime from ``large_batch_from`` sequences on.
- KV bytes per token ``2 * layers * kv_heads * head_dim * dtype_bytes`` (K and V). With
  more GPUs than KV heads, vLLM replicates each KV head on ``tp / kv_heads`` GPUs, so an
  instance's derived KV capacity shrinks by that factor.

Invariants: every coefficient is non-negative; every engine's tp is a power of two; the
KV capacity of an instance is positive or the (gpu type, tp) pair is infeasible.
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray
from pydantic import Field, model_validator

from pearl.core.limits import MAX_GPUS_PER_NODE
from pearl.core.limits import NonNegFloat as NonNeg
from pearl.core.limits import PositiveFloat as Pos
from pearl.core.limits import PositiveInt as PosInt
from pearl.core.state import Frozen


class ModelSpec(Frozen):
    name: str = Field(description="Model name, e.g. Qwen3-8B.")
    num_layers: PosInt = Field(description="Transformer layers (config.json num_hidden_layers).")
    num_kv_heads: PosInt = Field(description="KV heads (config.json num_key_value_heads).")
    head_dim: PosInt = Field(description="Head dimension (config.json head_dim).")
    kv_dtype_bytes: PosInt = Field(2, description="Bytes per KV element (2 for bf16).")
    weights_gb: Pos = Field(description="Weights in GB (1e9 bytes) in the serving dtype.")

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes


class PrefillCoeffs(Frozen):
    a_s: NonNeg = Field(description="Fixed cost of one prefill batch (s).")
    b_s_per_token: NonNeg = Field(description="Cost per new token (s).")
    c_s_per_token2: NonNeg = Field(description="Attention cost per token pair (s).")

    def batch_s(self, new_tokens: ArrayLike, prefix_tokens: ArrayLike = 0) -> float:
        """Time of one prefill batch (see the module docstring)."""
        n = np.asarray(new_tokens, dtype=float)
        p = np.asarray(prefix_tokens, dtype=float)
        quad = (p + n) ** 2 - p**2
        return float(self.a_s + self.b_s_per_token * n.sum() + self.c_s_per_token2 * quad.sum())

    def work_s(self, new_tokens: ArrayLike, prefix_tokens: ArrayLike = 0) -> NDArray[np.float64]:
        """Per-sequence share of prefill time when batched (the fixed cost excluded)."""
        n = np.asarray(new_tokens, dtype=float)
        p = np.asarray(prefix_tokens, dtype=float)
        work = self.b_s_per_token * n + self.c_s_per_token2 * ((p + n) ** 2 - p**2)
        return np.asarray(work, dtype=np.float64)


class DecodeRegime(Frozen):
    base_s: NonNeg = Field(description="Fixed cost of one decode step (s).")
    per_seq_s: NonNeg = Field(description="Cost per sequence in the batch (s).")
    per_ctx_token_s: NonNeg = Field(description="Cost per context token held by the batch (s).")


class DecodeCoeffs(Frozen):
    small: DecodeRegime = Field(description="Memory-bound regime, batches below the threshold.")
    large: DecodeRegime = Field(description="Compute-bound regime, from the threshold on.")
    large_batch_from: PosInt = Field(description="Batch size where the large regime starts.")

    def step_s(self, batch: ArrayLike, ctx_tokens: ArrayLike) -> NDArray[np.float64]:
        """Decode step time for batch sizes and total context tokens (vectorised)."""
        b = np.asarray(batch, dtype=float)
        k = np.asarray(ctx_tokens, dtype=float)
        s, g = self.small, self.large
        small = s.base_s + s.per_seq_s * b + s.per_ctx_token_s * k
        large = g.base_s + g.per_seq_s * b + g.per_ctx_token_s * k
        return np.where(b < self.large_batch_from, small, large)


class EngineProfile(Frozen):
    tp: Annotated[int, Field(ge=1, le=MAX_GPUS_PER_NODE)] = Field(
        description="Tensor-parallel degree (GPUs per instance)."
    )
    prefill: PrefillCoeffs
    decode: DecodeCoeffs
    max_num_seqs: PosInt = Field(256, description="Most sequences decoded at once (vLLM).")
    max_batched_tokens: PosInt = Field(
        8192, description="Token budget of one scheduler step (vLLM max_num_batched_tokens)."
    )
    kv_capacity_tokens: PosInt | None = Field(
        None, description="KV-cache capacity; derived from memory when absent."
    )

    @model_validator(mode="after")
    def _power_of_two(self) -> EngineProfile:
        if self.tp & (self.tp - 1):
            raise ValueError(f"tp: {self.tp} is not a power of two")
        return self


class GpuProfile(Frozen):
    memory_gb: Pos = Field(description="HBM per GPU in GB.")
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = Field(
        0.9, description="Share of HBM the engine may use (vLLM gpu_memory_utilization)."
    )
    activation_reserve_gb: NonNeg = Field(
        4.0, description="Per-GPU memory kept for activations and CUDA graphs."
    )
    kv_transfer_gb_per_s: Pos = Field(
        description="Effective KV transfer bandwidth between nodes per GPU (GB/s)."
    )
    kv_transfer_intra_node_gb_per_s: Pos = Field(
        description="Effective KV transfer bandwidth within a node (NVLink) per GPU (GB/s)."
    )
    engines: tuple[EngineProfile, ...] = Field(min_length=1, description="One entry per tp.")

    @model_validator(mode="after")
    def _unique_tp(self) -> GpuProfile:
        tps = [e.tp for e in self.engines]
        if len(set(tps)) != len(tps):
            raise ValueError(f"engines: duplicate tp in {tps}")
        return self


class TransitionCosts(Frozen):
    engine_cold_start_s: NonNeg = Field(description="Start an engine and load its weights.")
    wake_s: NonNeg = Field(description="Wake an engine from sleep (vLLM sleep mode level 1).")
    sleep_s: NonNeg = Field(description="Put an engine to sleep.")
    role_switch_s: NonNeg = Field(description="Switch the PD role of a drained instance.")
    migrate_s: NonNeg = Field(description="Abort in-flight requests and hand them elsewhere.")
    stop_s: NonNeg = Field(description="Stop an engine process.")
    weight_sync_s: NonNeg = Field(description="Load new weights after a training step.")
    trainer_offload_s: NonNeg = Field(description="Offload trainer state to host memory.")
    trainer_onload_s: NonNeg = Field(description="Bring trainer state back onto the GPUs.")
    train_step_s: NonNeg = Field(description="One training step on the base trainer.")


class WorkloadDefaults(Frozen):
    """Per-turn expectations used when the observed run has none yet."""

    prompt_tokens: Pos = Field(description="Mean tokens of the initial prompt.")
    output_tokens_per_turn: Pos = Field(description="Mean generated tokens per turn.")
    observation_tokens_per_turn: NonNeg = Field(description="Mean tokens appended by the env.")
    env_latency_s: NonNeg = Field(description="Mean environment (tool) latency per turn.")
    turns_per_trajectory: Pos = Field(description="Mean turns of one trajectory.")


class RuntimeProfile(Frozen):
    schema_version: Literal[1] = 1
    model: ModelSpec
    gpus: dict[str, GpuProfile] = Field(min_length=1, description="Per GPU type.")
    costs: TransitionCosts
    workload: WorkloadDefaults

    def engine(self, gpu_type: str, tp: int) -> EngineProfile | None:
        gpu = self.gpus.get(gpu_type)
        if gpu is None:
            return None
        return next((e for e in gpu.engines if e.tp == tp), None)

    def kv_capacity_tokens(self, gpu_type: str, tp: int) -> int:
        """KV tokens one instance can hold; 0 when the weights do not fit."""
        eng = self.engine(gpu_type, tp)
        if eng is None:
            return 0
        if eng.kv_capacity_tokens is not None:
            return eng.kv_capacity_tokens
        gpu = self.gpus[gpu_type]
        free_gb = tp * (gpu.memory_gb * gpu.gpu_memory_utilization - gpu.activation_reserve_gb)
        free_gb -= self.model.weights_gb
        replicas = max(1, tp // self.model.num_kv_heads)  # KV heads copied beyond tp > heads
        return max(0, int(free_gb * 1e9 / (self.model.kv_bytes_per_token * replicas)))

    def feasible_tps(self, gpu_type: str) -> tuple[int, ...]:
        gpu = self.gpus.get(gpu_type)
        if gpu is None:
            return ()
        return tuple(sorted(e.tp for e in gpu.engines if self.kv_capacity_tokens(gpu_type, e.tp)))
