"""Each baseline's defining behaviour, read from its run's log and metrics
(``pearl/sim/baselines.py`` docstring): on the busy inputs of ``sim_fixtures`` (B = 256 on
one rollout node, elastic windows that end mid-run), where lending and elastic GPUs pay."""

from __future__ import annotations

import pytest
import sim_fixtures as F

from pearl.core.config import PolicyConfig
from pearl.sim.baselines import RUN_POLICIES, make_policy
from pearl.sim.runner import Simulation


def _decisions(policy: str) -> list[object]:
    return F.of_type(F.busy_run(policy).records, "decision")


def _allocations(policy: str) -> list[object]:
    return F.of_type(F.busy_run(policy).records, "allocation")


def test_every_run_is_logged_under_its_policy() -> None:
    for name in RUN_POLICIES:
        r = F.busy_run(name)
        assert r.metrics.policy == name
        assert {d.policy for d in _decisions(name)} == {name}


def test_roll_fixed_holds_its_colocated_base_gpus() -> None:
    m = F.busy_run("roll-fixed").metrics
    assert m.gpu_hours_elastic == 0.0 and m.gpu_hours_borrowed == 0.0
    decisions = _decisions("roll-fixed")
    assert {d.pd_mode for d in decisions} == {"colocated"}
    assert all("disaggregated" not in d.target for d in decisions)
    assert {d.borrow for d in decisions} == {"none"}
    assert all(d.num_elastic_requests == 0 for d in decisions)
    assert _allocations("roll-fixed") == []
    # It never switches voluntarily: only the bootstrap placement is a transition.
    assert decisions[0].switch and not any(d.switch for d in decisions[1:])
    assert m.transitions == 1 and m.max_trainer_wait_s == 0.0


def test_roll_partial_lends_the_trainer_between_updates() -> None:
    m = F.busy_run("roll-partial").metrics
    assert m.gpu_hours_borrowed > 0.0
    assert m.gpu_hours_elastic == 0.0 and _allocations("roll-partial") == []
    decisions = _decisions("roll-partial")
    kinds = [d.borrow for d in decisions]
    assert "lend" in kinds
    # ... and takes them back when the batch is ready (the trainer needs them)
    assert "force_return" in kinds or "return" in kinds
    assert {d.pd_mode for d in decisions} == {"colocated"}
    # lending pays here: it finishes more than the same policy without lending
    assert m.trajectories > F.busy_run("roll-fixed").metrics.trajectories


def test_roll_partial_logs_borrow_records() -> None:
    borrows = F.of_type(F.busy_run("roll-partial").records, "borrow")
    assert any(b.kind == "lend" for b in borrows)


def test_rlboost_plus_takes_elastic_gpus_and_stays_colocated() -> None:
    m = F.busy_run("rlboost-plus").metrics
    assert m.gpu_hours_elastic > 0.0
    assert m.gpu_hours_borrowed > 0.0
    decisions = _decisions("rlboost-plus")
    assert {d.pd_mode for d in decisions} <= {"colocated", "none"}
    assert any(d.num_elastic_requests > 0 for d in decisions)
    statuses = {a.status for a in _allocations("rlboost-plus")}
    assert {"requested", "granted", "preempting", "ended"} <= statuses


def test_rlboost_plus_without_windows_gets_no_elastic_gpus() -> None:
    sc = F.scenario(elastic=True, batch=64, train_step_s=10.0, duration_s=300.0)
    r = F.run(F.inputs(sc, model=F.busy_model(), windows=()), "rlboost-plus")
    assert r.metrics.gpu_hours_elastic == 0.0
    granted = [a for a in F.of_type(r.records, "allocation") if a.status == "granted"]
    assert granted == []


def test_rlboost_plus_aimd_controller() -> None:
    cfg = PolicyConfig()
    p = make_policy("rlboost-plus", cfg, trainer_nodes=4)
    assert p.lent_nodes == 1 and p.config().borrowing.lend_fraction == 0.25
    p.on_train_step(0.0)  # did not wait: one node more
    p.on_train_step(0.0)
    assert p.lent_nodes == 3
    p.on_train_step(cfg.borrowing.max_return_delay_s)  # waited: halve (whole nodes)
    assert p.lent_nodes == 1
    p.on_train_step(cfg.borrowing.max_return_delay_s)
    assert p.lent_nodes == 1  # never below one node
    for _ in range(10):
        p.on_train_step(0.0)
    assert p.lent_nodes == 4
    assert p.config().borrowing.lend_fraction == 1.0


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_static_pd_holds_one_mode(mode: str) -> None:
    name = "roll-fixed" if mode == "colocated" else f"static-pd-{mode}"
    m = F.busy_run(name).metrics
    decisions = _decisions(name)
    assert {d.pd_mode for d in decisions} == {mode}
    assert all(d.target.startswith(mode) for d in decisions)
    assert m.gpu_hours_elastic == 0.0 and m.gpu_hours_borrowed == 0.0
    assert not any(d.switch for d in decisions[1:])
    if mode == "disaggregated":
        roles = {inst.role.value for inst in F.busy_run(name).sim.fleet.instances.values()}
        assert roles == {"prefill", "decode"}


def test_pearl_runs_the_scenario_configuration() -> None:
    sc = F.scenario(elastic=True)
    p = make_policy("pearl", sc.policy, sc.cluster.trainer.nodes)
    assert p.config() == sc.policy
    boot = p.config(bootstrap=True)
    assert boot.switching.rule == "always"
    assert boot.model_copy(update={"switching": sc.policy.switching}) == sc.policy
    # the baselines change it
    for name in RUN_POLICIES:
        if name != "pearl":
            assert make_policy(name, sc.policy, 1).config() != sc.policy


def test_pearl_uses_what_the_scenario_allows() -> None:
    # The scenario allows lending and elastic GPUs: on these inputs pearl uses both (the
    # baselines are each held out of at least one).
    r = F.busy_run("pearl")
    assert r.metrics.gpu_hours_elastic > 0.0 and r.metrics.gpu_hours_borrowed > 0.0


def test_pearl_holds_the_pd_mode_the_simulator_confirms() -> None:
    """Both modes are allowed; on these inputs (in-order batches of 256 fresh trajectories,
    whole prompts of up to 4,000 tokens) colocated serves faster, and pearl holds it. It
    held disaggregated while its predictor priced a fresh prompt as a returning turn
    (12,184 traj/h against 14,296 now; pearl.core.prompt_backlog)."""
    r = F.busy_run("pearl")
    assert {d.pd_mode for d in F.of_type(r.records, "decision")} == {"colocated"}
    inputs = F.busy_inputs()
    sc = inputs.scenario
    only = sc.policy.model_copy(
        update={"selection": sc.policy.selection.model_copy(update={"modes": "disaggregated"})}
    )
    disaggregated = Simulation(inputs, make_policy("pearl", only, 1), None).run().summary()
    held = r.metrics.summary()
    assert disaggregated["throughput_traj_per_h"] < held["throughput_traj_per_h"]


def test_unknown_policy() -> None:
    with pytest.raises(KeyError):
        make_policy("nope", PolicyConfig(), 1)
