"""An upper bound on the trajectories any policy can finish on the same inputs.

Every policy sees the same seeded trajectory stream (trajectory ``j`` is the same in
every run of a seed), the same GPUs and the same staleness rule. Two bounds, each on
the number of trajectories finished by the end of the run ``T``; the oracle is the
smaller:

1. **Critical path.** Trajectory ``j`` cannot finish before its batch may start plus its
   own shortest possible time: every tool latency (exact), every turn's prefill at the
   fastest engine of the profile with nothing else batched (``a + b n``, attention
   ignored) and every output token at the fastest decode step of any batch size with
   no context. Batches ``0..k`` start no earlier than the cheapest way to
   have an engine (a cold start, or the trainer's offload and a wake); batch ``b > k``
   starts no earlier than batch ``b - k - 1``'s bound plus one training step, since the
   update that consumes it must finish first. Every term is a lower bound of what any
   policy's run takes, so the count of ``j`` whose bound is at most ``T`` bounds the count
   finished.
2. **Capacity.** The trajectories finished need at least their work in GPU-seconds:
   prompt and observation tokens at the smallest prefill cost per token of any engine
   (``tp x b``) and output tokens at the smallest decode cost per token of any engine and
   batch size (``tp x step_s(B, 0) / B``). No policy has more GPU-seconds than every base
   GPU (the trainer's included, as if it never trained) and every elastic window's GPUs
   for the whole run; the bound counts the cheapest trajectories that fit.

Both bounds leave out costs every run pays (transitions, queueing, KV limits,
contention), so the oracle is loose by those; ``tests/sim/test_oracle.py`` checks that no
simulated policy exceeds it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from pearl.core.profile import EngineProfile, RuntimeProfile
from pearl.sim.availability import Window
from pearl.sim.scenario import Scenario
from pearl.sim.trajectories import TrajectorySpec


@dataclass(frozen=True)
class OracleBound:
    trajectories: int
    by_critical_path: int
    by_capacity: int
    capacity_gpu_s: float

    def throughput_traj_per_h(self, duration_s: float) -> float:
        return self.trajectories / (duration_s / 3600.0)


def _engines(profile: RuntimeProfile, gpu_types: set[str]) -> list[EngineProfile]:
    return [e for t in gpu_types if t in profile.gpus for e in profile.gpus[t].engines]


def oracle_bound(
    scenario: Scenario,
    profile: RuntimeProfile,
    windows: tuple[Window, ...],
    stream: Iterable[TrajectorySpec],
) -> OracleBound:
    """``stream``: the run's trajectories in order (read only as far as any run can start)."""
    T = scenario.duration_s
    c = scenario.cluster
    types = {c.trainer.gpu_type, c.rollout.gpu_type} | {w.gpu_type for w in windows}
    engines = _engines(profile, types)
    batch_sizes = np.arange(1, max(e.max_num_seqs for e in engines) + 1)
    # The fastest step of any batch size (a profile need not make it batch 1's).
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
    for j, spec in enumerate(stream):
        b = j // B
        if b == len(batch_start):
            start = first_engine_s if b <= k else batch_end[b - k - 1] + train_s
            if start > T:
                break
            batch_start.append(start)
            batch_end.append(start)
        specs.append(spec)
        done = batch_start[b] + own_s(spec)
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
    return OracleBound(min(by_path, by_capacity), by_path, by_capacity, gpu_s)
