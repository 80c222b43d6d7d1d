"""How well a distribution with the right mean and variance predicts the slowest of n
trajectories (the straggler estimate of ``pearl.core.predictor``; docs/predictor.md).

    .venv/bin/python benchmarks/straggler_fit.py

Draws 40,960 trajectories from the Qwen3-8B scenario's trace model (seed 0), takes each
one's tool time plus its decode time at 25 ms per output token (about the loaded decode
step of that scenario's H20 instances), and compares, for several n, the mean maximum of
n of them with the quantile n / (n + 1) of a gamma, a lognormal and a normal with the
moments the predictor uses (per-turn spreads, turns' spread). Prints JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from scipy.special import gammaincinv, ndtri

from pearl.io.scenarios import load_scenario_and_profile
from pearl.io.simulation import run_inputs
from pearl.sim.rollout import trajectory_stream
from pearl.sim.runner import trajectory_rng

DECODE_STEP_S = 0.025
SCENARIO = Path(__file__).resolve().parent / "scenarios" / "qwen3-8b.yaml"


def main() -> None:
    scenario, profile = load_scenario_and_profile(SCENARIO)
    inputs = run_inputs(scenario, profile, 0)
    stream = trajectory_stream(
        inputs.trajectory_model, trajectory_rng(0), scenario.rollout.max_context_tokens
    )
    specs = [next(stream) for _ in range(40_960)]
    outs = np.concatenate([s.output_tokens for s in specs])
    tools = np.concatenate([s.tool_latency_s for s in specs])
    turns = np.array([s.num_turns for s in specs])
    total = np.array([sum(s.tool_latency_s) + sum(s.output_tokens) * DECODE_STEP_S for s in specs])
    mu = float(total.mean())
    turn_s = outs.mean() * DECODE_STEP_S + tools.mean()
    var = turns.mean() * (DECODE_STEP_S**2 * outs.var() + tools.var()) + turns.var() * turn_s**2
    shape, scale = mu**2 / var, var / mu
    s2 = np.log(1 + var / mu**2)
    rows = []
    for n in (64, 256, 1024, 2048):
        q = n / (n + 1)
        maxima = [total[i * n : (i + 1) * n].max() for i in range(len(total) // n)]
        rows.append(
            {
                "n": n,
                "mean_max_s": round(float(np.mean(maxima)), 1),
                "gamma_s": round(float(scale * gammaincinv(shape, q)), 1),
                "lognormal_s": round(
                    float(np.exp(np.log(mu) - s2 / 2 + np.sqrt(s2) * ndtri(q))), 1
                ),
                "normal_s": round(float(mu + np.sqrt(var) * ndtri(q)), 1),
            }
        )
    print(json.dumps({"mean_s": round(mu, 1), "sd_s": round(float(np.sqrt(var)), 1), "rows": rows}))


if __name__ == "__main__":
    main()
