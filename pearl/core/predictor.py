"""Batch-completion predictor: time until every unfinished trajectory of the batch ends.

A fluid, time-stepped aggregate model (equations and assumptions in ``docs/predictor.md``):

1. Each unfinished trajectory i becomes an amount of remaining work r_i in turn cycles
   (prefill, decode, env; see ``turn_model``). With ``R`` its remaining turns and
   ``s_p, s_d, s_e`` the prefill (+ KV transfer), decode and env shares of the cycle
   with every trajectory live:
   queued ``R``; prefill ``R - s_p/2``; decode with ``k`` of ``o`` tokens out
   ``R - s_p - min(k/o, 1) s_d``; env (``R`` = turns after the tool call)
   ``R + min(rest/e, 1) s_e``. An env step past its mean (rest > e) and trajectories
   with no turn left after their env step only enter the critical path.
2. All live trajectories advance at the same rate 1/T(N) turns per second, N live. With
   r sorted, N is constant between finishes, so the fluid ODE solves exactly to
   ``sum_k (r_(k) - r_(k-1)) T(N_k)``; T(N_k) uses the mean turn-start context of the
   live trajectories at the segment's midpoint progress, growing by ``o + obs`` a turn.
3. The longest trajectory's last turn has no env step: over the last ``e`` seconds of
   the fluid timeline, each segment saves ``(T - T_no_env) / e`` of its time.
4. ``completion_s = max(fluid, critical path)``, the critical path being the longest
   trajectory served alone (N = 1, batch 1, no contention).

Per-workload work (columns, sorting, cumulative sums, the segment arrays) is done once by
``prepare``; each configuration then costs one vectorised ``solve_cycle`` over all its
segments. The sort order is computed with reference shares from the profile, so it does
not depend on the configuration; a configuration's shares can reorder positions by at
most one turn, and such inversions are flattened (running maximum) rather than re-sorted.

Invariants (asserted by ``tests/core/test_predictor.py``): ``completion_s >=
critical_path_s >= 0``; an empty workload predicts 0 with bottleneck "none"; a
configuration that cannot serve the workload predicts ``inf``; one trajectory alone
predicts ``turns * (prefill + o * step(1) + e) - e``; ``predict_many`` equals ``predict``
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
# Positions under a configuration's shares differ from the reference ones by < 1 turn, so
# the last e seconds (at most one turn of progress, as T >= e) lie in this reference tail.
_TAIL_TURNS = 3.0


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
    tail: NDArray[np.intp]  # segments that may hold the last e seconds
    # Inputs of the one solve_cycle call per configuration (colocated, disaggregated):
    # [segments | tail segments without env | each segment's longest trajectory alone].
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
    first = np.ones(n, dtype=bool)
    first[1:] = (
        (np.diff(turns) != 0)
        | (np.diff(coef_p) != 0)
        | (np.diff(coef_d) != 0)
        | (np.diff(coef_e) != 0)
    )
    starts = np.flatnonzero(first)
    num_live = (n - starts).astype(float)
    growth = turn.growth_tokens
    r_seg = r_ref[starts]
    mid = 0.5 * (np.concatenate([[0.0], r_seg[:-1]]) + r_seg)
    # The turn covering progress x started at about x - 1/2 (exact for whole turns).
    ctx_seg = np.cumsum(ctx0[::-1])[::-1][starts] / num_live + growth * (mid - 0.5)
    ctx_alone = (
        np.maximum.reduceat(ctx0, starts) + growth * (0.5 * r_seg - 0.5) if n else np.zeros(0)
    )
    tail = np.flatnonzero(r_seg > r_seg[-1] - _TAIL_TURNS) if n and e > 0 else np.zeros(0, int)
    num_seg = len(starts)
    num_live_all = np.concatenate([num_live, num_live[tail], np.ones(num_seg)])
    ctx_all = np.concatenate([ctx_seg, ctx_seg[tail], ctx_alone])
    env_all = np.concatenate([np.full(num_seg, e), np.zeros(len(tail)), np.full(num_seg, e)])
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
        tail=tail,
        stacked=(
            segments(turn, num_live_all, ctx_all, env_all, disaggregated=False),
            segments(turn, num_live_all, ctx_all, env_all, disaggregated=True),
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
    num_seg, num_tail, e = len(w.remaining_turns), len(w.tail), w.turn.env_s
    seg, tail, alone = (
        slice(0, num_seg),
        slice(num_seg, num_seg + num_tail),
        slice(num_seg + num_tail, None),
    )
    cycle_s = cyc.cycle_s[seg]
    if not np.isfinite(cycle_s).all():  # some context fits no decode instance
        return Prediction(math.inf, "kv_capacity", _with_critical(math.inf))

    # Positions in turns, with the shares of the cycle when every trajectory is live.
    # Positions in turns, from the parts of the cycle when every trajectory is live.
    offset_s = _offset_s(w, cyc, seg)
    r = w.remaining_turns + offset_s / cycle_s[0]
    r = np.maximum.accumulate(np.maximum(r, 0.0))
    dr = r.copy()
    dr[1:] -= r[:-1]
    seg_s = dr * cycle_s
    total_s = float(seg_s.sum())

    saving_s = 0.0
    if num_tail:
        after_s = total_s - np.cumsum(seg_s)[w.tail]  # fluid time after each tail segment
        overlap_s = np.minimum(np.maximum(e - after_s, 0.0), seg_s[w.tail])
        saved = np.minimum(np.maximum(cycle_s[w.tail] - cyc.cycle_s[tail], 0.0) / e, 1.0)
        saving_s = float(overlap_s @ saved)
    fluid_s = total_s - saving_s

    critical = w.remaining_turns * cyc.cycle_s[alone] + _offset_s(w, cyc, alone) - e
    critical += w.overrun_s
    critical_s = max(float(critical.max()), w.env_tail_s, 0.0)

    if critical_s >= fluid_s:
        bottleneck = "latency"
    else:
        by_bound = np.bincount(cyc.bound[seg], weights=seg_s, minlength=len(BOUND_NAMES))
        bottleneck = BOUND_NAMES[int(by_bound.argmax())]
    weights = seg_s / total_s if total_s > 0 else np.full(num_seg, 1.0 / num_seg)
    per_segment = (
        cyc.decode_batch,
        cyc.decode_slot_use,
        cyc.prefill_use,
        cyc.prefill_s,
        cyc.decode_s,
        cyc.transfer_s,
        cyc.prefix_hit,
        cyc.throughput_s,
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
