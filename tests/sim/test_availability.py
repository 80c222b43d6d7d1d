"""Availability windows: the layered rule on a series (toy, property-based, Helios) and the
synthetic generator (determinism, cap, rates)."""

from __future__ import annotations

import numpy as np
import pytest
import sim_fixtures
from hypothesis import given, settings
from hypothesis import strategies as st
from trace_files import traces_or_skip

from pearl.io.simulation import windows_for
from pearl.io.traces import HELIOS_VC, read_helios_idle
from pearl.sim.availability import (
    Window,
    clip_windows,
    open_gpus_at,
    synthetic_windows,
    windows_from_idle_series,
)
from pearl.sim.scenario import Scenario

RAW = "the window rule is checked on the raw Helios series"


def _open_per_sample(windows: tuple[Window, ...], time_s: np.ndarray) -> np.ndarray:
    """GPUs of the open windows at every sample time."""
    open_gpus = np.zeros(time_s.size, dtype=np.int64)
    for w in windows:
        a, b = np.searchsorted(time_s, [w.start_s, w.end_s], side="left")
        open_gpus[a:b] += w.num_gpus
    return open_gpus


def _check_invariants(
    windows: tuple[Window, ...], time_s: np.ndarray, idle: np.ndarray, min_duration_s: float
) -> None:
    assert list(windows) == sorted(windows)
    for w in windows:
        assert w.duration_s >= min_duration_s
        assert w.num_gpus > 0 and w.num_gpus % 8 == 0
    open_gpus = _open_per_sample(windows, time_s)
    assert np.all(open_gpus <= 8 * (idle // 8))
    assert open_gpus.max(initial=0) <= idle.max()


def test_toy_series_gives_the_documented_windows() -> None:
    t = np.arange(10) * 60.0
    idle = np.array([0, 8, 16, 16, 8, 9, 0, 16, 17, 0])
    windows = windows_from_idle_series(t, idle, gpu_type="h100", min_duration_s=60)
    assert windows == (
        Window(60.0, 360.0, 8, "h100"),
        Window(120.0, 240.0, 8, "h100"),
        Window(420.0, 540.0, 16, "h100"),  # two layers with the same run merge
    )
    longer = windows_from_idle_series(t, idle, gpu_type="h100", min_duration_s=180)
    assert longer == (Window(60.0, 360.0, 8, "h100"),)


def test_a_partly_idle_node_is_not_lent_and_the_last_sample_holds_one_step() -> None:
    t = np.arange(4) * 60.0
    assert windows_from_idle_series(t, [7, 7, 7, 7], gpu_type="a", min_duration_s=0) == ()
    assert windows_from_idle_series(t, [0, 0, 8, 8], gpu_type="a", min_duration_s=0) == (
        Window(120.0, 240.0, 8, "a"),
    )


@pytest.mark.parametrize(
    ("time_s", "idle", "problem"),
    [
        pytest.param([0.0, 60.0], [1], "same length", id="lengths"),
        pytest.param([0.0, 0.0], [1, 1], "increasing", id="time-repeats"),
        pytest.param([0.0, 60.0], [1, -1], ">= 0", id="negative"),
    ],
)
def test_bad_series_are_rejected(time_s: list[float], idle: list[int], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        windows_from_idle_series(time_s, idle, gpu_type="a")


@settings(max_examples=200, deadline=None)
@given(
    idle=st.lists(st.integers(0, 64), min_size=2, max_size=80),
    min_duration_s=st.sampled_from([0.0, 60.0, 300.0]),
)
def test_windows_never_exceed_the_idle_nodes(idle: list[int], min_duration_s: float) -> None:
    t = np.arange(len(idle)) * 60.0
    arr = np.asarray(idle)
    windows = windows_from_idle_series(t, arr, gpu_type="x", min_duration_s=min_duration_s)
    _check_invariants(windows, t, arr, min_duration_s)
    if min_duration_s == 0.0:  # with no filter every idle node is lent
        assert np.array_equal(_open_per_sample(windows, t), 8 * (arr // 8))


def test_helios_windows_respect_the_series() -> None:
    series = read_helios_idle(traces_or_skip(RAW) / HELIOS_VC)
    windows = windows_from_idle_series(series.time_s, series.idle_gpus, gpu_type="v100")
    _check_invariants(windows, series.time_s, series.idle_gpus, 600.0)
    assert windows == windows_from_idle_series(series.time_s, series.idle_gpus, gpu_type="v100")
    assert len(windows) > 10  # a month of a 56-GPU cluster leaves idle nodes often enough


def _synthetic(seed: int, horizon_s: float = 86_400.0) -> tuple[Window, ...]:
    return synthetic_windows(
        np.random.default_rng(seed),
        horizon_s=horizon_s,
        arrivals_per_h=6.0,
        mean_lifetime_s=1800.0,
        lifetime_sigma=1.0,
        gpu_type="h100",
        num_nodes=2,
    )


def test_synthetic_windows_are_deterministic_for_a_seed() -> None:
    assert _synthetic(1) == _synthetic(1)
    assert _synthetic(1) != _synthetic(2)


def test_synthetic_windows_respect_horizon_and_cap() -> None:
    windows = synthetic_windows(
        np.random.default_rng(3),
        horizon_s=86_400.0,
        arrivals_per_h=20.0,
        mean_lifetime_s=3600.0,
        lifetime_sigma=1.0,
        gpu_type="h100",
        max_gpus=32,
    )
    assert windows and all(0 <= w.start_s < w.end_s <= 86_400.0 for w in windows)
    assert all(w.num_gpus == 8 for w in windows)
    assert max(open_gpus_at(windows, w.start_s) for w in windows) <= 32


def test_synthetic_rates_and_lifetimes_match_the_parameters() -> None:
    windows = _synthetic(4, horizon_s=3.6e7)  # 10,000 h: clipping at the end is negligible
    assert all(w.num_gpus == 16 for w in windows)
    assert len(windows) / 1e4 == pytest.approx(6.0, rel=0.03)
    lifetimes = np.array([w.duration_s for w in windows])
    assert lifetimes.mean() == pytest.approx(1800.0, rel=0.03)
    assert np.std(np.log(lifetimes)) == pytest.approx(1.0, rel=0.03)


def test_a_window_open_at_the_run_end_outlives_the_run() -> None:
    """The run's end is not the owner reclaiming a window: clipped there, every window
    open at the end would be warned of a reclaim ``grace_s`` before it and taken off."""
    trace = (Window(0.0, 500.0, 8, "h800"), Window(700.0, 5000.0, 8, "h800"))
    trace += (Window(1500.0, 2000.0, 8, "h800"),)  # opens after the run: not in it
    assert clip_windows(trace, 100.0, 1000.0, None) == (
        Window(0.0, 400.0, 8, "h800"),
        Window(600.0, 4900.0, 8, "h800"),
    )
    doc = sim_fixtures.scenario_dict(elastic=True, duration_s=3600.0)
    doc["elastic"]["synthetic"].update(lifetime_median_s=20_000.0, max_gpus=64)
    scenario = Scenario.model_validate(doc)
    windows = windows_for(scenario, seed=0)
    assert windows and all(w.start_s < scenario.duration_s for w in windows)
    assert any(w.end_s > scenario.duration_s + scenario.elastic.grace_s for w in windows)
