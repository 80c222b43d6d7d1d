"""The oracle bound: no simulated policy beats it (both batchings, every past-bound mode,
groups, a cap on trajectories in flight), it grows with the run, the in-order bound is the
one of before first-completed batching bit for bit, and both arguments match hand
computations (the first-completed ones on the toy engine of ``oracle_fixtures``)."""

from __future__ import annotations

import itertools
from typing import Any

import oracle_fixtures as O
import pytest
import sim_fixtures as F

from pearl.rollout.rules import Batching, PastBound
from pearl.sim.baselines import RUN_POLICIES
from pearl.sim.oracle import OracleBound, oracle_bound, run_oracle_bound
from pearl.sim.runner import RunInputs
from pearl.sim.scenario import Scenario

IN_ORDER, FIRST = Batching.IN_ORDER, Batching.FIRST_COMPLETED
FIRST_COMPLETED_PARTS = ("by_admission", "by_in_flight", "by_blend", "updates", "max_updates")


def _with(sc: Scenario, **rollout: Any) -> Scenario:
    """``sc`` with these rollout fields, validated."""
    doc = sc.model_dump()
    doc["rollout"].update(rollout)
    return Scenario.model_validate(doc)


def _inputs_with(inputs: RunInputs, **rollout: Any) -> RunInputs:
    sc = _with(inputs.scenario, **rollout)
    return F.inputs(sc, model=inputs.trajectory_model, windows=inputs.windows, seed=inputs.seed)


def _oracle(inputs: RunInputs) -> OracleBound:
    return run_oracle_bound(inputs)


def _check_parts(bound: OracleBound) -> None:
    """The bound is the least of its parts; in order it has only today's two."""
    parts = [bound.by_critical_path, bound.by_capacity]
    if bound.by_admission is None:
        assert all(getattr(bound, p) is None for p in FIRST_COMPLETED_PARTS)
    else:
        assert bound.by_in_flight is not None and bound.by_blend is not None
        parts += [bound.by_admission, bound.by_in_flight, bound.by_blend]
        assert bound.updates is not None and bound.max_updates is not None
        assert 0 <= bound.updates <= bound.max_updates
    assert bound.trajectories == min(parts)


# --- no simulated policy beats it ---------------------------------------------------------


@pytest.mark.parametrize("batching", [FIRST, IN_ORDER])
@pytest.mark.parametrize("policy", RUN_POLICIES)
def test_no_policy_beats_the_oracle_on_busy_inputs(policy: str, batching: Batching) -> None:
    if batching is F.busy_inputs().scenario.rollout.batching:
        r = F.busy_run(policy)  # shared with the other test modules
    else:
        r = F.run(_inputs_with(F.busy_inputs(), batching=batching), policy)
    bound = _oracle(r.sim.inputs)
    assert 0 < r.metrics.trajectories <= bound.trajectories
    _check_parts(bound)


@pytest.mark.parametrize(("batching", "seed"), [(FIRST, 1), (FIRST, 2), (IN_ORDER, 1)])
@pytest.mark.parametrize("policy", RUN_POLICIES)
def test_no_policy_beats_the_oracle_on_light_inputs(
    policy: str, batching: Batching, seed: int
) -> None:
    # Light work, short train steps: the run is close to its critical path.
    sc = F.scenario(elastic=True, duration_s=600.0, batch=16, train_step_s=5.0)
    inputs = F.inputs(_with(sc, batching=batching), windows=F.PREEMPTED_WINDOWS, seed=seed)
    m = F.run(inputs, policy).metrics
    assert 0 < m.trajectories <= _oracle(inputs).trajectories


@pytest.mark.parametrize(
    "rollout",
    [
        {"past_bound": PastBound.INTERRUPT},
        {"past_bound": PastBound.RESTART, "max_in_flight": 8},
        {"past_bound": PastBound.DROP},
    ],
    ids=["interrupt", "restart-max8", "drop"],
)
@pytest.mark.parametrize("policy", RUN_POLICIES)
def test_no_policy_beats_the_oracle_with_groups(policy: str, rollout: dict[str, Any]) -> None:
    # First-completed batches of 4 groups of 4 samples, each past-bound mode (and a cap
    # of 8 in flight, two groups).
    sc = F.scenario(elastic=True, duration_s=400.0, batch=16, train_step_s=5.0)
    sc = _with(sc, batching=FIRST, group_size=4, **rollout)
    inputs = F.inputs(sc, windows=F.PREEMPTED_WINDOWS, seed=1)
    m = F.run(inputs, policy).metrics
    bound = _oracle(inputs)
    assert 0 < m.trajectories <= bound.trajectories
    _check_parts(bound)


# --- it grows with the run --------------------------------------------------------------


@pytest.mark.parametrize(
    "rollout",
    [
        {"batching": IN_ORDER},
        {"batching": FIRST},
        {"batching": FIRST, "past_bound": PastBound.RESTART},
        {"batching": FIRST, "past_bound": PastBound.DROP},
        {"batching": FIRST, "group_size": 4, "max_in_flight": 12},
    ],
    ids=["in-order", "interrupt", "restart", "drop", "groups-max12"],
)
def test_the_oracle_is_monotone_in_duration(rollout: dict[str, Any]) -> None:
    bounds = []
    for duration_s in (200.0, 400.0, 900.0, 1800.0, 3600.0):
        sc = F.scenario(elastic=True, duration_s=duration_s, batch=32, train_step_s=10.0)
        sc = _with(sc, **rollout)
        bounds.append(_oracle(F.inputs(sc, model=F.busy_model(), windows=F.PREEMPTED_WINDOWS)))
    for a, b in itertools.pairwise(bounds):
        _check_parts(b)
        assert a.trajectories <= b.trajectories
        if rollout["batching"] is IN_ORDER:
            assert a.by_critical_path <= b.by_critical_path
            assert a.by_capacity <= b.by_capacity
            assert a.capacity_gpu_s < b.capacity_gpu_s
        else:  # its parts are taken at the best update count, which moves
            assert a.max_updates is not None and b.max_updates is not None
            assert a.max_updates <= b.max_updates
    assert bounds[0].trajectories < bounds[-1].trajectories


# --- in order: today's bound, bit for bit -----------------------------------------------


def _in_order_cases() -> list[RunInputs]:
    light = F.scenario(elastic=True, duration_s=600.0, batch=16, train_step_s=5.0)
    return [
        F.busy_inputs(),
        F.inputs(light, windows=F.PREEMPTED_WINDOWS, seed=1),
        F.inputs(light, windows=F.PREEMPTED_WINDOWS, seed=2),
        F.inputs(
            F.scenario(batch=1, staleness=0, duration_s=100.0, train_step_s=20.0),
            model=F.constant_model(turns=1, prompt=100, output=10),
        ),
        F.inputs(
            F.scenario(batch=1024, staleness=1, duration_s=100.0),
            model=F.constant_model(turns=1, prompt=30000, output=2000),
        ),
        F.inputs(
            F.scenario(elastic=True, duration_s=3600.0, batch=32, train_step_s=10.0),
            model=F.busy_model(),
            windows=F.PREEMPTED_WINDOWS,
        ),
    ]


@pytest.mark.parametrize("case", range(len(_in_order_cases())))
def test_the_in_order_bound_ignores_what_in_order_batches_never_meet(case: int) -> None:
    # In order nothing is past the bound and a batch waits for all of it: groups, the
    # past-bound mode and a cap in flight change nothing the in-order argument uses
    # (the argument itself is checked by hand in test_critical_path_by_hand).
    inputs = _in_order_cases()[case]
    plain = _oracle(_inputs_with(inputs, batching=IN_ORDER))
    g = 4 if inputs.scenario.rollout.batch_trajectories % 4 == 0 else 1
    other = _inputs_with(
        inputs, batching=IN_ORDER, group_size=g, past_bound=PastBound.DROP, max_in_flight=8
    )
    bound = _oracle(other)
    assert bound == plain
    _check_parts(bound)


def test_capacity_counts_every_base_gpu_and_the_windows_inside_the_run() -> None:
    sc = _with(F.scenario(elastic=True, duration_s=500.0), batching=IN_ORDER)
    bound = _oracle(F.inputs(sc, windows=F.PREEMPTED_WINDOWS))
    # 16 base GPUs for 500 s; 16 GPUs over [0, 420); 8 GPUs over [100, 500) (clipped)
    assert bound.capacity_gpu_s == pytest.approx(16 * 500 + 16 * 420 + 8 * 400)


def test_critical_path_by_hand() -> None:
    # In order, B = 1, k = 0: trajectory j is batch j, which starts once update j - 1 has
    # finished. Every trajectory: one turn, 100 prompt tokens, 10 output tokens, no tool.
    sc = F.scenario(batch=1, staleness=0, duration_s=100.0, train_step_s=20.0)
    inputs = F.inputs(
        _with(sc, batching=IN_ORDER), model=F.constant_model(turns=1, prompt=100, output=10)
    )
    prof = F.profile()
    c = prof.costs
    assert (c.engine_cold_start_s, c.trainer_offload_s, c.wake_s) == (38.2, 0.819, 0.82)
    # The first engine: the cheaper of a cold start and the trainer's offload + a wake.
    first_s = 0.819 + 0.82
    # Fastest prefill of 100 tokens, a + b n (h800 tp 4): 0.003339 + 1.239e-05 x 100.
    # Fastest decode step of one sequence with no context, step_s(1, 0) (h20 tp 4 small
    # regime base): 0.003056 s per output token.
    assert prof.engine("h800", 4).prefill.a_s == 0.003339
    assert prof.engine("h20", 4).decode.small.base_s == 0.003056
    own_s = 0.003339 + 1.239e-05 * 100 + 10 * 0.003056
    # Trajectory j finishes no earlier than first + (j + 1) own + 20 j:
    # j = 4: 1.639 + 5 x 0.035138 + 80 = 81.81 s <= 100; j = 5: 101.85 s > 100.
    assert first_s + 5 * own_s + 80 < 100.0 < first_s + 6 * own_s + 100
    bound = _oracle(inputs)
    assert bound.by_critical_path == 5
    # 16 GPUs x 100 s hold far more such trajectories, but the bound reads the stream only
    # as far as a batch can start (j = 5's batch starts at 101.8 s): five
    assert bound.by_capacity == 5
    assert bound.trajectories == 5
    # and the simulator, paying a real cold start, finishes fewer
    assert F.run(inputs, "roll-fixed").metrics.trajectories <= 5


def test_capacity_by_hand() -> None:
    # In order, two whole batches start at once (B = 1024, k = 1) and each trajectory is
    # long: GPU-seconds bind. Each needs prefill_gpu_s x prompt + decode_gpu_s x output at
    # the cheapest engine (per token: tp x b for prefill; tp x step_s(B, 0) / B for decode).
    sc = _with(F.scenario(batch=1024, staleness=1, duration_s=100.0), batching=IN_ORDER)
    inputs = F.inputs(sc, model=F.constant_model(turns=1, prompt=30000, output=2000))
    prof = F.profile()
    engines = [e for g in ("h800", "h20") for e in prof.gpus[g].engines]
    prefill_gpu_s = min(e.tp * e.prefill.b_s_per_token for e in engines)
    decode_gpu_s = min(
        e.tp * float(e.decode.step_s(b, 0)) / b
        for e in engines
        for b in range(1, e.max_num_seqs + 1)
    )
    work_gpu_s = prefill_gpu_s * 30000 + decode_gpu_s * 2000
    bound = _oracle(inputs)
    assert bound.capacity_gpu_s == 16 * 100.0
    assert bound.by_capacity == int(16 * 100.0 / work_gpu_s)
    # the path bound: a batch every ~28 s (8 s of trajectory, 20 s of update), 8 batches
    assert bound.by_capacity < 2048 < bound.by_critical_path
    assert bound.trajectories == bound.by_capacity


# --- first completed: by hand on the toy engine -----------------------------------------


def _toy(owns_s: list[float], **scenario: Any) -> OracleBound:
    sc = O.toy_scenario(**scenario)
    return oracle_bound(sc, O.toy_profile(), (), [O.spec(s) for s in owns_s])


# B = 2, η = 1, train 10 s, F = 2 s. Own times: slots 0 and 3 take 10 s, the rest 1 s.
SLOW_TWO = [10.0, 1.0, 1.0, 10.0] + [1.0] * 16


def test_first_completed_by_hand() -> None:
    # Interrupt drops nothing: at most A(u) = (u + 2) 2 slots admitted while u updates are
    # done, so slots 0-3 start at F = 2, slots 4-5 after update 1, 6-7 after update 2,
    # 8-9 after update 3.
    # Update 1: the 2nd finish of slots 0-3 (12, 3, 3, 12): 3; it ends at 13.
    # Slots 4-5 finish at 14. Update 2: the 4th finish of slots 0-5, 12, but update 1
    # ends at 13: 13 to 23. Slots 6-7 finish at 24. Update 3: the 6th finish, 14, but
    # not before 23: 23 to 33. Slots 8-9 finish at 34. Update 4: the 8th finish, 24,
    # not before 33: it would end at 43 > 40. So 3 updates by T = 40.
    b = _toy(SLOW_TWO, duration_s=40.0, batch=2, staleness=1)
    assert (b.max_updates, b.updates) == (3, 3)
    # slots 0-9 have finished by 40, and with 3 updates (η + 3 + 1) B = 10 are accepted
    assert (b.by_critical_path, b.by_admission, b.trajectories) == (10, 10, 10)
    # GPU-seconds: 16 GPUs from F = 2 to 40, less the 8 trainer GPUs for 3 steps of 10 s
    assert b.capacity_gpu_s == 16 * 38.0 - 8 * 3 * 10.0
    assert b.by_capacity == 10  # 0.0025 GPU-s per output token: nowhere near
    # in order, a batch waits for its slowest trajectory (slot 3, 10 s): 12 there
    in_order = _toy(SLOW_TWO, duration_s=40.0, batch=2, staleness=1, batching="in-order")
    assert in_order.trajectories == 12


def test_first_completed_by_hand_per_past_bound_mode() -> None:
    # Restart drops nothing either: the same admission, every slot of 0-9 done by 40.
    restart = _toy(SLOW_TWO, duration_s=40.0, batch=2, staleness=1, past_bound="restart")
    assert (restart.max_updates, restart.by_critical_path, restart.trajectories) == (3, 10, 10)
    # Drop frees room: A(u) = (u + 2) 2 + 2 floor(u / 2) = 4, 6, 10, 12 for u = 0..3, so
    # slots 6-9 start after update 2 (at 23, done at 24) and 10-11 after update 3 (at 33,
    # done at 34): 12 finish by 40, the same 3 updates, and still 10 are accepted.
    drop = _toy(SLOW_TWO, duration_s=40.0, batch=2, staleness=1, past_bound="drop")
    assert (drop.max_updates, drop.by_critical_path, drop.trajectories) == (3, 12, 10)


def test_a_restart_may_draw_a_short_sample() -> None:
    # B = 1, η = 1, train 1 s: slot 0 takes 1000 s, the others 1 s.
    owns = [1000.0] + [1.0] * 20
    # Interrupt: A(u) = u + 2. Update 1 after slot 1 (3 s) ends at 4; slot 2 (admitted
    # after update 1) finishes at 5, update 2 ends at 6; slot 3 starts then, finishes at
    # 7 > 6.5. By 6.5: slots 1 and 2 (slot 0 runs on: under interrupt it keeps its sample).
    interrupt = _toy(owns, duration_s=6.5, batch=1, staleness=1, train_step_s=1.0)
    assert (interrupt.max_updates, interrupt.trajectories) == (2, 2)
    # Restart: at update 2's end (6 s) slot 0 is past the bound (admitted at version 0,
    # now 2 > 0 + η) and restarts with a fresh sample, which may be the smallest (one
    # token, 0.01 s): done at 6.01. By 6.5: slots 0, 1 and 2.
    restart = _toy(
        owns, duration_s=6.5, batch=1, staleness=1, train_step_s=1.0, past_bound="restart"
    )
    assert (restart.max_updates, restart.trajectories) == (2, 3)


def test_first_completed_by_hand_with_groups() -> None:
    # Groups of 2 (B = 2: one group a batch); a group is done when both are. Groups
    # (0, 1) and (2, 3) finish at 12: update 1 from 12 to 22. Group (4, 5) finishes at 23;
    # update 2 needs 2 groups (12): 22 to 32. Group (6, 7) finishes at 33; update 3 needs
    # the 3rd group, 23, not before 32: it would end at 42 > 40. 2 updates: 8.
    b = _toy(SLOW_TWO, duration_s=40.0, batch=2, staleness=1, group_size=2)
    assert (b.max_updates, b.by_critical_path, b.by_admission, b.trajectories) == (2, 8, 8, 8)
    assert b.capacity_gpu_s == 16 * 38.0 - 8 * 2 * 10.0


def test_first_completed_by_hand_in_flight() -> None:
    # No update by T (train 1000 s); 8 slots may start (η = 1, B = 4), each taking 30 s.
    # With at most 2 in flight their 30 s each fit 2 x 100 s six times. The bound is
    # tight: two lanes run three trajectories each by 2 + 90 = 92 s.
    owns = [30.0] * 40
    kw: dict[str, Any] = {"duration_s": 100.0, "batch": 4, "staleness": 1, "train_step_s": 1000.0}
    assert _toy(owns, **kw).trajectories == 8
    capped = _toy(owns, max_in_flight=2, **kw)
    assert (capped.max_updates, capped.by_in_flight, capped.trajectories) == (0, 6, 6)


def test_first_completed_by_hand_capacity() -> None:
    # η = 1, B = 64: 128 slots of 1 s (100 tokens, 0.25 GPU-s each) start at F = 2 and
    # are done at 3 <= 3.5; 16 GPUs from 2 to 3.5 s hold 24 GPU-s: 96 of them.
    b = _toy([1.0] * 400, duration_s=3.5, batch=64, staleness=1)
    assert (b.by_critical_path, b.by_admission, b.capacity_gpu_s) == (128, 128, 24.0)
    assert (b.by_capacity, b.trajectories) == (96, 96)


@pytest.mark.parametrize("mode", ["interrupt", "restart", "drop"])
@pytest.mark.parametrize("group_size", [1, 2])
def test_first_completed_toy_bound_is_monotone_in_duration(mode: str, group_size: int) -> None:
    counts = [
        _toy(
            SLOW_TWO * 4, duration_s=t, batch=2, staleness=1, past_bound=mode, group_size=group_size
        ).trajectories
        for t in (1.0, 3.0, 5.0, 13.0, 14.0, 23.0, 24.0, 33.0, 40.0, 80.0)
    ]
    assert counts == sorted(counts)
    assert counts[0] == 0 < counts[-1]
