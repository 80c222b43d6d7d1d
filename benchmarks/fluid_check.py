"""The fluid engine model against the step model: throughput and CPU time on scenarios.

For each scenario, every policy's runs (``pearl simulate``'s, static-pd's two modes
included; no oracle, no log) under ``engine_model: step`` and under ``fluid``, on the same
seeds: trajectories per hour and output tokens per second (mean over the seeds) of each,
the fluid model's relative difference, and the CPU seconds of each model's runs. The step
model's recompute preemptions are counted (the fluid model has none: it reserves a
request's KV on admission).

Usage::

    .venv/bin/python benchmarks/fluid_check.py [SCENARIO ...] [--seeds N] [--duration-s S]

Defaults: both shipped scenarios, their seeds (3) and duration (1,800 s). Prints JSON;
``max_abs_throughput_diff`` is the largest ``|fluid / step - 1|`` of trajectories per hour
over every (scenario, policy), and of the mean over the policies, per scenario.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pearl.io.scenarios import load_scenario_and_profile
from pearl.io.simulation import run_inputs
from pearl.sim import engine as step_engine
from pearl.sim.baselines import REPORTED, make_policy
from pearl.sim.engine import EngineStepResult
from pearl.sim.report import runs_needed
from pearl.sim.runner import simulate

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = [
    ROOT / "benchmarks/scenarios/qwen3-8b.yaml",
    ROOT / "benchmarks/scenarios/qwen3-30b-a3b.yaml",
]

_preempted = [0]
_step = step_engine.EngineModel.step


def _counting_step(
    self: step_engine.EngineModel, max_steps: int = 1, max_duration_s: float = float("inf")
) -> EngineStepResult:
    result = _step(self, max_steps, max_duration_s)
    _preempted[0] += len(result.preempted)
    return result


def check(path: Path, seeds: int | None, duration_s: float | None) -> dict[str, Any]:
    scenario, profile = load_scenario_and_profile(path)
    if duration_s is not None:
        scenario = scenario.model_copy(update={"duration_s": duration_s})
    n_seeds = seeds if seeds is not None else scenario.seeds
    names = runs_needed([p for p in REPORTED if p != "oracle"])
    out: dict[str, Any] = {"duration_s": scenario.duration_s, "seeds": n_seeds, "policies": {}}
    cpu_s = {"step": 0.0, "fluid": 0.0}
    means: dict[str, list[float]] = {"step": [], "fluid": []}
    _preempted[0] = 0
    for name in names:
        entry: dict[str, Any] = {}
        for model in ("step", "fluid"):
            sc = scenario.model_copy(update={"engine_model": model})
            traj_per_h = tokens_per_s = 0.0
            for seed in range(n_seeds):
                policy = make_policy(name, sc.policy, sc.cluster.trainer.nodes)
                start_s = time.process_time()
                m = simulate(run_inputs(sc, profile, seed), policy)
                cpu_s[model] += time.process_time() - start_s
                traj_per_h += m.trajectories / m.hours / n_seeds
                tokens_per_s += m.output_tokens / m.duration_s / n_seeds
            entry[model] = {"traj_per_h": traj_per_h, "tokens_per_s": tokens_per_s}
            means[model].append(traj_per_h)
        entry["traj_diff"] = entry["fluid"]["traj_per_h"] / entry["step"]["traj_per_h"] - 1
        entry["tokens_diff"] = entry["fluid"]["tokens_per_s"] / entry["step"]["tokens_per_s"] - 1
        out["policies"][name] = entry
    out["mean_traj_diff"] = sum(means["fluid"]) / sum(means["step"]) - 1
    out["cpu_s"] = {k: round(v, 2) for k, v in cpu_s.items()}
    out["step_preemptions"] = _preempted[0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenarios", nargs="*", type=Path, default=SHIPPED)
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--duration-s", type=float, default=None)
    args = parser.parse_args()
    step_engine.EngineModel.step = _counting_step  # type: ignore[method-assign]
    result = {str(p.stem): check(p, args.seeds, args.duration_s) for p in args.scenarios}
    worst = max(abs(e["traj_diff"]) for r in result.values() for e in r["policies"].values())
    worst_mean = max(abs(r["mean_traj_diff"]) for r in result.values())
    print(
        json.dumps(
            {
                "scenarios": result,
                "max_abs_throughput_diff": worst,
                "max_abs_mean_throughput_diff": worst_mean,
            }
        )
    )


if __name__ == "__main__":
    main()
