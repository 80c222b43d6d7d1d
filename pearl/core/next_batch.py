"""The next-batch question: how long until ``groups_needed`` more GRPO groups complete?

Under ``first-completed`` batching the trainer's next batch is the first ``m`` groups to
complete (``WorkloadSnapshot.next_batch``), not every unfinished trajectory. The fluid of
``prepared``/``predictor`` is kept as it is, the whole workload contending for the
engines; only the question changes (equations in ``docs/predictor.md``):

1. Positions are sorted once for every configuration and the fluid reaches them in that
   order, so a group completes with its *latest member*: at its position, in reference
   turns, later by any env time past its mean (``cut_groups``). The batch is the first
   ``m`` groups in that order (ties: the latest position, then stream order); without
   spreads it is complete when the fluid reaches the latest position ``p*`` among their
   members and their own critical paths are done. Groups whose members have no turn
   left need no engine: they complete when their final env steps end.
2. With spreads each trajectory's remaining progress (in turns) is a gamma variable with
   its position as mean and a variance from its turns left, so the groups complete in a
   random order; the batch completes at the progress ``x_m`` where the expected number
   of complete groups reaches the ``m``-th order statistic's (``batch_progress_turns``).
   It is found once per workload, in reference turns (the sort's), and mapped to each
   configuration's positions piecewise linearly through the segments' ends
   (``configuration_progress``).

Invariants: ``groups_needed <= num_groups``; ``cut_position`` is -1 exactly when the
first ``groups_needed`` groups have no member with a turn left (``groups_needed = 0``
included); ``members`` marks the trajectories of those groups; ``batch_progress_turns``
is non-decreasing in ``m``, ``configuration_progress`` in ``x_m``;
``order_statistic_share`` is non-decreasing in ``m`` and ``n / (n + 1)`` for ``m = G``
(``g = n / G``), the all-complete straggler's share.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from scipy.special import gammainc, gammaln

from pearl.core.workload import TurnStats, WorkloadSnapshot

F64 = NDArray[np.float64]
Index = NDArray[np.intp]
_SHIFT_ITERATIONS = 14  # bisection steps for x_m: the bracket / 2^14


@dataclass(frozen=True)
class GroupCut:
    """Where the first ``groups_needed`` groups complete, in positions (configuration-free)."""

    groups_needed: int  # m, at most num_groups
    num_groups: int  # G: listed groups and not-started ones
    cut_position: int  # p*: the latest position among the m groups' members; -1: none
    members: NDArray[np.bool_]  # per sorted trajectory with turns left: of the m groups
    tail_s: float  # longest final env step (no turn after it) of the m groups' members
    done_groups: int  # groups with no member with a turn left


@dataclass(frozen=True)
class PreparedBatch:
    """The next-batch part of a prepared workload.

    The critical-path candidates (``PreparedWorkload.alone``) are those of the whole
    workload (``alone_all``, for the all-complete bound) and those of the batch's members
    (``alone_in_batch``); a candidate in both is kept once.
    """

    groups_needed: int  # m
    num_groups: int  # G
    cut_segment: int  # the segment holding p*; -1: no engine needed
    cut_ref_turns: float  # p* in reference turns
    cut_ends_segment: bool  # p* ends its segment (always unless merged)
    segment_ref_turns: F64  # (S,) the segments' ends in reference turns
    tail_s: float  # longest final env step among the batch's groups
    alone_all: NDArray[np.bool_]  # candidates of the whole workload (they come first)
    alone_in_batch: NDArray[np.bool_]  # candidates of the batch's members
    alone_ref_turns: F64  # the candidates' positions in reference turns
    progress_turns: float | None  # with spreads: x_m, where the batch completes (reference)


def group_codes(workload: WorkloadSnapshot) -> tuple[Index, int]:
    """Group index of each entry of ``workload.arrays()``, and the number of groups.

    Listed groups are numbered in order of first appearance, then the not-started ones,
    ``group_size`` consecutive trajectories each (stream order).
    """
    assert workload.next_batch is not None
    size = workload.next_batch.group_size
    ids = [t.group_id for t in workload.trajectories]
    index = {g: i for i, g in enumerate(dict.fromkeys(ids))}
    listed = [index[g] for g in ids]
    num_listed = len(index)
    fresh = num_listed + np.arange(workload.not_started) // size
    codes = np.concatenate([np.asarray(listed, dtype=np.intp), fresh.astype(np.intp)])
    return codes, num_listed + workload.not_started // size


def cut_groups(
    num_groups: int,
    groups_needed: int,
    engine_codes: Index,
    engine_position: Index,
    engine_turns: F64,
    tail_codes: Index,
    tail_s: F64,
    turn_s: float,
) -> GroupCut:
    """The first ``groups_needed`` groups to complete, and the position they complete at.

    ``engine_*`` describe the trajectories with turns left, in sorted order: group,
    position index and when they end in reference turns (their reference position plus
    any env time past its mean, ``turn_s`` a reference turn). ``tail_*`` the
    trajectories whose last turn is done but whose final env step still runs (their
    group and its rest). A group with neither has completed. Groups complete in the
    order of their latest member's end (ties: its position, then stream order); the
    batch's fluid ends at the latest position among its groups' members.
    """
    m = min(groups_needed, num_groups)
    last = np.full(num_groups, -1, dtype=np.intp)
    np.maximum.at(last, engine_codes, engine_position)
    tail = np.zeros(num_groups)
    np.maximum.at(tail, tail_codes, tail_s)
    ends = tail / max(turn_s, 1e-300)
    np.maximum.at(ends, engine_codes, engine_turns)
    order = np.lexsort((np.arange(num_groups), last, ends))
    chosen = np.zeros(num_groups, dtype=bool)
    chosen[order[:m]] = True
    return GroupCut(
        groups_needed=m,
        num_groups=num_groups,
        cut_position=int(last[chosen].max(initial=-1)),
        members=chosen[engine_codes],
        tail_s=float(tail[chosen].max(initial=0.0)),
        done_groups=int((last < 0).sum()),
    )


def prepared_batch(
    cut: GroupCut,
    last: Index,
    r_seg: F64,
    alone: Index,
    num_all: int,
    in_batch: NDArray[np.bool_],
    progress_turns: float | None,
) -> PreparedBatch:
    """The next-batch part: the cut's segment (of those ending at ``last``), reference
    positions (``r_seg``) and the candidates (``alone``: the ``num_all`` of the whole
    workload, then the batch's members' where they differ; ``in_batch`` marks the
    batch's)."""
    at = cut.cut_position
    segment = int(np.searchsorted(last, at)) if at >= 0 else -1
    return PreparedBatch(
        groups_needed=cut.groups_needed,
        num_groups=cut.num_groups,
        cut_segment=segment,
        cut_ref_turns=float(r_seg[at]) if at >= 0 else 0.0,
        cut_ends_segment=at >= 0 and int(last[segment]) == at,
        segment_ref_turns=r_seg[last],
        tail_s=cut.tail_s,
        alone_all=np.arange(len(alone)) < num_all,
        alone_in_batch=in_batch,
        alone_ref_turns=r_seg[alone],
        progress_turns=progress_turns,
    )


def order_statistic_share(groups_needed: int, num_groups: int, group_size: float) -> float:
    """The share ``F`` of one trajectory's remaining-time cdf at which the batch completes.

    ``G`` groups of ``g`` members, each trajectory with cdf ``F``: a group completes with
    cdf ``H = F^g``, the ``m``-th of ``G`` at ``U = H(X) ~ Beta(m, G - m + 1)``, so on
    average at ``E[U^(1/g)] = B(m + 1/g, G - m + 1) / B(m, G - m + 1)`` in ``F``:
    ``m / (G + 1)`` for ``g = 1`` and ``n / (n + 1)`` for ``m = G`` (``n = g G``, the
    slowest of ``n``: the all-complete straggler's share), where it is used exactly.
    """
    m, big_g, inv_g = float(groups_needed), float(num_groups), 1.0 / group_size
    if m >= big_g:
        return big_g * group_size / (big_g * group_size + 1.0)
    log_share = gammaln(m + inv_g) - gammaln(m) + gammaln(big_g + 1.0)
    return float(np.exp(log_share - gammaln(big_g + 1.0 + inv_g)))


def progress_variance_turns2(
    progress: F64, turns: F64, spread: TurnStats, decode_share: float, env_share: float
) -> F64:
    """Variance (turns^2) of the ``progress`` a trajectory with ``turns`` turns left needs.

    In turns of an uncontended reference turn (its decode and env shares ``s_d``,
    ``s_e``): each decode ahead adds ``(s_d sd_o / o)^2``, the part ``f < 1`` left of the
    current one ``f^2`` of it (its relative spread stays a turn's); each env step ahead
    ``(s_e sd_e / e)^2``, ``R - 1`` of them between the turns left (none after the last)
    and, in env, the part of the current one; and the turns left spread by ``(cv_R R)^2``
    (as the straggler's, ``predictor._straggler_s``).
    """
    o, e = spread.output_tokens_per_turn, spread.env_latency_s
    decode_var = (decode_share * (spread.output_tokens_sd or 0.0) / o) ** 2
    env_var = (env_share * (spread.env_latency_sd_s or 0.0) / e) ** 2 if e > 0 else 0.0
    part = np.minimum(progress, 1.0)
    whole = np.maximum(progress - 1.0, 0.0)
    after = np.maximum(turns - 1.0, 0.0)
    in_env = np.minimum(np.maximum(progress - turns, 0.0) / max(env_share, 1e-300), 1.0)
    result: F64 = (part**2 + whole) * decode_var + (after + in_env**2) * env_var
    result += ((spread.turns_cv or 0.0) * turns) ** 2
    return result


def batch_progress_turns(
    cut: GroupCut,
    mean_turns: F64,
    turns_left: F64,
    spread: TurnStats,
    shares: tuple[float, float],
    engine_codes: Index,
    engine_position: Index,
) -> float:
    """``x_m``: the progress (reference turns) at which the batch completes, with spreads.

    Trajectory ``i`` needs a gamma-distributed progress ``X_i`` with its position's mean
    (``mean_turns``, per position) and the variance of ``progress_variance_turns2``
    (``shares``: the decode and env shares of a reference turn), independent of the
    others. Group ``g`` is complete at progress ``x`` with probability ``H_g(x) = prod
    F_i(x)`` (1 for a group with no turn left). The batch completes where the expected
    number of complete groups ``sum H_g(x)`` reaches ``G F_m^g``, ``F_m`` the order
    statistic's share (``order_statistic_share``, ``g`` the mean members with turns left
    per group): for identical groups that puts every trajectory at ``F_m``. Positions
    are binned to 1/64 turn for the cdfs; bisection over a bracket that does not depend
    on ``m``, so the result is non-decreasing in ``m``.
    """
    if cut.cut_position < 0:
        return 0.0
    engine_groups = cut.num_groups - cut.done_groups
    members = len(engine_codes) / engine_groups
    share = order_statistic_share(cut.groups_needed, cut.num_groups, members)
    target = cut.num_groups * share**members - cut.done_groups
    keys = np.stack([turns_left, np.round(mean_turns * 64.0)], axis=1)
    unique, inverse = np.unique(keys, axis=0, return_inverse=True)
    turns, mean = unique[:, 0], unique[:, 1] / 64.0
    var = progress_variance_turns2(mean, turns, spread, *shares)
    certain = (mean <= 1e-9) | (var <= 1e-12 * mean**2)  # no spread: a step at the mean
    shape = np.where(certain, 1.0, mean**2 / np.where(certain, 1.0, var))
    scale = np.where(certain, 1.0, var / np.where(certain, 1.0, mean))
    of_traj = inverse.ravel()[engine_position]  # each trajectory's bin
    if len(engine_codes) == engine_groups:  # one member a group: sum the cdfs
        weight = np.bincount(of_traj, minlength=len(unique)).astype(float)
        starts = by_group = None
    else:
        order = np.argsort(engine_codes, kind="stable")
        by_group, codes = of_traj[order], engine_codes[order]
        starts = np.flatnonzero(np.append(True, codes[1:] != codes[:-1]))

    def complete(x: float) -> float:
        step = (mean <= x).astype(float)
        cdf = np.where(certain, step, gammainc(shape, x / scale))
        if by_group is None or starts is None:
            return float(cdf @ weight)
        with np.errstate(divide="ignore"):
            log_cdf = np.log(cdf)[by_group]
        return float(np.exp(np.add.reduceat(log_cdf, starts)).sum())

    low, high = 0.0, float((mean + 8.0 * np.sqrt(var)).max()) + 1.0
    for _ in range(_SHIFT_ITERATIONS):
        mid = 0.5 * (low + high)
        if complete(mid) < target:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def progress_weights(r: F64, x: F64) -> F64:
    """Per configuration and segment, the share of the segment's progress below ``x``.

    ``r`` (C, S) holds the segments' ends (non-decreasing along a row), ``x`` (C, 1) a
    progress; a segment that ends at or below ``x`` counts whole (1 exactly), one that
    starts at or above it not at all (0 exactly).
    """
    start = np.concatenate([np.zeros((len(r), 1)), r[:, :-1]], axis=1)
    width = r - start
    inside = np.clip((x - start) / np.where(width > 0, width, 1.0), 0.0, 1.0)
    result: F64 = np.where(r <= x, 1.0, inside)
    return result


def configuration_progress(ref_turns: F64, r: F64, x_ref: float, segment: int | None = None) -> F64:
    """A configuration's progress (C, 1) at reference progress ``x_ref``.

    Piecewise linear through the points (0, 0) and (``ref_turns[k]``, ``r[:, k]``), the
    segments' ends in reference turns (S,) and in each configuration's turns (C, S), both
    non-decreasing; beyond the last end turn for turn. Non-decreasing in ``x_ref``.
    With ``segment``, within that segment (``x_ref`` is in its reference range), so
    between its start and its end.
    """
    j = int(np.searchsorted(ref_turns, x_ref, side="left")) if segment is None else segment
    if j >= len(ref_turns):
        return r[:, -1:] + (x_ref - float(ref_turns[-1]))
    before_ref = float(ref_turns[j - 1]) if j > 0 else 0.0
    before = r[:, j - 1 : j] if j > 0 else np.zeros((len(r), 1))
    width = float(ref_turns[j]) - before_ref  # > 0 unless given a segment
    share = min(max((x_ref - before_ref) / width, 0.0), 1.0) if width > 0 else 1.0
    result: F64 = before + share * (r[:, j : j + 1] - before)
    return result


@dataclass(frozen=True)
class BatchTotals:
    """The next batch's totals per configuration (C,), and each segment's share of it."""

    completion_s: F64
    critical_s: F64
    fluid_s: F64
    env_saving_s: F64
    share: F64  # (C, S): share of each segment's progress before the batch completes


def batch_totals(
    batch: PreparedBatch,
    r: F64,
    seg_s: F64,
    with_env_seg_s: F64,
    critical: F64,
    alone_cycle_s: F64,
    all_s: F64,
) -> BatchTotals:
    """Time until the batch's groups complete, at most ``all_s`` (the whole workload's).

    Arrays are (C, S) over segments (``r`` their ends in the configuration's turns,
    ``seg_s`` their fluid times, ``with_env_seg_s`` those before the last env steps were
    skipped) or (C, J) over critical-path candidates (``critical`` their mean paths).
    Without spreads the batch completes when the fluid reaches the cut ``r(p*)`` (inside
    a merged segment: interpolated in reference turns); its critical path is the longest
    of its own candidates' (the batch's members') and of its groups' final env steps.
    With spreads it completes at the configuration's progress ``x`` of the order
    statistic ``x_m``, beyond the last segment at the pace of the whole workload's
    longest candidate alone, and a candidate's critical path is shortened by the turns
    its reference position lies beyond ``x_m``, served alone. ``completion = min(max(
    fluid, critical), all_s)``. Every term is non-decreasing in ``groups_needed``.
    """
    cut = batch.cut_segment
    own = critical
    past_s = np.zeros(len(r))
    if batch.progress_turns is None and batch.cut_ends_segment:
        x = r[:, cut : cut + 1]
    elif batch.progress_turns is None:  # the cut inside a merged segment: interpolated
        x = configuration_progress(batch.segment_ref_turns, r, batch.cut_ref_turns, cut)
    else:
        x_ref = batch.progress_turns
        x = configuration_progress(batch.segment_ref_turns, r, x_ref)
        num_all = int(batch.alone_all.sum())
        longest = np.argmax(critical[:, :num_all], axis=1)[:, None]
        pace_s = np.take_along_axis(alone_cycle_s, longest, axis=1)[:, 0]
        past_s = np.maximum(x[:, 0] - r[:, -1], 0.0) * pace_s
        own = critical - np.maximum(batch.alone_ref_turns - x_ref, 0.0) * alone_cycle_s
    share = progress_weights(r, x)
    fluid_s = (share * seg_s).sum(axis=1) + past_s
    own_s = np.where(batch.alone_in_batch, own, -np.inf).max(axis=1)
    critical_s = np.minimum(np.maximum(np.maximum(own_s, batch.tail_s), 0.0), all_s)
    return BatchTotals(
        completion_s=np.minimum(np.maximum(fluid_s, critical_s), all_s),
        critical_s=critical_s,
        fluid_s=fluid_s,
        env_saving_s=(share * with_env_seg_s).sum(axis=1) - (fluid_s - past_s),
        share=share,
    )
