"""The straggler estimate: the slowest of many long-tailed trajectories, not the mean one."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import gamma
from testing_profiles import make_profile

from pearl.core.pd import InstanceSpec, PDConfig
from pearl.core.predictor import predict, prepare
from pearl.core.roles import Role
from pearl.core.workload import TrajectoryProgress, TrajPhase, TurnStats, WorkloadSnapshot

OUT, OBS, E = 256.0, 256.0, 2.0
SPREAD = {"output_tokens_sd": 200.0, "env_latency_sd_s": 6.0, "turns_cv": 0.3}
CONFIG = PDConfig.of({InstanceSpec(Role.COLOCATED, "h100", 1): 64})


def workload(n: int, turns: float = 4.0, spread: bool = True, **kw: float) -> WorkloadSnapshot:
    stats = TurnStats(
        output_tokens_per_turn=OUT,
        observation_tokens_per_turn=OBS,
        env_latency_s=E,
        **({**SPREAD, **kw} if spread else {}),
    )
    trajs = tuple(
        TrajectoryProgress(
            traj_id=f"t{i}", phase=TrajPhase.QUEUED, context_tokens=2048, remaining_turns=turns
        )
        for i in range(n)
    )
    return WorkloadSnapshot(trajectories=trajs, stats=stats)


def test_without_spreads_the_prediction_is_the_mean_critical_path() -> None:
    profile = make_profile()
    with_spread = predict(workload(256), CONFIG, profile)
    without = predict(workload(256, spread=False), CONFIG, profile)
    assert with_spread.completion_s > without.completion_s * 1.2
    assert without.breakdown.critical_path_s < with_spread.breakdown.critical_path_s


def test_the_straggler_is_the_gamma_quantile_of_the_remaining_time() -> None:
    """One position, n trajectories: mean path mu (the critical path without spreads),
    variance from the per-turn spreads, quantile n / (n + 1) of a gamma; the straggler
    is that quantile, or the loaded fluid time plus its excess over mu if later."""
    profile = make_profile()
    n, turns = 512, 4.0
    base = predict(workload(n, turns, spread=False), CONFIG, profile)
    mu = base.breakdown.critical_path_s
    prepared = prepare(workload(1, turns, spread=False), profile)
    alone = predict(workload(1, turns, spread=False), CONFIG, profile)
    assert alone.completion_s == pytest.approx(mu)  # one alone is the mean path
    decode_s = alone.breakdown.decode_s_per_turn
    cycle_s = (mu + E) / turns  # R turns, the last without its env step
    var = turns * ((decode_s / OUT) ** 2 * SPREAD["output_tokens_sd"] ** 2 + 6.0**2)
    var += (SPREAD["turns_cv"] * turns * cycle_s) ** 2
    slowest = gamma.ppf(n / (n + 1), mu**2 / var, scale=var / mu)
    expected = max(slowest, base.breakdown.fluid_s + slowest - mu)
    got = predict(workload(n, turns), CONFIG, profile).breakdown.critical_path_s
    assert prepared.num_trajectories == 1
    assert base.breakdown.fluid_s > mu  # 512 trajectories on 64 instances: loaded
    assert got == pytest.approx(expected, rel=1e-6)


def test_more_gpus_shorten_the_loaded_straggler() -> None:
    """The straggler runs with the batch until the batch drains: more instances make the
    loaded part shorter, so the prediction (unlike the alone path) depends on them."""
    profile = make_profile()
    work = workload(2048)
    small = PDConfig.of({InstanceSpec(Role.COLOCATED, "h100", 1): 16})
    times = [predict(work, c, profile).completion_s for c in (small, CONFIG)]
    assert times[1] < times[0]


@pytest.mark.parametrize("field", sorted(SPREAD))
def test_more_spread_is_never_faster(field: str) -> None:
    profile = make_profile()
    times = [
        predict(workload(128, **{field: SPREAD[field] * f}), CONFIG, profile).completion_s
        for f in (0.5, 1.0, 2.0)
    ]
    assert times == sorted(times)
    assert times[0] < times[-1]


def test_more_trajectories_are_never_faster() -> None:
    profile = make_profile()
    times = [predict(workload(n), CONFIG, profile).completion_s for n in (2, 16, 128, 1024)]
    assert times == sorted(times)


def test_a_few_long_trajectories_weigh_by_their_own_count() -> None:
    """Many short trajectories and 2 long ones: the long ones' straggler uses n = 2, so it
    stays well below what 1,000 trajectories as long would give."""
    profile = make_profile()
    short = workload(1000, turns=1.0).trajectories
    long = workload(2, turns=6.0).trajectories
    stats = workload(1).stats
    mixed = WorkloadSnapshot(
        trajectories=(*short, *(t.model_copy(update={"traj_id": "L" + t.traj_id}) for t in long)),
        stats=stats,
    )
    all_long = predict(workload(1002, turns=6.0), CONFIG, profile).breakdown.critical_path_s
    got = predict(mixed, CONFIG, profile).breakdown.critical_path_s
    two_long = predict(workload(2, turns=6.0), CONFIG, profile).breakdown.critical_path_s
    assert got < all_long * 0.8
    assert got >= two_long * (1 - 1e-9)
    assert np.isfinite(got)
