"""The predictor's online calibration: measured over predicted batch times, smoothed
and bounded, applied to the engines' costs; a scaled profile predicts that much longer."""

from __future__ import annotations

import math

import pytest

from pearl.core.calibration import BatchCalibration, scaled_engines
from pearl.core.pd import InstanceSpec, PDConfig
from pearl.core.predictor import predict
from pearl.core.roles import Role
from pearl.core.workload import NextBatch, TurnStats, WorkloadSnapshot
from pearl.io.documents import load_profile


def test_each_batch_moves_the_factor_part_of_the_way() -> None:
    c = BatchCalibration(weight=0.5)
    assert c.factor == 1.0
    assert c.observe(1.0, 4.0, 1.0) == pytest.approx(2.0)  # halfway (in logs) to x4
    # predicted with x2 and still 2x short: x4 would have been right; halfway from x2
    assert c.observe(2.0, 4.0, 2.0) == pytest.approx(math.sqrt(2.0 * 4.0))
    before = c.factor
    assert c.observe(float("inf"), 1.0, 1.0) == before  # no usable pair: no change
    assert c.observe(0.0, 1.0, 1.0) == before
    assert c.batches == 2


def test_a_prediction_is_judged_by_the_factor_it_was_made_with() -> None:
    """A batch predicted before the last change of the factor: what would have been
    right is its own factor times its error, not the current one's."""
    c = BatchCalibration(weight=1.0)
    c.observe(1.0, 3.0, 1.0)  # now x3
    assert c.observe(1.0, 2.0, 1.0) == pytest.approx(2.0)  # made at x1, 2x short: x2


def test_repeated_batches_converge_to_the_engines_true_slowness() -> None:
    c = BatchCalibration()
    for _ in range(30):
        f = c.factor
        c.observe(1.0 * f, 5.0, f)  # the prediction scales with the factor; truth 5x
    assert c.factor == pytest.approx(5.0, rel=1e-3)


def test_the_factor_is_bounded() -> None:
    c = BatchCalibration(weight=1.0, min_factor=0.5, max_factor=3.0)
    assert c.observe(1.0, 100.0, 1.0) == pytest.approx(3.0)
    low = BatchCalibration(weight=1.0, min_factor=0.5)
    assert low.observe(100.0, 1.0, 1.0) == pytest.approx(0.5)


def test_a_scaled_profile_predicts_the_same_batch_that_much_longer() -> None:
    profile = load_profile("tiny-cpu")
    w = profile.workload
    snapshot = WorkloadSnapshot(
        not_started=256,
        stats=TurnStats(
            output_tokens_per_turn=w.output_tokens_per_turn,
            observation_tokens_per_turn=w.observation_tokens_per_turn,
            env_latency_s=0.0,
        ),
        next_batch=NextBatch(groups_needed=64, group_size=4),
    )
    config = PDConfig.of({InstanceSpec(Role.COLOCATED, "cpu", 1): 2})
    base_s = predict(snapshot, config, profile).completion_s
    slow = scaled_engines(profile, 3.0)
    assert predict(snapshot, config, slow).completion_s == pytest.approx(3 * base_s, rel=0.02)
    assert slow.costs == profile.costs and slow.workload == profile.workload
    with pytest.raises(ValueError, match="factor"):
        scaled_engines(profile, 0.0)
