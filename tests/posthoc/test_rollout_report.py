"""``pearl analyze``'s rollout section: a rollout manager's turn records, figures by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_analysis_golden import FULL_LOG, write_log

from pearl.analysis.runs import RunLog, analyze_log
from pearl.cli.main import main
from pearl.runlog.jsonl import RunLogWriter
from pearl.runlog.schema import (
    Record,
    RunEnded,
    RunStarted,
    TrajectoryFinished,
    TrajectoryLost,
    TurnEnded,
)


def _turn(traj: str, turn: int, started_t: float, t: float, prompt: int, out: int,
          env_s: float | None, served: tuple[str, ...], prefilled: tuple[str, ...] = (),
          continuations: int = 0, finish: str | None = "tool_calls") -> TurnEnded:  # fmt: skip
    return TurnEnded(
        t=t,
        traj_id=traj,
        turn=turn,
        prompt_tokens=prompt,
        output_tokens=out,
        started_t=started_t,
        env_s=env_s,
        served_by=served,
        prefilled_by=prefilled,
        continuations=continuations,
        finish_reason=finish,
    )


def _finished(traj: str, t: float, turns: int, out: int, reward: float | None,
              end: str, started_t: float) -> TrajectoryFinished:  # fmt: skip
    return TrajectoryFinished(
        t=t,
        traj_id=traj,
        num_turns=turns,
        output_tokens=out,
        min_policy_version=0,
        reward=reward,
        end_reason=end,
        started_t=started_t,
        prompt_tokens=100,
        observation_tokens=10,
    )


# Four trajectories: a (3 turns; its second migrated d0 -> d1 and was resubmitted once),
# b (2 turns, prefilled on p0; its last resubmitted twice), c (1 long turn), d (lost after
# one turn when the manager restarted). Model-turn latencies 2, 1, 4, 3, 0.5, 10, 1.5 s;
# tool steps 0.5, 1.5, 2.5, 3 s; 440 output tokens from 0.5 (d's send) to 11 (c's end).
ROLLOUT_LOG: list[Record] = [
    RunStarted(t=0, run_id="roll1", source="rollout", policy="none"),
    _turn("d", 0, 0.5, 2.0, 90, 40, 3.0, ("d0",)),
    _turn("a", 0, 1.0, 3.0, 100, 50, 0.5, ("d0",)),
    _turn("a", 1, 3.5, 4.5, 200, 30, 1.5, ("d0", "d1"), continuations=1),
    _turn("b", 0, 2.0, 5.0, 120, 60, 2.5, ("d1",), ("p0",)),
    _turn("b", 1, 7.5, 8.0, 250, 20, None, ("d1",), ("p0",), continuations=2, finish="length"),
    _finished("b", 8.0, 2, 80, 0.0, "answered", 2.0),
    _turn("a", 2, 6.0, 10.0, 300, 100, None, ("d1",), finish="stop"),
    _finished("a", 10.0, 3, 180, 1.0, "answered", 1.0),
    _turn("c", 0, 1.0, 11.0, 80, 140, None, ("d0",), finish="stop"),
    _finished("c", 11.0, 1, 140, None, "context_limit", 1.0),
    TrajectoryLost(t=11.5, traj_id="d", reason="manager_restart", wasted_tokens=65, turns_done=1),
    RunEnded(t=12, reason="done"),
]
EXPECTED: dict[str, Any] = {
    "turns": 7,
    "trajectories_finished": 3,
    "trajectories_lost": 1,
    "prompt_tokens": 1140,
    "output_tokens": 440,
    "first_turn_started_t": 0.5,
    "last_turn_ended_t": 11.0,
    "span_s": 10.5,
    "output_tokens_per_s": round(440 / 10.5, 6),
    "turns_per_trajectory": {"mean": 2.0, "p50": 2.0, "max": 3.0},
    # sorted 0.5 1 1.5 2 3 4 10: p90 at rank 5.4 = 4 + 0.4 * 6, p99 at 5.94 = 4 + 0.94 * 6
    "model_turn_s": {"mean": round(22 / 7, 6), "p50": 2.0, "p90": 6.4, "p99": 9.64, "max": 10.0},
    # sorted 0.5 1.5 2.5 3: p50 at rank 1.5, p90 at 2.7 = 2.5 + 0.7 * 0.5, p99 at 2.97
    "tool_s": {"mean": 1.875, "p50": 2.0, "p90": 2.85, "p99": 2.985, "max": 3.0},
    "tool_steps": 4,
    "end_reasons": {"answered": 2, "context_limit": 1},
    "finish_reasons": {"length": 1, "stop": 2, "tool_calls": 4},
    "rewarded_trajectories": 2,
    "mean_reward": 0.5,
    "continued_turns": 2,
    "continuations": 3,
    "continued_turns_share": round(2 / 7, 6),
    "remote_prefill_turns": 2,
    "remote_prefill_share": round(2 / 7, 6),
    "migrated_turns": 1,
    "migrated_share": round(1 / 7, 6),
    "lost_wasted_tokens": 65,
    "lost_turns_done": 1,
    "lost_reasons": {"manager_restart": 1},
}


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _same(section: dict[str, Any]) -> bool:
    """The section equals EXPECTED (floats to 1e-6; pytest.approx takes no nested dicts)."""
    return _flat(section) == pytest.approx(_flat(EXPECTED), abs=1e-6)


def _write(path: Path, records: list[Record]) -> Path:
    with RunLogWriter(path, truncate=True) as log:
        for r in records:
            log.write(r)
    return path


def test_rollout_section_by_hand(tmp_path: Path) -> None:
    log = _write(tmp_path / "roll1" / "events.jsonl", ROLLOUT_LOG)
    summary = analyze_log(RunLog(log, "roll1")).summary()
    assert _same(summary["rollout_turns"])
    assert summary["run"]["source"] == "rollout"
    assert summary["throughput"]["trajectories"] == 3  # the existing section counts them too


def test_a_log_with_only_a_lost_trajectory_has_a_rollout_section(tmp_path: Path) -> None:
    records: list[Record] = [ROLLOUT_LOG[0], ROLLOUT_LOG[-2], ROLLOUT_LOG[-1]]
    log = _write(tmp_path / "events.jsonl", records)
    section = analyze_log(RunLog(log, "x")).summary()["rollout_turns"]
    assert (section["turns"], section["trajectories_lost"], section["span_s"]) == (0, 1, None)
    assert section["output_tokens_per_s"] is None and section["model_turn_s"]["p50"] is None


def test_a_log_without_turn_records_has_no_rollout_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = write_log(tmp_path / "run" / "events.jsonl", FULL_LOG)
    assert "rollout_turns" not in analyze_log(RunLog(log, "run")).summary()
    assert main(["analyze", str(log), "--out", str(tmp_path / "report")]) == 0
    assert "output_tokens_per_s" not in capsys.readouterr().out
    assert "Rollout: turns" not in (tmp_path / "report" / "report.md").read_text()


def test_pearl_analyze_json_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = _write(tmp_path / "roll1" / "events.jsonl", ROLLOUT_LOG)
    with log.open("a", encoding="utf-8") as f:  # bad turn lines: skipped and counted
        f.write(json.dumps({"v": 1, "t": 3, "type": "turn_ended", "traj_id": "a"}) + "\n")
        f.write('{"v":1,"t":12.5,"type":"turn_ended","traj_id":"e","tu')  # truncated
    out = tmp_path / "report"
    assert main(["analyze", str(log.parent), "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    (run,) = summary["runs"]
    assert _same(run["rollout_turns"])
    assert (run["read"]["invalid"], run["read"]["malformed"], summary["skipped_lines"]) == (1, 1, 2)
    assert run["read"]["by_type"]["turn_ended"] == 7
    report = (out / "report.md").read_text()
    assert "Rollout: turns, tokens/s, tool latencies" in report
    assert "| model_turn_s.p90 | 6.4 |" in report and "| end_reasons.answered | 2 |" in report

    assert main(["analyze", str(log.parent), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines.index(
        "run  turns  finished  lost  output_tokens_per_s  model_turn_p50_s  model_turn_p99_s"
        "  tool_p50_s  tool_p99_s  mean_reward"
    )
    assert lines[header + 1] == "roll1  7  3  1  41.9  2  9.64  2  2.985  0.5"
