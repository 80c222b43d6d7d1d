"""Batch-completion predictor: time until every unfinished trajectory of the batch ends.

A fluid aggregate model, not a per-request simulation (equations, assumptions and blind
spots in ``docs/predictor.md``):

1. A live trajectory repeats a turn cycle of time T(N) with N trajectories live:
   [wait | prefill + KV transfer | decode | env] (``turn_model``; the wait is the time
   beyond its own latency when capacity binds). Each unfinished trajectory becomes a
   position r_i in turns: its remaining turns R (queued: R; prefill: R less the wait and
   half the prefill; decode with k of o tokens out: R less wait, prefill and k/o of the
   decode; env, R counting the turns after it: R plus the rest of the env step), the
   parts converted to turns with the cycle when every trajectory is live. An env step
   past its mean, and trajectories with no turn after their env step, only enter the
   critical path.
2. All live trajectories advance at 1/T(N) turns per second. With r sorted, N is
   constant between finishes, so the fluid ODE solves exactly to
   ``sum_k (r_(k) - r_(k-1)) T(N_k)``; T(N_k) uses the mean turn-start context of the
   live trajectories (and its variance) at the segment's midpoint, growing o + obs a turn.
3. The last turn has no env step: each trajectory ends earlier by the env time the fluid
   added over its last turn (e where latency binds, nothing where capacity binds).
4. ``completion_s = max(fluid, critical path)``; the critical path is the longest
   remaining trajectory served alone (N = 1, batch 1, no contention).

``prepare`` does the per-workload work once (columns, sort, cumulative sums, segment
arrays); each configuration then costs one vectorised ``solve_cycle``. The sort uses
reference shares of an uncontended turn, so it does not depend on the configuration;
where a configuration's shares reorder positions (possible only between trajectories
whose remaining turns differ by a fraction of a turn), the inversion is flattened by a
running maximum instead of re-sorting.

Invariants (asserted by ``tests/core/test_predictor.py``): ``completion_s >=
critical_path_s >= 0`` and ``completion_s >= throughput_bound_s``; an empty workload
predicts 0 with bottleneck "none"; a configuration that cannot serve the workload
predicts ``inf``; one queued trajectory alone predicts
``turns * (prefill + o * step(1) + e) - e`` exactly; ``predict_many`` equals ``predict``
configuration by configuration.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import NDArray

from pearl.core.pd import PDConfig
from pearl.core.profile import RuntimeProfile
from pearl.core.turn_model import (
    BOUND_NAMES,
    Cycle,
    Segments,
    TurnShape,
    engine_groups,
    segments,
    solve_cycle,
)
from pearl.core.workload import TrajPhase, WorkloadSnapshot

F64 = NDArray[np.float64]
_PHASES = list(TrajPhase)
_PREFILL = _PHASES.index(TrajPhase.PREFILL)
_DECODE = _PHASES.index(TrajPhase.DECODE)
_ENV = _PHASES.index(TrajPhase.ENV)


@dataclass(frozen=True)
class PredictionBreakdown:
    """How the prediction came about. Means are weighted by the fluid time of segments."""

    critical_path_s: float  # longest remaining trajectory served alone (N = 1)
    fluid_s: float  # segment sum minus the final-env saving (before the critical-path floor)
    throughput_bound_s: float  # segment sum of the capacity bounds alone (zero latencies)
    final_env_saving_s: float  # time saved because the last turn has no env step
    cycle_time_s: float  # T with every trajectory live (the first segment)
    mean_decode_batch: float  # per-instance decode batch seen by a decoding sequence
    decode_slot_utilisation: float  # decode batch / decode slots (max_num_seqs or KV)
    prefill_utilisation: float  # busy share of the prefill(-capable) instances
    prefill_s_per_turn: float  # prefill latency of one turn
    decode_s_per_turn: float  # decode latency of one turn (colocated: incl. interference)
    kv_transfer_s_per_turn: float  # KV transfer latency of one turn (0 when colocated)
    prefix_hit_rate: float  # share of turns whose prefix is still in the KV cache
    env_share: float  # share of a turn cycle spent in the environment
    num_segments: int  # distinct remaining-work positions (segments of constant N)
    num_trajectories: int  # trajectories with turns left (the fluid's initial N)


_EMPTY = PredictionBreakdown(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)


@dataclass(frozen=True)
class Prediction:
    """Predicted completion of the unfinished batch under one PD configuration."""

    completion_s: float  # time until the batch completes; inf if the config cannot serve it
    bottleneck: str  # prefill, decode, kv_capacity, kv_transfer, latency, none, infeasible
    breakdown: PredictionBreakdown


@dataclass(frozen=True, eq=False)
class PreparedWorkload:
    """A workload reduced to segment arrays, shared by every configuration's prediction.

    Segments (index j, sorted by remaining work) group trajectories of identical position.
    """

    profile: RuntimeProfile
    turn: TurnShape
    num_trajectories: int
    env_tail_s: float  # longest env step of trajectories with no turn after it
    remaining_turns: F64  # R of each segment's trajectories
    # r = R + (coef_queue * wait + coef_prefill * (prefill + transfer) + coef_decode * decode
    #          + coef_env * e) / T, from the parts of a cycle of time T (see _offset_s).
    coef_queue: F64
    coef_prefill: F64
    coef_decode: F64
    coef_env: F64
    overrun_s: F64  # longest env time beyond e among the segment's trajectories
    # Inputs of the one solve_cycle call per configuration (colocated, disaggregated):
    # [segments | segments without env step (if e > 0) | each segment's longest alone].
    stacked: tuple[Segments, Segments]


def prepare(workload: WorkloadSnapshot, profile: RuntimeProfile) -> PreparedWorkload:
    """Do the per-workload part of the prediction once."""
    stats = workload.turn_stats(profile.workload)
    turn = TurnShape(
        stats.output_tokens_per_turn, stats.observation_tokens_per_turn, stats.env_latency_s
    )
    o, e = turn.output_tokens, turn.env_s
    cols = workload.arrays(profile.workload)
    in_env = cols.phase == _ENV
    ends_after_env = in_env & (cols.remaining_turns <= 0)
    env_tail_s = float(cols.env_remaining_s[ends_after_env].max(initial=0.0))
    keep = cols.remaining_turns > 0
    phase, turns, in_env = cols.phase[keep], cols.remaining_turns[keep], in_env[keep]
    ctx, out = cols.context_tokens[keep], cols.turn_output_tokens[keep]
    env_rest = cols.env_remaining_s[keep]

    coef_p = np.where(phase == _PREFILL, -0.5, np.where(phase == _DECODE, -1.0, 0.0))
    coef_d = np.where(phase == _DECODE, -np.minimum(out / o, 1.0), 0.0)
    coef_e = np.where(in_env & (e > 0), np.minimum(env_rest / max(e, 1e-300), 1.0), 0.0)
    overrun = np.where(in_env, np.maximum(env_rest - e, 0.0), 0.0)
    # Context at the start of the current (env: next) turn.
    ctx0 = np.where(phase == _DECODE, np.maximum(ctx - out, 0.0), ctx)
    ctx0 = np.where(in_env, ctx + turn.observation_tokens, ctx0)

    ref = _reference_shares(profile, turn, float(ctx0.mean()) if len(ctx0) else 0.0)
    r_ref = np.maximum(turns + coef_p * ref[0] + coef_d * ref[1] + coef_e * ref[2], 0.0)
    order = np.lexsort((coef_e, coef_d, coef_p, turns, r_ref))
    turns, coef_p, coef_d, coef_e = turns[order], coef_p[order], coef_d[order], coef_e[order]
    r_ref, ctx0, overrun = r_ref[order], ctx0[order], overrun[order]
    n = len(turns)
    keys = np.stack([turns, coef_p, coef_d, coef_e], axis=1)
    first = np.ones(n, dtype=bool)
    first[1:] = (keys[1:] != keys[:-1]).any(axis=1)  # a new position starts a segment
    starts = np.flatnonzero(first)
    num_live = (n - starts).astype(float)
    growth = turn.growth_tokens
    r_seg = r_ref[starts]
    mid = 0.5 * (np.concatenate([[0.0], r_seg[:-1]]) + r_seg)
    # Turn j of trajectory i covers progress [x_i + j, x_i + j + 1), x_i = r_i - R_i, with
    # context ctx0_i + j * growth: on average ctx0_i + growth * (x - x_i - 1/2) at x.
    ctx_at_0 = ctx0 - growth * (r_ref - turns)
    mean_at_0 = np.cumsum(ctx_at_0[::-1])[::-1][starts] / num_live
    mean_sq_at_0 = np.cumsum(ctx_at_0[::-1] ** 2)[::-1][starts] / num_live
    ctx_seg = mean_at_0 + growth * (mid - 0.5)
    # Spread across the live trajectories, and along the segment (uniform in progress).
    width = _steps(r_seg)
    var_seg = mean_sq_at_0 - mean_at_0**2 + (growth * width) ** 2 / 12
    # Alone, a trajectory's R turns start at ctx0 + j * growth, j = 0 .. R - 1.
    turns_seg = turns[starts]
    ctx_alone = np.maximum.reduceat(ctx0, starts) + growth * 0.5 * (turns_seg - 1) if n else ctx0
    var_alone = growth**2 * np.maximum(turns_seg**2 - 1, 0.0) / 12
    no_env = [num_live] if e > 0 else []
    num_live_all = np.concatenate([num_live, *no_env, np.ones(len(starts))])
    ctx_all = np.concatenate([ctx_seg, *(ctx_seg for _ in no_env), ctx_alone])
    var_all = np.concatenate([var_seg, *(var_seg for _ in no_env), var_alone])
    env_all = np.concatenate([np.full(len(starts), e), *(0 * x for x in no_env)])
    env_all = np.concatenate([env_all, np.full(len(starts), e)])
    return PreparedWorkload(
        profile=profile,
        turn=turn,
        num_trajectories=n,
        env_tail_s=env_tail_s,
        remaining_turns=turns[starts],
        coef_queue=-(coef_p[starts] < 0).astype(float),
        coef_prefill=coef_p[starts],
        coef_decode=coef_d[starts],
        coef_env=coef_e[starts],
        overrun_s=np.maximum.reduceat(overrun, starts) if n else np.zeros(0),
        stacked=(
            segments(turn, num_live_all, ctx_all, var_all, env_all, disaggregated=False),
            segments(turn, num_live_all, ctx_all, var_all, env_all, disaggregated=True),
        ),
    )


def predict_prepared(w: PreparedWorkload, config: PDConfig) -> Prediction:
    """Predict one configuration for a prepared workload."""
    if w.num_trajectories == 0:
        bottleneck = "latency" if w.env_tail_s > 0 else "none"
        breakdown = _EMPTY if w.env_tail_s == 0 else _with_critical(w.env_tail_s)
        return Prediction(w.env_tail_s, bottleneck, breakdown)
    groups = engine_groups(config, w.profile)
    if groups is None:
        return Prediction(math.inf, "infeasible", _with_critical(math.inf))
    cyc = solve_cycle(groups, w.turn, w.stacked[groups.disaggregated])
    num_seg, e = len(w.remaining_turns), w.turn.env_s
    seg, alone = slice(0, num_seg), slice(-num_seg, None)
    cycle_s = cyc.cycle_s[seg]
    if not np.isfinite(cyc.cycle_s).all():  # some context fits no decode instance
        return Prediction(math.inf, "kv_capacity", _with_critical(math.inf))

    # Positions in turns, from the parts of the cycle when every trajectory is live.
    r = np.maximum.accumulate(
        np.maximum(w.remaining_turns + _offset_s(w, cyc, seg) / cycle_s[0], 0.0)
    )
    with_env_s = float(_steps(r) @ cycle_s)
    if e > 0:
        r = _skip_last_env(r, cycle_s, cyc.cycle_s[num_seg : 2 * num_seg])
    dr = _steps(r)
    seg_s = dr * cycle_s
    fluid_s = float(seg_s.sum())
    saving_s = with_env_s - fluid_s

    critical = w.remaining_turns * cyc.cycle_s[alone] + _offset_s(w, cyc, alone) - e
    critical += w.overrun_s
    critical_s = max(float(critical.max()), w.env_tail_s, 0.0)

    if critical_s >= fluid_s:
        bottleneck = "latency"
    else:
        by_bound = np.bincount(cyc.bound[seg], weights=seg_s, minlength=len(BOUND_NAMES))
        bottleneck = BOUND_NAMES[int(by_bound.argmax())]
    weights = seg_s / fluid_s if fluid_s > 0 else np.full(num_seg, 1.0 / num_seg)
    per_segment = (
        cyc.decode_batch,
        cyc.decode_slot_use,
        cyc.prefill_use,
        cyc.prefill_s,
        cyc.decode_s,
        cyc.transfer_s,
        cyc.prefix_hit,
    )
    means = (np.stack(per_segment)[:, seg] @ weights).tolist()
    breakdown = PredictionBreakdown(
        critical_path_s=critical_s,
        fluid_s=fluid_s,
        throughput_bound_s=float(dr @ cyc.throughput_s[seg]),
        final_env_saving_s=saving_s,
        cycle_time_s=float(cycle_s[0]),
        mean_decode_batch=means[0],
        decode_slot_utilisation=means[1],
        prefill_utilisation=means[2],
        prefill_s_per_turn=means[3],
        decode_s_per_turn=means[4],
        kv_transfer_s_per_turn=means[5],
        prefix_hit_rate=means[6],
        env_share=float(weights @ (e / cycle_s)),
        num_segments=num_seg,
        num_trajectories=w.num_trajectories,
    )
    return Prediction(max(fluid_s, critical_s), bottleneck, breakdown)


def predict(workload: WorkloadSnapshot, config: PDConfig, profile: RuntimeProfile) -> Prediction:
    """Predicted time (s) until every unfinished trajectory completes under ``config``."""
    return predict_prepared(prepare(workload, profile), config)


def predict_many(
    workload: WorkloadSnapshot, configs: Sequence[PDConfig], profile: RuntimeProfile
) -> list[Prediction]:
    """``predict`` for each configuration, preparing the workload once."""
    prepared = prepare(workload, profile)
    return [predict_prepared(prepared, c) for c in configs]


def _steps(r: F64) -> F64:
    """Segment widths of sorted positions."""
    dr = r.copy()
    dr[1:] -= r[:-1]
    return dr


def _skip_last_env(r: F64, cycle_s: F64, no_env_cycle_s: F64) -> F64:
    """Positions moved earlier by the env time the fluid added over each last turn.

    Over progress [0, x] the env steps add F(x) = integral of (T - T_no_env): e a turn
    when latency binds, nothing when capacity binds. A trajectory ending at r has no env
    step in its last turn [r - 1, r], so it ends F(r) - F(r - 1) seconds earlier.
    """
    gap_s = np.maximum(cycle_s - no_env_cycle_s, 0.0)
    ends = np.concatenate([[0.0], r])
    added = np.concatenate([[0.0], np.cumsum(_steps(r) * gap_s)])
    start = r - 1.0  # before now, the first segment's gap continues backwards
    at_start = np.where(start >= 0.0, np.interp(start, ends, added), start * gap_s[0])
    skip = (added[1:] - at_start) / cycle_s
    return np.maximum.accumulate(np.maximum(r - np.minimum(skip, 1.0), 0.0))


def _offset_s(w: PreparedWorkload, cyc: Cycle, part: slice) -> F64:
    """Seconds of the current cycle already done (< 0) or still ahead in env (> 0).

    The cycle is [wait | prefill + transfer | decode | env]; the wait (time beyond the
    latency when capacity binds) is spent queued before the prefill.
    """
    e = w.turn.env_s
    own_s = cyc.prefill_s[part] + cyc.transfer_s[part]
    decode_s = cyc.decode_s[part]
    wait_s = cyc.cycle_s[part] - own_s - decode_s - e
    offset = w.coef_queue * wait_s + w.coef_prefill * own_s + w.coef_decode * decode_s
    return offset + w.coef_env * e


def _with_critical(critical_s: float) -> PredictionBreakdown:
    return replace(_EMPTY, critical_path_s=critical_s, fluid_s=critical_s)


def _reference_shares(
    profile: RuntimeProfile, turn: TurnShape, ctx_tokens: float
) -> tuple[float, float, float]:
    """Prefill, decode and env shares of one uncontended turn, averaged over engines.

    Only used to sort positions once per workload, independently of the configuration.
    """
    o, new = turn.output_tokens, min(turn.observation_tokens, ctx_tokens)
    prefix, decode_ctx = ctx_tokens - new, ctx_tokens + 0.5 * o
    prefill_s = decode_s = 0.0
    engines = [e for gpu in profile.gpus.values() for e in gpu.engines]
    for e in engines:
        p, d = e.prefill, e.decode
        prefill_s += p.a_s + new * (p.b_s_per_token + p.c_s_per_token2 * (2 * prefix + new))
        regime = d.small if d.large_batch_from > 1 else d.large
        decode_s += o * (regime.base_s + regime.per_seq_s + regime.per_ctx_token_s * decode_ctx)
    total = prefill_s + decode_s + turn.env_s * len(engines)
    if total <= 0:
        return (1 / 3, 1 / 3, 1 / 3)
    return (prefill_s / total, decode_s / total, turn.env_s * len(engines) / total)
