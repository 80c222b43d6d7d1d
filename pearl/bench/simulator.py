"""Benchmarks of the simulator: predictor accuracy on simulated runs, and simulation speed.

``bench_predictor``: runs pearl on a scenario and compares, at every decision, the core
predictor's completion time of the work then unfinished (the in-flight trajectories plus
those allowed to start) with the time the simulator took to finish that same set. The
prediction is of the configuration running (or, when the decision switched, of the target
plus the transition); the figures are ``pearl.sim.predictions.prediction_errors``'s.

``bench_sim``: one pearl run at the scale of ``gpus`` (a quarter training, half base
rollout, a quarter elastic synthetic windows, the batch scaled with the GPUs) for
``sim_hours``, with the fluid engine model unless told (its throughput is the step
model's within 2% on the shipped scenarios and on this one: ``benchmarks/fluid_check.py``,
``docs/simulator.md``); it reports the wall and CPU time and the events processed per
second.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pearl.io.scenarios import load_scenario_and_profile
from pearl.io.simulation import run_inputs
from pearl.sim.baselines import make_policy
from pearl.sim.engine_models import EngineModelName
from pearl.sim.predictions import Prediction, prediction_errors
from pearl.sim.runner import simulate
from pearl.sim.scenario import Scenario

SCALE_SCENARIO = Path(__file__).resolve().parents[2] / "benchmarks/scenarios/qwen3-8b.yaml"


def bench_predictor(
    scenario_path: str | Path, seeds: int = 1, duration_s: float | None = None
) -> dict[str, Any]:
    scenario, profile = load_scenario_and_profile(scenario_path)
    if duration_s is not None:
        scenario = scenario.model_copy(update={"duration_s": duration_s})
    seeded: list[tuple[int, Prediction]] = []
    for seed in range(seeds):
        policy = make_policy("pearl", scenario.policy, scenario.cluster.trainer.nodes)
        predictions = simulate(run_inputs(scenario, profile, seed), policy).predictions
        seeded += [(seed, p) for p in predictions]
    return {
        **prediction_errors(seeded),
        "scenario": scenario.name,
        "seeds": seeds,
        "duration_s": scenario.duration_s,
    }


def scaled_scenario(
    base: Scenario, gpus: int, sim_hours: float, engine_model: EngineModelName = "fluid"
) -> Scenario:
    nodes = max(4, gpus // 8)
    trainer, elastic = max(1, nodes // 4), max(1, nodes // 4)
    rollout = nodes - trainer - elastic
    cluster = base.cluster.model_copy(
        update={
            "trainer": base.cluster.trainer.model_copy(update={"nodes": trainer}),
            "rollout": base.cluster.rollout.model_copy(update={"nodes": rollout}),
        }
    )
    gpu_type = base.cluster.trainer.gpu_type
    data = base.model_dump()
    data.update(
        duration_s=sim_hours * 3600.0,
        engine_model=engine_model,
        cluster=cluster.model_dump(),
        elastic={
            "source": "synthetic",
            "synthetic": {
                "gpu_type": gpu_type,
                "arrivals_per_h": 2.0,
                "lifetime_median_s": 9690.0,
                "lifetime_sigma": 1.45,
                "gpus_per_allocation": 8,
                "max_gpus": elastic * 8,
            },
            "queue_delay_median_s": base.elastic.queue_delay_median_s,
            "queue_delay_sigma": base.elastic.queue_delay_sigma,
            "grace_s": base.elastic.grace_s,
        },
    )
    data["rollout"]["batch_trajectories"] = 1024 * max(1, (rollout * 8) // 32)
    data["policy"]["elastic"].update(gpu_type=gpu_type, max_allocations=elastic)
    return Scenario.model_validate(data)


def bench_sim(
    gpus: int = 256, sim_hours: float = 24.0, engine_model: EngineModelName = "fluid"
) -> dict[str, Any]:
    base, profile = load_scenario_and_profile(SCALE_SCENARIO)
    scenario = scaled_scenario(base, gpus, sim_hours, engine_model)
    inputs = run_inputs(scenario, profile, seed=0)
    policy = make_policy("pearl", scenario.policy, scenario.cluster.trainer.nodes)
    start = time.perf_counter()
    start_cpu_s = time.process_time()
    metrics = simulate(inputs, policy)
    wall_s = time.perf_counter() - start
    cpu_s = time.process_time() - start_cpu_s
    return {
        "engine_model": engine_model,
        "gpus": scenario.base_gpus + (scenario.elastic.synthetic.max_gpus or 0)
        if scenario.elastic.synthetic
        else scenario.base_gpus,
        "sim_hours": sim_hours,
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "events_per_s": metrics.num_events / wall_s,
        "events": metrics.num_events,
        "trajectories": metrics.trajectories,
        "throughput_traj_per_h": metrics.trajectories / metrics.hours,
        "projected_wall_s_for_24_sim_hours": wall_s * 24.0 / sim_hours,
    }
