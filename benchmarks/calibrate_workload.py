"""Per-turn workload figures of agentic rollout, computed from the public traces.

The ``workload`` section of the shipped runtime profiles (``pearl/profiles/*.yaml``) quotes
the output of this script. It reads, from ``../shared/traces/`` (run it from the project
root, or pass ``--traces-dir``):

- ``TraceLab__replay_multi_session_large.csv``: 48 multi-turn agent sessions, 303 rounds,
  columns ``session_id,arrival_time,round_idx,prefix_len,input_len,output_len,
  tool_wait_after_ms``. Round 0's ``input_len`` is the initial prompt; a later round's
  ``input_len`` is what the environment appended (its ``prefix_len`` is the previous
  round's prefix + input + output, checked here); ``tool_wait_after_ms`` is the tool wait
  after the round (0 after the last round).
- ``TraceLab__sanitized_round_trace.jsonl``: 19 real coding-agent rounds with
  ``newly_append_tokens``, ``output_tokens`` and per-tool ``tool_wall_latency_ms``.
- ``SWE-agent__*.traj``: SWE-agent trajectories whose steps carry ``execution_time`` (s),
  the latency of one sandbox action.

Definitions (they match ``pearl.core.profile.WorkloadDefaults`` and
``pearl.core.workload``: an environment step follows every turn but the last):

- ``prompt_tokens``: mean round-0 ``input_len``.
- ``output_tokens_per_turn``: mean ``output_len`` over all rounds.
- ``observation_tokens_per_turn``: mean ``input_len`` over rounds after the first.
- ``turns_per_trajectory``: mean rounds per session.
- ``env_latency_s``: mean SWE-agent ``execution_time``; the TraceLab tool waits are printed
  next to it as a cross-check.

Prints one JSON object. Usage::

    .venv/bin/python benchmarks/calibrate_workload.py [--traces-dir ../shared/traces]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from collections import defaultdict
from itertools import pairwise
from pathlib import Path
from typing import Any

REPLAY_CSV = "TraceLab__replay_multi_session_large.csv"
ROUND_JSONL = "TraceLab__sanitized_round_trace.jsonl"
SWE_GLOB = "SWE-agent__*.traj"


def replay_stats(path: Path) -> dict[str, Any]:
    """Per-turn means of the TraceLab multi-session replay trace."""
    with path.open(newline="") as f:
        rows = [{k: int(v) for k, v in row.items()} for row in csv.DictReader(f)]
    sessions: dict[int, list[dict[str, int]]] = defaultdict(list)
    for row in rows:
        sessions[row["session_id"]].append(row)
    inconsistent = 0
    tool_waits_ms: list[int] = []
    for turns in sessions.values():
        turns.sort(key=lambda r: r["round_idx"])
        for prev, nxt in pairwise(turns):
            expected = prev["prefix_len"] + prev["input_len"] + prev["output_len"]
            inconsistent += nxt["prefix_len"] != expected
        tool_waits_ms.extend(r["tool_wait_after_ms"] for r in turns[:-1])
    prompts = [r["input_len"] for r in rows if r["round_idx"] == 0]
    observations = [r["input_len"] for r in rows if r["round_idx"] > 0]
    return {
        "num_sessions": len(sessions),
        "num_rounds": len(rows),
        "prefix_inconsistencies": inconsistent,
        "prompt_tokens_mean": statistics.fmean(prompts),
        "output_tokens_per_turn_mean": statistics.fmean(r["output_len"] for r in rows),
        "observation_tokens_per_turn_mean": statistics.fmean(observations),
        "turns_per_trajectory_mean": len(rows) / len(sessions),
        "tool_wait_s_mean": statistics.fmean(tool_waits_ms) / 1000,
        "tool_wait_s_median": statistics.median(tool_waits_ms) / 1000,
        "num_tool_waits": len(tool_waits_ms),
    }


def round_trace_stats(path: Path) -> dict[str, Any]:
    """Observation and tool-latency figures of the sanitized real coding-agent rounds."""
    with path.open() as f:
        rounds = [json.loads(line) for line in f if line.strip()]
    appended = [r["newly_append_tokens"] for r in rounds if r["round_index"] > 0]
    latencies_ms = [
        t["tool_wall_latency_ms"]
        for r in rounds
        for t in r["tools"]
        if t.get("tool_wall_latency_ms") is not None
    ]
    return {
        "num_rounds": len(rounds),
        "observation_tokens_per_turn_mean": statistics.fmean(appended),
        "output_tokens_per_turn_mean": statistics.fmean(r["output_tokens"] for r in rounds),
        "tool_latency_s_mean": statistics.fmean(latencies_ms) / 1000,
        "tool_latency_s_median": statistics.median(latencies_ms) / 1000,
        "num_tool_calls": len(latencies_ms),
    }


def swe_agent_stats(paths: list[Path]) -> dict[str, Any]:
    """Sandbox action latency from the ``execution_time`` of SWE-agent trajectory steps."""
    times: list[float] = []
    files_with_times: list[str] = []
    for path in paths:
        steps = json.loads(path.read_text())["trajectory"]
        found = [float(s["execution_time"]) for s in steps if s.get("execution_time") is not None]
        if found:
            files_with_times.append(path.name)
        times.extend(found)
    if not times:
        return {"num_steps": 0}
    return {
        "files_with_execution_time": files_with_times,
        "num_steps": len(times),
        "execution_time_s_mean": statistics.fmean(times),
        "execution_time_s_median": statistics.median(times),
        "execution_time_s_min": min(times),
        "execution_time_s_max": max(times),
    }


def calibrate(traces_dir: Path) -> dict[str, Any]:
    replay = replay_stats(traces_dir / REPLAY_CSV)
    rounds = round_trace_stats(traces_dir / ROUND_JSONL)
    swe = swe_agent_stats(sorted(traces_dir.glob(SWE_GLOB)))
    env_latency_s = swe.get("execution_time_s_mean", replay["tool_wait_s_mean"])
    return {
        "workload_defaults": {
            "prompt_tokens": replay["prompt_tokens_mean"],
            "output_tokens_per_turn": replay["output_tokens_per_turn_mean"],
            "observation_tokens_per_turn": replay["observation_tokens_per_turn_mean"],
            "env_latency_s": env_latency_s,
            "turns_per_trajectory": replay["turns_per_trajectory_mean"],
        },
        "tracelab_replay": replay,
        "tracelab_rounds": rounds,
        "swe_agent": swe,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces-dir", type=Path, default=Path("../shared/traces"))
    args = parser.parse_args(argv)
    if not (args.traces_dir / REPLAY_CSV).is_file():
        print(f"no {REPLAY_CSV} under {args.traces_dir}", file=sys.stderr)
        return 2
    print(json.dumps(calibrate(args.traces_dir), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
