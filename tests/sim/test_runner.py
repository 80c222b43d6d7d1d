"""The simulated run end to end: closed forms, determinism, conservation, trainer waits."""

from __future__ import annotations

import pytest
import sim_fixtures as F

from pearl.runlog.schema import encode
from pearl.sim.baselines import RUN_POLICIES, make_policy
from pearl.sim.kv_cache import BLOCK_TOKENS
from pearl.sim.rollout import trajectory_stream
from pearl.sim.runner import RunInputs, Simulation, simulate, trajectory_rng
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


@pytest.mark.parametrize("policy", RUN_POLICIES)
def test_started_trajectories_are_finished_or_unfinished(policy: str) -> None:
    r = F.busy_run(policy)
    ro, m = r.sim.rollout, r.metrics
    assert ro.num_started == ro.num_finished + len(ro.in_flight)
    assert (m.trajectories, m.unfinished) == (ro.num_finished, len(ro.in_flight))
    ids = [rec.traj_id for rec in F.of_type(r.records, "trajectory_finished")]
    assert len(ids) == len(set(ids)) == m.trajectories
    assert not set(ids) & set(ro.in_flight)
    # trajectories start in stream order: the finished and unfinished are t0 .. t(n-1)
    assert set(ids) | set(ro.in_flight) == {f"t{j:07d}" for j in range(ro.num_started)}
    assert m.trajectories > 0


@pytest.mark.parametrize("policy", RUN_POLICIES)
def test_finished_trajectories_are_their_stream_specs(policy: str) -> None:
    r = F.busy_run(policy)
    sc = r.sim.inputs.scenario
    stream = trajectory_stream(
        r.sim.inputs.trajectory_model, trajectory_rng(0), sc.rollout.max_context_tokens
    )
    specs = [next(stream) for _ in range(r.sim.rollout.num_started)]
    for rec in F.of_type(r.records, "trajectory_finished"):
        spec = specs[int(rec.traj_id[1:])]
        assert (rec.num_turns, rec.output_tokens) == (spec.num_turns, sum(spec.output_tokens))
        assert rec.batch_id == int(rec.traj_id[1:]) // sc.rollout.batch_trajectories


def _somewhere(sim: Simulation) -> dict[str, list[str]]:
    """Where each in-flight trajectory's current turn is: on an engine, in a step that
    is running, parked, or on its way to an instance (tool call or KV transfer)."""
    places: dict[str, list[str]] = {}
    for inst in sim.fleet.instances.values():
        for seq in inst.engine._by_id.values():
            places.setdefault(seq.request.traj_id, []).append(f"engine {inst.worker_id}")
        if inst.result is not None:
            for f in inst.result.finished:
                places.setdefault(f.request.traj_id, []).append(f"finishing {inst.worker_id}")
            for h in inst.result.handoffs:
                places.setdefault(h.request.traj_id, []).append(f"handoff {inst.worker_id}")
    for req in sim.fleet.parked:
        places.setdefault(req.traj_id, []).append("parked")
    for item in sim.loop._heap:
        if isinstance(item.event, Arrive):
            places.setdefault(item.event.request.traj_id, []).append(f"arriving {item.time_s}")
    return places


@pytest.mark.parametrize("policy", RUN_POLICIES)
def test_no_trajectory_is_lost(policy: str) -> None:
    r = F.busy_run(policy)
    places = _somewhere(r.sim)
    lost = sorted(set(r.sim.rollout.in_flight) - set(places))
    assert lost == []
    assert {t: p for t, p in places.items() if len(p) > 1} == {}  # and none is in two places


@pytest.mark.parametrize("policy", RUN_POLICIES)
def test_every_generated_token_is_accounted_for(policy: str) -> None:
    # What the engines generated = outputs of completed turns + what in-flight turns have
    # generated so far (on instances they left, on their engine, or in a running step that
    # finishes them). A token generated twice (a migration that forgot the partial output)
    # or lost (a finished turn dropped) breaks the equality.
    r = F.busy_run(policy)
    sim = r.sim
    in_flight = sum(t.generated_tokens for t in sim.rollout.in_flight.values())
    on_engines = sum(
        inst.engine.num_generated(rid)
        for inst in sim.fleet.instances.values()
        for rid in inst.engine._by_id
    )
    finishing = sum(
        f.request.output_tokens
        for inst in sim.fleet.instances.values()
        if inst.result is not None
        for f in inst.result.finished
    )
    assert r.generated_tokens == sim.rollout.output_tokens + in_flight + on_engines + finishing
    assert sim.rollout.output_tokens == r.metrics.output_tokens


@pytest.mark.parametrize("policy", RUN_POLICIES)
def test_the_trainer_keeps_training(policy: str) -> None:
    # With B = 256 and one batch ahead (k = 1), at most 512 trajectories are started and not
    # consumed: more than that unfinished at the end means a batch never completed.
    r = F.busy_run(policy)
    k, b = 1, 256
    assert r.sim.rollout.num_started <= (r.metrics.train_steps + k + 1) * b
    stuck = [
        bid
        for bid, batch in r.sim.rollout.batches.items()
        if batch.completed_s is None
        and bid < r.sim.next_batch + k
        and batch.started_s is not None
        and batch.started_s < r.metrics.duration_s - 300.0
    ]
    assert stuck == []


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
