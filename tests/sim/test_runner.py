"""The simulated run end to end: closed forms, determinism, conservation, trainer waits."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import sim_fixtures as F

from pearl.rollout.ledger import TrajState
from pearl.runlog.schema import encode
from pearl.serving.requests import Request
from pearl.sim.baselines import RUN_POLICIES, make_policy
from pearl.sim.fleet import Instance
from pearl.sim.kv_cache import BLOCK_TOKENS
from pearl.sim.runner import RunInputs, Simulation, simulate
from pearl.sim.scenario import Scenario
from pearl.sim.timeline import Arrive

# --- closed form -------------------------------------------------------------------------


def _engine_turn_s(engine: object, context: int, prefix: int, output: int) -> float:
    """engine.py: a turn alone on an instance is one prefill step of the new tokens (with
    ``prefix`` tokens cached), then ``output`` decode steps of a batch of one whose context
    is the tokens in KV before the step: ``context, context + 1, ...``."""
    prefill_s = engine.prefill.batch_s([context - prefix], [prefix])  # type: ignore[attr-defined]
    decode_s = sum(
        float(engine.decode.step_s(1, context + i))  # type: ignore[attr-defined]
        for i in range(output)
    )
    return prefill_s + decode_s


@pytest.mark.parametrize("turns", [1, 2])
def test_a_lone_trajectory_finishes_at_cold_start_plus_the_engine_formula(turns: int) -> None:
    # B = 1 and k = 0: one trajectory, alone, until the trainer's first update. roll-fixed
    # keeps colocated instances (no KV transfer, no borrowing, no elastic GPUs).
    prompt, obs, out, tool_s = 100, 20, 10, 0.5
    sc = F.scenario(batch=1, staleness=0, duration_s=120.0)
    model = F.constant_model(turns=turns, prompt=prompt, observation=obs, output=out, tool_s=tool_s)
    r = F.run(F.inputs(sc, model=model), "roll-fixed")
    first = F.of_type(r.records, "decision")[0]
    assert first.t == 0.0 and first.pd_mode == "colocated"
    # The rollout node starts empty: the first plan cold-starts its engines, in parallel.
    assert first.transition_s == pytest.approx(F.profile().costs.engine_cold_start_s)
    finished = F.of_type(r.records, "trajectory_finished")[0]
    assert finished.traj_id == "t0000000" and finished.num_turns == turns
    inst = r.sim.fleet.affinity[finished.traj_id].instance
    engine = F.profile().engine(inst.gpu_type, inst.tp)
    assert engine is not None and inst.engine.engine == engine

    expected = first.transition_s + _engine_turn_s(engine, prompt, 0, out)
    if turns == 2:
        # After the tool call the turn comes back to the same instance; the full blocks of
        # the first turn's prompt and output are cached there (prefix reuse).
        context = prompt + out + obs
        cached = (prompt + out) // BLOCK_TOKENS * BLOCK_TOKENS
        expected += tool_s + _engine_turn_s(engine, context, min(cached, context - 1), out)
    # The multi-step decode sums the same step times with numpy (cumsum): equal up to
    # floating-point rounding.
    assert finished.t == pytest.approx(expected, rel=1e-9)
    assert r.metrics.batch_times_s[0] == pytest.approx(expected, rel=1e-9)


# --- determinism ---------------------------------------------------------------------------


def _elastic_inputs(seed: int) -> RunInputs:
    sc = F.scenario(elastic=True, duration_s=600.0, batch=32)
    return F.inputs(sc, model=F.busy_model(), windows=F.PREEMPTED_WINDOWS, seed=seed)


def _encoded(records: list[object]) -> list[dict[str, object]]:
    return [encode(rec) for rec in records]  # type: ignore[arg-type]


def test_same_inputs_same_run_bit_for_bit() -> None:
    a = F.run(_elastic_inputs(3), "rlboost-plus")
    b = F.run(_elastic_inputs(3), "rlboost-plus")
    assert a.metrics == b.metrics
    assert _encoded(a.records) == _encoded(b.records)
    assert a.metrics.num_events > 1000 and len(a.records) > 100  # a run with something in it


def test_simulate_equals_simulation_run() -> None:
    inputs = _elastic_inputs(4)
    sc = inputs.scenario
    records: list[object] = []
    metrics = simulate(
        inputs, make_policy("roll-partial", sc.policy, 1), records.append, progress=None
    )
    r = F.run(inputs, "roll-partial")
    assert metrics == r.metrics
    assert _encoded(records) == _encoded(r.records)


def test_a_different_seed_gives_a_different_run() -> None:
    a = F.run(_elastic_inputs(3), "roll-fixed")
    b = F.run(_elastic_inputs(5), "roll-fixed")
    assert a.metrics != b.metrics
    assert _encoded(a.records) != _encoded(b.records)


def test_progress_reaches_one() -> None:
    seen: list[float] = []
    inputs = F.inputs(F.scenario(duration_s=300.0))
    sc = inputs.scenario
    Simulation(inputs, make_policy("pearl", sc.policy, 1)).run(seen.append)
    assert seen == sorted(seen) and seen[-1] == 1.0 and len(seen) == 100


# --- conservation --------------------------------------------------------------------------


# Every policy under in-order batches; two policies (one that switches PD, one that lends
# the trainer) under each other rollout rule.
CASES = [(p, F.IN_ORDER) for p in RUN_POLICIES] + [
    (p, rules) for rules in F.RULES[1:] for p in ("pearl", "roll-partial")
]
CASE_IDS = [f"{p}-{b}-{m}-g{g}" for p, (b, m, g) in CASES]


@pytest.mark.parametrize(("policy", "rules"), CASES, ids=CASE_IDS)
def test_admitted_trajectories_are_running_finished_consumed_or_dropped(
    policy: str, rules: tuple[str, str, int]
) -> None:
    r = F.busy_run(policy, 0, rules)
    ro, m = r.sim.rollout, r.metrics
    ledger = ro.ledger
    ledger.check()
    assert ro.num_started == ledger.totals.admitted
    by_state = {
        s: {t for t, rec in ledger.trajectories.items() if rec.state is s} for s in TrajState
    }
    assert (
        set(ro.in_flight)
        == by_state[TrajState.QUEUED] | by_state[TrajState.GENERATING] | by_state[TrajState.IN_ENV]
    )
    assert set(ro.waiting) == by_state[TrajState.FINISHED]
    assert m.trajectories == len(by_state[TrajState.FINISHED]) + len(by_state[TrajState.CONSUMED])
    assert m.unfinished == len(ro.in_flight)
    # trajectories start in stream order: t0 .. t(n-1), each admitted once
    assert set(ledger.trajectories) == {f"t{j:07d}" for j in range(ro.num_started)}
    finished = [rec.traj_id for rec in F.of_type(r.records, "trajectory_finished")]
    restarts = sum(rec.restarts for rec in ledger.trajectories.values())
    assert len(finished) - len(set(finished)) <= restarts  # only a restart finishes again
    assert by_state[TrajState.CONSUMED] <= set(finished)
    consumed = F.of_type(r.records, "batch_consumed")
    assert (
        sum(b.trajectories for b in consumed)
        == m.rollout.consumed
        == len(by_state[TrajState.CONSUMED])
    )
    assert m.train_steps > 0 and m.rollout.consumed > 0


@pytest.mark.parametrize(("policy", "rules"), CASES, ids=CASE_IDS)
def test_finished_trajectories_are_their_stream_specs(
    policy: str, rules: tuple[str, str, int]
) -> None:
    r = F.busy_run(policy, 0, rules)
    sc = r.sim.inputs.scenario
    g = sc.rollout.group_size
    stream = r.sim.inputs.stream()
    specs = [next(stream) for _ in range(r.sim.rollout.num_started)]
    restarted = {t for t, rec in r.sim.rollout.ledger.trajectories.items() if rec.restarts}
    checked = 0
    for rec in F.of_type(r.records, "trajectory_finished"):
        j = int(rec.traj_id[1:])
        if rec.traj_id in restarted:  # a fresh sample of the same prompt
            continue
        spec = specs[j]
        assert (rec.num_turns, rec.output_tokens) == (spec.num_turns, sum(spec.output_tokens))
        if sc.rollout.batching == "in-order":
            assert rec.batch_id == j // sc.rollout.batch_trajectories
        else:
            assert rec.batch_id is None
        checked += 1
    assert checked > 0
    for j in range(0, len(specs), g):  # a group's samples share their prompt (clipped alone)
        assert len({s.prompt_tokens for s in specs[j : j + g]}) == 1 or any(
            s.total_tokens >= sc.rollout.max_context_tokens for s in specs[j : j + g]
        )


def _somewhere(sim: Simulation) -> dict[str, list[str]]:
    """Where each running trajectory's live request is: on an engine, in a step that is
    running, parked, or on its way to an instance (tool call or KV transfer). Requests a
    restart or a drop left behind (stale) are not counted."""
    places: dict[str, list[str]] = {}

    def note(request: Request, where: str) -> None:
        traj = sim.rollout.in_flight.get(request.traj_id)
        if traj is not None and traj.request_id == request.request_id:
            places.setdefault(request.traj_id, []).append(where)

    for inst in sim.fleet.instances.values():
        for seq in inst.engine._by_id.values():
            note(seq.request, f"engine {inst.worker_id}")
        if inst.result is not None:
            for f in inst.result.finished:
                note(f.request, f"finishing {inst.worker_id}")
            for h in inst.result.handoffs:
                note(h.request, f"handoff {inst.worker_id}")
    for req in sim.fleet.parked:
        note(req, "parked")
    for time_s, event in sim.loop.pending():
        if isinstance(event, Arrive):
            note(event.request, f"arriving {time_s}")
    return places


@pytest.mark.parametrize(("policy", "rules"), CASES, ids=CASE_IDS)
def test_no_trajectory_is_lost(policy: str, rules: tuple[str, str, int]) -> None:
    r = F.busy_run(policy, 0, rules)
    places = _somewhere(r.sim)
    lost = sorted(set(r.sim.rollout.in_flight) - set(places))
    assert lost == []
    assert {t: p for t, p in places.items() if len(p) > 1} == {}  # and none is in two places


@pytest.mark.parametrize(("policy", "rules"), CASES, ids=CASE_IDS)
def test_every_generated_token_is_accounted_for(policy: str, rules: tuple[str, str, int]) -> None:
    # What the engines generated = outputs of completed turns + what running turns have
    # generated so far (on instances they left, on their engine, or in a running step that
    # finishes them) + the partial turns a restart or a drop aborted. A token generated
    # twice (a migration that forgot the partial output) or lost breaks the equality.
    r = F.busy_run(policy, 0, rules)
    sim = r.sim

    def live(request: Request) -> bool:
        traj = sim.rollout.in_flight.get(request.traj_id)
        return traj is not None and traj.request_id == request.request_id

    in_flight = sum(t.generated_tokens for t in sim.rollout.in_flight.values())
    on_engines = sum(
        inst.engine.num_generated(rid)
        for inst in sim.fleet.instances.values()
        for rid, seq in inst.engine._by_id.items()
        if live(seq.request)
    )
    finishing = sum(
        f.request.output_tokens
        for inst in sim.fleet.instances.values()
        if inst.result is not None
        for f in inst.result.finished
        if live(f.request)
    )
    aborted = sim.rollout.aborted_tokens
    assert (
        r.generated_tokens
        == sim.rollout.output_tokens + in_flight + on_engines + finishing + aborted
    )
    assert sim.rollout.output_tokens == r.metrics.output_tokens
    if rules[1] == "interrupt" or rules == F.IN_ORDER:
        assert r.metrics.rollout.dropped == 0


@pytest.mark.parametrize(("policy", "rules"), CASES, ids=CASE_IDS)
def test_the_trainer_keeps_training(policy: str, rules: tuple[str, str, int]) -> None:
    # With B = 256 and a staleness bound of 1, at most 512 trajectories are admitted and
    # not accepted (finished, not dropped) beyond what the updates allow: more than that
    # means a batch never completed.
    r = F.busy_run(policy, 0, rules)
    k, b = 1, 256
    ledger = r.sim.rollout.ledger
    assert ledger.num_accepted + ledger.num_running <= (r.metrics.train_steps + k + 1) * b
    if rules == F.IN_ORDER:
        stuck = [
            bid
            for bid, batch in r.sim.rollout.batches.items()
            if batch.completed_s is None
            and bid < ledger.totals.batches + k
            and batch.started_s is not None
            and batch.started_s < r.metrics.duration_s - 300.0
        ]
        assert stuck == []
    consumed = F.of_type(r.records, "batch_consumed")
    assert len(consumed) in (r.metrics.train_steps, r.metrics.train_steps + 1)
    assert all(c.max_staleness_versions <= k for c in consumed)
    assert all(0 <= c.off_policy_tokens <= c.output_tokens for c in consumed)


# --- the trainer's wait --------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_pearl_returns_lent_gpus_within_the_bound(seed: int) -> None:
    r = F.busy_run("pearl", seed)
    bound_s = r.sim.inputs.scenario.policy.borrowing.max_return_delay_s
    decisions = F.of_type(r.records, "decision")
    assert any(d.borrow == "lend" for d in decisions)  # it did lend: the bound is at stake
    assert r.metrics.gpu_hours_borrowed > 0
    waits = [s.waited_for_gpus_s for s in F.of_type(r.records, "train_step")]
    assert waits and max(waits) == r.metrics.max_trainer_wait_s
    assert r.metrics.max_trainer_wait_s <= bound_s


def test_pearl_wait_bound_with_a_tight_return_delay() -> None:
    sc = F.scenario(elastic=True, batch=256, train_step_s=10.0, max_return_delay_s=3.0)
    r = F.run(F.inputs(sc, model=F.busy_model(), windows=F.PREEMPTED_WINDOWS), "pearl")
    assert r.metrics.max_trainer_wait_s <= 3.0


# --- the log -------------------------------------------------------------------------------


def test_log_starts_and_ends_the_run_and_is_in_time_order() -> None:
    r = F.busy_run("roll-partial")
    recs = r.records
    assert recs[0].type == "run_started" and recs[-1].type == "run_ended"
    assert recs[0].policy == "roll-partial" and recs[0].seed == 0
    assert recs[-1].t == r.metrics.duration_s
    times = [rec.t for rec in recs]
    assert times == sorted(times)
    steps = F.of_type(recs, "train_step")
    assert [s.step for s in steps] == list(range(len(steps)))
    assert [s.policy_version for s in steps] == [s.step + 1 for s in steps]
    assert len(F.of_type(recs, "decision")) == r.metrics.decisions


def test_batch_completed_carries_the_prediction() -> None:
    r = F.busy_run("roll-fixed")
    completed = F.of_type(r.records, "batch_completed")
    assert completed
    assert all(c.predicted_s is not None for c in completed)


def test_a_request_bound_for_an_instance_that_switched_goes_elsewhere() -> None:
    """A switch takes an instance off and brings one back under the same worker id: a
    turn in flight to the old one must not reach its (draining, gone) engine."""
    from pearl.core.roles import Role
    from pearl.io.documents import load_profile
    from pearl.sim.fleet import Fleet

    fleet = Fleet(load_profile("qwen3-8b"))
    old = fleet.add("e0", Role.COLOCATED, "h20", "n0", 1, 0)
    fleet.stop_accepting("e0")
    fleet.remove("e0")
    new = fleet.add("e0", Role.PREFILL, "h20", "n0", 1, 0)
    assert not fleet.accepts(old)
    assert fleet.accepts(new)


@pytest.mark.parametrize(
    ("past_bound", "group_size"), [("interrupt", 2), ("restart", 1), ("drop", 1)]
)
def test_the_trainer_goes_on_after_an_update_takes_a_complete_batch_back(
    past_bound: str, group_size: int
) -> None:
    # A small batch whose groups are complete while an update runs: the update's
    # past-bound rule takes members back, the batch is incomplete again and completes
    # later; the trainer must start when it does (it once waited for the run's end).
    sc = F.scenario(
        batch=16,
        staleness=1,
        batching="first-completed",
        past_bound=past_bound,
        group_size=group_size,
        duration_s=600.0,
        train_step_s=10.0,
    )
    r = F.run(F.inputs(sc, model=F.busy_model(), seed=0), "roll-fixed")
    ledger, sim = r.sim.rollout.ledger, r.sim
    assert r.metrics.rollout.restarted + r.metrics.rollout.dropped > 0
    assert not (ledger.batch_ready() and not sim.training)  # never ready and idle at the end
    steps = F.of_type(r.records, "train_step")
    assert len(steps) > 20 and steps[-1].t > 550.0


@pytest.mark.parametrize(("policy", "rules"), CASES, ids=CASE_IDS)
def test_decision_records_neither_repeat_nor_switch_over_empty_plans(
    policy: str, rules: tuple[str, str, int]
) -> None:
    """Several causes at one time (grants, a window's end, the trainer's phase) get one
    decision, and a decision that plans no step does not say it switches."""
    decisions = F.of_type(F.busy_run(policy, 0, rules).records, "decision")
    assert decisions
    same = [
        a.t
        for a, b in itertools.pairwise(decisions)
        if a.model_dump(exclude={"decide_s"}) == b.model_dump(exclude={"decide_s"})
    ]
    assert same == []
    assert [d.t for d in decisions if d.switch and d.num_steps == 0] == []


@pytest.mark.parametrize("batching", ["in-order", "first-completed"])
def test_a_cap_in_flight_admits_again_as_trajectories_finish(batching: str) -> None:
    """``max_in_flight`` bounds the trajectories running, not the run: a finished one
    frees its slot for the next group. Admitting only at updates, a batch of 16 under a
    cap of 4 never completed (the oracle's soundness variant finished 31 trajectories of
    the 165 its rules allow)."""
    doc = F.scenario_dict(batch=16, batching=batching)
    doc["rollout"]["max_in_flight"] = 4
    r = F.run(F.inputs(Scenario.model_validate(doc)), "roll-fixed")
    assert r.metrics.train_steps >= 2
    assert max(len(r.sim.rollout.in_flight), r.sim.rollout.ledger.num_running) <= 4


def test_no_instance_holds_more_requests_than_it_runs_and_parked_turns_all_go() -> None:
    """With two slots an instance (max_num_seqs 2), sixteen trajectories at a time: the
    turns beyond the slots wait parked at the router, not in an instance's queue, and go
    as requests leave; every batch still completes."""
    base = F.profile()
    gpus = {
        name: gpu.model_copy(
            update={"engines": tuple(e.model_copy(update={"max_num_seqs": 2}) for e in gpu.engines)}
        )
        for name, gpu in base.gpus.items()
    }
    profile = base.model_copy(update={"gpus": gpus})
    inputs = F.inputs(F.scenario(batch=16, batching="first-completed"))
    inputs = dataclasses.replace(inputs, profile=profile)
    sim = Simulation(inputs, make_policy("roll-fixed", inputs.scenario.policy, 1))
    most = [0]
    step = sim.fleet.start_step

    def watched(inst: Instance, now_s: float, horizon_s: float) -> float | None:
        most[0] = max(most[0], inst.engine.num_requests + inst.num_assigned)
        return step(inst, now_s, horizon_s)

    sim.fleet.start_step = watched  # type: ignore[method-assign]
    metrics = sim.run()
    assert most[0] <= 2
    assert metrics.train_steps >= 3
