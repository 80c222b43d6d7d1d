"""Inputs of simulated runs, read from pearl's data files: the shell side of ``pearl simulate``.

``run_inputs`` fits the trajectory model (once per process and file; the fit is
deterministic) to the scenario's workload data, rescales it to the scenario's means, and
builds the elastic windows: the availability windows moved to run time for ``source:
trace``, or synthetic windows drawn from the run's seed for ``source: synthetic`` (from
``SYNTHETIC_WARMUP_S`` before the start, so the run begins with the windows the process
would have open).

The data is pearl's shipped files (``pearl/data``, ``pearl.io.data_files``) unless the
scenario names others: a workload samples or windows file in the same format, or, for
research, the raw public traces (``rollout.traces_dir``, ``elastic.trace.idle_series_file``).
The loader (``pearl.io.scenarios``) has made those paths absolute.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np

from pearl.core.profile import RuntimeProfile
from pearl.io.data_files import (
    SHIPPED_WINDOWS,
    SHIPPED_WORKLOAD,
    read_windows,
    read_workload_samples,
    shipped,
)
from pearl.io.traces import fit_trajectory_model_from, helios_windows
from pearl.sim.availability import Window, clip_windows, synthetic_windows
from pearl.sim.runner import RunInputs
from pearl.sim.scenario import RolloutSection, Scenario, TraceElastic
from pearl.sim.trajectories import TrajectoryModel, fit_trajectory_model, scaled

WINDOW_SEED_SALT = 0x5EED  # windows draw from their own stream, apart from the run's
# Synthetic windows are drawn from this long before the run starts, so a run begins in the
# arrival process's steady state (windows already open), as a trace offset does for Helios.
SYNTHETIC_WARMUP_S = 24 * 3600.0


@cache
def _samples_model(path: Path) -> TrajectoryModel:
    return fit_trajectory_model(**read_workload_samples(path))


@cache
def _traces_model(directory: Path) -> TrajectoryModel:
    return fit_trajectory_model_from(directory)


def trajectory_model(rollout: RolloutSection) -> TrajectoryModel:
    """The fitted (unscaled) trajectory model of the scenario's workload data."""
    if rollout.traces_dir is not None:
        return _traces_model(Path(rollout.traces_dir))
    return _samples_model(Path(rollout.workload_file or shipped(SHIPPED_WORKLOAD)))


@cache
def _series_windows(path: Path, gpu_type: str, min_duration_s: float) -> tuple[Window, ...]:
    return helios_windows(path, gpu_type=gpu_type, min_duration_s=min_duration_s)


def trace_windows(trace: TraceElastic) -> tuple[Window, ...]:
    """Every window of the scenario's availability data, in trace time."""
    if trace.idle_series_file is not None:
        path = Path(trace.idle_series_file)
        return _series_windows(path, trace.gpu_type, trace.min_duration_s)
    path = Path(trace.windows_file or shipped(SHIPPED_WINDOWS))
    return read_windows(path, gpu_type=trace.gpu_type, min_duration_s=trace.min_duration_s)


def windows_for(scenario: Scenario, seed: int) -> tuple[Window, ...]:
    el = scenario.elastic
    if el.trace is not None:
        t = el.trace
        return clip_windows(trace_windows(t), t.offset_s, scenario.duration_s, t.max_gpus)
    if el.synthetic is not None:
        s = el.synthetic
        rng = np.random.default_rng([WINDOW_SEED_SALT, seed])
        drawn = synthetic_windows(
            rng,
            # past the run's end by the preemption notice: the draw's horizon ends the
            # windows still open there, which is not a reclaim the run may be warned of
            horizon_s=SYNTHETIC_WARMUP_S + scenario.duration_s + el.grace_s + 1.0,
            arrivals_per_h=s.arrivals_per_h,
            mean_lifetime_s=s.lifetime_mean_s,
            lifetime_sigma=s.lifetime_sigma,
            gpu_type=s.gpu_type,
            num_nodes=s.gpus_per_allocation // 8,
            max_gpus=s.max_gpus,
        )
        return clip_windows(drawn, SYNTHETIC_WARMUP_S, scenario.duration_s, None)
    return ()


def run_inputs(
    scenario: Scenario,
    profile: RuntimeProfile,
    seed: int,
    decision_interval_s: float = 60.0,
) -> RunInputs:
    model = scaled(trajectory_model(scenario.rollout), **scenario.rollout.workload.kwargs())
    return RunInputs(
        scenario=scenario,
        profile=profile,
        trajectory_model=model,
        windows=windows_for(scenario, seed),
        seed=seed,
        decision_interval_s=decision_interval_s,
    )
