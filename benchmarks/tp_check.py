"""Which TP degree of the rollout GPUs the simulator and the predictor favour (issue 18).

    .venv/bin/python benchmarks/tp_check.py [--scenario qwen3-30b-a3b] [--duration-s 900]
        [--seeds 1] [--jobs 1] [--policies pearl,roll-fixed]

For each TP degree the profile lists for the scenario's rollout GPU type, the profile is
restricted to that degree alone (the other GPU types keep theirs) and each policy runs on
it. Per run: the simulated throughput, the predictor's error on the run's own decisions
(each decision's predicted time to the next batch against the time the run took, as
``pearl bench predictor`` pairs them: the median of predicted / actual) and the
configurations the run held. A degree whose predicted / actual is lower than another's is
one the predictor rates faster, relative to the simulator, than that other. The run with
the profile as shipped says which degree pearl holds when it may choose.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from held_run import held_run

from pearl.cli.flags import integer, positive_seconds
from pearl.core.limits import MAX_SEEDS
from pearl.core.profile import RuntimeProfile
from pearl.io.scenarios import load_scenario_and_profile

ROOT = Path(__file__).resolve().parents[1]


def path_of(name: str) -> Path:
    return ROOT / "benchmarks" / "scenarios" / f"{name}.yaml"


def restricted(profile: RuntimeProfile, gpu_type: str, tp: int | None) -> RuntimeProfile:
    """``profile`` with only the engines of ``tp`` on ``gpu_type`` (None: as shipped)."""
    if tp is None:
        return profile
    gpu = profile.gpus[gpu_type]
    engines = tuple(e for e in gpu.engines if e.tp == tp)
    gpus = {**profile.gpus, gpu_type: gpu.model_copy(update={"engines": engines})}
    return profile.model_copy(update={"gpus": gpus})


def run_one(
    name: str, tp: int | None, policy_name: str, seed: int, duration_s: float
) -> dict[str, Any]:
    scenario, profile = load_scenario_and_profile(path_of(name))
    scenario = scenario.model_copy(update={"duration_s": duration_s})
    profile = restricted(profile, scenario.cluster.rollout.gpu_type, tp)
    figures, records = held_run(scenario, profile, policy_name, seed)
    held = Counter(str(r.target) for r in records)
    return {
        "scenario": name,
        "tp": tp if tp is not None else "any",
        "policy": policy_name,
        "seed": seed,
        **figures,
        "held": held.most_common(3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="qwen3-30b-a3b")
    ap.add_argument("--duration-s", type=positive_seconds, default=900.0)
    ap.add_argument("--seeds", type=integer(1, MAX_SEEDS), default=1)
    ap.add_argument("--jobs", type=integer(1, 1024), default=1)
    ap.add_argument("--policies", default="pearl,roll-fixed")
    args = ap.parse_args()
    scenario, profile = load_scenario_and_profile(path_of(args.scenario))
    gpu_type = scenario.cluster.rollout.gpu_type
    degrees: list[int | None] = [None, *profile.feasible_tps(gpu_type)]
    tasks = [
        (args.scenario, tp, policy, seed, args.duration_s)
        for policy in args.policies.split(",")
        for tp in degrees
        for seed in range(args.seeds)
    ]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(run_one, *zip(*tasks, strict=True)))
    print(json.dumps({"rollout_gpu_type": gpu_type, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
