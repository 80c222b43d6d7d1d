"""Does the split search find what exhaustive enumeration finds? Prints one JSON object.

Run: python benchmarks/selection_search.py
Over both shipped profiles, homogeneous and heterogeneous budgets, and workloads of
several shapes, it compares ``select_pd`` with ``exhaustive_limit=1`` (search) against
``exhaustive_limit=100000`` (every candidate) and reports the worst relative gap of the
best predicted completion time, and the share of candidates the search evaluated.
"""

from __future__ import annotations

import json

import numpy as np

from pearl.bench.synth import build_workload
from pearl.core.config import SelectionConfig
from pearl.core.pd import GpuBudget
from pearl.core.predictor import prepare
from pearl.core.selection import select_pd
from pearl.io.documents import load_profile

BUDGETS = {
    "qwen3-8b": [{"h100": [8] * 12}, {"h100": [8] * 32}, {"h800": [8] * 6, "h20": [8] * 6}],
    "qwen3-30b-a3b": [{"h100": [8] * 12}, {"h100": [8] * 32}, {"h800": [8] * 6, "h20": [8] * 6}],
}
SHAPES = [(4.0, 2000.0), (20.0, 2000.0), (4.0, 8000.0)]  # (mean turns, prompt tokens)


def main() -> None:
    gaps, shares = [], []
    for name, budgets in BUDGETS.items():
        profile = load_profile(name)
        for nodes in budgets:
            budget = GpuBudget.of(nodes)
            for seed in range(6):
                for turns, prompt_tokens in SHAPES:
                    rng = np.random.default_rng(seed)
                    workload = build_workload(
                        rng, 300 + 100 * seed, mean_turns=turns, prompt_tokens=prompt_tokens
                    )
                    prepared = prepare(workload, profile)
                    full = select_pd(prepared, budget, SelectionConfig(exhaustive_limit=100_000))
                    fast = select_pd(prepared, budget, SelectionConfig(exhaustive_limit=1))
                    gaps.append(fast.best.completion_s / full.best.completion_s - 1.0)
                    shares.append(fast.num_evaluated / full.num_evaluated)
    print(
        json.dumps(
            {
                "cases": len(gaps),
                "worst_relative_gap": max(gaps),
                "cases_with_gap": sum(g > 1e-9 for g in gaps),
                "mean_share_evaluated": round(float(np.mean(shares)), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
