"""Inputs of simulated runs, read from the traces: the shell side of ``pearl simulate``.

``run_inputs`` fits the trajectory model to the public traces (once per process; the
fit is deterministic), rescales it to the scenario's means, and builds the elastic
windows: the Helios series moved to run time for ``source: trace``, or synthetic
windows drawn from the run's seed for ``source: synthetic`` (from ``SYNTHETIC_WARMUP_S``
before the start, so the run begins with the windows the process would have open).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np

from pearl.core.profile import RuntimeProfile
from pearl.sim.availability import Window, synthetic_windows
from pearl.sim.cluster import clip_windows
from pearl.sim.runner import RunInputs
from pearl.sim.scenario import Scenario
from pearl.sim.trajectories import TrajectoryModel, scaled
from pearl.traces import fit_trajectory_model_from, helios_windows, traces_dir

WINDOW_SEED_SALT = 0x5EED  # windows draw from their own stream, apart from the run's
# Synthetic windows are drawn from this long before the run starts, so a run begins in the
# arrival process's steady state (windows already open), as a trace offset does for Helios.
SYNTHETIC_WARMUP_S = 24 * 3600.0


@cache
def _model(directory: Path) -> TrajectoryModel:
    return fit_trajectory_model_from(directory)


@cache
def _helios(directory: Path, gpu_type: str, min_duration_s: float) -> tuple[Window, ...]:
    return helios_windows(directory, gpu_type=gpu_type, min_duration_s=min_duration_s)


def windows_for(scenario: Scenario, seed: int, directory: Path) -> tuple[Window, ...]:
    el = scenario.elastic
    if el.trace is not None:
        t = el.trace
        raw = _helios(directory, t.gpu_type, t.min_duration_s)
        return clip_windows(raw, t.offset_s, scenario.duration_s, t.max_gpus)
    if el.synthetic is not None:
        s = el.synthetic
        rng = np.random.default_rng([WINDOW_SEED_SALT, seed])
        drawn = synthetic_windows(
            rng,
            horizon_s=SYNTHETIC_WARMUP_S + scenario.duration_s,
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
    directory: Path | None = None,
    decision_interval_s: float = 60.0,
) -> RunInputs:
    directory = directory or traces_dir()
    model = scaled(_model(directory), **scenario.rollout.workload.kwargs())
    return RunInputs(
        scenario=scenario,
        profile=profile,
        trajectory_model=model,
        windows=windows_for(scenario, seed, directory),
        seed=seed,
        decision_interval_s=decision_interval_s,
    )
