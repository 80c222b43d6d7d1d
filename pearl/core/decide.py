"""``decide()``: the single entry point of the simulator and the coordinator.

    state    = observe(state, observation)          # passive: mirror what happened
    elastic  = elastic rule (which grants to use, what to request or release)
    borrow   = borrowing rule (lend, keep, return, force a return)
    target   = best PD configuration for the resulting GPU pool
    plan     = incremental transition plan from the state to the target
    verdict  = switching rule: is the plan worth it (always, when the pool changed);
               no switch over a plan of no steps
    (a lend kept while a plan would run past its return's start returns with the plan:
    decided again with the return, as the next decision waits for the plan)

Pure: the clock arrives as ``now_s``; nothing is read or written. Deciding twice on the
same inputs returns equal decisions, and a state that already matches the best target
gets an empty plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from pearl.core.config import PolicyConfig
from pearl.core.context import DecisionContext
from pearl.core.decision import BorrowAction, BorrowKind, Decision, ElasticAction
from pearl.core.observation import Observation, observe
from pearl.core.plan import Target, TransitionPlan
from pearl.core.planner import plan_transition
from pearl.core.policies.borrowing import BORROW_RULES, return_start_s
from pearl.core.policies.elastic import ELASTIC_RULES
from pearl.core.policies.switching import SWITCH_RULES, SwitchInput
from pearl.core.pool import Pool
from pearl.core.profile import RuntimeProfile
from pearl.core.registry import check_names, lookup
from pearl.core.selection import Selection
from pearl.core.state import AllocationKind, AllocationStatus, BorrowWindow, ClusterState

Policy = Callable[[ClusterState, Observation, PolicyConfig, RuntimeProfile, float], Decision]


def decide(
    state: ClusterState,
    obs: Observation,
    cfg: PolicyConfig,
    profile: RuntimeProfile,
    now_s: float,
) -> Decision:
    check_names(cfg, POLICIES)
    return POLICIES[cfg.policy](state, obs, cfg, profile, now_s)


def decide_pearl(
    state: ClusterState,
    obs: Observation,
    cfg: PolicyConfig,
    profile: RuntimeProfile,
    now_s: float,
) -> Decision:
    ctx = DecisionContext(
        _close_finished_borrow(observe(state, obs, now_s)), obs, cfg, profile, now_s
    )
    observed = ctx.state
    elastic = lookup(ELASTIC_RULES, cfg.elastic.rule, "elastic.rule")(ctx)
    borrow = lookup(BORROW_RULES, cfg.borrowing.rule, "borrowing.rule")(ctx)
    decision = _decide_with(ctx, observed, elastic, borrow)
    returning = _return_with_the_plan(ctx, borrow, decision.plan)
    if returning is not None:  # the plan would hold the next decision past the return
        ctx.state = observed
        decision = _decide_with(ctx, observed, elastic, returning)
    return decision


def _return_with_the_plan(
    ctx: DecisionContext, borrow: BorrowAction, plan: TransitionPlan
) -> BorrowAction | None:
    """A kept lend whose return would have to start while this decision's plan still runs
    returns with the plan: the next decision waits for the plan (one runs at a time), and
    a return decided then left the trainer waiting for the rest of it (a grant's cold
    starts, up to 40 s) on top of its own. None when the plan ends in time."""
    window = ctx.state.borrow
    if borrow.kind is not BorrowKind.KEEP or plan.empty or window is None:
        return None
    assert borrow.return_by_s is not None
    start_at_s = return_start_s(ctx, borrow.return_by_s)
    if ctx.now_s + plan.makespan_s <= start_at_s:
        return None
    return BorrowAction(
        BorrowKind.RETURN,
        borrow.gpu_ids,
        borrow.return_by_s,
        reason=f"with the plan: it runs to {ctx.now_s + plan.makespan_s:.1f} s, past the "
        f"return's start at {start_at_s:.1f} s",
    )


def _decide_with(
    ctx: DecisionContext,
    observed: ClusterState,
    elastic: ElasticAction,
    borrow: BorrowAction,
) -> Decision:
    """The decision from the observed state with these elastic and borrow actions. Called
    twice when the lend returns with the plan: the context's selections are kept per GPU
    budget, and the second call's budget (no lent GPUs) is another."""
    cfg, profile, now_s = ctx.cfg, ctx.profile, ctx.now_s
    ctx.state = _with_borrow(observed, borrow, now_s, cfg.borrowing.return_margin_s)
    lent = frozenset(borrow.gpu_ids if borrow.kind in (BorrowKind.LEND, BorrowKind.KEEP) else ())
    pool = ctx.rollout_gpus(lent, elastic.releases)
    current_config = ctx.current_config
    current = ctx.current_prediction
    lending = bool(lent - ctx.lent_gpu_ids())
    selection = ctx.select(pool, lending=lending)
    mandatory = _pool_changed(ctx.state, pool, lent != ctx.lent_gpu_ids(), elastic)
    held_reason = ""
    if mandatory:
        selection, held_reason = _mode_held(ctx, selection, pool, lending)
    target = Target(selection.best.config, lent)
    if mandatory or target.config != current_config:
        plan = plan_transition(ctx.state, target, profile, now_s, ctx.drain_estimate_s)
    else:  # what the planner would return, without its cost on every tick
        plan = TransitionPlan(target, reason=f"already at {current_config.label()}")
    switch_input = SwitchInput(
        current_s=current.completion_s,
        target_s=selection.best.completion_s,
        cost_s=plan.makespan_s,
        mandatory=mandatory,
        last_switch_s=ctx.state.last_pd_switch_s,
        now_s=now_s,
    )
    verdict = lookup(SWITCH_RULES, cfg.switching.rule, "switching.rule")(
        switch_input, cfg.switching
    )
    if verdict.switch and plan.empty:  # nothing to carry out: no switch to speak of
        reason = f"nothing to change: {plan.reason}"
        verdict = dataclasses.replace(verdict, switch=False, reason=reason)
    if not verdict.switch:
        plan = TransitionPlan(Target(current_config, lent), reason=verdict.reason)
    elif not plan.empty and target.config != current_config:
        ctx.state = ctx.state.evolve(last_pd_switch_s=now_s)
    reasons = (
        f"elastic: {elastic.reason}",
        f"borrow: {borrow.kind.value}: {borrow.reason}",
        f"select: {selection.reason}" + (f"; {held_reason}" if held_reason else ""),
        f"switch: {'yes' if verdict.switch else 'no'}: {verdict.reason}",
        f"plan: {len(plan.steps)} steps, {plan.makespan_s:.1f} s; {plan.reason}",
    )
    return Decision(
        time_s=now_s,
        policy=cfg.policy,
        reasons=reasons,
        plan=plan,
        switch=verdict,
        borrow=borrow,
        elastic=elastic,
        current=current,
        selection=selection,
        state=ctx.state,
    )


def _mode_held(
    ctx: DecisionContext, selection: Selection, pool: Pool, lending: bool
) -> tuple[Selection, str]:
    """A change of the GPU pool must be made, but a change of PD mode with it need not:
    every engine that switches role loses the prefixes it caches and the requests it
    runs, which the transition estimate does not count. So when the best configuration
    is of another mode than the running one, the best of the running mode is taken
    unless the other saves more than the switching rule's margins (``min_gain_s`` and
    ``min_gain_fraction`` of the time, effective times: transitions included)."""
    current = ctx.current_config
    best = selection.best
    if not current.instances or best.config.mode is current.mode:
        return selection, ""
    if ctx.cfg.selection.modes != "any":
        return selection, ""
    held = ctx.select(pool, lending=lending, modes=current.mode.value)
    sw = ctx.cfg.switching
    gain_s = held.best.effective_s - best.effective_s
    needed_s = sw.min_gain_s + sw.min_gain_fraction * held.best.effective_s
    if gain_s > needed_s or not math.isfinite(held.best.effective_s):
        return selection, ""
    return held, (
        f"{current.mode.value} held: {best.config.label()} saves {gain_s:.1f} s <= "
        f"{needed_s:.1f} s needed to change mode"
    )


def _close_finished_borrow(state: ClusterState) -> ClusterState:
    """A returning window closes once its GPUs are no longer lent (the trainer onloaded)."""
    window = state.borrow
    if window is None or not window.returning:
        return state
    if any(state.gpu_by_id[g].lent for g in window.gpu_ids if g in state.gpu_by_id):
        return state
    return state.replace(borrow=None)


def _with_borrow(
    state: ClusterState, borrow: BorrowAction, now_s: float, margin_s: float
) -> ClusterState:
    if borrow.kind is BorrowKind.LEND:
        assert borrow.return_by_s is not None
        window = BorrowWindow(
            gpu_ids=borrow.gpu_ids, lent_at_s=now_s, return_by_s=borrow.return_by_s
        )
        return state.replace(borrow=window)
    if borrow.kind is BorrowKind.KEEP and state.borrow is not None:
        # The schedule follows the prediction, but only a move of more than the return's
        # margin is a new state: every tick's prediction differs by a little, and each new
        # state is a journal write of the whole state for the coordinator.
        assert borrow.return_by_s is not None
        if abs(borrow.return_by_s - state.borrow.return_by_s) > margin_s:
            return state.replace(
                borrow=state.borrow.model_copy(update={"return_by_s": borrow.return_by_s})
            )
        return state
    if borrow.kind in (BorrowKind.RETURN, BorrowKind.FORCE_RETURN) and state.borrow is not None:
        assert borrow.return_by_s is not None
        forced = state.borrow.forced or borrow.kind is BorrowKind.FORCE_RETURN
        window = state.borrow.model_copy(
            update={"returning": True, "return_by_s": borrow.return_by_s, "forced": forced}
        )
        if window != state.borrow:
            return state.replace(borrow=window)
    return state


def _pool_changed(
    state: ClusterState, pool: Pool, lending_changes: bool, elastic: ElasticAction
) -> bool:
    """The running configuration must change: engines outside the pool, a lend or a
    return to carry out, a usable grant that hosts no worker yet, or no engine at all on
    a pool that has GPUs, or only asleep ones (a run's start: nothing serves, so the
    running configuration's predicted completion is infinite and no margin could ever be
    met)."""
    if pool and not state.active_engines:
        return True
    if not pool.holds_active_engines(state):
        return True
    if lending_changes:
        return True
    # a granted elastic allocation that is not released is in the pool whole
    hosting = state.allocations_hosting_live
    return any(
        a.kind is AllocationKind.ELASTIC
        and a.status is AllocationStatus.GRANTED
        and a.allocation_id not in elastic.releases
        and a.allocation_id not in hosting
        for a in state.allocations
    )


POLICIES: dict[str, Policy] = {"pearl": decide_pearl}
