"""The trajectory model: determinism, layout invariants, means, shape under scaling, tails.

Pure tests use small synthetic observation arrays; the ``real`` tests fit the model to
pearl's shipped workload samples (``pearl/data``, derived from the public traces).
"""

from __future__ import annotations

import numpy as np
import pytest

from pearl.io.data_files import SHIPPED_WORKLOAD, read_workload_samples, shipped
from pearl.sim.distributions import fit_distribution, mean_of, rescaled, sample
from pearl.sim.trajectories import (
    TrajectoryModel,
    TrajectorySpec,
    fit_trajectory_model,
    means,
    sample_trajectories,
    scaled,
)


def _toy_model() -> TrajectoryModel:
    rng = np.random.default_rng(7)
    return fit_trajectory_model(
        turns_per_session=[3, 4, 6, 8, 9, 5],
        prompt_tokens=rng.lognormal(7.0, 1.2, 2000).round() + 1,
        observation_tokens=rng.lognormal(6.0, 0.6, 300).round() + 1,
        output_tokens=rng.lognormal(5.2, 1.0, 2000).round() + 1,
        tool_latency_s=rng.lognormal(-0.9, 1.9, 40),
    )


def _parts(specs: list[TrajectorySpec]) -> dict[str, np.ndarray]:
    return {
        "prompt_tokens": np.array([s.prompt_tokens for s in specs], dtype=float),
        "observation_tokens": np.array([t for s in specs for t in s.new_tokens[1:]], float),
        "output_tokens": np.array([t for s in specs for t in s.output_tokens], dtype=float),
        "tool_latency_s": np.array([t for s in specs for t in s.tool_latency_s]),
        "turns": np.array([s.num_turns for s in specs], dtype=float),
    }


def test_same_seed_same_trajectories_other_seed_others() -> None:
    model = _toy_model()
    a = sample_trajectories(model, np.random.default_rng(3), 200)
    b = sample_trajectories(model, np.random.default_rng(3), 200)
    c = sample_trajectories(model, np.random.default_rng(4), 200)
    assert a == b
    assert a != c


def test_every_spec_has_the_documented_layout() -> None:
    for spec in sample_trajectories(_toy_model(), np.random.default_rng(0), 500):
        assert spec.num_turns >= 1
        assert len(spec.new_tokens) == len(spec.output_tokens) == spec.num_turns
        assert spec.new_tokens[0] == 0
        assert len(spec.tool_latency_s) == spec.num_turns - 1
        assert spec.prompt_tokens >= 1 and min(spec.output_tokens) >= 1
        assert all(t > 0 for t in spec.tool_latency_s)


@pytest.mark.parametrize(
    ("field", "kwarg"),
    [
        pytest.param("prompt_tokens", "prompt_tokens", id="prompt"),
        pytest.param("output_tokens", "output_tokens_per_turn", id="output"),
        pytest.param("observation_tokens", "observation_tokens_per_turn", id="observation"),
        pytest.param("tool_latency_s", "env_latency_s", id="tool-latency"),
    ],
)
def test_scaled_sets_the_mean_and_keeps_every_quantile_ratio(field: str, kwarg: str) -> None:
    model = _toy_model()
    before = getattr(model, field)
    after = getattr(scaled(model, **{kwarg: 3.0 * mean_of(before)}), field)
    assert mean_of(after) == pytest.approx(3.0 * mean_of(before), rel=1e-12)
    x = sample(before, np.random.default_rng(1), 1000)
    y = sample(after, np.random.default_rng(1), 1000)
    assert np.allclose(y / x, 3.0)  # same uniforms, every draw times one factor


def test_scaled_turns_keep_the_mean_exact_and_at_least_one_turn() -> None:
    model = scaled(_toy_model(), turns_per_trajectory=2.5)
    assert means(model).turns_per_trajectory == pytest.approx(2.5)
    turns = _parts(sample_trajectories(model, np.random.default_rng(2), 40_000))["turns"]
    assert turns.min() >= 1
    assert turns.mean() == pytest.approx(2.5, rel=0.02)
    with pytest.raises(ValueError, match=">= 1"):
        scaled(model, turns_per_trajectory=0.5)


def test_large_samples_match_the_fitted_means() -> None:
    model = scaled(_toy_model(), prompt_tokens=4000.0, env_latency_s=2.0)
    want = means(model)
    got = _parts(sample_trajectories(model, np.random.default_rng(5), 40_000))
    assert got["prompt_tokens"].mean() == pytest.approx(want.prompt_tokens, rel=0.03)
    assert got["output_tokens"].mean() == pytest.approx(want.output_tokens_per_turn, rel=0.03)
    obs = want.observation_tokens_per_turn
    assert got["observation_tokens"].mean() == pytest.approx(obs, rel=0.03)
    assert got["tool_latency_s"].mean() == pytest.approx(want.env_latency_s, rel=0.05)
    assert got["turns"].mean() == pytest.approx(want.turns_per_trajectory, rel=0.02)


def test_the_tail_goes_beyond_the_largest_observation_up_to_the_cap() -> None:
    observations = np.random.default_rng(9).lognormal(0.0, 1.5, 50)
    d = fit_distribution(observations)
    draws = sample(d, np.random.default_rng(0), 200_000)
    assert draws.max() > observations.max()
    assert draws.max() <= d.cap
    # up to the largest observation the draws are the observations themselves
    assert set(draws[draws <= d.threshold]) <= set(observations)
    assert rescaled(d, 5.0).scale == pytest.approx(5.0 / mean_of(d))


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        pytest.param([1.0], "at least 2", id="too-few"),
        pytest.param([1.0, 0.0], "> 0", id="zero"),
        pytest.param([2.0, 2.0, 2.0], "all be equal", id="constant"),
    ],
)
def test_fit_rejects_degenerate_observations(values: list[float], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        fit_distribution(values)


# --- fitted to the shipped data (derived from the public traces) -------------------------


@pytest.fixture(scope="module")
def real_model() -> TrajectoryModel:
    return fit_trajectory_model(**read_workload_samples(shipped(SHIPPED_WORKLOAD)))


def test_real_model_large_sample_matches_its_means(real_model: TrajectoryModel) -> None:
    want = means(real_model)
    got = _parts(sample_trajectories(real_model, np.random.default_rng(11), 100_000))
    assert got["prompt_tokens"].mean() == pytest.approx(want.prompt_tokens, rel=0.04)
    assert got["output_tokens"].mean() == pytest.approx(want.output_tokens_per_turn, rel=0.02)
    obs = want.observation_tokens_per_turn
    assert got["observation_tokens"].mean() == pytest.approx(obs, rel=0.02)
    assert got["tool_latency_s"].mean() == pytest.approx(want.env_latency_s, rel=0.05)
    assert got["turns"].mean() == pytest.approx(want.turns_per_trajectory, rel=0.01)
    assert got["turns"].min() >= 3 and got["turns"].max() <= 9  # TraceLab: 3-9 rounds


# p99/p50 of the pooled observations (``python -m pearl.io.traces``, ``data_p99_over_p50``):
# prompt 50.06, output 4.23, observation 5.82, tool latency 116.0. The model draws each
# observation with probability 1/(n+1) and puts the remaining 1/(n+1) above the largest one,
# so its quantiles are at least the data's at nearly the same level; a sample keeps these
# ratios up to sampling noise. The bounds are the ratios times 0.9, rounded down.
TAIL_BOUNDS = {
    "prompt_tokens": 45.0,
    "output_tokens": 3.8,
    "observation_tokens": 5.2,
    "tool_latency_s": 100.0,
}


def test_real_model_keeps_the_long_tails(real_model: TrajectoryModel) -> None:
    got = _parts(sample_trajectories(real_model, np.random.default_rng(12), 50_000))
    for name, bound in TAIL_BOUNDS.items():
        p50, p99 = np.percentile(got[name], [50, 99])
        assert p99 / p50 > bound, name
        # the fitted tail is drawn: beyond the largest observation, never beyond the cap
        dist = getattr(real_model, name)
        draws = sample(dist, np.random.default_rng(13), 1_000_000)
        assert dist.threshold < draws.max() <= dist.cap, name
