"""One pearl or baseline run with its decision records, as the checks of what a policy
holds read it (``pd_mode_check.py``, ``tp_check.py``): the throughput, the predictor's
median predicted / actual on the run's own decisions, and every decision record."""

from __future__ import annotations

from typing import Any

import numpy as np

from pearl.core.profile import RuntimeProfile
from pearl.io.simulation import run_inputs
from pearl.sim.baselines import make_policy
from pearl.sim.runner import simulate
from pearl.sim.scenario import Scenario


def held_run(
    scenario: Scenario, profile: RuntimeProfile, policy_name: str, seed: int
) -> tuple[dict[str, Any], list[Any]]:
    """The run's figures (``traj_per_h``, ``median_predicted_over_actual``) and its
    decision records, in order."""
    policy = make_policy(policy_name, scenario.policy, scenario.cluster.trainer.nodes)
    decisions: list[Any] = []

    def sink(record: Any) -> None:
        if getattr(record, "type", None) == "decision":
            decisions.append(record)

    metrics = simulate(run_inputs(scenario, profile, seed), policy, sink)
    ratios = [p.predicted_s / p.actual_s for p in metrics.predictions if p.actual_s > 0]
    figures = {
        "traj_per_h": metrics.trajectories / (scenario.duration_s / 3600),
        "median_predicted_over_actual": float(np.median(ratios)) if ratios else None,
    }
    return figures, decisions
