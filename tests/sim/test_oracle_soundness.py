"""No simulated policy beats the oracle on the shipped scenarios (cut short) and on
variants of them that span the workload and the rules: short and long outputs, tool
latencies from milliseconds to tens of seconds, groups of 1 to 16, no elastic GPUs or
many, both models, in-order and first-completed batches, every past-bound mode and a
cap in flight. And on the shipped scenarios the bound is its relaxation, replayed: the
ledger run in which every trajectory takes its own time from its admission reaches it
(``pearl.sim.oracle_replay``; measured equal on seeds 0-2 of the full 30 minutes,
``docs/baselines.md``)."""

from __future__ import annotations

from functools import cache
from typing import Any

import oracle_fixtures as O
import pytest

from pearl.io.simulation import run_inputs
from pearl.sim.baselines import RUN_POLICIES, make_policy
from pearl.sim.oracle import OracleBound, run_oracle_bound
from pearl.sim.oracle_replay import replay_run
from pearl.sim.runner import RunInputs, simulate

# Each varies several factors at once; together they cover every level of each.
VARIANTS: dict[str, dict[str, Any]] = {
    "8b-short-outputs-ms-tools-g1": {
        "model": "8b",
        "output_tokens_per_turn": 20.0,
        "env_latency_s": 0.005,
        "group_size": 1,
    },
    "8b-long-outputs-30s-tools-g16-elastic": {
        "model": "8b",
        "output_tokens_per_turn": 2000.0,
        "env_latency_s": 30.0,
        "group_size": 16,
        "elastic": "large",
        "duration_s": 900.0,
    },
    "30b-short-outputs-30s-tools-g4-elastic-restart": {
        "model": "30b",
        "output_tokens_per_turn": 20.0,
        "env_latency_s": 30.0,
        "group_size": 4,
        "elastic": "large",
        "past_bound": "restart",
        "duration_s": 900.0,
    },
    "30b-long-outputs-ms-tools-g8-drop": {
        "model": "30b",
        "output_tokens_per_turn": 2000.0,
        "env_latency_s": 0.005,
        "group_size": 8,
        "past_bound": "drop",
    },
    "8b-5s-tools-g16-in-order": {
        "model": "8b",
        "env_latency_s": 5.0,
        "group_size": 16,
        "batching": "in-order",
    },
    "30b-g1-elastic-in-order": {
        "model": "30b",
        "group_size": 1,
        "elastic": "large",
        "batching": "in-order",
    },
    "8b-short-outputs-10s-tools-g4-max32": {
        "model": "8b",
        "output_tokens_per_turn": 20.0,
        "env_latency_s": 10.0,
        "group_size": 4,
        "max_in_flight": 32,
    },
    "30b-long-outputs-ms-tools-g16-restart-max48-elastic": {
        "model": "30b",
        "output_tokens_per_turn": 2000.0,
        "env_latency_s": 0.005,
        "group_size": 16,
        "past_bound": "restart",
        "max_in_flight": 48,
        "elastic": "large",
    },
}


@cache
def _shipped(model: str) -> tuple[RunInputs, OracleBound]:
    sc, prof = O.shipped(model, 300.0)
    inputs = run_inputs(sc, prof, 0)
    return inputs, run_oracle_bound(inputs)


@cache
def _variant(name: str) -> tuple[RunInputs, OracleBound]:
    kw = dict(VARIANTS[name])
    sc, prof = O.variant(kw.pop("model"), duration_s=kw.pop("duration_s", 300.0), **kw)
    inputs = run_inputs(sc, prof, 0)
    return inputs, run_oracle_bound(inputs)


def _trajectories(inputs: RunInputs, policy: str) -> int:
    sc = inputs.scenario
    return simulate(inputs, make_policy(policy, sc.policy, sc.cluster.trainer.nodes)).trajectories


@pytest.mark.parametrize("policy", RUN_POLICIES)
@pytest.mark.parametrize("model", sorted(O.SHIPPED))
def test_no_policy_beats_the_oracle_on_the_shipped_scenarios(model: str, policy: str) -> None:
    inputs, bound = _shipped(model)
    assert bound.max_updates is not None and bound.max_updates >= 2  # the cadence is in play
    assert 0 < _trajectories(inputs, policy) <= bound.trajectories


@pytest.mark.parametrize("policy", RUN_POLICIES)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_no_policy_beats_the_oracle_on_variants(name: str, policy: str) -> None:
    inputs, bound = _variant(name)
    assert 0 < _trajectories(inputs, policy) <= bound.trajectories


@pytest.mark.parametrize("model", sorted(O.SHIPPED))
def test_the_oracle_is_its_relaxation_replayed_on_the_shipped_scenarios(model: str) -> None:
    sc, prof = O.shipped(model, 900.0)
    inputs = run_inputs(sc, prof, 0)
    bound, replayed = run_oracle_bound(inputs), replay_run(inputs)
    assert replayed.updates == bound.max_updates
    assert replayed.trajectories == bound.trajectories
