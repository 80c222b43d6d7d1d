"""Batch-completion predictor: time until every unfinished trajectory of the batch ends
(or, with ``next_batch``, until the trainer's next batch of groups is complete).

A fluid aggregate model, not a per-request simulation (equations, assumptions and blind
spots in ``docs/predictor.md``):

1. A live trajectory repeats a turn cycle of time T(N) with N trajectories live:
   [wait | prefill + KV transfer | decode | env] (``turn_model``; the wait is the time
   beyond its own latency when capacity binds). Each unfinished trajectory becomes a
   position r_i in turns: its remaining turns R (queued: R; prefill: R less the wait and
   half the prefill; decode with k of o tokens out: R less wait, prefill and k/o of the
   decode; env, R counting the turns after it: R plus the rest of the env step), the
   parts (those of the segment it ends in) converted to turns with the cycle when every
   trajectory is live. An env step past its mean, and trajectories with no turn after
   their env step, only enter the critical path.
2. All live trajectories advance at 1/T(N) turns per second. With r sorted, N is
   constant between finishes, so the fluid ODE solves exactly to
   ``sum_k (r_(k) - r_(k-1)) T(N_k)``; T(N_k) uses the mean turn-start context of the
   live trajectories (and its variance) at the segment's midpoint, growing o + obs a turn.
   Beyond ``max_segments`` distinct positions, adjacent ones are merged (``prepared``).
3. The last turn has no env step: each trajectory ends earlier by the env time the fluid
   added over its last turn (e where latency binds, nothing where capacity binds).
4. ``completion_s = max(fluid, critical path)``; the critical path is the longest
   remaining trajectory served alone (N = 1, batch 1, no contention), or, when the
   workload's turn statistics carry spreads, the expected slowest of its n trajectories
   (``_straggler_s``: gamma-distributed remaining times, quantile n / (n + 1); the later
   of it served alone and the fluid completion plus its excess over the mean).

``prepare`` (module ``prepared``) does the per-workload work once. ``predict_prepared_many``
then solves every configuration at once: arrays have the configuration as their first
axis and the segment as their second, two ``solve_cycle`` calls (the segments, and the
critical-path candidates alone) and a fixed number of numpy operations, with no Python
loop over configurations, trajectories or segments except to build the configurations'
engine rows and the ``Prediction`` objects. The sort uses reference shares of an
uncontended turn, so it does not depend on the configuration; where a configuration's
shares reorder positions, the inversion is flattened by a running maximum.

With ``WorkloadSnapshot.next_batch`` the question is the time until the first
``groups_needed`` groups complete, the whole workload still contending for the engines
(``next_batch``: the fluid up to the batch's progress, its own critical path, the order
statistic of the groups' completions; never more than the prediction without it;
``tests/core/test_next_batch.py``).

Invariants (asserted by ``tests/core/test_predictor.py``): ``completion_s >=
critical_path_s >= 0`` and ``completion_s >= throughput_bound_s``; an empty workload
predicts 0 with bottleneck "none"; a configuration that cannot serve the workload
predicts ``inf``; one queued trajectory alone predicts
``turns * (prefill + o * step(1) + e) - e`` exactly (whatever ``max_segments``); a
configuration's prediction is the same, bit for bit, alone or among others
(``predict_prepared`` is ``predict_prepared_many`` of one configuration).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
from numpy.typing import NDArray
from scipy.special import gammaincinv

from pearl.core.engine_groups import EngineGroups, engine_groups
from pearl.core.next_batch import batch_totals
from pearl.core.pd import PDConfig
from pearl.core.prepared import (
    DEFAULT_MAX_SEGMENTS,
    Ends,
    Positions,
    PreparedWorkload,
    prepare,
    steps,
)
from pearl.core.profile import RuntimeProfile
from pearl.core.prompt_backlog import backlog_s, mean_wait_s, reach_share
from pearl.core.turn_model import BOUND_NAMES, Cycle, solve_cycle
from pearl.core.workload import TurnStats, WorkloadSnapshot

__all__ = [
    "DEFAULT_MAX_SEGMENTS",
    "Prediction",
    "PredictionBreakdown",
    "PreparedWorkload",
    "predict",
    "predict_many",
    "predict_prepared",
    "predict_prepared_many",
    "prepare",
]

F64 = NDArray[np.float64]


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
    prompt_backlog_s: float  # time the prefill pool takes for fresh whole prompts (prompt_backlog)
    num_segments: int  # segments of the fluid sum (distinct positions, merged if many)
    num_trajectories: int  # trajectories with turns left (the fluid's initial N)


_EMPTY = PredictionBreakdown(
    0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0
)


def _with_critical(critical_s: float) -> PredictionBreakdown:
    return replace(_EMPTY, critical_path_s=critical_s, fluid_s=critical_s)


@dataclass(frozen=True)
class Prediction:
    """Predicted completion of the unfinished batch under one PD configuration."""

    completion_s: float  # time until the batch completes; inf if the config cannot serve it
    bottleneck: str  # prefill, decode, kv_capacity, kv_transfer, latency, none, infeasible
    breakdown: PredictionBreakdown


_INFEASIBLE = Prediction(math.inf, "infeasible", _with_critical(math.inf))
_NO_KV = Prediction(math.inf, "kv_capacity", _with_critical(math.inf))  # a context fits nowhere


def predict_prepared_many(w: PreparedWorkload, configs: Sequence[PDConfig]) -> list[Prediction]:
    """Predict every configuration for a prepared workload, in one vectorised solve.

    A configuration's prediction does not depend on the others in ``configs``.
    """
    no_engine = w.batch is not None and w.batch.cut_segment < 0
    if w.num_trajectories == 0 or no_engine:
        tail_s = w.batch.tail_s if no_engine and w.batch is not None else w.env_tail_s
        bottleneck = "latency" if tail_s > 0 else "none"
        breakdown = _EMPTY if tail_s == 0 else _with_critical(tail_s)
        return [Prediction(tail_s, bottleneck, breakdown)] * len(configs)
    results = [_INFEASIBLE] * len(configs)
    groups, kept = engine_groups(configs, w.profile)
    if groups is not None:
        for index, prediction in zip(kept, _predict_groups(w, groups), strict=True):
            results[index] = prediction
    if w.start_delay_s > 0:  # with groups that begin later, or from the listed alone
        d = w.start_delay_s
        results = [replace(p, completion_s=p.completion_s + d) for p in results]
        if w.listed_only is not None:
            alone = predict_prepared_many(w.listed_only, configs)
            results = [
                min(a, b, key=lambda p: p.completion_s) for a, b in zip(alone, results, strict=True)
            ]
    return results


def predict_prepared(w: PreparedWorkload, config: PDConfig) -> Prediction:
    """Predict one configuration for a prepared workload."""
    return predict_prepared_many(w, [config])[0]


def predict(
    workload: WorkloadSnapshot,
    config: PDConfig,
    profile: RuntimeProfile,
    max_segments: int | None = DEFAULT_MAX_SEGMENTS,
) -> Prediction:
    """Predicted time (s) until every unfinished trajectory completes under ``config``."""
    return predict_prepared(prepare(workload, profile, max_segments), config)


def predict_many(
    workload: WorkloadSnapshot,
    configs: Sequence[PDConfig],
    profile: RuntimeProfile,
    max_segments: int | None = DEFAULT_MAX_SEGMENTS,
) -> list[Prediction]:
    """``predict`` for each configuration, preparing the workload once."""
    return predict_prepared_many(prepare(workload, profile, max_segments), configs)


def _predict_groups(w: PreparedWorkload, g: EngineGroups) -> list[Prediction]:
    """Predictions of the configurations of ``g``; arrays are (configuration, segment)."""
    num_seg, e = w.num_segments, w.turn.env_s
    cyc = solve_cycle(g, w.turn, w.fluid, without_env=e > 0)
    alone = solve_cycle(g, w.turn, w.alone_segments, num_iterations=0, detail=False)
    detail = cyc.detail
    assert detail is not None
    # Some context fits no decode instance: inf. Finite stand-ins keep the arithmetic quiet.
    feasible = _finite_rows(cyc.cycle_s) & _finite_rows(alone.cycle_s)
    cycle_s = np.where(feasible[:, None], cyc.cycle_s, 1.0)
    alone_cycle_s = np.where(feasible[:, None], alone.cycle_s, 1.0)

    # Segment ends in turns: in-flight parts of each segment's cycle, over the first cycle.
    r = np.maximum.accumulate(np.maximum(_end_turns(w.ends, e, cyc, cycle_s), 0.0), axis=1)
    with_env_seg_s = steps(r) * cycle_s
    with_env_s = with_env_seg_s.sum(axis=1)
    if cyc.env_gap_s is not None:
        r = _skip_last_env(r, cycle_s, cyc.env_gap_s)
    dr = steps(r)
    seg_s = dr * cycle_s
    fluid_s = seg_s.sum(axis=1)

    critical = w.alone.remaining_turns * alone_cycle_s
    critical += _offset_s(w.alone, e, alone, alone_cycle_s) - e
    critical += w.alone_overrun_s
    if w.batch is None:
        critical_s = np.maximum(critical.max(axis=1), max(w.env_tail_s, 0.0))
        if w.spread is not None and w.num_trajectories > 1:
            slowest_s, excess_s = _straggler_s(w, w.spread, critical, alone)
            critical_s = np.maximum(critical_s, np.maximum(slowest_s, fluid_s + excess_s))
        completion_s = np.maximum(fluid_s, critical_s)
        throughput_s = (dr * cyc.throughput_s).sum(axis=1)
        env_saving_s = with_env_s - fluid_s
        uniform: F64 | float = 1.0 / num_seg
    else:
        all_s = _all_complete_s(w, int(w.batch.alone_all.sum()), seg_s, critical, alone)
        t = batch_totals(w.batch, r, seg_s, with_env_seg_s, critical, alone_cycle_s, all_s)
        seg_s = seg_s * t.share  # the fluid time up to the batch, per segment
        completion_s, critical_s, fluid_s = t.completion_s, t.critical_s, t.fluid_s
        throughput_s = (t.share * dr * cyc.throughput_s).sum(axis=1)
        env_saving_s = t.env_saving_s
        shares = t.share.sum(axis=1, keepdims=True)
        uniform = t.share / np.where(shares > 0, shares, 1.0)
        num_seg = w.batch.cut_segment + 1

    # Fresh prompts queue at the prefill pool ahead of the turns (prompt_backlog).
    backlog = backlog_s(g, w.fresh, detail.prefix_hit[:, :1])[:, 0]
    if w.fresh.count:
        wait_s = mean_wait_s(backlog, cycle_s[:, 0]) * reach_share(completion_s, cycle_s[:, 0])
        completion_s = completion_s + wait_s
        if w.batch is None or w.batch.groups_needed == w.batch.num_groups:
            # every trajectory, the last fresh one too: it starts at D
            completion_s = np.maximum(completion_s, critical_s + backlog)

    # The bottleneck: the binding term of the most fluid time (sums in segment order).
    num_configs, num_codes = len(r), len(BOUND_NAMES)
    rows = np.arange(num_configs)[:, None]
    by_bound = np.bincount(
        (detail.bound + rows * num_codes).ravel(), seg_s.ravel(), num_configs * num_codes
    ).reshape(num_configs, num_codes)
    bound_code = np.where(critical_s >= fluid_s, -1, by_bound.argmax(axis=1))
    # Means over the segments' own time: a batch's fluid_s also counts progress past the
    # last segment, which would shrink every mean below the range of its segments.
    seg_total_s = seg_s.sum(axis=1, keepdims=True)
    positive = seg_total_s > 0
    weights = np.where(positive, seg_s / np.where(positive, seg_total_s, 1.0), uniform)
    per_segment = np.stack(
        [
            cyc.decode_batch,
            detail.decode_slot_use,
            detail.prefill_use,
            cyc.prefill_s,
            cyc.decode_s,
            cyc.transfer_s,
            detail.prefix_hit,
            e / cycle_s,
        ]
    )
    totals = np.stack(
        [completion_s, critical_s, fluid_s, throughput_s, env_saving_s, cycle_s[:, 0]]
    )
    columns = np.concatenate(
        [totals, (per_segment * weights).sum(axis=2), backlog[None, :]]
    ).T.tolist()
    names = ("latency", *BOUND_NAMES)
    counts = (num_seg, w.num_trajectories)
    return [
        Prediction(row[0], names[code + 1], _breakdown(row[1:], counts)) if ok else _NO_KV
        for ok, code, row in zip(feasible.tolist(), bound_code.tolist(), columns, strict=True)
    ]


def _all_complete_s(
    w: PreparedWorkload, num_all: int, seg_s: F64, critical: F64, alone: Cycle
) -> F64:
    """The prediction without ``next_batch`` from the first ``num_all`` candidates (the
    whole workload's): its fluid, critical path and straggler."""
    total_s = seg_s.sum(axis=1)
    critical_s = np.maximum(critical[:, :num_all].max(axis=1), max(w.env_tail_s, 0.0))
    if w.spread is not None and w.num_trajectories > 1:
        slowest_s, excess_s = _straggler_s(w, w.spread, critical[:, :num_all], alone)
        critical_s = np.maximum(critical_s, np.maximum(slowest_s, total_s + excess_s))
    result: F64 = np.maximum(total_s, critical_s)
    return result


_STRAGGLER_CANDIDATES = 8  # longest mean paths per configuration given a spread


def _straggler_s(
    w: PreparedWorkload, spread: TurnStats, critical: F64, alone: Cycle
) -> tuple[F64, F64]:
    """Expected time of the slowest unfinished trajectory (the batch's straggler).

    A critical-path candidate's mean path ``mu`` (its column of ``critical``) is what one
    trajectory at its position takes on average. Its spread comes from its ``R`` turns
    left: ``var = R (tau^2 sd_o^2 + sd_e^2) + (cv_R R T)^2``, with ``tau`` the decode time
    per token and ``T`` the turn time of the candidate alone, and ``cv_R`` the relative
    spread of the turns left. The ``n`` trajectories with at least ``R`` turns left are
    taken as independent gamma variables with that mean and variance (a sum of
    long-tailed turns is right-skewed; a lognormal overshoots the maximum of many, a
    normal undershoots it), and their slowest as the quantile ``n / (n + 1)``.

    Returns, per configuration, the largest quantile over the ``_STRAGGLER_CANDIDATES``
    longest candidates (served alone throughout) and the largest excess of a quantile
    over its mean, which the caller adds to the fluid completion (the straggler runs
    loaded with the batch, then alone in the drained tail).
    """
    assert w.alone_at_least is not None
    o = w.turn.output_tokens
    k = min(_STRAGGLER_CANDIDATES, critical.shape[1])
    cols = np.argpartition(-critical, k - 1, axis=1)[:, :k]
    rows = np.arange(len(critical))[:, None]
    mu = np.maximum(critical[rows, cols], 1e-9)
    turns = w.alone.remaining_turns[cols]
    tau_s = alone.decode_s[rows, cols] / o
    cycle_s = alone.cycle_s[rows, cols]
    sd_o, sd_e = spread.output_tokens_sd or 0.0, spread.env_latency_sd_s or 0.0
    cv_r = spread.turns_cv or 0.0
    var = turns * (tau_s**2 * sd_o**2 + sd_e**2) + (cv_r * turns * cycle_s) ** 2
    n = w.alone_at_least[cols]
    shape = mu**2 / np.maximum(var, 1e-300)
    quantile = (var / mu) * gammaincinv(np.maximum(shape, 1e-9), n / (n + 1.0))
    slowest = np.where(var > 0, quantile, mu)
    return slowest.max(axis=1), (slowest - mu).max(axis=1)


_BREAKDOWN_FLOATS = tuple(f.name for f in fields(PredictionBreakdown))[:-2]  # then the counts


def _breakdown(values: list[float], counts: tuple[int, int]) -> PredictionBreakdown:
    """``PredictionBreakdown(*values, *counts)``, without the frozen ``__init__``'s cost.

    Equal to the constructor's result (a frozen dataclass's fields live in its
    ``__dict__``); about half the time, which counts with hundreds of configurations.
    """
    breakdown = object.__new__(PredictionBreakdown)
    fields_ = breakdown.__dict__
    fields_.update(zip(_BREAKDOWN_FLOATS, values, strict=True))
    fields_["num_segments"], fields_["num_trajectories"] = counts
    return breakdown


def _count_below(r: F64, x: F64) -> NDArray[np.intp]:
    """Per row, how many of the sorted ``r`` lie below ``x``: a binary search per entry.

    Exact comparisons, one row at a time, so a row's answer does not depend on the others.
    """
    num_rows, num_cols = r.shape
    padded = np.concatenate([r, np.full((num_rows, 1), np.inf)], axis=1).ravel()
    base = np.arange(num_rows)[:, None] * (num_cols + 1)
    count = np.zeros(x.shape, dtype=np.intp)
    step = 1 << (num_cols.bit_length() - 1) if num_cols else 0
    while step:  # add step where the entry step further on still lies below x
        probe = np.minimum(count + (step - 1), num_cols) + base
        count += (np.take(padded, probe) < x) * step
        step >>= 1
    return count


def _finite_rows(x: F64) -> NDArray[np.bool_]:
    finite: NDArray[np.bool_] = np.logical_and.reduce(np.isfinite(x), axis=1)
    return finite


def _skip_last_env(r: F64, cycle_s: F64, gap_s: F64) -> F64:
    """Positions moved earlier by the env time the fluid added over each last turn.

    Over progress [0, x] the env steps add F(x) = integral of (T - T_no_env): e a turn
    when latency binds, nothing when capacity binds. A trajectory ending at r has no env
    step in its last turn [r - 1, r], so it ends F(r) - F(r - 1) seconds earlier.
    """
    added = np.cumsum(steps(r) * gap_s, axis=1)  # F at each segment's end
    zero = np.zeros((len(r), 1))
    r_before = np.concatenate([zero, r[:, :-1]], axis=1)
    added_before = np.concatenate([zero, added[:, :-1]], axis=1)
    start = r - 1.0  # before now, the first segment's gap continues backwards
    j = np.minimum(_count_below(r, start), r.shape[1] - 1)  # segment holding start
    j += np.arange(len(r))[:, None] * r.shape[1]  # index into the flattened arrays
    inside = np.take(added_before, j) + (start - np.take(r_before, j)) * np.take(gap_s, j)
    at_start = np.where(start >= 0.0, inside, start * gap_s[:, :1])
    skip = (added - at_start) / cycle_s
    return np.maximum.accumulate(np.maximum(r - np.minimum(skip, 1.0), 0.0), axis=1)


def _end_turns(ends: Ends, e: float, cyc: Cycle, cycle_s: F64) -> F64:
    """Each segment's end in turns: its latest candidate, parts in turns of the first cycle.

    A segment's parts (wait, prefill + transfer, decode, env) are those of its own cycle.
    """
    first_s = cycle_s[:, :1]
    own = (cyc.prefill_s + cyc.transfer_s) / first_s
    decode = cyc.decode_s / first_s
    wait = cycle_s / first_s - own - decode - e / first_s
    env = e / first_s
    prefill_end = ends.prefill_turns - (wait + 0.5 * own)
    decode_end = np.maximum(
        ends.decode_turns[0] + ends.decode_coef[0] * decode,
        ends.decode_turns[1] + ends.decode_coef[1] * decode,
    ) - (wait + own)
    env_end = np.maximum(
        ends.env_turns[0] + ends.env_coef[0] * env, ends.env_turns[1] + ends.env_coef[1] * env
    )
    result: F64 = np.maximum(
        np.maximum(ends.still_turns, prefill_end), np.maximum(decode_end, env_end)
    )
    return result


def _offset_s(p: Positions, e: float, cyc: Cycle, cycle_s: F64) -> F64:
    """Seconds of the current cycle already done (< 0) or still ahead in env (> 0).

    The cycle is [wait | prefill + transfer | decode | env]; the wait (time beyond the
    latency when capacity binds) is spent queued before the prefill.
    """
    own_s = cyc.prefill_s + cyc.transfer_s
    decode_s = cyc.decode_s
    wait_s = cycle_s - own_s - decode_s - e
    offset = p.coef_queue * wait_s + p.coef_prefill * own_s + p.coef_decode * decode_s
    result: F64 = offset + p.coef_env * e
    return result
