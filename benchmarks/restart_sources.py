"""Where the trajectories an update starts again come from (docs/results.md, "The paper's
regime"): every restart in the shipped scenarios is of a finished trajectory that the
update put past the staleness bound. It waited either in a complete group that no batch
had taken yet (``complete_group``) or for the rest of its own group (``incomplete_group``).

    .venv/bin/python benchmarks/restart_sources.py [--scenario qwen3-30b-a3b-paper]
        [--policies pearl rlboost-plus] [--seeds 0] [--duration-s 900]

Prints one JSON object per run: the two counts, the running trajectories the update
continued (``interrupted``), and the batches taken.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pearl.io.scenarios import load_scenario_and_profile
from pearl.io.simulation import run_inputs
from pearl.rollout.ledger import PastBoundOutcome, RolloutLedger, TrajState
from pearl.sim.baselines import make_policy
from pearl.sim.runner import Simulation

SCENARIOS = Path(__file__).resolve().parent / "scenarios"


def sources(ledger: RolloutLedger, version: int) -> tuple[int, int]:
    """Finished trajectories that an update to ``version`` puts past the bound: those in
    complete groups, those in groups with members still running."""
    bound = ledger.rules.max_staleness_versions
    complete = incomplete = 0
    for rec in ledger.unconsumed():
        if rec.state is not TrajState.FINISHED or version - rec.head_version <= bound:
            continue
        group = ledger.groups[rec.group_id]
        if group.num_finished == len(group.members):
            complete += 1
        else:
            incomplete += 1
    return complete, incomplete


def run(scenario_name: str, policy: str, seed: int, duration_s: float) -> dict[str, object]:
    scenario, profile = load_scenario_and_profile(SCENARIOS / f"{scenario_name}.yaml")
    scenario = scenario.model_copy(update={"duration_s": duration_s})
    sim = Simulation(
        run_inputs(scenario, profile, seed),
        make_policy(policy, scenario.policy, scenario.cluster.trainer.nodes),
    )
    ledger = sim.rollout.ledger
    counts = {"complete_group": 0, "incomplete_group": 0, "interrupted": 0}
    updated = ledger.updated

    def counting(now_s: float, version: int) -> PastBoundOutcome:
        complete, incomplete = sources(ledger, version)
        outcome = updated(now_s, version)
        # the split reads the ledger's past-bound test again: it must count what it took back
        assert complete + incomplete == outcome.taken_back, (complete, incomplete, outcome)
        counts["complete_group"] += complete
        counts["incomplete_group"] += incomplete
        counts["interrupted"] += len(outcome.interrupted)
        return outcome

    ledger.updated = counting  # type: ignore[method-assign]
    sim.run()
    return {
        "scenario": scenario_name,
        "policy": policy,
        "seed": seed,
        "duration_s": duration_s,
        **counts,
        "restarted": ledger.totals.restarted,
        "batches": ledger.totals.batches,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="qwen3-30b-a3b-paper")
    ap.add_argument("--policies", nargs="+", default=["pearl", "rlboost-plus"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--duration-s", type=float, default=900.0)
    args = ap.parse_args()
    for policy in args.policies:
        for seed in args.seeds:
            print(json.dumps(run(args.scenario, policy, seed, args.duration_s)), flush=True)


if __name__ == "__main__":
    main()
