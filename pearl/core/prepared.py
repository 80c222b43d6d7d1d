"""The per-workload part of the batch-completion predictor: positions, segments, merging.

``prepare`` reduces a workload snapshot once to arrays that every configuration's
prediction shares (equations in ``docs/predictor.md``):

1. Each unfinished trajectory gets a position r in turns, linear in the parts of a
   turn cycle: ``r = R + (coef_queue * wait + coef_prefill * (prefill + transfer)
   + coef_decode * decode + coef_env * e) / T``. The sort uses reference shares of an
   uncontended turn, so it is the same for every configuration.
2. Trajectories of identical (R, coefficients) share a *position*; between two
   positions the number of live trajectories N is constant (a segment of the fluid sum),
   with the mean context (and variance) of the live trajectories at its midpoint.
3. With more than ``max_segments`` positions, adjacent positions are merged into at most
   ``max_segments`` segments. The first position stays alone (its cycle, with every
   trajectory live, converts the in-flight parts to turns); the others are cut at
   quantiles of the trajectory count. A merged segment ends at the latest of its
   positions (``Ends``: per phase, the candidates that can be latest) and uses its mean N
   over its reference progress, ``integral(N dx) / width``, and the N-weighted mean and
   variance of its contexts (exact where T is linear in N at a fixed context, as when
   capacity binds, if the configuration's positions keep the reference spacing).
4. The critical path needs each position alone (N = 1). Positions that another one
   dominates for every configuration are dropped (exact); beyond ``max_segments`` left,
   the ``max_segments`` of highest reference estimate are kept, always with the one of
   largest context (which decides whether any context fits).

Invariants: segments are sorted by reference position; with at most ``max_segments``
positions nothing is merged (one trajectory alone is exact); segment and candidate
arrays hold at most ``max_segments`` entries (all positions and all undominated
candidates without a bound); ``num_trajectories`` counts the trajectories with turns
left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pearl.core.engine_groups import TurnShape
from pearl.core.next_batch import (
    PreparedBatch,
    batch_progress_turns,
    cut_groups,
    group_codes,
    prepared_batch,
)
from pearl.core.profile import RuntimeProfile
from pearl.core.prompt_backlog import NO_FRESH_PROMPTS, FreshPrompts
from pearl.core.turn_model import Segments, segments
from pearl.core.workload import PHASE_CODE, TrajPhase, TurnStats, WorkloadSnapshot

F64 = NDArray[np.float64]
Index = NDArray[np.intp]
_PREFILL = PHASE_CODE[TrajPhase.PREFILL]
_DECODE = PHASE_CODE[TrajPhase.DECODE]
_ENV = PHASE_CODE[TrajPhase.ENV]
DEFAULT_MAX_SEGMENTS = 64


@dataclass(frozen=True)
class Positions:
    """Positions of rows (shape (S,)), linear in the parts of a configuration's cycle.

    ``r = R + (coef_queue * wait + coef_prefill * own + coef_decode * decode
    + coef_env * e) / T``; ``offset = r - R`` in seconds is the part of the current turn
    done (< 0) or still ahead in env (> 0).
    """

    remaining_turns: F64  # R
    coef_queue: F64  # -1 where the turn's prefill has begun (its wait is over), else 0
    coef_prefill: F64  # -1/2 in prefill, -1 past it, else 0
    coef_decode: F64  # minus the decoded share of the turn
    coef_env: F64  # share of the env step still ahead


@dataclass(frozen=True)
class Ends:
    """Where each segment ends: the latest position among its trajectories (shape (S,)).

    Which position is latest depends on the configuration's cycle, so each phase keeps
    the candidates that can be latest, as R and in-flight coefficients (R = -inf where
    the segment has none): trajectories with no turn in progress (queued, or in env
    without rest) sit at R; in prefill at R - (wait + own / 2) / T; in decode at
    R - (wait + own - coef * decode) / T and in env at R + coef * e / T, each with two
    candidates: the largest R and the largest R + coef (exact for one parts share of 0
    or 1, and for a segment of one position).
    """

    still_turns: F64
    prefill_turns: F64
    decode_turns: tuple[F64, F64]
    decode_coef: tuple[F64, F64]
    env_turns: tuple[F64, F64]
    env_coef: tuple[F64, F64]


@dataclass(frozen=True, eq=False)
class PreparedWorkload:
    """A workload reduced to segment arrays, shared by every configuration's prediction.

    Segment j (sorted by position) ends at ``ends``'s row j; ``fluid`` holds its live
    trajectories and their contexts. ``alone`` are the critical-path candidates, each
    served alone (N = 1).
    """

    profile: RuntimeProfile
    turn: TurnShape
    num_trajectories: int
    env_tail_s: float  # longest env step of trajectories with no turn after it
    num_positions: int  # distinct positions before merging
    ends: Ends  # where each segment ends
    fluid: Segments
    alone: Positions
    alone_overrun_s: F64  # longest env time beyond e among the candidate's trajectories
    alone_segments: Segments
    spread: TurnStats | None = None  # per-turn spreads, for the straggler estimate
    alone_at_least: F64 | None = None  # per candidate: trajectories with >= its turns left
    batch: PreparedBatch | None = None  # the next batch's groups, if the snapshot asks for it
    start_delay_s: float = 0.0  # NextBatch.not_started_after_s, when it applies
    listed_only: PreparedWorkload | None = None  # the same batch from listed groups alone
    fresh: FreshPrompts = NO_FRESH_PROMPTS  # first prefills of whole prompts (prompt_backlog)

    @property
    def num_segments(self) -> int:
        return len(self.ends.still_turns)


def prepare(
    workload: WorkloadSnapshot,
    profile: RuntimeProfile,
    max_segments: int | None = DEFAULT_MAX_SEGMENTS,
) -> PreparedWorkload:
    """Do the per-workload part of the prediction once.

    ``max_segments`` bounds the segments of the fluid sum and the critical-path
    candidates (None: no bound, every distinct position is a segment). With
    ``workload.next_batch`` the batch's cut and the critical-path candidates of its
    members are added (``next_batch``); the segments are those of the whole workload.
    """
    if max_segments is not None and max_segments < 2:
        raise ValueError("max_segments must be at least 2")
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
    cut = engine_codes = None
    if workload.next_batch is not None:
        codes, num_groups = group_codes(workload)
        engine_codes = codes[keep][order]
        turn_s = _reference_turn_s(profile, turn, float(ctx0.mean()) if n else 0.0)
        cut = cut_groups(
            num_groups,
            workload.next_batch.groups_needed,
            engine_codes=engine_codes,
            engine_position=np.cumsum(first) - 1,
            engine_turns=r_ref + overrun / max(turn_s, 1e-300),
            tail_codes=codes[ends_after_env],
            tail_s=cols.env_remaining_s[ends_after_env],
            turn_s=turn_s,
        )
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
    width = steps(r_seg)
    var_seg = mean_sq_at_0 - mean_at_0**2 + (growth * width) ** 2 / 12
    # Alone, a trajectory's R turns start at ctx0 + j * growth, j = 0 .. R - 1.
    turns_seg = turns[starts]
    ctx_alone = np.maximum.reduceat(ctx0, starts) + growth * 0.5 * (turns_seg - 1) if n else ctx0
    var_alone = growth**2 * np.maximum(turns_seg**2 - 1, 0.0) / 12
    positions = Positions(
        remaining_turns=turns_seg,
        coef_queue=-(coef_p[starts] < 0).astype(float),
        coef_prefill=coef_p[starts],
        coef_decode=coef_d[starts],
        coef_env=coef_e[starts],
    )
    overrun_seg = np.maximum.reduceat(overrun, starts) if n else np.zeros(0)

    num_positions = len(starts)
    alone = _alone_candidates(profile, turn, positions, ctx_alone, overrun_seg, max_segments)
    if max_segments is None or num_positions <= max_segments:
        last = np.arange(num_positions)
    else:
        last, num_live, ctx_seg, var_seg = _merge(num_live, r_seg, ctx_seg, var_seg, max_segments)
    batch = None
    alone_ctx, alone_overrun_s = ctx_alone[alone], overrun_seg[alone]
    if cut is not None:
        assert engine_codes is not None
        x_m = None
        if stats.has_spread and cut.cut_position >= 0 and n > 1:  # as the straggler
            x_m = batch_progress_turns(
                cut, r_seg, turns_seg, stats, ref[1:], engine_codes, np.cumsum(first) - 1
            )
        # The batch's members at the whole workload's candidates (kept once if the same).
        members_ctx = np.where(cut.members, ctx0, -np.inf)
        members_overrun = np.where(cut.members, overrun, 0.0)
        ctx_b = np.maximum.reduceat(members_ctx, starts)[alone] if n else np.zeros(0)
        ctx_b = ctx_b + growth * 0.5 * (turns_seg[alone] - 1)
        overrun_b = np.maximum.reduceat(members_overrun, starts)[alone] if n else np.zeros(0)
        held = ctx_b > -np.inf
        same = held & (ctx_b == alone_ctx) & (overrun_b == alone_overrun_s)
        extra = held & ~same
        alone = np.concatenate([alone, alone[extra]])  # the batch's where they differ
        alone_ctx = np.concatenate([alone_ctx, ctx_b[extra]])
        alone_overrun_s = np.concatenate([alone_overrun_s, overrun_b[extra]])
        in_batch = np.concatenate([same, np.ones(int(extra.sum()), bool)])
        batch = prepared_batch(cut, last, r_seg, alone, len(same), in_batch, x_m)
    return PreparedWorkload(
        profile=profile,
        turn=turn,
        num_trajectories=n,
        env_tail_s=env_tail_s,
        num_positions=num_positions,
        ends=_ends(positions, last),
        fluid=segments(turn, num_live, ctx_seg, var_seg, np.full(len(last), e)),
        alone=_take(positions, alone),
        alone_overrun_s=alone_overrun_s,
        alone_segments=segments(
            turn, np.ones(len(alone)), alone_ctx, var_alone[alone], np.full(len(alone), e)
        ),
        spread=stats if stats.has_spread else None,
        alone_at_least=(n - np.searchsorted(np.sort(turns), turns_seg[alone])).astype(float),
        batch=batch,
        fresh=FreshPrompts.of(cols.context_tokens[keep & cols.fresh], turn),
        **_later_groups(workload, profile, max_segments),
    )


def _later_groups(
    workload: WorkloadSnapshot, profile: RuntimeProfile, max_segments: int | None
) -> dict[str, Any]:
    """Not-started groups that begin ``not_started_after_s`` from now (admitted when the
    running update ends). The fluid lets them start at once; so the batch completes
    either from the listed groups alone (``listed_only``, when there are enough of them)
    or with the later ones, that much later (``start_delay_s``): the sooner of the two."""
    nb = workload.next_batch
    if nb is None or nb.not_started_after_s <= 0 or workload.not_started == 0:
        return {}
    listed = {t.group_id for t in workload.trajectories}
    alone = None
    if nb.groups_needed <= len(listed):
        alone = prepare(workload.model_copy(update={"not_started": 0}), profile, max_segments)
    return {"start_delay_s": nb.not_started_after_s, "listed_only": alone}


def _alone_candidates(
    profile: RuntimeProfile,
    turn: TurnShape,
    positions: Positions,
    ctx_alone: F64,
    overrun_s: F64,
    max_segments: int | None,
) -> Index:
    """The critical-path candidates: undominated positions, at most ``max_segments``."""
    alone = _undominated(positions.remaining_turns, ctx_alone, overrun_s)
    if max_segments is not None and len(alone) > max_segments:
        estimate_s = _reference_critical_s(
            profile, turn, _take(positions, alone), ctx_alone[alone], overrun_s[alone]
        )
        alone = alone[_candidates(estimate_s, ctx_alone[alone], max_segments)]
    return alone


def steps(r: F64) -> F64:
    """Segment widths of positions sorted along the last axis (the first from 0)."""
    dr = r.copy()
    dr[..., 1:] -= r[..., :-1]
    return dr


def _take(p: Positions, index: Index) -> Positions:
    return Positions(
        p.remaining_turns[index],
        p.coef_queue[index],
        p.coef_prefill[index],
        p.coef_decode[index],
        p.coef_env[index],
    )


def _ends(p: Positions, last: Index) -> Ends:
    """The end candidates of segments of positions, the segments ending at ``last``."""
    start = np.append(0, last[:-1] + 1)[: len(last)].astype(np.intp)
    turns = p.remaining_turns
    prefill = p.coef_prefill == -0.5
    decode = p.coef_prefill == -1.0
    env = (p.coef_prefill == 0.0) & (p.coef_env > 0.0)
    still = ~(prefill | decode | env)

    def largest(mask: NDArray[np.bool_], key: F64) -> F64:
        return np.maximum.reduceat(np.where(mask, key, -np.inf), start)

    sizes = np.diff(np.append(start, len(turns)))

    def best(mask: NDArray[np.bool_], first: F64, second: F64) -> tuple[F64, F64]:
        """Per segment, the largest ``first`` and the largest ``second`` among those."""
        top = largest(mask, first)
        return top, largest(mask & (first == np.repeat(top, sizes)), second)

    def lines(mask: NDArray[np.bool_], coef: F64) -> tuple[tuple[F64, F64], tuple[F64, F64]]:
        """Lines R + coef * x of the largest R, and of the largest R + coef."""
        r0, at_one0 = best(mask, turns, turns + coef)
        at_one1, r1 = best(mask, turns + coef, turns)
        none = np.isinf(r0)
        slope0 = np.where(none, 0.0, at_one0 - np.where(none, 0.0, r0))
        slope1 = np.where(none, 0.0, at_one1 - np.where(none, 0.0, r1))
        return (r0, r1), (slope0, slope1)

    decode_turns, decode_coef = lines(decode, p.coef_decode)
    env_turns, env_coef = lines(env, p.coef_env)
    return Ends(
        still_turns=largest(still, turns),
        prefill_turns=largest(prefill, turns),
        decode_turns=decode_turns,
        decode_coef=decode_coef,
        env_turns=env_turns,
        env_coef=env_coef,
    )


def _merge(
    num_live: F64, r: F64, ctx: F64, var: F64, max_segments: int
) -> tuple[Index, F64, F64, F64]:
    """Merge adjacent positions into at most ``max_segments`` segments.

    The first position stays alone; the others are cut at quantiles of the trajectory
    count (a position goes to the quantile holding the middle of its trajectories, so a
    crowded position may take several quantiles' room). Returns each segment's last
    position, its mean N over its reference progress, ``integral(N dx) / width``, and
    the N-weighted mean and variance of its contexts. A segment of one position keeps
    that position's values exactly.
    """
    width = steps(r)
    work = num_live * width  # integral of N over each position's progress
    count = num_live[1:] - np.append(num_live[2:], 0.0)  # trajectories per position
    centre = np.cumsum(count) - 0.5 * count
    group = (centre * ((max_segments - 1) / count.sum())).astype(np.intp)
    first = np.ones(len(r), dtype=bool)
    first[2:] = group[1:] != group[:-1]
    start = np.flatnonzero(first)
    size = np.diff(np.append(start, len(r)))
    seg_width = np.add.reduceat(width, start)
    seg_work = np.add.reduceat(work, start)
    merged = size > 1
    has_width = seg_width > 0
    mean_live = np.where(
        merged & has_width, seg_work / np.where(has_width, seg_width, 1.0), num_live[start]
    )
    # Context moments weighted by work (by N where a segment has no width).
    weight = np.where(np.repeat(seg_work > 0, size), work, num_live)
    total_weight = np.add.reduceat(weight, start)
    mean_ctx = np.add.reduceat(weight * ctx, start) / total_weight
    spread = var + (ctx - np.repeat(mean_ctx, size)) ** 2
    mean_var = np.add.reduceat(weight * spread, start) / total_weight
    mean_ctx = np.where(merged, mean_ctx, ctx[start])
    mean_var = np.where(merged, mean_var, var[start])
    return start + size - 1, mean_live, mean_ctx, mean_var


def _undominated(turns: F64, ctx_tokens: F64, overrun_s: F64) -> Index:
    """Positions whose critical path no other position's exceeds for every configuration.

    Alone, position j's critical path is at least (R_j - 1) T_j + overrun_j and position
    k's at most R_k T_k + overrun_k (the in-flight parts of a turn lie within one cycle),
    and T grows with the context, so j dominates k when R_j >= R_k + 1, its context is at
    least k's and its overrun is too. Positions with an overrun are kept.
    """
    order = np.argsort(turns, kind="stable")
    # Largest context among the positions of at least each R (suffix maximum).
    ctx_from = np.maximum.accumulate(ctx_tokens[order][::-1])[::-1]
    after = np.searchsorted(turns[order], turns + 1.0, side="left")  # first R >= R_k + 1
    best = np.append(ctx_from, -np.inf)[after]
    return np.flatnonzero((best < ctx_tokens) | (overrun_s > 0))


def _candidates(estimate_s: F64, ctx_alone: F64, max_segments: int) -> Index:
    """The positions of highest estimate, with the one of largest context, in order."""
    top = np.argpartition(-estimate_s, max_segments - 1)[:max_segments]
    largest = int(np.argmax(ctx_alone))
    if largest not in top:
        top[np.argmin(estimate_s[top])] = largest
    return np.sort(top)


def _reference_critical_s(
    profile: RuntimeProfile,
    turn: TurnShape,
    p: Positions,
    ctx_tokens: F64,
    overrun_s: F64,
) -> F64:
    """Critical path of each position alone, with uncontended turns averaged over engines.

    Only used to choose the critical-path candidates when positions are merged.
    """
    o = turn.output_tokens
    new = np.minimum(turn.observation_tokens, ctx_tokens)
    prefix, decode_ctx = ctx_tokens - new, ctx_tokens + 0.5 * o
    engines = [e for gpu in profile.gpus.values() for e in gpu.engines]
    prefill_s = np.zeros_like(ctx_tokens)
    decode_s = np.zeros_like(ctx_tokens)
    for e in engines:
        pf, d = e.prefill, e.decode
        prefill_s += pf.a_s + new * (pf.b_s_per_token + pf.c_s_per_token2 * (2 * prefix + new))
        regime = d.small if d.large_batch_from > 1 else d.large
        decode_s += o * (regime.base_s + regime.per_seq_s + regime.per_ctx_token_s * decode_ctx)
    prefill_s /= len(engines)
    decode_s /= len(engines)
    turn_s = prefill_s + decode_s + turn.env_s
    offset_s = p.coef_prefill * prefill_s + p.coef_decode * decode_s + p.coef_env * turn.env_s
    result: F64 = p.remaining_turns * turn_s + offset_s - turn.env_s + overrun_s
    return result


def _reference_parts_s(
    profile: RuntimeProfile, turn: TurnShape, ctx_tokens: float
) -> tuple[float, float, int]:
    """Prefill and decode seconds of one uncontended turn summed over the profile's
    engines, and their number."""
    o, new = turn.output_tokens, min(turn.observation_tokens, ctx_tokens)
    prefix, decode_ctx = ctx_tokens - new, ctx_tokens + 0.5 * o
    prefill_s = decode_s = 0.0
    engines = [e for gpu in profile.gpus.values() for e in gpu.engines]
    for e in engines:
        p, d = e.prefill, e.decode
        prefill_s += p.a_s + new * (p.b_s_per_token + p.c_s_per_token2 * (2 * prefix + new))
        regime = d.small if d.large_batch_from > 1 else d.large
        decode_s += o * (regime.base_s + regime.per_seq_s + regime.per_ctx_token_s * decode_ctx)
    return prefill_s, decode_s, len(engines)


def _reference_shares(
    profile: RuntimeProfile, turn: TurnShape, ctx_tokens: float
) -> tuple[float, float, float]:
    """Prefill, decode and env shares of one uncontended turn, averaged over engines.

    Only used to sort positions once per workload, independently of the configuration.
    """
    prefill_s, decode_s, num_engines = _reference_parts_s(profile, turn, ctx_tokens)
    total = prefill_s + decode_s + turn.env_s * num_engines
    if total <= 0:
        return (1 / 3, 1 / 3, 1 / 3)
    return (prefill_s / total, decode_s / total, turn.env_s * num_engines / total)


def _reference_turn_s(profile: RuntimeProfile, turn: TurnShape, ctx_tokens: float) -> float:
    """Seconds of one uncontended turn, averaged over engines (the next batch's unit)."""
    prefill_s, decode_s, num_engines = _reference_parts_s(profile, turn, ctx_tokens)
    return (prefill_s + decode_s) / max(num_engines, 1) + turn.env_s
