"""Run logs: every record type round-trips; the reader skips and counts what it cannot use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pearl.runlog.jsonl import ReadStats, RunLogWriter, read_records
from pearl.runlog.schema import (
    RECORD_TYPES,
    AllocationChanged,
    BatchCompleted,
    BatchConsumed,
    BorrowChanged,
    DecisionMade,
    GpuAdded,
    GpuRemoved,
    PastBoundApplied,
    PlanStepDone,
    Record,
    RunEnded,
    RunStarted,
    TrainStep,
    TrajectoryFinished,
    TrajectoryLost,
    TurnEnded,
    WorkerPhase,
    decode,
    encode,
)

ROOT = Path(__file__).resolve().parents[1]

EXAMPLES: list[Record] = [
    RunStarted(t=0, run_id="r1", source="simulator", policy="pearl", scenario="s", seed=1),
    GpuAdded(t=0, gpu_id="n0/0", node="n0", gpu_type="h100", source="elastic", allocation_id="7"),
    GpuRemoved(t=5, gpu_id="n0/0", reason="preempted"),
    WorkerPhase(
        t=1, worker_id="e0", kind="engine", gpu_ids=("n0/0",), role="decode", phase="switching"
    ),
    DecisionMade(
        t=2,
        policy="pearl",
        pd_mode="disaggregated",
        target="2P:6D",
        switch=True,
        mandatory=False,
        predicted_current_s=None,
        predicted_target_s=40.0,
        transition_s=2.1,
        num_steps=4,
        borrow="none",
        num_elastic_requests=0,
        reasons=("select: ...",),
    ),
    PlanStepDone(t=4, action="switch", worker_id="e0", started_t=2),
    AllocationChanged(t=3, allocation_id="7", status="granted", gpu_type="h100", num_gpus=8),
    BorrowChanged(t=3, kind="lend", gpu_ids=("t0/0",), return_by_t=90),
    TrajectoryFinished(
        t=9, traj_id="x", batch_id=0, num_turns=5, output_tokens=900, min_policy_version=0
    ),
    TurnEnded(
        t=3.5,
        traj_id="x",
        turn=0,
        prompt_tokens=812,
        output_tokens=240,
        started_t=1.25,
        env_s=0.8,
        served_by=("d0", "d1"),
        prefilled_by=("p0",),
        continuations=1,
        finish_reason="stop",
    ),
    TrajectoryLost(t=6, traj_id="y", reason="manager_restart", wasted_tokens=300, turns_done=2),
    BatchCompleted(t=10, batch_id=0, started_t=0, predicted_s=9.5),
    BatchConsumed(
        t=10,
        batch_id=0,
        policy_version=1,
        trajectories=256,
        output_tokens=90000,
        off_policy_tokens=60000,
        max_staleness_versions=1,
        mean_staleness_versions=0.4,
    ),
    PastBoundApplied(
        t=40,
        policy_version=2,
        mode="interrupt",
        interrupted=12,
        restarted=3,
        dropped=0,
        wasted_tokens=4000,
        taken_back=1,
    ),
    TrainStep(t=40, step=0, started_t=10, policy_version=1, waited_for_gpus_s=0.5),
    RunEnded(t=50, reason="duration"),
]


def test_every_type_has_an_example_and_round_trips() -> None:
    assert sorted(r.type for r in EXAMPLES) == sorted(RECORD_TYPES)
    for record in EXAMPLES:
        assert decode(json.loads(json.dumps(encode(record)))) == record


def test_the_schema_doc_lists_every_type() -> None:
    doc = (ROOT / "docs" / "log-schema.md").read_text()
    for name in RECORD_TYPES:
        assert f"`{name}`" in doc, name


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param({"v": 1, "t": 0, "type": "teleport"}, "teleport", id="unknown-type"),
        pytest.param(
            {"v": 1, "t": 0, "type": "gpu_removed"}, "gpu_id: Field required", id="missing-field"
        ),
        pytest.param({"v": 2, "t": 0, "type": "run_ended"}, "v: schema version 2", id="version"),
    ],
)
def test_decode_names_the_problem(data: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode(data)


def test_writer_and_tolerant_reader(tmp_path: Path) -> None:
    path = tmp_path / "run" / "events.jsonl"
    with RunLogWriter(path) as log:
        for record in EXAMPLES:
            log.write(record)
    with path.open("a") as f:
        f.write("not json\n")
        f.write(json.dumps({"v": 1, "t": 1, "type": "mystery"}) + "\n")
        f.write(json.dumps({"v": 9, "t": 1, "type": "run_ended"}) + "\n")
        f.write(json.dumps({"v": 1, "t": 1, "type": "gpu_removed"}) + "\n")
        f.write('{"v": 1, "t": 3, "type": "run_en')  # truncated last line
    stats = ReadStats()
    records = list(read_records(path, stats))
    assert records == EXAMPLES
    assert (stats.lines, stats.records) == (len(EXAMPLES) + 5, len(EXAMPLES))
    assert (stats.malformed, stats.unknown_type, stats.other_version, stats.invalid) == (2, 1, 1, 1)
    assert stats.by_type["decision"] == 1


# The rollout manager's records: turns, lost trajectories, the fields it adds to
# trajectory_finished, and its run_started source.
TURN: dict[str, object] = {
    "v": 1,
    "t": 4.0,
    "type": "turn_ended",
    "traj_id": "x",
    "turn": 1,
    "prompt_tokens": 1100,
    "output_tokens": 90,
    "started_t": 3.0,
    "env_s": None,
    "served_by": ["d0"],
    "prefilled_by": [],
    "continuations": 0,
    "finish_reason": None,
}
OLD_FINISHED: dict[str, object] = {  # a trajectory_finished line as written before
    "v": 1,
    "t": 9.0,
    "type": "trajectory_finished",
    "traj_id": "x",
    "batch_id": None,
    "num_turns": 2,
    "output_tokens": 330,
    "min_policy_version": 0,
}


def test_rollout_records_round_trip() -> None:
    records: list[Record] = [
        RunStarted(t=0, run_id="r2", source="rollout", policy="none"),
        TurnEnded(
            t=4,
            traj_id="x",
            turn=1,
            prompt_tokens=1100,
            output_tokens=90,
            started_t=3,
            env_s=None,
            served_by=("d0",),
            prefilled_by=(),
            continuations=0,
            finish_reason=None,
        ),
        TrajectoryFinished(
            t=9,
            traj_id="x",
            num_turns=2,
            output_tokens=330,
            min_policy_version=0,
            reward=0.5,
            end_reason="max_turns",
            prompt_tokens=812,
            observation_tokens=288,
            started_t=1.25,
        ),
        TrajectoryLost(t=6, traj_id="y", reason="manager_restart", wasted_tokens=0, turns_done=0),
    ]
    for record in records:
        assert decode(json.loads(json.dumps(encode(record)))) == record
    assert decode(TURN) == records[1]


def test_trajectory_finished_without_the_new_fields() -> None:
    """An old line still decodes (the new fields at their defaults), and a record that sets
    none of them encodes to exactly the old line: v stays 1."""
    record = decode(OLD_FINISHED)
    assert isinstance(record, TrajectoryFinished)
    assert (record.reward, record.end_reason, record.prompt_tokens) == (None, "", None)
    assert (record.observation_tokens, record.started_t) == (None, None)
    assert encode(record) == OLD_FINISHED
    with_reward = record.model_copy(update={"reward": 0.0})
    assert encode(with_reward) == {**OLD_FINISHED, "reward": 0.0}  # 0.0 is set, not default


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param({k: v for k, v in TURN.items() if k != "served_by"},
                     "served_by: Field required", id="turn-missing-field"),
        pytest.param({**TURN, "output_tokens": -1}, "output_tokens: Input should be greater",
                     id="turn-negative-tokens"),
        pytest.param({**TURN, "env_s": "slow"}, "env_s: Input should be a valid number",
                     id="turn-bad-env"),
        pytest.param({**TURN, "served_by": "d0"}, "served_by: Input should be a valid tuple",
                     id="turn-served-by-not-a-list"),
        pytest.param({**TURN, "engine": "d0"}, "engine: Extra inputs", id="turn-extra-field"),
        pytest.param({"v": 1, "t": 6, "type": "trajectory_lost", "traj_id": "y",
                      "wasted_tokens": 3, "turns_done": 1}, "reason: Field required",
                     id="lost-missing-reason"),
        pytest.param({**OLD_FINISHED, "reward": "high"}, "reward: Input should be a valid number",
                     id="finished-bad-reward"),
        pytest.param({"v": 1, "t": 0, "type": "run_started", "run_id": "r", "source": "trainer",
                      "policy": "p"}, "source: Input should be", id="run-started-bad-source"),
    ],
)  # fmt: skip
def test_decode_names_the_problem_in_rollout_records(data: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode(data)


def test_the_reader_skips_and_counts_a_bad_turn(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(
        json.dumps(TURN)
        + "\n"
        + json.dumps({**TURN, "turn": -1})  # invalid
        + "\n"
        + json.dumps(TURN)[:40],  # truncated
        encoding="utf-8",
    )
    stats = ReadStats()
    assert [r.type for r in read_records(path, stats)] == ["turn_ended"]
    assert (stats.lines, stats.invalid, stats.malformed) == (3, 1, 1)
