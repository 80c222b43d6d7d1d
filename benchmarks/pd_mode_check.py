"""Where the predictor and the simulator disagree on the PD mode (issue 18).

    .venv/bin/python benchmarks/pd_mode_check.py [--duration-s 900] [--seeds 1] [--jobs 2]

For each shipped scenario and each variant of output length and tool latency
(``pearl.sim.family.workload``), pearl runs held to one PD mode at a time
(``policy.selection.modes``: colocated, disaggregated) and free (``any``). Per run:
the simulated throughput, and the predictor's error on the run's own decisions (each
decision's predicted time to the next batch against the time the run took; ``pearl bench
predictor``'s pairs): the median of predicted / actual. Printed as JSON, one entry per
variant: which held mode the simulator says is faster, by how much, which the predictor's
error says it over- or underrates, and which mode the free run held most.

A mode the predictor underrates (predicted / actual high) against the other is one it
avoids wrongly; one it overrates it picks wrongly. The free run's mode share says which
it picked.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from held_run import held_run

from pearl.cli.flags import integer, positive_seconds
from pearl.core.limits import MAX_SEEDS
from pearl.io.scenarios import load_scenario_and_profile, scenario_of_document
from pearl.sim.family import OUTPUT_TOKENS, TOOL_LATENCIES_S, workload
from pearl.sim.sweep import Point, with_point

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("qwen3-8b", "qwen3-30b-a3b")
# the family's values of the two axes (pearl.sim.family)
VARIANTS: dict[str, Point] = {
    "shipped": (),
    **{f"outputs-{t:g}": workload(output_tokens_per_turn=t) for t in OUTPUT_TOKENS},
    **{f"tools-{t:g}s": workload(env_latency_s=t) for t in TOOL_LATENCIES_S},
}
MODES = ("colocated", "disaggregated", "any")


def run_one(name: str, variant: str, mode: str, seed: int, duration_s: float) -> dict[str, Any]:
    path = ROOT / "benchmarks" / "scenarios" / f"{name}.yaml"
    base, _ = load_scenario_and_profile(path)
    point = (*VARIANTS[variant], ("policy.selection.modes", mode))
    doc = with_point(base.model_dump(mode="json"), point)
    scenario, profile = scenario_of_document(doc, path)
    scenario = scenario.model_copy(update={"duration_s": duration_s})
    figures, records = held_run(scenario, profile, "pearl", seed)
    decisions = [str(r.pd_mode) for r in records]
    return {
        "scenario": name,
        "variant": variant,
        "mode": mode,
        "seed": seed,
        **figures,
        "decisions": len(decisions),
        "disaggregated_share": (
            sum(d == "disaggregated" for d in decisions) / len(decisions) if decisions else None
        ),
    }


def summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for name in SCENARIOS:
        for variant in VARIANTS:
            by_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
            for r in runs:
                if r["scenario"] == name and r["variant"] == variant:
                    by_mode[r["mode"]].append(r)

            def mean(mode: str, key: str, by: dict[str, list[dict[str, Any]]] = by_mode) -> Any:
                values = [r[key] for r in by[mode] if r[key] is not None]
                return float(np.mean(values)) if values else None

            col, dis = mean("colocated", "traj_per_h"), mean("disaggregated", "traj_per_h")
            out.append(
                {
                    "scenario": name,
                    "variant": variant,
                    "traj_per_h": {m: mean(m, "traj_per_h") for m in MODES},
                    "simulator_faster": "colocated" if col >= dis else "disaggregated",
                    "disaggregated_over_colocated": dis / col if col else None,
                    "median_predicted_over_actual": {
                        m: mean(m, "median_predicted_over_actual") for m in MODES
                    },
                    "free_run_disaggregated_share": mean("any", "disaggregated_share"),
                }
            )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=positive_seconds, default=900.0)
    ap.add_argument("--seeds", type=integer(1, MAX_SEEDS), default=1)
    ap.add_argument("--jobs", type=integer(1, 1024), default=2)
    args = ap.parse_args()
    tasks = [
        (name, variant, mode, seed, args.duration_s)
        for name in SCENARIOS
        for variant in VARIANTS
        for mode in MODES
        for seed in range(args.seeds)
    ]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(run_one, *zip(*tasks, strict=True)))
    print(json.dumps({"runs": runs, "summary": summary(runs)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
