from __future__ import annotations

import numpy as np
import pytest

from pearl.bench.synth import Layout, build_state, build_workload, settle
from pearl.core.apply import apply_plan
from pearl.core.config import BorrowingConfig, PolicyConfig, SelectionConfig, SwitchingConfig
from pearl.core.context import DecisionContext
from pearl.core.decide import decide
from pearl.core.decision import BorrowKind, Decision
from pearl.core.observation import (
    AllocationGranted,
    AllocationPending,
    AllocationPreempting,
    GrantedNode,
    Observation,
    TrainerPhase,
    TrainerStatus,
    WorkersLost,
)
from pearl.core.pd import PDMode, config_of
from pearl.core.plan import Action
from pearl.core.policies.borrowing import _net_gain_s
from pearl.core.profile import RuntimeProfile
from pearl.core.registry import UnknownName
from pearl.core.state import AllocationStatus
from pearl.core.workload import NextBatch, WorkloadSnapshot
from pearl.io.documents import load_profile

WAITING = TrainerStatus(phase=TrainerPhase.WAITING)
TRAINING = TrainerStatus(phase=TrainerPhase.TRAINING)


@pytest.fixture(scope="module")
def profile() -> RuntimeProfile:
    return load_profile("qwen3-8b")


def _obs(trainer: TrainerStatus = TRAINING, n: int = 96, **kw: object) -> Observation:
    """A latency-bound batch of n trajectories: more GPUs hardly help."""
    workload = build_workload(np.random.default_rng(3), n)
    return Observation(trainer=trainer, workload=workload, **kw)  # type: ignore[arg-type]


def _busy_obs(trainer: TrainerStatus = TRAINING, **kw: object) -> Observation:
    """A batch bound by KV capacity: more GPUs help."""
    rng = np.random.default_rng(3)
    workload = build_workload(rng, 512, prompt_tokens=6000, not_started=1536)
    return Observation(trainer=trainer, workload=workload, **kw)  # type: ignore[arg-type]


def test_same_inputs_same_decision(profile: RuntimeProfile) -> None:
    state = build_state(Layout(1, 2, 1))
    a = decide(state, _obs(WAITING), PolicyConfig(), profile, 10.0)
    b = decide(state, _obs(WAITING), PolicyConfig(), profile, 10.0)
    assert a == b


def test_a_state_at_its_best_target_gets_an_empty_plan(profile: RuntimeProfile) -> None:
    cfg = PolicyConfig(switching=SwitchingConfig(rule="always"))
    state = settle(build_state(Layout(1, 2, 1)), _obs(), cfg, profile, 10.0)
    again = decide(state, _obs(), cfg, profile, 20.0)
    assert again.plan.empty
    assert config_of(state) == again.selection.best.config


def test_margin_rule_keeps_the_running_config_for_small_gains(profile: RuntimeProfile) -> None:
    state = build_state(Layout(1, 2, 1))
    huge_margin = PolicyConfig(switching=SwitchingConfig(min_gain_s=1e7))
    d = decide(state, _obs(), huge_margin, profile, 10.0)
    assert not d.switch.switch and d.plan.empty and "needed" in d.switch.reason


def test_dwell_time_prevents_flapping(profile: RuntimeProfile) -> None:
    state = build_state(Layout(1, 2, 1)).replace(last_pd_switch_s=5.0)
    cfg = PolicyConfig(switching=SwitchingConfig(min_gain_s=0, min_gain_fraction=0, min_dwell_s=60))
    d = decide(state, _obs(), cfg, profile, 10.0)
    assert not d.switch.switch and d.switch.reason.startswith("dwell")


def test_waiting_trainer_lends_then_returns_on_demand(profile: RuntimeProfile) -> None:
    cfg = PolicyConfig()
    state = build_state(Layout(1, 1, 0))
    lend = decide(state, _busy_obs(WAITING), cfg, profile, 10.0)
    assert lend.borrow.kind is BorrowKind.LEND, lend.borrow.reason
    assert lend.state.borrow is not None and lend.borrow.gain_s > lend.borrow.overhead_s
    lent = apply_plan(lend.state, lend.plan, 10.0)
    assert all(g.lent for g in lent.gpus if g.source.value == "base-train")
    needs = TrainerStatus(phase=TrainerPhase.WAITING, needs_gpus=True)
    back = decide(lent, _busy_obs(needs), cfg, profile, 30.0)
    assert back.borrow.kind is BorrowKind.FORCE_RETURN
    limit_s = 30.0 + cfg.borrowing.max_return_delay_s - profile.costs.trainer_onload_s
    assert back.borrow.return_by_s is not None and back.borrow.return_by_s <= limit_s
    # the trainer waits: the lent engines' turns migrate at once, whatever a drain's estimate
    leaving = [s.action for s in back.plan.steps if s.action in (Action.DRAIN, Action.MIGRATE)]
    assert leaving and set(leaving) == {Action.MIGRATE}, back.plan.steps
    assert back.state.borrow is not None and back.state.borrow.forced
    returned = apply_plan(back.state, back.plan, 30.0)
    assert not any(g.lent for g in returned.gpus)
    closed = decide(returned, _busy_obs(TRAINING), cfg, profile, 40.0)
    assert closed.state.borrow is None


def test_a_lent_window_is_kept_while_the_batch_runs_longer_than_predicted_at_the_lend(
    profile: RuntimeProfile,
) -> None:
    """The return follows each decision's prediction, not the one made at the lend: a
    batch that runs longer keeps the GPUs (the trainer has nothing to do before it)."""
    cfg = PolicyConfig()
    lend = decide(build_state(Layout(1, 1, 0)), _busy_obs(WAITING), cfg, profile, 10.0)
    lent = apply_plan(lend.state, lend.plan, 10.0)
    assert lent.borrow is not None
    planned_s = lent.borrow.return_by_s
    late_s = planned_s + 5.0  # past the lend's schedule, and the same work still left
    keep = decide(lent, _busy_obs(WAITING), cfg, profile, late_s)
    assert keep.borrow.kind is BorrowKind.KEEP, keep.borrow.reason
    assert keep.state.borrow is not None and keep.state.borrow.return_by_s > planned_s
    current_s = keep.current.completion_s
    assert keep.state.borrow.return_by_s == pytest.approx(
        late_s + current_s - profile.costs.trainer_onload_s
    )
    # a tick later, the same work: a move within the return's margin is no new state
    again = decide(keep.state, _busy_obs(WAITING), cfg, profile, late_s + 2.0)
    assert again.borrow.kind is BorrowKind.KEEP and again.state.borrow == keep.state.borrow
    # nothing left to generate: the return starts at once
    done = Observation(trainer=WAITING, workload=WorkloadSnapshot())
    back = decide(keep.state, done, cfg, profile, late_s + 1.0)
    assert back.borrow.kind is BorrowKind.RETURN, back.borrow.reason
    assert back.state.borrow is not None and back.state.borrow.returning


def test_forced_return_migrates_when_draining_is_too_slow(profile: RuntimeProfile) -> None:
    cfg = PolicyConfig(
        borrowing=BorrowingConfig(max_return_delay_s=profile.costs.trainer_onload_s + 1)
    )
    state = build_state(Layout(1, 1, 0))
    # lent under the default delay (this one is too short to lend under at all)
    lend = decide(state, _busy_obs(WAITING), PolicyConfig(), profile, 10.0)
    assert decide(state, _busy_obs(WAITING), cfg, profile, 10.0).borrow.kind is BorrowKind.NONE
    lent = apply_plan(lend.state, lend.plan, 10.0)
    needs = TrainerStatus(phase=TrainerPhase.WAITING, needs_gpus=True)
    back = decide(lent, _busy_obs(needs), cfg, profile, 30.0)
    actions = {s.action.value for s in back.plan.steps if s.node.startswith("train")}
    assert "migrate" in actions and "drain" not in actions


def test_training_trainer_lends_nothing(profile: RuntimeProfile) -> None:
    d = decide(build_state(Layout(1, 1, 0)), _obs(TRAINING), PolicyConfig(), profile, 10.0)
    assert d.borrow.kind is BorrowKind.NONE


def test_grant_with_a_short_window_is_released(profile: RuntimeProfile) -> None:
    grant = AllocationGranted(
        allocation_id="99",
        end_by_s=15.0,
        nodes=(GrantedNode(node="x1", gpu_type="h100", num_gpus=8),),
    )
    d = decide(build_state(Layout(1, 1, 0)), _obs(events=(grant,)), PolicyConfig(), profile, 10.0)
    assert d.elastic.releases == ("99",)
    assert not [s for s in d.plan.steps if s.node == "x1"]


def test_grant_with_a_long_window_is_used(profile: RuntimeProfile) -> None:
    grant = AllocationGranted(
        allocation_id="99",
        end_by_s=5000.0,
        nodes=(GrantedNode(node="x1", gpu_type="h100", num_gpus=8),),
    )
    state = build_state(Layout(1, 1, 0))
    d = decide(state, _busy_obs(events=(grant,)), PolicyConfig(), profile, 10.0)
    assert d.switch.mandatory and d.elastic.releases == ()
    assert {s.action.value for s in d.plan.steps if s.node == "x1"} == {"start"}


def test_preemption_moves_engines_off_within_grace(profile: RuntimeProfile) -> None:
    state = build_state(Layout(1, 1, 1))
    ev = AllocationPreempting(allocation_id="el0000", deadline_s=40.0)
    d = decide(state, _obs(events=(ev,)), PolicyConfig(), profile, 10.0)
    assert d.state.allocation_by_id["el0000"].status is AllocationStatus.PREEMPTING
    leaving = [s for s in d.plan.steps if s.node == "elas0000"]
    assert leaving and all(10.0 + s.end_s <= 40.0 for s in leaving if s.action.value != "stop")
    after = apply_plan(d.state, d.plan, 10.0)
    assert not [w for w in after.workers if w.node == "elas0000" and w.active]


def test_lost_workers_leave_the_state_and_their_gpus_are_planned_again(
    profile: RuntimeProfile,
) -> None:
    cfg = PolicyConfig(switching=SwitchingConfig(rule="always"))
    state = settle(build_state(Layout(1, 1, 1)), _busy_obs(), cfg, profile, 10.0)
    lost = sorted(w.worker_id for w in state.workers if w.node == "elas0000")
    assert lost
    ev = WorkersLost(worker_ids=tuple(lost), reason="agent dead")
    d = decide(state, _busy_obs(events=(ev,)), cfg, profile, 20.0)
    assert not set(lost) & set(d.state.worker_by_id)
    assert {g.gpu_id for g in d.state.gpus} == {g.gpu_id for g in state.gpus}  # GPUs stay
    restarted = [s for s in d.plan.steps if s.node == "elas0000"]
    assert restarted and {s.action.value for s in restarted} == {"start"}


def test_elastic_requests_respect_the_cap(profile: RuntimeProfile) -> None:
    d = decide(build_state(Layout(1, 1, 1)), _obs(n=2000), PolicyConfig(), profile, 10.0)
    assert len(d.elastic.requests) <= PolicyConfig().elastic.max_allocations - 1


def test_unknown_policy_is_rejected(profile: RuntimeProfile) -> None:
    with pytest.raises(UnknownName, match="policy: unknown name 'zzz'"):
        decide(build_state(Layout(1, 1, 0)), _obs(), PolicyConfig(policy="zzz"), profile, 1.0)


def test_a_pool_without_engines_gets_them_under_the_margin_rule(profile: RuntimeProfile) -> None:
    """A run's start: no engine serves, so the running configuration's completion is
    infinite and no margin could be met; the change is mandatory (the default rule)."""
    from pearl.core.base_job import BaseNode, base_job_state

    state = base_job_state([BaseNode("n0", "h100", 1)], [BaseNode("n1", "h100", 2)])
    d = decide(state, _obs(), PolicyConfig(), profile, 0.0)
    assert d.switch.switch and d.switch.mandatory
    assert d.plan.steps and {s.action.value for s in d.plan.steps} == {"start"}


def test_a_pool_whose_only_engines_are_asleep_gets_engines(profile: RuntimeProfile) -> None:
    """The base job with an asleep engine on the trainer's GPU (pearl run's and the
    simulator's start): still nothing serves, so the change is mandatory."""
    from pearl.core.base_job import BaseNode, base_job_state

    state = base_job_state(
        [BaseNode("n0", "h100", 1)], [BaseNode("n1", "h100", 2)], asleep_engines=True
    )
    d = decide(state, _obs(), PolicyConfig(), profile, 0.0)
    assert d.switch.switch and d.switch.mandatory
    started = [s for s in d.plan.steps if s.action.value == "start"]
    assert started and all(s.node == "n1" for s in started)  # the rollout GPUs


def _granted_on_a_settled_state(
    profile: RuntimeProfile, num_trajectories: int
) -> tuple[Observation, Decision]:
    state = build_state(Layout(1, 1, 0))
    state = settle(state, _obs(n=num_trajectories), PolicyConfig(), profile, 0.0)
    grant = AllocationGranted(
        allocation_id="99",
        end_by_s=5000.0,
        nodes=(GrantedNode(node="x1", gpu_type="h100", num_gpus=8),),
    )
    obs = _obs(n=num_trajectories, events=(grant,))
    return obs, decide(state, obs, PolicyConfig(), profile, 10.0)


def test_a_grant_serves_even_when_the_batch_ends_before_its_engines_start(
    profile: RuntimeProfile,
) -> None:
    """Four trajectories left: the running engines end the batch before a cold start on
    the granted node would, and an instant move would barely help. The node is still put
    to work (it serves the batches after this one), not held idle while every decision
    said the pool changed and planned nothing (the transition counted as a stall of the
    whole fleet, before)."""
    _, d = _granted_on_a_settled_state(profile, 4)
    assert d.elastic.releases == ()
    assert {s.action.value for s in d.plan.steps if s.node == "x1"} == {"start"}
    assert d.switch.switch and d.switch.mandatory


@pytest.mark.parametrize("num_trajectories", [4, 96])
def test_a_plan_that_adds_engines_predicts_the_batch_on_the_kept_ones_meanwhile(
    profile: RuntimeProfile, num_trajectories: int
) -> None:
    """The decision's predicted time (what a run scores the predictor on) is the one the
    selection ranked the target by: the running engines serve through the plan. Before,
    it was the plan's makespan plus the target's whole completion, as if the fleet
    stopped for the cold start: on the 8B paper scenario a decision that added 8 engines
    to 120 predicted 84.3 s for a batch that took 49.8 s."""
    _, d = _granted_on_a_settled_state(profile, num_trajectories)
    assert d.plan.steps and all(s.action is Action.START for s in d.plan.steps)
    best = d.selection.best
    stalled_s = d.plan.makespan_s + best.completion_s
    assert best.kept_share == 1.0  # it only starts engines: every running one serves on
    assert min(best.completion_s, d.current.completion_s) <= d.predicted_s < stalled_s


def test_a_plan_from_no_engines_predicts_its_makespan_then_the_target(
    profile: RuntimeProfile,
) -> None:
    from pearl.core.base_job import BaseNode, base_job_state

    state = base_job_state([BaseNode("n0", "h100", 1)], [BaseNode("n1", "h100", 2)])
    d = decide(state, _obs(), PolicyConfig(), profile, 0.0)
    assert d.selection.best.kept_share == 0.0
    assert d.predicted_s == pytest.approx(d.plan.makespan_s + d.selection.best.completion_s)


@pytest.mark.parametrize("min_gain_s", [10.0, 1000.0])
def test_a_grant_changes_the_pd_mode_only_when_the_gain_clears_the_switching_margins(
    profile: RuntimeProfile, min_gain_s: float
) -> None:
    """A disaggregated fleet gets a node. The node must be put to work, but the mode need
    not change with it: colocated is predicted 85 s faster, which clears the default
    margins (10 s and 5%) and not 1,000 s. (A pool change once took any mode the
    selection preferred: on a drawn Qwen3-8B variant pearl flipped to disaggregated and
    back at grants and returns, every instance switching role, 71,916 traj/h against
    81,176 with the mode held; docs/architecture.md.)"""
    work = build_workload(np.random.default_rng(3), 512, prompt_tokens=6000, not_started=1536)
    start = PolicyConfig(
        selection=SelectionConfig(modes="disaggregated"), switching=SwitchingConfig(rule="always")
    )
    state = settle(
        build_state(Layout(1, 1, 0)),
        Observation(trainer=TRAINING, workload=work),
        start,
        profile,
        0.0,
    )
    assert config_of(state).mode is PDMode.DISAGGREGATED
    grant = AllocationGranted(
        allocation_id="99",
        end_by_s=5000.0,
        nodes=(GrantedNode(node="x1", gpu_type="h100", num_gpus=8),),
    )
    obs = Observation(trainer=TRAINING, workload=work, events=(grant,))
    cfg = PolicyConfig(switching=SwitchingConfig(min_gain_s=min_gain_s))
    d = decide(state, obs, cfg, profile, 10.0)
    assert d.switch.mandatory and any(s.node == "x1" for s in d.plan.steps)
    held = min_gain_s > 100.0
    mode = PDMode.DISAGGREGATED if held else PDMode.COLOCATED
    assert d.plan.target.config.mode is mode
    assert ("disaggregated held" in " ".join(d.reasons)) is held


def test_a_grant_whose_gpus_gain_nothing_is_released_not_held_idle(
    profile: RuntimeProfile,
) -> None:
    """Sixteen trajectories, latency-bound: with the node or without it the batch is
    predicted to end at the same time, so it goes back to its owner at once."""
    _, d = _granted_on_a_settled_state(profile, 16)
    assert d.elastic.releases == ("99",)
    assert "released 99" in d.elastic.reason
    assert not [s for s in d.plan.steps if s.node == "x1"]
    assert not d.switch.switch


def _nearly_done(groups_per_batch: int, events: tuple[AllocationGranted, ...] = ()) -> Observation:
    """Sixteen trajectories in two groups and the next batch complete (the trainer takes
    it next): it gains nothing from more GPUs; a batch of ``groups_per_batch`` groups of 8
    comes after it."""
    base = build_workload(np.random.default_rng(3), 16)
    trajs = tuple(
        t.model_copy(update={"group_id": f"g{i // 8}"}) for i, t in enumerate(base.trajectories)
    )
    workload = WorkloadSnapshot(
        trajectories=trajs,
        next_batch=NextBatch(groups_needed=0, group_size=8, groups_per_batch=groups_per_batch),
    )
    return Observation(trainer=WAITING, workload=workload, events=events)


@pytest.mark.parametrize(("groups_per_batch", "released"), [(0, True), (128, False)])
def test_a_grant_idle_at_a_batch_end_is_kept_for_the_batch_after_it(
    profile: RuntimeProfile, groups_per_batch: int, released: bool
) -> None:
    """Near a batch's end no GPU shortens it, but a node granted now serves the next
    update's admission: 1,024 fresh trajectories, which more GPUs do finish sooner. The
    elastic rule asks that lookahead before it gives the node back (without one, as
    before, it goes back: the simulator's 8B run released three nodes at 114 s and asked
    Slurm for more at 787 s)."""
    cfg = PolicyConfig(borrowing=BorrowingConfig(rule="never"))
    state = settle(build_state(Layout(1, 1, 0)), _nearly_done(0), cfg, profile, 0.0)
    grant = AllocationGranted(
        allocation_id="99",
        end_by_s=5000.0,
        nodes=(GrantedNode(node="x1", gpu_type="h100", num_gpus=8),),
    )
    d = decide(state, _nearly_done(groups_per_batch, (grant,)), cfg, profile, 10.0)
    assert (d.elastic.releases == ("99",)) is released, d.elastic.reason


def test_pending_requests_like_a_grant_that_gains_nothing_are_cancelled_with_it(
    profile: RuntimeProfile,
) -> None:
    """Granted one by one, each pending node of the same kind would gain nothing either,
    and be given back at once, its release letting Slurm grant the next (the simulator's
    30B runs logged six grant-and-release decisions at one time). Another kind stays."""
    state = build_state(Layout(1, 1, 0))
    state = settle(state, _obs(n=16), PolicyConfig(), profile, 0.0)
    pending = tuple(
        AllocationPending(allocation_id=aid, gpu_type=gpu, num_gpus=n)
        for aid, gpu, n in (("100", "h100", 8), ("101", "h100", 8), ("102", "h100", 16))
    )
    grant = AllocationGranted(
        allocation_id="99",
        end_by_s=5000.0,
        nodes=(GrantedNode(node="x1", gpu_type="h100", num_gpus=8),),
    )
    d = decide(state, _obs(n=16, events=(*pending, grant)), PolicyConfig(), profile, 10.0)
    assert set(d.elastic.releases) == {"99", "100", "101"}
    assert "released 99, 100, 101" in d.elastic.reason


def test_no_switch_is_said_over_a_plan_of_no_steps(profile: RuntimeProfile) -> None:
    cfg = PolicyConfig(switching=SwitchingConfig(rule="always"))
    state = settle(build_state(Layout(1, 2, 1)), _obs(), cfg, profile, 10.0)
    again = decide(state, _obs(), cfg, profile, 20.0)
    assert again.plan.empty and not again.switch.switch
    assert again.switch.reason.startswith("nothing to change")


def test_lending_nets_the_return_by_the_share_of_the_batch_the_lent_gpus_do() -> None:
    """The return ends as the batch completes: the lent GPUs stop serving that long before,
    which costs the batch their share of that time (gain / batch time), not all of it. A
    throughput-bound batch of 55 s that lending shortens by 6 s, with a 6.7 s return: the
    old rule (gain - return > 5 s) declined it, RLBoost's controller took it."""
    net_s = _net_gain_s(6.0, 6.7, 55.0)
    assert net_s == pytest.approx(6.0 * (1 - 6.7 / 55.0))
    assert net_s > PolicyConfig().borrowing.min_gain_s
    assert _net_gain_s(6.0, 80.0, 55.0) == 0.0  # a return longer than the batch: no gain
    assert _net_gain_s(-1.0, 6.7, 55.0) == -1.0  # a loss stays a loss


def test_a_lend_returns_with_a_plan_that_would_run_past_its_return(
    profile: RuntimeProfile,
) -> None:
    """A grant's cold starts (38 s) while the trainer's GPUs are lent and their return is
    due to start in 20 s: the next decision waits for that plan, so a return decided then
    would leave the trainer waiting for the rest of it (the simulator's 30B run: 39.5 s,
    past max_return_delay_s). The return goes with the plan instead."""
    lend = decide(build_state(Layout(1, 1, 0)), _busy_obs(WAITING), PolicyConfig(), profile, 10.0)
    lent = apply_plan(lend.state, lend.plan, 10.0)
    # the margin that puts the return's start 20 s after the decision at 20 s
    ctx = DecisionContext(lent, _busy_obs(WAITING), PolicyConfig(), profile, 20.0)
    return_by_s = 20.0 + ctx.current_prediction.completion_s - profile.costs.trainer_onload_s
    margin_s = return_by_s - ctx.drain_estimate_s - profile.costs.sleep_s - 40.0
    cfg = PolicyConfig(borrowing=BorrowingConfig(return_margin_s=margin_s))
    quiet = decide(lent, _busy_obs(WAITING), cfg, profile, 20.0)
    assert quiet.borrow.kind is BorrowKind.KEEP, quiet.borrow.reason  # no plan to wait for
    grant = AllocationGranted(
        allocation_id="99",
        end_by_s=5000.0,
        nodes=(GrantedNode(node="x1", gpu_type="h100", num_gpus=8),),
    )
    d = decide(lent, _busy_obs(WAITING, events=(grant,)), cfg, profile, 20.0)
    assert d.borrow.kind is BorrowKind.RETURN and "with the plan" in d.borrow.reason
    assert d.state.borrow is not None and d.state.borrow.returning
    actions = {(s.action.value, s.node) for s in d.plan.steps}
    assert ("start", "x1") in actions  # the grant's engines start in the same plan
    assert "onload" in {a for a, node in actions if node.startswith("train")}
