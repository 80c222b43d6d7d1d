"""A family of scenarios: variants of the shipped ones that span what users meet.

pearl's decisions are checked on the family, not on the two shipped scenarios alone
(issue 18): every policy runs every variant, and pearl must be at or above every baseline
on each. A variant is a base scenario (a shipped file) and a *point*, the fields it sets
(``pearl.sim.sweep.with_point``); nothing is tuned per variant: pearl runs the base
scenario's ``policy`` section, which the shipped scenarios leave at the defaults but for
the elastic partition they name (its GPU type and how many allocations the partition
holds, a fact of the cluster and not a tuning).

The generators, each documented where it is defined:

- ``elastic_supply``: synthetic preemptible windows (Poisson arrivals of whole nodes,
  lognormal lifetimes, ``pearl.sim.availability.synthetic_windows``) capped at ``factor``
  times the base rollout GPUs open at once, arriving often enough that the cap binds
  most of the time; a long or a short lifetime. ``factor`` 0 is no elastic source.
- ``workload``: the trajectory model's means (``pearl.sim.trajectories.scaled`` keeps
  every quantile ratio of the data): tool latency, output tokens per turn, turns.
- ``group_size``: GRPO samples per prompt.
- ``homogeneous``: the base rollout nodes of the trainer's GPU type.

``canonical()``: one variant at a time around each shipped scenario (the family of
``docs/results.md``). ``drawn(rng, n)``: ``n`` variants with every axis drawn at random
(a scenario family pearl has never been run on). Pure: points in, points out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pearl.sim.availability import GPUS_PER_NODE
from pearl.sim.sweep import Point

# Lifetimes of the elastic windows. Long: the Helios windows' fit, as the shipped
# Qwen3-30B-A3B scenario has it (median 9,690 s, log-space sigma 1.45; docs/simulator.md).
# Short: ASSUMED 15 minutes, sigma 0.5: a busy cluster's idle nodes, used by other
# tenants' jobs again after about one backfill cycle of queued work; still above the
# 600 s windows the Helios rule keeps (shorter ones cannot amortise a cold start).
LONG_WINDOW = (9690.0, 1.45)
SHORT_WINDOW = (900.0, 0.5)
# Open windows without the cap, over the cap (see elastic_supply): the count open is
# Poisson (M/G/inf), below a cap of 4 nodes 15% of the time at a mean of 6, 43% at 4.
OVERSUBSCRIPTION = 1.5


@dataclass(frozen=True)
class BaseScenario:
    """What the generators need to know of a base scenario."""

    name: str  # the shipped scenario's file stem
    rollout_gpus: int  # base rollout GPUs
    trainer_gpu_type: str
    elastic_gpu_type: str  # the type the policy requests


@dataclass(frozen=True)
class Variant:
    name: str  # unique in a family: "BASE/what"
    base: str  # BaseScenario.name
    point: Point


def elastic_supply(base: BaseScenario, factor: float, window: tuple[float, float]) -> Point:
    """Synthetic windows of one node each, at most ``factor x`` the base rollout GPUs open
    at once; ``factor`` 0 is ``elastic.source: none``. Windows arrive as often as keeps
    ``OVERSUBSCRIPTION`` times that many open on average without the cap (M/G/inf: the
    arrivals per hour times the mean lifetime in hours, in nodes), so the cap binds most
    of the time (at the cap's mean alone, a Poisson count of 2 or 4 nodes is often well
    below it: seed 0 of the 8B scenario had none). The policy's allocation cap is the
    partition's size in nodes."""
    if factor < 0:
        raise ValueError(f"factor: {factor} < 0")
    cap_nodes = math.floor(factor * base.rollout_gpus / GPUS_PER_NODE)
    if cap_nodes == 0:
        return (
            ("elastic.source", "none"),
            ("elastic.trace", None),
            ("elastic.synthetic", None),
        )
    median_s, sigma = window
    mean_lifetime_h = median_s * math.exp(sigma**2 / 2.0) / 3600.0
    synthetic = {
        "gpu_type": base.elastic_gpu_type,
        "arrivals_per_h": round(OVERSUBSCRIPTION * cap_nodes / mean_lifetime_h, 6),
        "lifetime_median_s": median_s,
        "lifetime_sigma": sigma,
        "gpus_per_allocation": GPUS_PER_NODE,
        "max_gpus": cap_nodes * GPUS_PER_NODE,
    }
    return (
        ("elastic.source", "synthetic"),
        ("elastic.trace", None),
        ("elastic.synthetic", synthetic),
        ("policy.elastic.gpus_per_allocation", GPUS_PER_NODE),
        ("policy.elastic.max_allocations", cap_nodes),
    )


def workload(
    env_latency_s: float | None = None,
    output_tokens_per_turn: float | None = None,
    turns_per_trajectory: float | None = None,
) -> Point:
    """The workload's means (None: the data's own)."""
    out: list[tuple[str, Any]] = []
    if env_latency_s is not None:
        out.append(("rollout.workload.env_latency_s", env_latency_s))
    if output_tokens_per_turn is not None:
        out.append(("rollout.workload.output_tokens_per_turn", output_tokens_per_turn))
    if turns_per_trajectory is not None:
        out.append(("rollout.workload.turns_per_trajectory", turns_per_trajectory))
    return tuple(out)


def group_size(size: int) -> Point:
    return (("rollout.group_size", size),)


def homogeneous(base: BaseScenario) -> Point:
    """The base rollout nodes of the trainer's GPU type (one type in the whole job)."""
    return (("cluster.rollout.gpu_type", base.trainer_gpu_type),)


# The values the canonical family takes on each axis, around the data's means (tool
# latency 4.4 s, 262 output tokens a turn, 6.3 turns; docs/simulator.md "Trajectories").
TOOL_LATENCIES_S = (0.01, 30.0)  # "from milliseconds to tens of seconds"
OUTPUT_TOKENS = (32.0, 1024.0)  # short answers (tool calls) and long reasoning
TURNS = (2.0, 12.0)
GROUP_SIZES = (1, 16)
SUPPLIES = (0.0, 0.5, 1.0, 2.0)  # elastic GPUs, in base rollout GPUs


def canonical(bases: Mapping[str, BaseScenario]) -> list[Variant]:
    """Each base as shipped, then one axis at a time: elastic supply (none to twice the
    base rollout GPUs, long windows; short windows at 1x), tool latency, output length,
    turns, group size and one GPU type."""
    out: list[Variant] = []
    for name, base in bases.items():

        def add(what: str, point: Point, name: str = name) -> None:
            out.append(Variant(f"{name}/{what}", name, point))

        add("shipped", ())
        for factor in SUPPLIES:
            add(f"elastic-{factor:g}x", elastic_supply(base, factor, LONG_WINDOW))
        add("elastic-1x-short-windows", elastic_supply(base, 1.0, SHORT_WINDOW))
        for latency_s in TOOL_LATENCIES_S:
            add(f"tools-{latency_s:g}s", workload(env_latency_s=latency_s))
        for tokens in OUTPUT_TOKENS:
            add(f"outputs-{tokens:g}", workload(output_tokens_per_turn=tokens))
        for turns in TURNS:
            add(f"turns-{turns:g}", workload(turns_per_trajectory=turns))
        for size in GROUP_SIZES:
            add(f"groups-{size}", group_size(size))
        add("homogeneous", homogeneous(base))
    return out


def drawn(bases: Mapping[str, BaseScenario], rng: np.random.Generator, n: int) -> list[Variant]:
    """``n`` variants, every axis drawn independently: the base (uniform), the elastic
    supply (uniform over 0-2x, a short window with probability 1/3), tool latency
    (log-uniform 0.01-30 s), output tokens (log-uniform 32-1,024), turns (uniform 1-12),
    group size (1, 2, 4, 8 or 16) and the rollout GPU type (the trainer's with
    probability 1/3)."""
    names = sorted(bases)
    out: list[Variant] = []
    for i in range(n):
        base = bases[names[int(rng.integers(len(names)))]]
        factor = float(rng.uniform(0.0, 2.0))
        window = SHORT_WINDOW if rng.random() < 1 / 3 else LONG_WINDOW
        point = elastic_supply(base, factor, window)
        point += workload(
            env_latency_s=_round(math.exp(rng.uniform(math.log(0.01), math.log(30.0)))),
            output_tokens_per_turn=_round(math.exp(rng.uniform(math.log(32), math.log(1024)))),
            turns_per_trajectory=_round(float(rng.uniform(1.0, 12.0))),
        )
        point += group_size(int(2 ** rng.integers(5)))
        if rng.random() < 1 / 3:
            point += homogeneous(base)
        out.append(Variant(f"{base.name}/drawn-{i}", base.name, point))
    return out


def _round(x: float) -> float:
    """Three significant digits: readable points, the same draws on every machine."""
    return float(f"{x:.3g}")
