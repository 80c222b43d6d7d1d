"""Elastic rules: which granted GPUs to use, which to give back, how many more to ask for.

``marginal-gain`` (the default):
- a granted allocation is used when its remaining window (its end time, or the expected
  window of a grant without one) is at least ``min_window_factor`` cold starts, or when
  engines already run on it; otherwise it is released at once. One that hosts nothing yet
  is released too when the best configuration with it is no better than the best
  without it (same completion, with and without the transition), for the next batch and
  for the one after it: held, it would sit idle while every decision said the pool
  changed; the pending requests for GPUs of its kind are cancelled with it (each,
  granted, would gain nothing either);
- a preempting allocation leaves the pool: the planner moves its engines off within the
  grace period;
- while fewer than ``max_allocations`` are pending or held, it requests more when the
  batch time saved per requested GPU beats ``min_gain_s_per_gpu``; the new GPUs serve
  only after a cold start, which the transition estimate of the candidates with them
  includes (Slurm's queueing delay is not). Where the next batch gains nothing (it is
  nearly complete), the batch after it is asked too (``DecisionContext.lookahead``: the
  groups the next update admits): GPUs granted now serve it. An idle grant is released
  only when it gains nothing on either.

Invariant: never more requests than the room under ``max_allocations``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable

from pearl.core.context import DecisionContext
from pearl.core.decision import ElasticAction, ElasticRequest
from pearl.core.selection import Candidate
from pearl.core.state import Allocation, AllocationKind, AllocationStatus

ElasticRule = Callable[[DecisionContext], ElasticAction]

_LIVE = (AllocationStatus.PENDING, AllocationStatus.GRANTED, AllocationStatus.PREEMPTING)


def marginal_gain_rule(ctx: DecisionContext) -> ElasticAction:
    action, idle = _marginal_gain(ctx)
    if not idle:
        return action
    why = f"released {', '.join(idle)}: no gain from their GPUs; {action.reason}"
    return dataclasses.replace(action, reason=why)


def _marginal_gain(ctx: DecisionContext) -> tuple[ElasticAction, tuple[str, ...]]:
    cfg = ctx.cfg.elastic
    elastic = [a for a in ctx.state.allocations if a.kind is AllocationKind.ELASTIC]
    hosting = ctx.state.allocations_hosting_active
    unused = tuple(
        a.allocation_id for a in elastic if a.allocation_id not in hosting and _too_short(ctx, a)
    )
    lent = ctx.lent_gpu_ids() | set(ctx.state.borrow.gpu_ids if ctx.state.borrow else ())
    idle = _gaining_nothing(ctx, elastic, hosting, lent, unused)
    idle += _pending_like(elastic, idle)
    unused += idle
    live = [a for a in elastic if a.status in _LIVE and a.allocation_id not in unused]
    room = cfg.max_allocations - len(live)
    if room <= 0 or ctx.obs.workload.num_unfinished == 0 or cfg.gpu_type not in ctx.profile.gpus:
        why = "at the allocation cap" if room <= 0 else "nothing to gain"
        return ElasticAction(releases=unused, reason=why), idle
    extra_nodes = [(cfg.gpu_type, cfg.gpus_per_allocation)] * room
    gain_s = _request_gain_s(ctx, lent, unused, extra_nodes)
    if gain_s <= cfg.min_gain_s_per_gpu * room * cfg.gpus_per_allocation:
        ahead = ctx.lookahead  # GPUs granted now serve the batch after the next too
        if ahead is not None:
            gain_s = max(gain_s, _request_gain_s(ahead, lent, unused, extra_nodes))
    if math.isnan(gain_s):
        return ElasticAction(releases=unused, reason="no feasible prediction"), idle
    gain_per_gpu_s = gain_s / (room * cfg.gpus_per_allocation)
    if gain_per_gpu_s <= cfg.min_gain_s_per_gpu:
        return ElasticAction(
            releases=unused,
            gain_s_per_gpu=gain_per_gpu_s,
            reason=f"{gain_per_gpu_s:.2f} s per GPU is not worth a request",
        ), idle
    request = ElasticRequest(
        cfg.gpus_per_allocation, cfg.gpu_type, cfg.partition, cfg.time_limit_min
    )
    return ElasticAction(
        requests=(request,) * room,
        releases=unused,
        gain_s_per_gpu=gain_per_gpu_s,
        reason=f"request {room} x {cfg.gpus_per_allocation} {cfg.gpu_type}: "
        f"{gain_per_gpu_s:.2f} s saved per GPU",
    ), idle


def _request_gain_s(
    ctx: DecisionContext,
    lent: Iterable[str],
    unused: tuple[str, ...],
    extra_nodes: list[tuple[str, int]],
) -> float:
    """Batch time saved by ``extra_nodes`` more (NaN where either side has no feasible
    prediction)."""
    pool = ctx.rollout_gpus(lent, unused)
    now = ctx.select(pool).best.effective_s
    more = ctx.select(pool, extra_nodes=extra_nodes).best.effective_s
    if math.isinf(now) or math.isinf(more):
        return math.nan
    return now - more


def _gaining_nothing(
    ctx: DecisionContext,
    elastic: list[Allocation],
    hosting: frozenset[str],
    lent: Iterable[str],
    released: tuple[str, ...],
) -> tuple[str, ...]:
    """Granted allocations that host nothing and whose GPUs the best configuration gains
    nothing from: no better with them than without, by the selection's own ranking, for
    the next batch and for the one after it (the lookahead)."""
    idle: tuple[str, ...] = ()
    for a in elastic:
        if a.status is not AllocationStatus.GRANTED or a.allocation_id in hosting:
            continue
        if a.allocation_id in released:
            continue
        if not _gains(ctx, lent, (*released, *idle), a.allocation_id):
            ahead = ctx.lookahead  # it may shorten the batch after the next instead
            if ahead is None or not _gains(ahead, lent, (*released, *idle), a.allocation_id):
                idle += (a.allocation_id,)
    return idle


def _gains(
    ctx: DecisionContext, lent: Iterable[str], released: tuple[str, ...], allocation_id: str
) -> bool:
    """The best configuration with the allocation's GPUs is better than without them."""
    with_it = ctx.select(ctx.rollout_gpus(lent, released)).best
    without = ctx.select(ctx.rollout_gpus(lent, (*released, allocation_id))).best
    return _rank_key(with_it) < _rank_key(without)


def _pending_like(elastic: list[Allocation], idle: tuple[str, ...]) -> tuple[str, ...]:
    """The pending requests for GPUs like those of a grant that gains nothing: granted,
    each would gain nothing too (one more node of the same kind), so they are cancelled
    rather than granted and given back one by one."""
    kinds = {(a.gpu_type, a.num_gpus) for a in elastic if a.allocation_id in idle}
    return tuple(
        a.allocation_id
        for a in elastic
        if a.status is AllocationStatus.PENDING and (a.gpu_type, a.num_gpus) in kinds
    )


def _rank_key(c: Candidate) -> tuple[float, float]:
    return c.effective_s, c.completion_s


def _too_short(ctx: DecisionContext, a: Allocation) -> bool:
    """A granted allocation whose window is too short to pay for a cold start."""
    if a.status is not AllocationStatus.GRANTED:
        return False
    cfg = ctx.cfg.elastic
    end_s = (
        a.end_by_s
        if a.end_by_s is not None
        else (a.granted_at_s or ctx.now_s) + cfg.expected_window_s
    )
    return end_s - ctx.now_s < cfg.min_window_factor * ctx.profile.costs.engine_cold_start_s


def greedy_rule(ctx: DecisionContext) -> ElasticAction:
    """RLBoost's use of preemptible GPUs: hold as many as allowed whenever there is work,
    with no cost model; release nothing (the owner reclaims them)."""
    cfg = ctx.cfg.elastic
    live = [
        a for a in ctx.state.allocations if a.kind is AllocationKind.ELASTIC and a.status in _LIVE
    ]
    room = cfg.max_allocations - len(live)
    if room <= 0 or ctx.obs.workload.num_unfinished == 0:
        return ElasticAction(reason="at the allocation cap" if room <= 0 else "no work")
    request = ElasticRequest(
        cfg.gpus_per_allocation, cfg.gpu_type, cfg.partition, cfg.time_limit_min
    )
    return ElasticAction(requests=(request,) * room, reason=f"request {room} more")


def never_rule(ctx: DecisionContext) -> ElasticAction:
    granted = tuple(
        a.allocation_id
        for a in ctx.state.allocations
        if a.kind is AllocationKind.ELASTIC and a.status is AllocationStatus.GRANTED
    )
    return ElasticAction(releases=granted, reason="elastic GPUs disabled")


ELASTIC_RULES: dict[str, ElasticRule] = {
    "marginal-gain": marginal_gain_rule,
    "greedy": greedy_rule,
    "never": never_rule,
}
