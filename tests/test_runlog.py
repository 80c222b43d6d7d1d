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
