"""Borrowing rules: lend the trainer's idle GPUs to rollout and get them back in time.

``predictive`` (the default):
- lend while the trainer waits for the next batch, when the batch time saved by the
  extra GPUs (transition estimate plus predicted completion, with and without them), net
  of the return (drain, sleep, onload: the lent GPUs stop serving that long before the
  batch completes, which costs the batch their share of that time), beats
  ``min_gain_s``, and when reaching the lent configuration and a forced return from it
  (migrate, sleep, onload) take no longer than the trainer may wait
  (``max_return_delay_s``: a lend that cold-starts engines on the trainer's GPUs runs a
  plan a forced return would wait for, and the predictor errs by tens of percent), unless
  no engine serves yet (a run's start: no batch can complete before the plan's engines
  are up); the window's ``return_by_s`` is when rollout must have vacated the GPUs so
  that the trainer's onload ends as the batch is predicted to complete;
- return on schedule, starting early enough for drain, sleep and the margin; the
  schedule follows each decision's prediction of the running configuration (the one
  made when lending is stale once the batch runs longer or shorter than predicted);
- when the trainer needs its GPUs now, force the return: the vacate deadline becomes
  ``now + max_return_delay_s - onload``, and the planner migrates in-flight requests
  wherever draining would miss it. The trainer's wait is thereby bounded by
  ``max_return_delay_s`` whenever migration fits in it.

``always`` (ROLL's partial-GPU mode, for the baseline): lend ``lend_fraction`` of the
trainer's nodes whenever it waits, force the return the moment the batch is ready.
``never``: lend nothing (return anything lent).

Invariant: a forced return's deadline is never later than the open window's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from pearl.core.context import DecisionContext
from pearl.core.decision import BorrowAction, BorrowKind
from pearl.core.observation import TrainerPhase
from pearl.core.pool import node_counts
from pearl.core.state import Gpu

BorrowRule = Callable[[DecisionContext], BorrowAction]


def predictive_rule(ctx: DecisionContext) -> BorrowAction:
    cfg, costs, now_s = ctx.cfg.borrowing, ctx.profile.costs, ctx.now_s
    trainer = ctx.obs.trainer
    window = ctx.state.borrow
    if window is not None:
        if trainer.needs_gpus:
            deadline_s = min(
                window.return_by_s, now_s + cfg.max_return_delay_s - costs.trainer_onload_s
            )
            return BorrowAction(
                BorrowKind.FORCE_RETURN,
                window.gpu_ids,
                max(now_s, deadline_s),
                reason="the trainer needs its GPUs now",
            )
        if window.returning:
            return BorrowAction(
                BorrowKind.RETURN, window.gpu_ids, window.return_by_s, reason="return under way"
            )
        return_by_s = _return_by_s(ctx, window.return_by_s)
        start_at_s = return_start_s(ctx, return_by_s)
        if now_s >= start_at_s:
            return BorrowAction(
                BorrowKind.RETURN,
                window.gpu_ids,
                return_by_s,
                reason=f"scheduled return (vacate by {return_by_s:.1f} s)",
            )
        return BorrowAction(
            BorrowKind.KEEP,
            window.gpu_ids,
            return_by_s,
            reason=f"lent until {start_at_s:.1f} s",
        )
    trainer_gpus = ctx.trainer_gpu_ids()
    if not trainer_gpus:
        return BorrowAction(BorrowKind.NONE, reason="no trainer GPUs")
    if trainer.phase is not TrainerPhase.WAITING or trainer.needs_gpus:
        return BorrowAction(BorrowKind.NONE, reason="the trainer is using its GPUs")
    if ctx.obs.workload.num_unfinished == 0:
        return BorrowAction(BorrowKind.NONE, reason="no rollout work left")
    pool = ctx.rollout_gpus(())
    selection = ctx.select(pool)
    without = selection.best
    return_s = ctx.drain_estimate_s + costs.sleep_s + costs.trainer_onload_s
    most_s = without.effective_s - selection.min_critical_path_s
    if _same_kind(pool, [ctx.state.gpu_by_id[g] for g in trainer_gpus]) and (
        _net_gain_s(most_s, return_s, without.effective_s) <= cfg.min_gain_s
    ):
        return BorrowAction(
            BorrowKind.NONE,
            reason=f"lending saves at most {most_s:.1f} s: the critical path binds",
        )
    with_lent = ctx.select(ctx.rollout_gpus(trainer_gpus), lending=True).best
    # Each candidate's effective time includes its transition (for the lent one: the
    # offload and the wake); the return comes on top.
    gain_s = without.effective_s - with_lent.effective_s
    overhead_s = with_lent.transition_s + return_s
    forced_s = costs.migrate_s + costs.sleep_s + costs.trainer_onload_s
    if with_lent.transition_s + forced_s > cfg.max_return_delay_s and ctx.state.active_engines:
        # One plan runs at a time: a batch complete while this one still runs (cold starts
        # on the lent GPUs) waits for the rest of it before its forced return can begin.
        return BorrowAction(
            BorrowKind.NONE,
            gain_s=gain_s,
            overhead_s=overhead_s,
            reason=f"lending takes {with_lent.transition_s:.1f} s to reach and "
            f"{forced_s:.1f} s to take back at once: more than the trainer may wait "
            f"({cfg.max_return_delay_s:.1f} s) if the batch completes meanwhile",
        )
    # (not >: a NaN gain, no feasible prediction either way, lends nothing)
    if not _net_gain_s(gain_s, return_s, without.effective_s) > cfg.min_gain_s:
        return BorrowAction(
            BorrowKind.NONE,
            gain_s=gain_s,
            overhead_s=overhead_s,
            reason=f"lending saves {gain_s:.1f} s, overhead {overhead_s:.1f} s",
        )
    return_by_s = now_s + with_lent.effective_s - costs.trainer_onload_s
    return BorrowAction(
        BorrowKind.LEND,
        trainer_gpus,
        return_by_s,
        gain_s,
        overhead_s,
        reason=f"lending saves {gain_s:.1f} s for {overhead_s:.1f} s overhead",
    )


def return_start_s(ctx: DecisionContext, return_by_s: float) -> float:
    """When a return must start for the lent GPUs to be vacated by ``return_by_s``: the
    drain, the sleep and the margin before it."""
    costs = ctx.profile.costs
    return return_by_s - ctx.drain_estimate_s - costs.sleep_s - ctx.cfg.borrowing.return_margin_s


def _net_gain_s(gain_s: float, return_s: float, without_s: float) -> float:
    """The batch time lending saves, less what the return costs it. The return is planned
    to end as the batch completes, so the lent GPUs stop serving ``return_s`` early: the
    batch loses their share of the work over that time (``gain_s / without_s``: the share
    by which they shorten it), not the whole of it; the trainer, idle until the batch is
    complete, loses nothing."""
    if gain_s <= 0.0 or not math.isfinite(without_s) or without_s <= 0.0:
        return gain_s
    return gain_s * (1.0 - min(return_s / without_s, 1.0))


def _return_by_s(ctx: DecisionContext, lent_return_by_s: float) -> float:
    """When the lent GPUs must be vacated, from this decision's prediction of the running
    configuration (the lent GPUs serving): the trainer's onload then ends as the batch
    completes. The prediction made when they were lent is stale by now: the batch may
    take longer (keep them longer: the trainer has nothing to do) or less. Without a
    finite prediction, the lend's own deadline stands."""
    completion_s = ctx.current_prediction.completion_s
    if not math.isfinite(completion_s):
        return lent_return_by_s
    return ctx.now_s + completion_s - ctx.profile.costs.trainer_onload_s


def _same_kind(pool: Sequence[Gpu], lent: Sequence[Gpu]) -> bool:
    """Lending adds no GPU type and no larger node: the configurations predicted on the
    pool cover every TP combination the lent GPUs allow, so none can finish before the
    shortest critical path among them (the predictor's completion is never below it)."""
    in_pool, lent_per_node = node_counts(pool), node_counts(lent)
    types = {t for t, _ in in_pool} | {t for t, _ in lent_per_node}
    largest_node = max(in_pool.values(), default=0)
    return len(types) == 1 and max(lent_per_node.values()) <= largest_node


def always_rule(ctx: DecisionContext) -> BorrowAction:
    """ROLL's partial-GPU mode, no cost model: lend (a share of) the trainer's nodes as
    soon as its update is done and take them back, migrating in-flight requests, the
    moment the next batch is ready."""
    window = ctx.state.borrow
    trainer = ctx.obs.trainer
    if window is not None:
        if trainer.needs_gpus or trainer.phase is TrainerPhase.TRAINING:
            return BorrowAction(
                BorrowKind.FORCE_RETURN, window.gpu_ids, ctx.now_s, reason="the batch is ready"
            )
        if window.returning:
            return BorrowAction(
                BorrowKind.RETURN, window.gpu_ids, window.return_by_s, reason="return under way"
            )
        return BorrowAction(
            BorrowKind.KEEP, window.gpu_ids, window.return_by_s, reason="until the batch is ready"
        )
    if trainer.phase is not TrainerPhase.WAITING or trainer.needs_gpus:
        return BorrowAction(BorrowKind.NONE, reason="the trainer is using its GPUs")
    if ctx.obs.workload.num_unfinished == 0:
        return BorrowAction(BorrowKind.NONE, reason="no rollout work left")
    gpus = [ctx.state.gpu_by_id[g] for g in ctx.trainer_gpu_ids()]
    nodes = sorted({g.node for g in gpus})
    share = math.ceil(round(ctx.cfg.borrowing.lend_fraction * len(nodes), 9))  # k/n -> k
    lent = tuple(g.gpu_id for g in gpus if g.node in nodes[:share])
    if not lent:
        return BorrowAction(BorrowKind.NONE, reason="lend fraction rounds to no node")
    return BorrowAction(
        BorrowKind.LEND, lent, math.inf, reason=f"the trainer waits: lend {share} nodes"
    )


def never_rule(ctx: DecisionContext) -> BorrowAction:
    window = ctx.state.borrow
    if window is None:
        return BorrowAction(BorrowKind.NONE, reason="borrowing disabled")
    return BorrowAction(BorrowKind.RETURN, window.gpu_ids, ctx.now_s, reason="borrowing disabled")


BORROW_RULES: dict[str, BorrowRule] = {
    "predictive": predictive_rule,
    "always": always_rule,
    "never": never_rule,
}
