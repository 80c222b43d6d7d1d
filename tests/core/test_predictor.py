"""Batch-completion predictor: closed forms, bounds, monotonicity and the modelled effects."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testing_profiles import make_profile

from pearl.core.engine_groups import TurnShape, engine_groups
from pearl.core.pd import InstanceSpec, PDConfig
from pearl.core.predictor import (
    DEFAULT_MAX_SEGMENTS,
    Prediction,
    PreparedWorkload,
    _end_turns,
    _offset_s,
    predict,
    predict_many,
    predict_prepared,
    predict_prepared_many,
    prepare,
)
from pearl.core.profile import RuntimeProfile
from pearl.core.roles import Role
from pearl.core.turn_model import BOUND_NAMES, segments, solve_cycle
from pearl.core.workload import TrajectoryProgress, TrajPhase, TurnStats, WorkloadSnapshot

OUT, OBS, E = 256, 256, 2.0  # the profile's per-turn defaults


def traj(
    i: int,
    turns: float,
    ctx: int = 4096,
    phase: TrajPhase = TrajPhase.QUEUED,
    out: int = 0,
    env_rest_s: float = 0.0,
) -> TrajectoryProgress:
    return TrajectoryProgress(
        traj_id=f"t{i}",
        phase=phase,
        context_tokens=ctx,
        remaining_turns=turns,
        turn_output_tokens=out,
        env_remaining_s=env_rest_s,
    )


def batch(
    n: int, turns: float = 4, ctx: int = 4096, env_s: float = E, obs: float = OBS
) -> WorkloadSnapshot:
    stats = TurnStats(
        output_tokens_per_turn=OUT, observation_tokens_per_turn=obs, env_latency_s=env_s
    )
    return WorkloadSnapshot(trajectories=tuple(traj(i, turns, ctx) for i in range(n)), stats=stats)


def colocated(n: int, gpu: str = "h100", tp: int = 1) -> PDConfig:
    return PDConfig.of({InstanceSpec(Role.COLOCATED, gpu, tp): n})


def disaggregated(p: int, d: int, gpu: str = "h100", tp: int = 1) -> PDConfig:
    return PDConfig.of(
        {InstanceSpec(Role.PREFILL, gpu, tp): p, InstanceSpec(Role.DECODE, gpu, tp): d}
    )


def constant_profile() -> RuntimeProfile:
    """Costs that do not depend on the context, so a turn always costs the same."""
    return make_profile(prefill_c_s_per_token2=0.0, decode_per_ctx_token_s=0.0)


# --- closed forms -------------------------------------------------------------------------


@pytest.mark.parametrize("turns", [1, 2, 5, 12])
def test_one_trajectory_alone_is_the_closed_form(turns: int) -> None:
    profile = constant_profile()
    eng = profile.engine("h100", 1)
    assert eng is not None
    prefill_s = eng.prefill.batch_s([OBS], [4096 - OBS])
    step_s = float(eng.decode.step_s(1, 0))
    p = predict(batch(1, turns), colocated(1), profile)
    assert p.completion_s == pytest.approx(turns * (prefill_s + OUT * step_s + E) - E, rel=1e-12)
    assert p.bottleneck == "latency"
    assert p.breakdown.mean_decode_batch == 1.0


@pytest.mark.parametrize("turns", [1, 3, 7])
def test_one_trajectory_alone_follows_its_growing_context(turns: int) -> None:
    profile = make_profile()  # prefill attention and decode costs grow with the context
    eng = profile.engine("a100", 2)
    assert eng is not None
    total = -E
    for j in range(turns):
        ctx = 3000 + j * (OUT + OBS)  # context at the start of turn j, observation included
        total += eng.prefill.batch_s([OBS], [ctx - OBS])
        total += OUT * float(eng.decode.step_s(1, ctx + OUT / 2)) + E
    p = predict(batch(1, turns, ctx=3000), colocated(1, "a100", 2), profile)
    assert p.completion_s == pytest.approx(total, rel=1e-12)
    assert p.breakdown.critical_path_s == pytest.approx(total, rel=1e-12)


def test_one_disaggregated_trajectory_pays_prefill_of_output_and_kv_transfer() -> None:
    profile = constant_profile()
    eng = profile.engine("h100", 1)
    assert eng is not None
    new = OBS + OUT  # the prefill instance never saw the last output
    transfer_s = profile.model.kv_bytes_per_token * new / 25e9
    turn_s = eng.prefill.batch_s([new], [4096 - new]) + transfer_s
    turn_s += OUT * float(eng.decode.step_s(1, 0)) + E
    p = predict(batch(1, 3), disaggregated(1, 1), profile)
    assert p.completion_s == pytest.approx(3 * turn_s - E, rel=1e-12)
    assert p.breakdown.kv_transfer_s_per_turn == pytest.approx(transfer_s, rel=1e-12)


@pytest.mark.parametrize(
    ("progress", "expected"),
    [
        pytest.param(
            traj(0, 2, phase=TrajPhase.DECODE, out=OUT // 4), "3/4 decode + turn", id="decode"
        ),
        pytest.param(
            traj(0, 2, phase=TrajPhase.PREFILL), "1/2 prefill + rest + turn", id="prefill"
        ),
        pytest.param(traj(0, 1, phase=TrajPhase.ENV, env_rest_s=0.5), "env rest + turn", id="env"),
        pytest.param(
            traj(0, 1, phase=TrajPhase.ENV, env_rest_s=9.0), "env rest + turn", id="env-late"
        ),
    ],
)
def test_a_trajectory_in_flight_finishes_its_current_turn_first(
    progress: TrajectoryProgress, expected: str
) -> None:
    profile = constant_profile()
    eng = profile.engine("h100", 1)
    assert eng is not None
    prefill_s = eng.prefill.batch_s([OBS], [4096 - OBS])
    decode_s = OUT * float(eng.decode.step_s(1, 0))
    turn_s = prefill_s + decode_s  # the last turn has no env step
    rest_s = {
        "3/4 decode + turn": 0.75 * decode_s + E + turn_s,
        "1/2 prefill + rest + turn": 0.5 * prefill_s + decode_s + E + turn_s,
        "env rest + turn": progress.env_remaining_s + turn_s,
    }[expected]
    p = predict(WorkloadSnapshot(trajectories=(progress,)), colocated(1), profile)
    assert p.completion_s == pytest.approx(rest_s, rel=1e-9)


def test_empty_workload_takes_no_time() -> None:
    p = predict(WorkloadSnapshot(), colocated(2), make_profile())
    assert (p.completion_s, p.bottleneck) == (0.0, "none")
    # even with a configuration that could serve nothing
    assert predict(WorkloadSnapshot(), PDConfig(), make_profile()).completion_s == 0.0


def test_a_last_env_step_is_waited_for_without_any_engine() -> None:
    last = traj(0, 0, phase=TrajPhase.ENV, env_rest_s=3.0)
    p = predict(WorkloadSnapshot(trajectories=(last,)), PDConfig(), make_profile())
    assert (p.completion_s, p.bottleneck) == (3.0, "latency")


def test_not_started_trajectories_use_the_profile_defaults() -> None:
    profile = constant_profile()
    queued = traj(0, 4, ctx=1024).model_copy(update={"fresh": True})
    started = WorkloadSnapshot(trajectories=(queued,))
    fresh = WorkloadSnapshot(not_started=1)
    assert predict(fresh, colocated(1), profile) == predict(started, colocated(1), profile)


def test_not_started_trajectories_are_what_the_snapshot_says_they_are() -> None:
    """Seen prompts and turn counts replace the profile's: a not-started trajectory of a
    run whose trajectories have 2 turns of a 512-token prompt is predicted as one."""
    profile = make_profile()
    known = WorkloadSnapshot(not_started=1, not_started_prompt_tokens=512, not_started_turns=2)
    queued = traj(0, 2, ctx=512).model_copy(update={"fresh": True})
    started = WorkloadSnapshot(trajectories=(queued,))
    assert predict(known, colocated(1), profile) == predict(started, colocated(1), profile)
    assert predict(known, colocated(1), profile) != predict(
        WorkloadSnapshot(not_started=1), colocated(1), profile
    )


def test_an_early_output_mean_is_weighed_against_the_defaults_by_the_turns_still_running() -> None:
    """The turns ended early in a batch are its short ones: 32 turns of 16 tokens, while
    2,000 run, say little of a workload whose turns average 256 (the profile's)."""
    profile = constant_profile()
    running = tuple(traj(i, 4) for i in range(2000))
    in_tool = tuple(traj(2000 + i, 4, phase=TrajPhase.ENV, env_rest_s=1.0) for i in range(500))

    def stats(observed: int | None) -> TurnStats:
        return TurnStats(
            output_tokens_per_turn=16,
            observation_tokens_per_turn=OBS,
            env_latency_s=E,
            turns_observed=observed,
        )

    early = WorkloadSnapshot(trajectories=running + in_tool, stats=stats(32))
    # the trajectories in a tool call have no turn running: they do not count
    assert early.turn_stats(profile.workload).output_tokens_per_turn == pytest.approx(
        (32 * 16 + 2000 * OUT) / 2032
    )
    # a count that dwarfs the running turns leaves the observed mean
    late = WorkloadSnapshot(trajectories=running, stats=stats(2_000_000))
    assert late.turn_stats(profile.workload).output_tokens_per_turn == pytest.approx(16, rel=0.02)
    # without the count (a hand-made snapshot) or with nothing running, as observed
    for unweighed in (
        WorkloadSnapshot(trajectories=running, stats=stats(None)),
        WorkloadSnapshot(trajectories=in_tool, stats=stats(32)),
    ):
        assert unweighed.turn_stats(profile.workload).output_tokens_per_turn == 16
    # so the early batch is predicted near what the defaults give, not 16 tokens a turn
    defaults = WorkloadSnapshot(trajectories=running + in_tool)
    naive = WorkloadSnapshot(trajectories=running + in_tool, stats=stats(None))
    config = colocated(8)
    weighed_s = predict(early, config, profile).completion_s
    assert weighed_s == pytest.approx(predict(defaults, config, profile).completion_s, rel=0.05)
    assert predict(naive, config, profile).completion_s < 0.8 * weighed_s


# --- infeasible configurations --------------------------------------------------------------


def _no_kv_profile() -> RuntimeProfile:
    profile = make_profile()
    return profile.model_copy(
        update={"model": profile.model.model_copy(update={"weights_gb": 500})}
    )


@pytest.mark.parametrize(
    ("config", "profile", "bottleneck"),
    [
        pytest.param(PDConfig(), make_profile(), "infeasible", id="no-instances"),
        pytest.param(
            PDConfig.of({InstanceSpec(Role.PREFILL, "h100", 1): 4}),
            make_profile(),
            "infeasible",
            id="no-decode",
        ),
        pytest.param(
            PDConfig.of({InstanceSpec(Role.DECODE, "h100", 1): 4}),
            make_profile(),
            "infeasible",
            id="no-prefill",
        ),
        pytest.param(colocated(2, "b200"), make_profile(), "infeasible", id="unknown-gpu"),
        pytest.param(colocated(2, "h100", 4), make_profile(), "infeasible", id="unprofiled-tp"),
        pytest.param(colocated(2), _no_kv_profile(), "infeasible", id="zero-kv"),
        pytest.param(
            colocated(2),
            make_profile(kv_capacity_tokens=2000),
            "kv_capacity",
            id="context-fits-nowhere",
        ),
    ],
)
def test_a_configuration_that_cannot_serve_predicts_inf(
    config: PDConfig, profile: RuntimeProfile, bottleneck: str
) -> None:
    p = predict(batch(8), config, profile)
    assert math.isinf(p.completion_s)
    assert p.bottleneck == bottleneck


def test_one_context_too_long_for_every_decode_instance_is_infeasible() -> None:
    work = WorkloadSnapshot(trajectories=(traj(0, 2, ctx=2000), traj(1, 2, ctx=60_000)))
    p = predict(work, colocated(4), make_profile(kv_capacity_tokens=40_000))
    assert (p.completion_s, p.bottleneck) == (math.inf, "kv_capacity")


# --- bounds and the modelled effects ----------------------------------------------------------


def test_adding_gpus_has_diminishing_returns_once_the_critical_path_dominates() -> None:
    profile = make_profile(kv_capacity_tokens=10_000_000)  # every prefix stays cached
    work = batch(1024, turns=6)
    sizes = (1, 2, 4, 8, 16, 32, 64, 128)
    times = [predict(work, colocated(n), profile).completion_s for n in sizes]
    speedups = [a / b for a, b in itertools.pairwise(times)]
    assert speedups[0] == pytest.approx(
        2.0, rel=1e-6
    )  # decode-bound: twice the GPUs, half the time
    assert all(b < a for a, b in itertools.pairwise(speedups))
    assert 1.0 < speedups[-1] < 1.1  # latency-bound: the critical path dominates
    alone = predict(work, colocated(128), profile)
    assert alone.completion_s <= 1.1 * alone.breakdown.critical_path_s


def test_kv_capacity_evicting_prefixes_gives_superlinear_speedup() -> None:
    profile = make_profile()  # 352k KV tokens per h100 instance
    work = batch(256, turns=6)  # about 1.2M tokens of live context
    one, two = (predict(work, colocated(n), profile) for n in (1, 2))
    assert one.breakdown.prefix_hit_rate < two.breakdown.prefix_hit_rate < 1.0
    assert one.completion_s > 2.0 * two.completion_s


def test_prefixes_overflow_each_instance_not_the_pool() -> None:
    """A mixed pool of small-KV and large-KV instances: the router spreads trajectories
    evenly over instances, so the small ones evict prefixes although the pool as a whole
    holds every context. Each group hits as it would alone with its share of the
    trajectories. (Once pooled: a 30B model on 32 one-GPU H20 instances beside 24 H800
    TP4 ones read no misses where the simulator saw 42%, and pearl held H20 TP1 at 0.87 of
    the throughput TP4 gave; benchmarks/tp_check.py.)"""
    profile = make_profile(kv_capacity_tokens=200_000)  # tp 1: 200k tokens, tp 2: 400k
    work, half = batch(400, turns=1), batch(200, turns=1)  # ~1.75M tokens live, and half
    small, large = colocated(4, tp=1), colocated(4, tp=2)
    mixed = PDConfig.of(
        {InstanceSpec(Role.COLOCATED, "h100", 1): 4, InstanceSpec(Role.COLOCATED, "h100", 2): 4}
    )
    hit_small = predict(half, small, profile).breakdown.prefix_hit_rate
    hit_large = predict(half, large, profile).breakdown.prefix_hit_rate
    hit_mixed = predict(work, mixed, profile).breakdown.prefix_hit_rate
    assert hit_small < 0.95 and hit_large == 1.0  # the pool's 2.4M tokens hold all 1.75M
    assert hit_mixed == pytest.approx((hit_small + hit_large) / 2)


def test_huge_contexts_make_the_kv_cache_the_bottleneck() -> None:
    profile = make_profile(kv_capacity_tokens=100_000)
    work = batch(256, turns=4, ctx=20_000, env_s=0.0)
    for config in (disaggregated(8, 4), colocated(8)):
        p = predict(work, config, profile)
        assert p.bottleneck == "kv_capacity", config.label()
        assert p.breakdown.prefix_hit_rate < 0.5
        assert p.breakdown.mean_decode_batch <= 100_000 / 20_000 + 1e-9


def test_decode_slots_are_capped_by_max_num_seqs() -> None:
    p = predict(batch(512, env_s=0.0), disaggregated(8, 1), make_profile(max_num_seqs=32))
    assert p.breakdown.mean_decode_batch == pytest.approx(32.0)
    assert p.bottleneck == "decode"


def test_env_time_lowers_the_decode_batch() -> None:
    profile = make_profile()
    busy = predict(batch(256, env_s=0.0), colocated(4), profile)
    waiting = predict(batch(256, env_s=10.0), colocated(4), profile)
    assert waiting.breakdown.mean_decode_batch < 0.7 * busy.breakdown.mean_decode_batch
    assert waiting.breakdown.env_share > 0.3
    assert busy.breakdown.env_share == 0.0


def test_disaggregated_pays_kv_transfer() -> None:
    work = batch(64)
    fast = predict(work, disaggregated(2, 2), make_profile(kv_transfer_gb_per_s=50.0))
    slow = predict(work, disaggregated(2, 2), make_profile(kv_transfer_gb_per_s=0.5))
    assert slow.completion_s > fast.completion_s
    assert slow.breakdown.kv_transfer_s_per_turn > 50 * fast.breakdown.kv_transfer_s_per_turn
    assert predict(work, colocated(4), make_profile()).breakdown.kv_transfer_s_per_turn == 0.0


def test_a_slow_kv_link_becomes_the_bottleneck() -> None:
    p = predict(batch(512, env_s=0.0), disaggregated(4, 4), make_profile(kv_transfer_gb_per_s=0.05))
    assert p.bottleneck == "kv_transfer"


def test_heavier_prefill_slows_colocated_decode_more_than_disaggregated() -> None:
    profile = make_profile()

    def decode_slowdown(config: PDConfig) -> float:
        light = predict(batch(256, obs=64), config, profile).breakdown.decode_s_per_turn
        heavy = predict(batch(256, obs=4096), config, profile).breakdown.decode_s_per_turn
        return heavy / light

    assert decode_slowdown(colocated(8)) > 1.2 * decode_slowdown(disaggregated(4, 4))


def test_a_starved_prefill_pool_is_the_bottleneck() -> None:
    profile = make_profile(kv_capacity_tokens=50_000_000)  # no prefix is ever evicted
    p = predict(batch(256, obs=8192, env_s=0.0), disaggregated(1, 8, "a100"), profile)
    assert p.bottleneck == "prefill"
    assert p.breakdown.prefill_utilisation > 0.9


def test_mixed_gpu_types_fall_between_the_pure_configurations() -> None:
    profile = make_profile()
    work = batch(256)
    fast = predict(work, disaggregated(2, 4, "h100"), profile).completion_s
    slow = predict(work, disaggregated(2, 4, "a100"), profile).completion_s
    mixed = PDConfig.of(
        {
            InstanceSpec(Role.PREFILL, "h100", 1): 1,
            InstanceSpec(Role.PREFILL, "a100", 1): 1,
            InstanceSpec(Role.DECODE, "h100", 1): 2,
            InstanceSpec(Role.DECODE, "a100", 1): 2,
        }
    )
    assert fast < predict(work, mixed, profile).completion_s < slow


# --- the decode-batch fixed point -------------------------------------------------------------


@pytest.mark.parametrize("env_s", [0.0, 0.5, 5.0])
@pytest.mark.parametrize("config", [colocated(4), disaggregated(2, 3, "a100", 2)], ids=["C", "PD"])
def test_the_decode_batch_is_a_fixed_point(config: PDConfig, env_s: float) -> None:
    profile = make_profile()
    groups, kept = engine_groups([config], profile)
    assert groups is not None and kept == [0]
    num_live = np.array([1.0, 2, 16, 64, 256, 1024, 4096])
    ctx = np.full_like(num_live, 6000.0)
    turn = TurnShape(OUT, OBS, env_s)
    seg = segments(turn, num_live, ctx, np.zeros_like(ctx), np.full_like(num_live, env_s))
    solved = solve_cycle(groups, turn, seg)
    batch, cycle_s, latency_s, decode_s = (
        solved.decode_batch[0],
        solved.cycle_s[0],
        solved.latency_s[0],
        solved.decode_s[0],
    )
    num_dec = config.count(Role.DECODE) or config.count(Role.COLOCATED)
    b_max = min(
        256.0,
        profile.kv_capacity_tokens(config.instances[-1][0].gpu_type, config.instances[-1][0].tp)
        / (6000 + OUT / 2),
    )
    implied = 1 + (num_live - 1) * decode_s / (cycle_s * num_dec)
    np.testing.assert_allclose(batch, np.clip(implied, 1, b_max), rtol=1e-9)
    assert batch[0] == 1.0
    assert (cycle_s >= latency_s).all() and (latency_s >= env_s).all()
    more = solve_cycle(groups, turn, seg, num_iterations=30)
    np.testing.assert_allclose(cycle_s, more.cycle_s[0], rtol=1e-9)


# --- properties ---------------------------------------------------------------------------------


def _mixed_workload(
    rng: np.random.Generator, n: int, env_s: float = E, same_context: bool = False
) -> WorkloadSnapshot:
    """Trajectories in random phases; with ``same_context`` all turns start at one context."""
    phases = list(TrajPhase)
    shared_ctx = int(rng.integers(500, 20_000))
    trajs = []
    for i in range(n):
        phase = phases[int(rng.integers(len(phases)))]
        out = int(rng.integers(0, OUT)) if phase is TrajPhase.DECODE else 0
        ctx = int(rng.integers(500, 20_000))
        if same_context:  # the context at the start of the current (env: next) turn
            ctx = shared_ctx + out - (OBS if phase is TrajPhase.ENV else 0)
        env_rest_s = float(rng.uniform(0, 2 * env_s)) if phase is TrajPhase.ENV else 0.0
        t = traj(i, float(rng.integers(1, 9)), ctx, phase, out, env_rest_s)
        if phase is TrajPhase.QUEUED and i % 3 == 0:  # its first turn: nothing cached
            t = t.model_copy(update={"fresh": True})
        trajs.append(t)
    stats = TurnStats(
        output_tokens_per_turn=OUT, observation_tokens_per_turn=OBS, env_latency_s=env_s
    )
    not_started = 0 if same_context else int(rng.integers(0, 20))
    return WorkloadSnapshot(trajectories=tuple(trajs), not_started=not_started, stats=stats)


PROFILE = make_profile()
SMALL_KV = make_profile(kv_capacity_tokens=150_000)  # prefixes get evicted at a few dozen
workloads = st.builds(
    _mixed_workload,
    st.integers(0, 2**32 - 1).map(np.random.default_rng),
    st.integers(1, 300),
    st.sampled_from([0.0, 0.3, 2.0, 15.0]),
)
profiles = st.sampled_from([PROFILE, SMALL_KV])
gpus = st.sampled_from([("h100", 1), ("h100", 2), ("a100", 1)])
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Relative tolerances of the monotonicity properties, far below any modelled effect:
# second-order effects of the final-env skip and of the midpoint contexts of segments
# (at most 2e-5 seen while developing, then 1.6e-4 in one example hypothesis found
# later: one more turn on an aligned workload, colocated x1); and, for turns, the two
# artefacts named in test_more_remaining_turns_are_never_faster (at most 0.3% seen).
MODEL_TOL = 1e-3
ARTEFACT_TOL = 1e-2
# Across two workloads (one more turn, a longer env step) merged segments differ, so each
# prediction carries its own merge error (max 0.9% over random workloads, see
# docs/predictor.md): 0.37% was the largest violation hypothesis found.
MERGE_TOL = 1e-2
max_segments_options = st.sampled_from([None, DEFAULT_MAX_SEGMENTS])


def _check(p: Prediction) -> None:
    assert p.completion_s >= p.breakdown.critical_path_s >= 0.0
    if math.isfinite(p.completion_s):
        assert p.completion_s >= p.breakdown.throughput_bound_s * (1 - 1e-12)


@SETTINGS
@given(workloads, profiles, gpus, st.integers(1, 8), st.integers(1, 16))
def test_more_decode_instances_are_never_slower(
    work: WorkloadSnapshot, profile: RuntimeProfile, gpu: tuple[str, int], p: int, d: int
) -> None:
    before = predict(work, disaggregated(p, d, *gpu), profile)
    after = predict(work, disaggregated(p, d + 1, *gpu), profile)
    _check(before)
    _check(after)
    assert after.completion_s <= before.completion_s * (1 + MODEL_TOL)


@SETTINGS
@given(workloads, profiles, gpus, st.integers(1, 16))
def test_more_colocated_instances_are_never_slower(
    work: WorkloadSnapshot, profile: RuntimeProfile, gpu: tuple[str, int], c: int
) -> None:
    before = predict(work, colocated(c, *gpu), profile)
    after = predict(work, colocated(c + 1, *gpu), profile)
    _check(after)
    assert after.completion_s <= before.completion_s * (1 + MODEL_TOL)


@SETTINGS
@given(st.booleans(), profiles, st.integers(1, 8), max_segments_options, st.data())
def test_more_remaining_turns_are_never_faster(
    aligned: bool, profile: RuntimeProfile, c: int, max_segments: int | None, data: st.DataObject
) -> None:
    """Tight when turns are whole and every turn starts at the same context. Otherwise two
    artefacts may shorten the prediction a little: a short-context trajectory that lives
    longer lowers the mean context of the tail, and a fractional turn count can reorder
    positions against the configuration-independent sort (inversions are flattened)."""
    seed, n = data.draw(st.integers(0, 2**32 - 1)), data.draw(st.integers(1, 300))
    env_s = data.draw(st.sampled_from([0.0, 0.3, 2.0, 15.0]))
    work = _mixed_workload(np.random.default_rng(seed), n, env_s, same_context=aligned)
    i = data.draw(st.integers(0, len(work.trajectories) - 1))
    extra = data.draw(st.sampled_from([1.0, 3.0] if aligned else [0.5, 1.0, 3.0]))
    t = work.trajectories[i]
    longer = t.model_copy(update={"remaining_turns": t.remaining_turns + extra})
    trajs = (*work.trajectories[:i], longer, *work.trajectories[i + 1 :])
    more = work.model_copy(update={"trajectories": trajs})
    tolerance = MODEL_TOL if aligned else ARTEFACT_TOL
    tolerance = tolerance if max_segments is None else MERGE_TOL
    for config in (colocated(c), disaggregated(c, 2 * c)):
        before = predict(work, config, profile, max_segments).completion_s
        after = predict(more, config, profile, max_segments).completion_s
        assert after >= before * (1 - tolerance)


@SETTINGS
@given(
    workloads, profiles, st.integers(1, 8), st.sampled_from([0.1, 1.0, 10.0]), max_segments_options
)
def test_longer_env_latency_is_never_faster(
    work: WorkloadSnapshot,
    profile: RuntimeProfile,
    c: int,
    extra_s: float,
    max_segments: int | None,
) -> None:
    assert work.stats is not None
    slower_env = work.stats.model_copy(update={"env_latency_s": work.stats.env_latency_s + extra_s})
    slower = work.model_copy(update={"stats": slower_env})
    tolerance = MODEL_TOL if max_segments is None else MERGE_TOL
    for config in (colocated(c), disaggregated(c, 2 * c)):
        before = predict(work, config, profile, max_segments).completion_s
        after = predict(slower, config, profile, max_segments).completion_s
        assert after >= before * (1 - tolerance)


def test_prepare_is_shared_and_does_not_depend_on_the_configuration() -> None:
    work = _mixed_workload(np.random.default_rng(3), 300)
    prepared = prepare(work, PROFILE, max_segments=None)
    assert prepared.num_trajectories == len(work.trajectories) + work.not_started
    assert prepared.num_segments == prepared.num_positions <= prepared.num_trajectories


# --- many configurations at once ----------------------------------------------------------------


def _random_config(rng: np.random.Generator) -> PDConfig:
    """0 to 4 groups of random roles, GPU types (b200 is not profiled) and TP (4 is not)."""
    counts: dict[InstanceSpec, int] = {}
    for _ in range(int(rng.integers(0, 5))):
        role = (Role.PREFILL, Role.DECODE, Role.COLOCATED)[int(rng.integers(3))]
        gpu = str(rng.choice(["h100", "h100", "a100", "a100", "b200"]))
        tp = int(rng.choice([1, 1, 2, 2, 4]))
        spec = InstanceSpec(role, gpu, tp)
        counts[spec] = counts.get(spec, 0) + int(rng.integers(1, 40))
    return PDConfig.of(counts)


def _random_batch(seed: int) -> tuple[WorkloadSnapshot, RuntimeProfile, list[PDConfig]]:
    rng = np.random.default_rng(seed)
    profile = [PROFILE, SMALL_KV, make_profile(kv_capacity_tokens=30_000)][seed % 3]
    n = int(rng.choice([1, 3, 40, 150, 400]))
    work = _mixed_workload(rng, n, float(rng.choice([0.0, 0.3, 2.0, 15.0])))
    configs = [_random_config(rng) for _ in range(40)]
    configs += [PDConfig(), colocated(3), disaggregated(2, 5), colocated(3)]  # empty, repeated
    return work, profile, configs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_segments", [None, DEFAULT_MAX_SEGMENTS])
def test_a_configuration_predicts_the_same_alone_and_in_a_batch(
    seed: int, max_segments: int | None
) -> None:
    work, profile, configs = _random_batch(seed)
    prepared = prepare(work, profile, max_segments)
    many = predict_prepared_many(prepared, configs)
    assert many == [predict_prepared(prepared, c) for c in configs]  # bit for bit
    assert predict_many(work, configs, profile, max_segments) == many
    assert {p.bottleneck for p in many} >= {"infeasible"}


@pytest.mark.parametrize("seed", range(6))
def test_the_batched_path_equals_a_per_configuration_reference(seed: int) -> None:
    work, profile, configs = _random_batch(seed)
    prepared = prepare(work, profile, max_segments=None)
    for config, got in zip(configs, predict_prepared_many(prepared, configs), strict=True):
        completion_s, bottleneck, breakdown = _reference(prepared, config)
        assert got.bottleneck == bottleneck
        assert got.completion_s == pytest.approx(completion_s, rel=1e-9)
        for name, value in breakdown.items():
            assert getattr(got.breakdown, name) == pytest.approx(value, rel=1e-9, abs=1e-12), name


def _reference(w: PreparedWorkload, config: PDConfig) -> tuple[float, str, dict[str, float]]:
    """One configuration, step by step as the predictor did before batching.

    Straightforward per-configuration code (one solve, np.interp, np.bincount, dot
    products) for the parts that batching rewrote: positions, the final-env skip, the
    critical path, the bottleneck and the weighted means.
    """
    groups, _ = engine_groups([config], w.profile)
    if groups is None:
        return math.inf, "infeasible", {"critical_path_s": math.inf}
    e = w.turn.env_s
    cyc = solve_cycle(groups, w.turn, w.fluid, without_env=e > 0)
    alone = solve_cycle(groups, w.turn, w.alone_segments, num_iterations=0)
    if not (np.isfinite(cyc.cycle_s).all() and np.isfinite(alone.cycle_s).all()):
        return math.inf, "kv_capacity", {"critical_path_s": math.inf}
    cycle_s = cyc.cycle_s[0]
    r = np.maximum.accumulate(np.maximum(_end_turns(w.ends, e, cyc, cyc.cycle_s)[0], 0.0))
    with_env_s = float(np.diff(r, prepend=0.0) @ cycle_s)
    if e > 0:  # the same segments without env step, solved in full
        no_env = dataclasses.replace(w.fluid, env_s=np.zeros_like(w.fluid.env_s))
        gap_s = np.maximum(cycle_s - solve_cycle(groups, w.turn, no_env).cycle_s[0], 0.0)
        ends = np.concatenate([[0.0], r])
        added = np.concatenate([[0.0], np.cumsum(np.diff(ends) * gap_s)])
        start = r - 1.0
        at_start = np.where(start >= 0.0, np.interp(start, ends, added), start * gap_s[0])
        skip = (added[1:] - at_start) / cycle_s
        r = np.maximum.accumulate(np.maximum(r - np.minimum(skip, 1.0), 0.0))
    dr = np.diff(r, prepend=0.0)
    seg_s = dr * cycle_s
    fluid_s = float(seg_s.sum())
    offset_s = _offset_s(w.alone, e, alone, alone.cycle_s)[0]
    critical = w.alone.remaining_turns * alone.cycle_s[0] + offset_s - e + w.alone_overrun_s
    critical_s = max(float(critical.max()), w.env_tail_s, 0.0)
    assert cyc.detail is not None
    by_bound = np.bincount(cyc.detail.bound[0], weights=seg_s, minlength=len(BOUND_NAMES))
    bottleneck = "latency" if critical_s >= fluid_s else BOUND_NAMES[int(by_bound.argmax())]
    weights = seg_s / fluid_s if fluid_s > 0 else np.full(len(r), 1 / len(r))
    means = {
        "mean_decode_batch": cyc.decode_batch,
        "decode_slot_utilisation": cyc.detail.decode_slot_use,
        "prefill_utilisation": cyc.detail.prefill_use,
        "prefill_s_per_turn": cyc.prefill_s,
        "decode_s_per_turn": cyc.decode_s,
        "kv_transfer_s_per_turn": cyc.transfer_s,
        "prefix_hit_rate": cyc.detail.prefix_hit,
    }
    breakdown = {name: float(x[0] @ weights) for name, x in means.items()}
    breakdown |= {
        "critical_path_s": critical_s,
        "fluid_s": fluid_s,
        "throughput_bound_s": float(dr @ cyc.throughput_s[0]),
        "final_env_saving_s": with_env_s - fluid_s,
        "cycle_time_s": float(cycle_s[0]),
        "env_share": float(weights @ (e / cycle_s)),
        "num_segments": len(r),
    }
    completion_s = max(fluid_s, critical_s)
    backlog_s = _reference_backlog_s(w, config, float(cyc.detail.prefix_hit[0, 0]))
    if w.fresh.count:  # a turn waits until the fresh prompts are computed
        t = float(cycle_s[0])
        wait_s = backlog_s**2 / (2 * t) if backlog_s <= t else backlog_s - t / 2
        reach = min(completion_s / t, 1.0)  # the turns that come before the batch ends
        completion_s = max(completion_s + wait_s * reach, critical_s + backlog_s)
    breakdown["prompt_backlog_s"] = backlog_s
    return completion_s, bottleneck, breakdown


def _reference_backlog_s(w: PreparedWorkload, config: PDConfig, hit: float) -> float:
    """The fresh prompts' tokens beyond a returning turn's, shared by the prefill-capable
    instances in proportion to their speed: 1 / sum over instances of 1 / (its time)."""
    disaggregated = config.count(Role.PREFILL) + config.count(Role.DECODE) > 0
    new = w.turn.observation_tokens + w.turn.output_tokens * disaggregated
    beyond = [p - new for p in w.fresh.prompt_tokens.tolist() if p > new]
    rate = 0.0
    for spec, count in config.instances:
        if spec.role in (Role.PREFILL, Role.COLOCATED):
            e = w.profile.engine(spec.gpu_type, spec.tp)
            assert e is not None
            pf = e.prefill
            alone_s = sum(
                pf.b_s_per_token * x + pf.c_s_per_token2 * x * x + pf.a_s * x / e.max_batched_tokens
                for x in beyond
            )
            rate += count / (hit * alone_s) if hit * alone_s > 0 else math.inf
    return 1.0 / rate if 0 < rate < math.inf else 0.0


# --- merged segments ------------------------------------------------------------------------------


def test_many_trajectories_merge_into_a_bounded_number_of_segments() -> None:
    work = _mixed_workload(np.random.default_rng(11), 2000)
    prepared = prepare(work, PROFILE)
    assert prepared.num_positions > 500
    assert prepared.num_segments <= DEFAULT_MAX_SEGMENTS
    assert len(prepared.alone_overrun_s) <= DEFAULT_MAX_SEGMENTS
    configs = [colocated(c) for c in (1, 8, 64)] + [disaggregated(4, 12), disaggregated(16, 48)]
    for p in predict_prepared_many(prepared, configs):
        _check(p)
        assert p.breakdown.num_segments == prepared.num_segments


def test_merged_segments_stay_close_to_every_position_as_a_segment() -> None:
    """Merge error (docs/predictor.md): mean 0.1-0.2%, max 0.9% over random workloads."""
    errors = []
    configs = [colocated(c) for c in (2, 16, 64)] + [disaggregated(2, 8), disaggregated(8, 32)]
    for seed in range(4):
        work = _mixed_workload(np.random.default_rng(seed), 512, float([0.0, 2.0, 15.0, 0.3][seed]))
        exact = predict_many(work, configs, SMALL_KV if seed % 2 else PROFILE, max_segments=None)
        merged = predict_many(work, configs, SMALL_KV if seed % 2 else PROFILE)
        for a, b in zip(exact, merged, strict=True):
            errors.append(abs(b.completion_s / a.completion_s - 1))
            assert b.breakdown.critical_path_s == pytest.approx(a.breakdown.critical_path_s)
    assert max(errors) < 0.02
    assert float(np.mean(errors)) < 0.005


@SETTINGS
@given(workloads, profiles, st.integers(2, 8), st.integers(1, 8))
def test_merged_predictions_keep_the_invariants(
    work: WorkloadSnapshot, profile: RuntimeProfile, max_segments: int, c: int
) -> None:
    prepared = prepare(work, profile, max_segments)
    assert prepared.num_segments <= max_segments
    assert len(prepared.alone_overrun_s) <= max_segments
    for p in predict_prepared_many(prepared, [colocated(c), disaggregated(c, 2 * c)]):
        _check(p)


@pytest.mark.parametrize("turns", [1, 4])
def test_one_trajectory_is_exact_with_any_segment_bound(turns: int) -> None:
    profile = constant_profile()
    work = batch(1, turns)
    assert predict(work, colocated(1), profile, max_segments=2) == predict(
        work, colocated(1), profile, max_segments=None
    )


def test_at_least_two_segments() -> None:
    with pytest.raises(ValueError, match="max_segments"):
        prepare(batch(4), PROFILE, max_segments=1)
