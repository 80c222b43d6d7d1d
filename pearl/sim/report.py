"""Comparing policies: per-seed runs averaged into the figures ``pearl simulate`` prints.

``static-pd`` is the better (by throughput) of its two held modes for each seed:
``roll-fixed`` (colocated, held) and ``static-pd-disaggregated``, so it is the best static
PD mode in hindsight. ``oracle`` is the bound of ``pearl.sim.oracle``, in trajectories per
hour, with its parts (a first-completed bound's too, and the most updates any run can end);
every other entry's ``oracle_fraction`` is its throughput over the oracle's, both averaged
over the seeds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from pearl.sim.metrics import RunMetrics
from pearl.sim.oracle import OracleBound

STATIC_PD_MODES = ("roll-fixed", "static-pd-disaggregated")


def runs_needed(policies: Sequence[str]) -> list[str]:
    """The runs behind the reported policies (static-pd needs both held modes)."""
    out: list[str] = []
    for name in policies:
        for run in STATIC_PD_MODES if name == "static-pd" else () if name == "oracle" else (name,):
            if run not in out:
                out.append(run)
    return out


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if values else float("nan")


def _average(runs: Sequence[RunMetrics]) -> dict[str, Any]:
    rows = [r.summary() for r in runs]
    out: dict[str, Any] = {}
    for key, value in rows[0].items():
        if isinstance(value, dict):
            out[key] = {k: _mean([row[key][k] for row in rows]) for k in value}
        else:
            out[key] = _mean([row[key] for row in rows])
    out["max_trainer_wait_s"] = max(r.max_trainer_wait_s for r in runs)  # worst run, not mean
    out["seeds"] = [r.seed for r in runs]
    return out


# The first-completed bound's parts (None in order), reported per hour as the others.
FIRST_COMPLETED_PARTS = ("by_admission", "by_in_flight", "by_blend")


def _oracle_entry(oracle: Sequence[OracleBound], duration_s: float) -> dict[str, Any]:
    """The oracle's mean throughput and its parts' (at each seed's binding update count)."""
    hours = duration_s / 3600
    entry: dict[str, Any] = {
        "throughput_traj_per_h": _mean([o.throughput_traj_per_h(duration_s) for o in oracle]),
        "by_critical_path_traj_per_h": _mean([o.by_critical_path / hours for o in oracle]),
        "by_capacity_traj_per_h": _mean([o.by_capacity / hours for o in oracle]),
    }
    for part in FIRST_COMPLETED_PARTS:
        values = [getattr(o, part) for o in oracle]
        if values and all(v is not None for v in values):
            entry[f"{part}_traj_per_h"] = _mean([v / hours for v in values])
    updates = [o.max_updates for o in oracle]
    if updates and all(u is not None for u in updates):
        entry["max_updates"] = _mean([float(u) for u in updates if u is not None])
    entry["oracle_fraction"] = 1.0
    return entry


def compare(
    policies: Sequence[str],
    runs: Mapping[str, Sequence[RunMetrics]],
    oracle: Sequence[OracleBound],
    duration_s: float,
) -> dict[str, dict[str, Any]]:
    """Per reported policy, its figures averaged over seeds (see the module docstring)."""
    oracle_tph = _mean([o.throughput_traj_per_h(duration_s) for o in oracle])
    out: dict[str, dict[str, Any]] = {}
    for name in policies:
        if name == "oracle":
            out[name] = _oracle_entry(oracle, duration_s)
            continue
        if name == "static-pd":
            chosen = [
                max(pair, key=lambda r: (r.trajectories, r.policy))
                for pair in zip(*(runs[m] for m in STATIC_PD_MODES), strict=True)
            ]
            entry = _average(chosen)
            entry["chosen"] = [r.policy for r in chosen]
        else:
            entry = _average(runs[name])
        entry["oracle_fraction"] = entry["throughput_traj_per_h"] / oracle_tph
        out[name] = entry
    return out


Column = tuple[str, str, Callable[[str, Mapping[str, Any]], Any]]
COLUMNS: tuple[Column, ...] = (
    ("policy", "{}", lambda n, e: n),
    ("traj/h", "{:,.0f}", lambda n, e: e["throughput_traj_per_h"]),
    ("tok/s", "{:,.0f}", lambda n, e: e.get("tokens_per_s", float("nan"))),
    ("steps/h", "{:.1f}", lambda n, e: e.get("train_steps_per_h", float("nan"))),
    ("traj/GPU-h", "{:.1f}", lambda n, e: e.get("traj_per_gpu_hour", float("nan"))),
    ("elastic GPU-h", "{:.1f}", lambda n, e: e.get("gpu_hours", {}).get("elastic", float("nan"))),
    ("lent GPU-h", "{:.1f}", lambda n, e: e.get("gpu_hours", {}).get("borrowed", float("nan"))),
    ("batch s mean", "{:.1f}", lambda n, e: e.get("batch_time_s", {}).get("mean", float("nan"))),
    ("batch s p99", "{:.1f}", lambda n, e: e.get("batch_time_s", {}).get("p99", float("nan"))),
    ("transitions", "{:.1f}", lambda n, e: e.get("transitions", float("nan"))),
    ("max wait s", "{:.1f}", lambda n, e: e.get("max_trainer_wait_s", float("nan"))),
    ("off-policy", "{:.2f}", lambda n, e: e.get("rollout", {}).get("off_policy_share", math.nan)),
    ("wasted tok", "{:,.0f}", lambda n, e: e.get("rollout", {}).get("wasted_tokens", math.nan)),
    ("of oracle", "{:.3f}", lambda n, e: e["oracle_fraction"]),
)


def table(result: Mapping[str, Mapping[str, Any]]) -> str:
    """A Markdown table, one row per policy."""
    head = "| " + " | ".join(c[0] for c in COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in COLUMNS) + "|"
    rows = [
        "| " + " | ".join(_cell(fmt, get(name, entry)) for _, fmt, get in COLUMNS) + " |"
        for name, entry in result.items()
    ]
    return "\n".join([head, rule, *rows])


def _cell(fmt: str, value: Any) -> str:
    """A figure, or an empty cell where there is none (the oracle has no tokens/s)."""
    if isinstance(value, float) and math.isnan(value):
        return ""
    return fmt.format(value)
