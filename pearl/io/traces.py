"""Readers of the public traces beside the repository (``../shared/traces``; the shell).

Each reader opens one file and returns plain numpy arrays in a frozen dataclass; any
problem (missing file or column, a value that is not a number, a negative count, a broken
JSON line) raises ``InputError(path, field, problem)`` naming the row or line. The
workload and availability models that use these arrays are pure (``pearl.sim``);
``fit_trajectory_model_from`` and ``helios_windows`` are the glue.

File formats and sources: ``../shared/traces/README.md``.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pearl.io.documents import InputError
from pearl.io.untrusted import MAX_DOCUMENT_BYTES, UntrustedInput, join_field, loads_json
from pearl.sim.availability import Window, windows_from_idle_series
from pearl.sim.trajectories import TrajectoryModel, fit_trajectory_model

TRACELAB_SESSIONS = "TraceLab__replay_multi_session_large.csv"
TRACELAB_ROUNDS = "TraceLab__sanitized_round_trace.jsonl"
SWE_AGENT_GLOB = "SWE-agent__*.traj"
AZURE_CONV = "AzurePublicDataset__AzureLLMInferenceTrace_conv.csv"
MOONCAKE_CONV = "Mooncake__conversation_trace.jsonl"
HELIOS_VC = "HeliosArtifact__Earth_vcpDC_cluster_sequence_vc.csv"

Ints = NDArray[np.int64]
Floats = NDArray[np.float64]


def traces_dir() -> Path:
    """``$PEARL_TRACES`` if set, else ``../shared/traces`` beside the repository root."""
    env = os.environ.get("PEARL_TRACES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "shared" / "traces"  # pearl/io/traces.py


@dataclass(frozen=True)
class SessionRounds:
    """TraceLab multi-session rounds, one entry per round, in file order."""

    session_id: Ints
    round_idx: Ints
    prefix_len: Ints
    input_len: Ints
    output_len: Ints
    tool_wait_after_ms: Floats

    def turns_per_session(self) -> Ints:
        _, counts = np.unique(self.session_id, return_counts=True)
        return counts.astype(np.int64)


@dataclass(frozen=True)
class AgentRounds:
    """TraceLab sanitized coding-agent rounds; ``tool_latency_ms`` is the wall time of the
    round's tools (``_round_tool_ms``), 0 for a round without tools."""

    round_index: Ints
    prefix_tokens: Ints
    new_tokens: Ints
    output_tokens: Ints
    tool_latency_ms: Floats
    num_tools: Ints


@dataclass(frozen=True)
class RequestLengths:
    """Single-request input and output lengths (Azure or Mooncake)."""

    input_tokens: Ints
    output_tokens: Ints


@dataclass(frozen=True)
class IdleSeries:
    """Helios per-minute series: seconds since the first row and idle GPUs."""

    time_s: Floats
    idle_gpus: Ints


def _csv_rows(path: Path, columns: list[str]) -> Iterator[tuple[int, dict[str, str]]]:
    try:
        handle = path.open(newline="", encoding="utf-8")
    except OSError as err:
        raise InputError(
            path, "", f"cannot read: {err.strerror or err.__class__.__name__}"
        ) from None
    with handle:
        reader = csv.DictReader(handle)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise InputError(path, missing[0], "missing column")
        for row in reader:
            yield reader.line_num, row


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(path, "", f"cannot read: {err.__class__.__name__}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = loads_json(line, max_bytes=MAX_DOCUMENT_BYTES)
        except UntrustedInput as err:
            where = join_field(f"line {number}", err.field.removeprefix("line 1"))
            raise InputError(path, where, err.problem) from None
        if not isinstance(row, dict):
            raise InputError(path, f"line {number}", "expected a JSON object")
        yield number, row


def _number(path: Path, where: str, value: Any) -> float:
    if isinstance(value, bool):
        raise InputError(path, where, f"expected a number, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise InputError(path, where, f"expected a number, got {value!r}") from None
    if not np.isfinite(x) or x < 0:
        raise InputError(path, where, f"expected a finite number >= 0, got {value!r}")
    return x


def _count(path: Path, where: str, value: Any) -> int:
    x = _number(path, where, value)
    if x != int(x):
        raise InputError(path, where, f"expected an integer, got {value!r}")
    return int(x)


def _columns(path: Path, rows: list[list[float]], names: list[str]) -> list[Floats]:
    if not rows:
        raise InputError(path, "", "no data rows")
    table = np.asarray(rows, dtype=np.float64)
    return [table[:, i] for i in range(len(names))]


def _read_counts(path: Path, names: list[str]) -> list[Floats]:
    rows: list[list[float]] = [
        [_count(path, f"line {n} {c}", row.get(c)) for c in names]
        for n, row in _csv_rows(path, names)
    ]
    return _columns(path, rows, names)


def read_tracelab_sessions(path: Path) -> SessionRounds:
    names = ["session_id", "round_idx", "prefix_len", "input_len", "output_len"]
    names.append("tool_wait_after_ms")
    cols = _read_counts(path, names)
    ints = [c.astype(np.int64) for c in cols[:5]]
    return SessionRounds(ints[0], ints[1], ints[2], ints[3], ints[4], cols[5])


def read_tracelab_rounds(path: Path) -> AgentRounds:
    rows: list[list[float]] = []
    for n, row in _jsonl_rows(path):
        keys = ["round_index", "prefix_tokens", "newly_append_tokens", "output_tokens"]
        values: list[float] = [_count(path, f"line {n} {k}", row.get(k)) for k in keys]
        tools = row.get("tools", [])
        if not isinstance(tools, list):
            raise InputError(path, f"line {n} tools", "expected a list")
        rows.append([*values, _round_tool_ms(path, n, tools), len(tools)])
    cols = _columns(path, rows, ["r", "p", "n", "o", "l", "t"])
    ints = [c.astype(np.int64) for c in cols]
    return AgentRounds(ints[0], ints[1], ints[2], ints[3], cols[4], ints[5])


def _round_tool_ms(path: Path, n: int, tools: list[Any]) -> float:
    """Wall time of a round's tools: first ``emitted_at`` to last ``result_at`` when every
    tool has both (tools of one round can overlap), else the sum of ``tool_wall_latency_ms``.
    """
    latencies: list[float] = []
    spans: list[tuple[datetime, datetime]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise InputError(path, f"line {n} tools[{i}]", "expected an object")
        where = f"line {n} tools[{i}].tool_wall_latency_ms"
        latencies.append(_number(path, where, tool.get("tool_wall_latency_ms")))
        with contextlib.suppress(KeyError, TypeError, ValueError):
            spans.append((_stamp(tool["emitted_at"]), _stamp(tool["result_at"])))
    if tools and len(spans) == len(tools):
        first = min(a for a, _ in spans)
        last = max(b for _, b in spans)
        return max(0.0, (last - first).total_seconds() * 1000.0)
    return float(sum(latencies))


def _stamp(text: Any) -> datetime:
    """An ISO time (``Z`` allowed) as an aware datetime; naive times are taken as UTC."""
    stamp = datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)


def read_swe_agent_latencies_s(path: Path) -> Floats:
    """``execution_time`` of each step that records one (older trajectories have none)."""
    try:
        data = loads_json(path.read_text(encoding="utf-8"), max_bytes=MAX_DOCUMENT_BYTES)
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(path, "", f"cannot read: {err.__class__.__name__}") from None
    except UntrustedInput as err:
        raise InputError(path, err.field, err.problem) from None
    steps = data.get("trajectory") if isinstance(data, dict) else None
    if not isinstance(steps, list):
        raise InputError(path, "trajectory", "expected a list of steps")
    out = []
    for i, step in enumerate(steps):
        if not isinstance(step, dict):
            raise InputError(path, f"trajectory[{i}]", "expected an object")
        if step.get("execution_time") is not None:
            where = f"trajectory[{i}].execution_time"
            out.append(_number(path, where, step["execution_time"]))
    return np.asarray(out, dtype=np.float64)


def read_azure_lengths(path: Path) -> RequestLengths:
    cols = _read_counts(path, ["ContextTokens", "GeneratedTokens"])
    return RequestLengths(cols[0].astype(np.int64), cols[1].astype(np.int64))


def read_mooncake_lengths(path: Path) -> RequestLengths:
    names = ["input_length", "output_length"]
    rows: list[list[float]] = [
        [_count(path, f"line {n} {k}", row.get(k)) for k in names] for n, row in _jsonl_rows(path)
    ]
    cols = _columns(path, rows, names)
    return RequestLengths(cols[0].astype(np.int64), cols[1].astype(np.int64))


def read_helios_idle(path: Path) -> IdleSeries:
    times: list[float] = []
    idle: list[int] = []
    for n, row in _csv_rows(path, ["time", "idle_gpu_num"]):
        try:
            stamp = datetime.fromisoformat(row["time"] or "").replace(tzinfo=UTC)
        except ValueError:
            raise InputError(path, f"line {n} time", f"not a time: {row['time']!r}") from None
        if times and stamp.timestamp() <= times[-1]:
            raise InputError(path, f"line {n} time", "times must increase")
        times.append(stamp.timestamp())
        idle.append(_count(path, f"line {n} idle_gpu_num", row.get("idle_gpu_num")))
    if len(times) < 2:
        raise InputError(path, "", "need at least 2 data rows")
    t = np.asarray(times, dtype=np.float64)
    return IdleSeries(time_s=t - t[0], idle_gpus=np.asarray(idle, dtype=np.int64))


def workload_observations(directory: Path) -> dict[str, NDArray[Any]]:
    """The pooled observations of each trajectory component (rules in pearl.sim.trajectories),
    keyed by the keyword arguments of ``fit_trajectory_model``."""
    sessions = read_tracelab_sessions(directory / TRACELAB_SESSIONS)
    rounds = read_tracelab_rounds(directory / TRACELAB_ROUNDS)
    swe_s = [read_swe_agent_latencies_s(p) for p in sorted(directory.glob(SWE_AGENT_GLOB))]
    azure = read_azure_lengths(directory / AZURE_CONV)
    mooncake = read_mooncake_lengths(directory / MOONCAKE_CONV)
    return {
        "turns_per_session": sessions.turns_per_session(),
        "prompt_tokens": np.concatenate([azure.input_tokens, mooncake.input_tokens]),
        "observation_tokens": np.concatenate(
            [
                sessions.input_len[sessions.round_idx >= 1],
                rounds.new_tokens[rounds.round_index >= 1],
            ]
        ),
        "output_tokens": np.concatenate([azure.output_tokens, mooncake.output_tokens]),
        "tool_latency_s": np.concatenate(
            [*swe_s, rounds.tool_latency_ms[rounds.num_tools > 0] / 1000.0]
        ),
    }


def fit_trajectory_model_from(directory: Path) -> TrajectoryModel:
    """Read the six workload traces in ``directory`` and fit the trajectory model."""
    return _fit(workload_observations(directory))


def _fit(observed: dict[str, NDArray[Any]]) -> TrajectoryModel:
    return fit_trajectory_model(
        turns_per_session=observed["turns_per_session"],
        prompt_tokens=observed["prompt_tokens"],
        observation_tokens=observed["observation_tokens"],
        output_tokens=observed["output_tokens"],
        tool_latency_s=observed["tool_latency_s"],
    )


def helios_windows(
    path: Path, *, gpu_type: str, min_duration_s: float = 600.0
) -> tuple[Window, ...]:
    """Availability windows of a Helios ``idle_gpu_num`` series file (rule in pearl.sim)."""
    series = read_helios_idle(path)
    return windows_from_idle_series(
        series.time_s, series.idle_gpus, gpu_type=gpu_type, min_duration_s=min_duration_s
    )


def summary(directory: Path, seed: int = 0, num_trajectories: int = 50_000) -> dict[str, Any]:
    """Measured statistics of the fitted models (``python -m pearl.io.traces``; docs/simulator.md).

    For each component: the pooled observations (count, mean, p99/p50, max), the fitted
    mean, and mean, p50, p99 and max of a seeded sample of ``num_trajectories``
    trajectories; for Helios: the windows' count, sizes, durations and GPU-hours.
    """
    from pearl.sim.trajectories import means, sample_trajectories

    observed = workload_observations(directory)
    model = _fit(observed)
    specs = sample_trajectories(model, np.random.default_rng(seed), num_trajectories)
    drawn = {
        "prompt_tokens": [s.prompt_tokens for s in specs],
        "observation_tokens": [t for s in specs for t in s.new_tokens[1:]],
        "output_tokens": [t for s in specs for t in s.output_tokens],
        "tool_latency_s": [t for s in specs for t in s.tool_latency_s],
    }
    fitted = means(model)
    fitted_mean = {
        "prompt_tokens": fitted.prompt_tokens,
        "observation_tokens": fitted.observation_tokens_per_turn,
        "output_tokens": fitted.output_tokens_per_turn,
        "tool_latency_s": fitted.env_latency_s,
    }
    out: dict[str, Any] = {"seed": seed, "num_trajectories": num_trajectories}
    for name, values in drawn.items():
        x = np.asarray(values, dtype=np.float64)
        dist = getattr(model, name)
        p50, p99 = np.percentile(x, [50, 99])
        data_p50, data_p99 = np.percentile(observed[name], [50, 99])
        out[name] = {
            "num_observations": dist.num_observations,
            "data_mean": round(float(np.mean(observed[name])), 3),
            "data_p99_over_p50": round(float(data_p99 / data_p50), 2),
            "data_max": round(float(np.max(observed[name])), 3),
            "threshold": round(dist.threshold, 3),
            "cap": round(dist.cap, 3),
            "fitted_mean": round(fitted_mean[name], 3),
            "sample_mean": round(float(x.mean()), 3),
            "p50": round(float(p50), 3),
            "p99": round(float(p99), 3),
            "p99_over_p50": round(float(p99 / p50), 2),
            "max": round(float(x.max()), 3),
        }
    turns = np.asarray([s.num_turns for s in specs])
    out["turns"] = {"fitted_mean": fitted.turns_per_trajectory, "sample_mean": turns.mean()}
    windows = helios_windows(directory / HELIOS_VC, gpu_type="helios")
    durations_s = np.asarray([w.duration_s for w in windows])
    out["helios_windows"] = {
        "count": len(windows),
        "num_gpus": sorted({w.num_gpus for w in windows}),
        "duration_s_p50": float(np.median(durations_s)),
        "duration_s_max": float(durations_s.max()),
        "gpu_hours": round(sum(w.num_gpus * w.duration_s for w in windows) / 3600.0, 1),
    }
    return out


if __name__ == "__main__":
    print(json.dumps(summary(traces_dir()), indent=2, default=float))
