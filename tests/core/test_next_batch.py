"""The next-batch question: the time until ``groups_needed`` more GRPO groups complete."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from scipy.special import gammaincinv
from testing_profiles import make_profile

from pearl.core.next_batch import (
    batch_progress_turns,
    cut_groups,
    order_statistic_share,
    progress_variance_turns2,
)
from pearl.core.pd import InstanceSpec, PDConfig
from pearl.core.predictor import predict, predict_many, predict_prepared, predict_prepared_many
from pearl.core.prepared import prepare
from pearl.core.roles import Role
from pearl.core.workload import (
    NextBatch,
    TrajectoryProgress,
    TrajPhase,
    TurnStats,
    WorkloadSnapshot,
)

OUT, OBS, E = 256, 256, 2.0
PROFILE = make_profile()
SPREAD = {"output_tokens_sd": 200.0, "env_latency_sd_s": 3.0, "turns_cv": 0.4}


def colocated(n: int, gpu: str = "h100") -> PDConfig:
    return PDConfig.of({InstanceSpec(Role.COLOCATED, gpu, 1): n})


def disaggregated(p: int, d: int) -> PDConfig:
    return PDConfig.of(
        {InstanceSpec(Role.PREFILL, "h100", 1): p, InstanceSpec(Role.DECODE, "h100", 1): d}
    )


CONFIGS = [colocated(1), colocated(8), colocated(64), disaggregated(2, 6)]


def stats(spread: bool, env_s: float = E) -> TurnStats:
    return TurnStats(
        output_tokens_per_turn=OUT,
        observation_tokens_per_turn=OBS,
        env_latency_s=env_s,
        **(SPREAD if spread else {}),
    )


def grouped(
    rng: np.random.Generator,
    num_groups: int,
    group_size: int,
    spread: bool = False,
    env_s: float = E,
    fresh_groups: int = 0,
) -> WorkloadSnapshot:
    """Listed groups with 1 to ``group_size`` unfinished members in random phases (a few in
    their final env step), and ``fresh_groups`` not begun."""
    phases = list(TrajPhase)
    trajs = []
    for gi in range(num_groups):
        for k in range(int(rng.integers(1, group_size + 1))):
            phase = phases[int(rng.integers(len(phases)))]
            out = int(rng.integers(0, OUT)) if phase is TrajPhase.DECODE else 0
            in_env = phase is TrajPhase.ENV
            turns = 0.0 if in_env and rng.uniform() < 0.1 else float(rng.integers(1, 9))
            trajs.append(
                TrajectoryProgress(
                    traj_id=f"g{gi}/{k}",
                    group_id=f"g{gi}",
                    phase=phase,
                    context_tokens=int(rng.integers(500, 20_000)),
                    remaining_turns=turns,
                    turn_output_tokens=out,
                    env_remaining_s=float(rng.uniform(0, 2 * env_s)) if in_env else 0.0,
                )
            )
    return WorkloadSnapshot(
        trajectories=tuple(trajs),
        not_started=fresh_groups * group_size,
        stats=stats(spread, env_s),
    )


def asking(work: WorkloadSnapshot, groups_needed: int, group_size: int) -> WorkloadSnapshot:
    return work.model_copy(
        update={"next_batch": NextBatch(groups_needed=groups_needed, group_size=group_size)}
    )


def num_groups(work: WorkloadSnapshot, group_size: int) -> int:
    return len({t.group_id for t in work.trajectories}) + work.not_started // group_size


def times(work: WorkloadSnapshot, max_segments: int | None = 64) -> list[float]:
    return [p.completion_s for p in predict_many(work, CONFIGS, PROFILE, max_segments)]


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
Case = tuple[WorkloadSnapshot, int]  # a snapshot and its group size
cases = st.tuples(
    st.integers(0, 2**32 - 1).map(np.random.default_rng),
    st.integers(1, 40),
    st.sampled_from([1, 2, 8]),
    st.booleans(),
    st.sampled_from([0.0, 2.0, 15.0]),
    st.integers(0, 5),
).map(lambda a: (grouped(*a), a[2]))


# --- the snapshot's fields ----------------------------------------------------------------------


def test_a_next_batch_needs_every_trajectory_in_a_group() -> None:
    work = grouped(np.random.default_rng(0), 3, 2)
    lone = work.trajectories[0].model_copy(update={"group_id": None})
    with pytest.raises(ValidationError, match=r"trajectory g0/0 has no group_id"):
        WorkloadSnapshot(
            trajectories=(lone, *work.trajectories[1:]),
            next_batch=NextBatch(groups_needed=1, group_size=2),
        )


def test_a_group_lists_at_most_group_size_trajectories() -> None:
    trajs = tuple(
        TrajectoryProgress(
            traj_id=f"t{i}",
            group_id="a",
            phase=TrajPhase.QUEUED,
            context_tokens=1,
            remaining_turns=1,
        )
        for i in range(3)
    )
    with pytest.raises(ValidationError, match=r"group a lists more than group_size 2"):
        WorkloadSnapshot(trajectories=trajs, next_batch=NextBatch(groups_needed=1, group_size=2))
    WorkloadSnapshot(trajectories=trajs, next_batch=NextBatch(groups_needed=1, group_size=3))


def test_not_started_trajectories_make_whole_groups() -> None:
    with pytest.raises(ValidationError, match=r"not_started 5 is not a multiple of group_size 4"):
        WorkloadSnapshot(not_started=5, next_batch=NextBatch(groups_needed=1, group_size=4))
    with pytest.raises(ValidationError, match="group_size"):
        NextBatch(groups_needed=1, group_size=0)
    with pytest.raises(ValidationError, match="groups_needed"):
        NextBatch(groups_needed=-1, group_size=1)


def test_group_ids_alone_change_nothing() -> None:
    work = grouped(np.random.default_rng(1), 30, 4, spread=True, fresh_groups=2)
    anonymous = work.model_copy(
        update={
            "trajectories": tuple(
                t.model_copy(update={"group_id": None}) for t in work.trajectories
            )
        }
    )
    assert predict_many(work, CONFIGS, PROFILE) == predict_many(anonymous, CONFIGS, PROFILE)


# --- invariants ---------------------------------------------------------------------------------


@SETTINGS
@given(cases, st.sampled_from([None, 64]))
def test_no_groups_needed_predicts_zero(case: Case, max_segments: int | None) -> None:
    work, size = case
    for p in predict_many(asking(work, 0, size), CONFIGS, PROFILE, max_segments):
        assert p.completion_s == 0.0
        assert p.bottleneck == "none"


@SETTINGS
@given(cases, st.sampled_from([None, 64, 5]))
def test_more_groups_take_longer_but_never_longer_than_all(
    case: Case, max_segments: int | None
) -> None:
    """Non-decreasing in groups_needed (by construction: rounding only), at most the
    all-complete prediction of the same snapshot, and the breakdown's bounds hold."""
    work, size = case
    everything = times(work, max_segments)
    before = [0.0] * len(CONFIGS)
    for m in range(num_groups(work, size) + 1):
        ps = predict_many(asking(work, m, size), CONFIGS, PROFILE, max_segments)
        for p, low, high in zip(ps, before, everything, strict=True):
            assert p.completion_s >= low * (1 - 1e-9)
            assert p.completion_s <= high * (1 + 1e-12)
            assert p.completion_s >= p.breakdown.critical_path_s >= 0.0
            assert p.completion_s >= p.breakdown.throughput_bound_s * (1 - 1e-12)
        before = [p.completion_s for p in ps]


@SETTINGS
@given(cases, st.sampled_from([None, 64]))
@example((grouped(np.random.default_rng(4194305), 2, 1, True, 2.0, 1), 1), None)
def test_all_groups_is_the_all_complete_prediction(case: Case, max_segments: int | None) -> None:
    """Without spreads, exactly (the same fluid, candidates and floors); with spreads, at
    most it and close to it (the order statistic of the last group in turns against the
    gamma straggler in seconds; 0.66 the lowest ratio over 400 random cases, and 0.585 in
    a case hypothesis found later: three trajectories in groups of two, 17.2 s against
    10.1 s, kept below with ``example``)."""
    work, size = case
    every = asking(work, num_groups(work, size), size)
    everything = predict_many(work, CONFIGS, PROFILE, max_segments)
    batch = predict_many(every, CONFIGS, PROFILE, max_segments)
    assert work.stats is not None
    if not work.stats.has_spread:
        assert batch == everything
    for b, a in zip(batch, everything, strict=True):
        assert b.completion_s <= a.completion_s
        assert b.completion_s >= 0.5 * a.completion_s


@pytest.mark.parametrize("spread", [False, True])
@pytest.mark.parametrize("turns", [1.0, 4.0])
def test_one_group_of_one_queued_trajectory_is_todays_prediction(
    spread: bool, turns: float
) -> None:
    alone = TrajectoryProgress(
        traj_id="t",
        group_id="g",
        phase=TrajPhase.QUEUED,
        context_tokens=3000,
        remaining_turns=turns,
    )
    today = WorkloadSnapshot(trajectories=(alone,), stats=stats(spread))
    assert times(asking(today, 1, 1)) == times(today)
    assert predict_many(asking(today, 1, 4), CONFIGS, PROFILE) == predict_many(
        today, CONFIGS, PROFILE
    )


@pytest.mark.parametrize("seed", range(4))
def test_a_configuration_predicts_the_same_alone_and_among_others(seed: int) -> None:
    rng = np.random.default_rng(seed)
    work = grouped(rng, 60, 8, spread=bool(seed % 2), fresh_groups=3)
    configs = [*CONFIGS, PDConfig(), colocated(3, "a100"), colocated(5), disaggregated(1, 1)]
    configs += [PDConfig.of({InstanceSpec(Role.COLOCATED, "b200", 1): 2})]  # not profiled
    prepared = prepare(asking(work, 20, 8), PROFILE)
    many = predict_prepared_many(prepared, configs)
    assert many == [predict_prepared(prepared, c) for c in configs]  # bit for bit
    assert math.isinf(many[4].completion_s)


def test_groups_beyond_the_snapshot_wait_for_everything_listed() -> None:
    work = grouped(np.random.default_rng(2), 10, 4, fresh_groups=1)
    assert times(asking(work, 50, 4)) == times(asking(work, 11, 4)) == times(work)


# --- what the batch waits for --------------------------------------------------------------------


def queued(traj_id: str, group_id: str, turns: float) -> TrajectoryProgress:
    return TrajectoryProgress(
        traj_id=traj_id,
        group_id=group_id,
        phase=TrajPhase.QUEUED,
        context_tokens=4096,
        remaining_turns=turns,
    )


def test_a_group_completes_with_its_slowest_member() -> None:
    """Group a: 1 and 6 turns left, group b: 3 and 3. The first group to complete is b,
    when its members end (alone: 3 turns), not when a's short member does."""
    many = colocated(1000)  # uncontended: the prediction is the critical path
    work = WorkloadSnapshot(
        trajectories=(
            queued("a1", "a", 1),
            queued("a6", "a", 6),
            queued("b1", "b", 3),
            queued("b2", "b", 3),
        ),
        stats=stats(False),
    )
    three = predict(
        WorkloadSnapshot(trajectories=(queued("x", "x", 3),), stats=stats(False)), many, PROFILE
    )
    first = predict(asking(work, 1, 2), many, PROFILE)
    assert first.completion_s == pytest.approx(three.completion_s, rel=1e-3)
    assert predict(asking(work, 2, 2), many, PROFILE) == predict(work, many, PROFILE)


def test_groups_in_their_final_env_step_need_no_engine() -> None:
    ending = TrajectoryProgress(
        traj_id="e",
        group_id="e",
        phase=TrajPhase.ENV,
        context_tokens=4096,
        remaining_turns=0,
        env_remaining_s=1.5,
    )
    work = WorkloadSnapshot(trajectories=(ending, queued("q", "q", 4)), stats=stats(False))
    p = predict(asking(work, 1, 1), colocated(1), PROFILE)
    assert (p.completion_s, p.bottleneck) == (1.5, "latency")
    assert predict(asking(work, 2, 1), colocated(1), PROFILE) == predict(
        work, colocated(1), PROFILE
    )


def test_not_started_groups_count_as_groups_of_default_trajectories() -> None:
    """Four groups of two not begun: without spreads (one position) the fluid completes
    them all at once, so every groups_needed predicts the all-complete time, less the
    wait for the last prompts (pearl.core.prompt_backlog: all are fresh, and only the
    whole workload waits for the last to be computed)."""
    work = WorkloadSnapshot(not_started=8, stats=stats(False))
    assert times(asking(work, 4, 2)) == times(work)
    backlog = [p.breakdown.prompt_backlog_s for p in predict_many(work, CONFIGS, PROFILE)]
    for m in (1, 2, 3):
        for got, whole, d in zip(times(asking(work, m, 2)), times(work), backlog, strict=True):
            assert whole - d - 1e-9 <= got <= whole


def test_spreads_bring_the_first_groups_forward_and_the_last_back() -> None:
    """Many identical fresh groups: without spreads each completes at the mean; with them
    the first of many single trajectories comes earlier, and the median of groups of 8
    (each the slowest of 8) later."""
    for size, m, earlier in ((1, 1, True), (8, 16, False)):
        plain = WorkloadSnapshot(not_started=32 * size, stats=stats(False))
        spread = plain.model_copy(update={"stats": stats(True)})
        p_plain, p_spread = times(asking(plain, m, size)), times(asking(spread, m, size))
        for a, b in zip(p_plain, p_spread, strict=True):
            assert (b < 0.9 * a) if earlier else (b > 1.1 * a)


def test_merged_segments_stay_close_for_the_trainers_usual_asks() -> None:
    """The segments are those of the whole workload; a cut inside a merged segment is
    interpolated in reference turns. For half the groups or more the merge error stays
    small (for the first groups it can be large: docs/predictor.md)."""
    for seed, spread in ((3, False), (4, True)):
        work = grouped(np.random.default_rng(seed), 300, 8, spread=spread, fresh_groups=10)
        g = num_groups(work, 8)
        for m in (g // 2, 3 * g // 4, g - 1):
            ask = asking(work, m, 8)
            assert prepare(ask, PROFILE).num_positions > 64 >= prepare(ask, PROFILE).num_segments
            for a, b in zip(times(ask, None), times(ask, 64), strict=True):
                assert b == pytest.approx(a, rel=0.03)


# --- the order statistic --------------------------------------------------------------------------


def test_the_order_statistic_share_has_its_closed_forms() -> None:
    assert order_statistic_share(3, 9, 1.0) == pytest.approx(3 / 10)
    assert order_statistic_share(9, 9, 4.0) == 36 / 37  # the slowest of 36, exactly
    shares = [order_statistic_share(m, 20, 8.0) for m in range(1, 21)]
    assert shares == sorted(shares)
    rng = np.random.default_rng(0)  # E[U^(1/g)], U ~ Beta(m, G - m + 1)
    u = rng.beta(5, 16, 400_000)
    assert order_statistic_share(5, 20, 8.0) == pytest.approx(
        float(np.mean(u ** (1 / 8))), rel=2e-3
    )


def test_identical_groups_put_every_trajectory_at_the_share() -> None:
    """G identical groups of g fresh trajectories: the batch completes where each
    trajectory's gamma cdf equals the order statistic's share."""
    spread = stats(True)
    for size, m, big_g in ((1, 7, 30), (8, 3, 12), (4, 12, 12)):
        n = size * big_g
        codes = np.arange(n) // size
        positions = np.zeros(n, dtype=np.intp)
        no_tail = np.zeros(0, np.intp)
        cut = cut_groups(big_g, m, codes, positions, np.full(n, 5.0), no_tail, np.zeros(0), 1.0)
        mean, turns = np.array([5.0]), np.array([5.0])
        x_m = batch_progress_turns(cut, mean, turns, spread, (0.5, 0.3), codes, positions)
        var = progress_variance_turns2(mean, turns, spread, 0.5, 0.3)[0]
        share = order_statistic_share(m, big_g, float(size))
        expected = var / 5.0 * gammaincinv(25.0 / var, share)
        assert x_m == pytest.approx(expected, rel=1e-3)


def test_groups_admitted_after_the_update_start_that_much_later() -> None:
    """Two listed groups and two not-started ones that begin 40 s from now (the running
    update's rest). A batch of three needs a later group: the prediction with them all
    starting now, plus 40 s. A batch of one: the sooner of the listed groups alone and that."""
    many = colocated(1000)
    listed = (queued("a1", "a", 2), queued("b1", "b", 5))
    work = WorkloadSnapshot(trajectories=listed, not_started=2, stats=stats(False))

    def at(m: int, after_s: float) -> float:
        nb = NextBatch(groups_needed=m, group_size=1, not_started_after_s=after_s)
        return predict(work.model_copy(update={"next_batch": nb}), many, PROFILE).completion_s

    assert at(3, 40.0) == pytest.approx(at(3, 0.0) + 40.0)
    alone = WorkloadSnapshot(trajectories=listed, stats=stats(False))
    first_listed = predict(asking(alone, 1, 1), many, PROFILE).completion_s
    assert at(1, 40.0) == pytest.approx(min(first_listed, at(1, 0.0) + 40.0))
    assert at(1, 40.0) == pytest.approx(first_listed)  # 2 turns alone beat 40 s of waiting


@pytest.mark.parametrize("seed", range(3))
def test_asking_for_every_group_keeps_the_whole_workloads_breakdown_means(seed: int) -> None:
    """The same segments, so the same means. (They were once divided by the batch's fluid
    time, which with spreads counts the straggler's time past the last segment, and read
    short: a prefix hit rate of 0.73 where every turn hit.)"""
    work = grouped(np.random.default_rng(seed), 30, 4, spread=True, fresh_groups=3)
    every = asking(work, num_groups(work, 4), 4)
    fields = ("mean_decode_batch", "prefix_hit_rate", "decode_s_per_turn", "env_share")
    for config in CONFIGS:
        whole = predict(work, config, PROFILE).breakdown
        batch = predict(every, config, PROFILE).breakdown
        for field in fields:
            assert getattr(batch, field) == pytest.approx(getattr(whole, field)), field
