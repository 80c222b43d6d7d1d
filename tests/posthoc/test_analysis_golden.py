"""Golden summaries: hand-written small run logs whose figures are derived by hand below."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pearl.analysis.runs import RunLog, analyze_log
from pearl.analysis.timeline import GpuTimeline, Segment
from pearl.runlog.schema import GpuAdded, GpuRemoved

H = 3600.0


def _decision(t: float, mode: str, target: str, steps: int, transition_s: float,
              reasons: list[str]) -> dict[str, Any]:  # fmt: skip
    return {"t": t, "type": "decision", "policy": "pearl", "pd_mode": mode, "target": target,
            "switch": True, "mandatory": False, "predicted_current_s": 100.0,
            "predicted_target_s": 90.0, "transition_s": transition_s, "num_steps": steps,
            "borrow": "none", "num_elastic_requests": 0, "reasons": reasons}  # fmt: skip


# Two base GPUs (a/0 trains, b/0 rolls out), one elastic GPU (c/0) granted at 20 and
# preempted (notice 120, gone 150); a transition colocated -> 1P:1D at 30 whose two plan
# steps end at 34 and 40; a/0 lent from 30 to 95; three trajectories; two batches; one
# training step that waited 5 s; the run ends at 200.
FULL_LOG: list[dict[str, Any]] = [
    {"t": 0, "type": "run_started", "run_id": "g1", "source": "coordinator", "policy": "pearl",
     "scenario": "tiny", "seed": 3, "profile": "p"},
    {"t": 0, "type": "gpu_added", "gpu_id": "a/0", "node": "a", "gpu_type": "h100",
     "source": "base-train", "allocation_id": "base"},
    {"t": 0, "type": "gpu_added", "gpu_id": "b/0", "node": "b", "gpu_type": "h100",
     "source": "base-rollout", "allocation_id": "base"},
    {"t": 0, "type": "worker_phase", "worker_id": "t0", "kind": "trainer", "gpu_ids": ["a/0"],
     "role": "train", "phase": "ready"},
    {"t": 0, "type": "worker_phase", "worker_id": "e0", "kind": "engine", "gpu_ids": ["b/0"],
     "role": "colocated", "phase": "ready"},
    _decision(0, "colocated", "colocated 1C [colocated:h100x1 x1]", 0, 0.0, ["select: keep"]),
    {"t": 10, "type": "allocation", "allocation_id": "el1", "status": "requested",
     "gpu_type": "h100", "num_gpus": 1},
    {"t": 20, "type": "allocation", "allocation_id": "el1", "status": "granted",
     "gpu_type": "h100", "num_gpus": 1},
    {"t": 20, "type": "gpu_added", "gpu_id": "c/0", "node": "c", "gpu_type": "h100",
     "source": "elastic", "allocation_id": "el1"},
    {"t": 30, "type": "worker_phase", "worker_id": "e1", "kind": "engine", "gpu_ids": ["c/0"],
     "role": "decode", "phase": "switching"},
    _decision(30, "disaggregated", "disaggregated 1P:1D [decode:h100x1 x1, prefill:h100x1 x1]",
              2, 8.0, ["select: best 1P:1D", "switch: yes: gain 30 s"]),
    {"t": 30, "type": "borrow", "kind": "lend", "gpu_ids": ["a/0"], "return_by_t": 100},
    {"t": 34, "type": "plan_step", "action": "switch", "worker_id": "e0", "started_t": 30},
    {"t": 40, "type": "plan_step", "action": "start", "worker_id": "e1", "started_t": 30},
    {"t": 40, "type": "worker_phase", "worker_id": "e0", "kind": "engine", "gpu_ids": ["b/0"],
     "role": "prefill", "phase": "ready"},
    {"t": 40, "type": "worker_phase", "worker_id": "e1", "kind": "engine", "gpu_ids": ["c/0"],
     "role": "decode", "phase": "ready"},
    {"t": 60, "type": "trajectory_finished", "traj_id": "x0", "batch_id": 0, "num_turns": 2,
     "output_tokens": 100, "min_policy_version": 0},
    {"t": 70, "type": "trajectory_finished", "traj_id": "x1", "batch_id": 0, "num_turns": 1,
     "output_tokens": 200, "min_policy_version": 0},
    {"t": 90, "type": "borrow", "kind": "return", "gpu_ids": ["a/0"], "return_by_t": 100},
    {"t": 95, "type": "borrow", "kind": "returned", "gpu_ids": ["a/0"]},
    {"t": 100, "type": "batch_completed", "batch_id": 0, "started_t": 0, "predicted_s": 80},
    {"t": 120, "type": "allocation", "allocation_id": "el1", "status": "preempting",
     "gpu_type": "h100", "num_gpus": 1},
    {"t": 130, "type": "trajectory_finished", "traj_id": "x2", "batch_id": 1, "num_turns": 3,
     "output_tokens": 300, "min_policy_version": 1},
    {"t": 130, "type": "train_step", "step": 0, "started_t": 100, "policy_version": 1,
     "waited_for_gpus_s": 5},
    {"t": 150, "type": "allocation", "allocation_id": "el1", "status": "ended",
     "gpu_type": "h100", "num_gpus": 1},
    {"t": 150, "type": "gpu_removed", "gpu_id": "c/0", "reason": "preempted by owner"},
    {"t": 180, "type": "batch_completed", "batch_id": 1, "started_t": 100, "predicted_s": 100},
    {"t": 200, "type": "run_ended", "reason": "done"},
]  # fmt: skip


def write_log(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"v": 1, **r}) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_golden_summary_of_a_full_log(tmp_path: Path) -> None:
    log = write_log(tmp_path / "run" / "events.jsonl", FULL_LOG)
    s = analyze_log(RunLog(log, "run"), max_return_delay_s=3.0).summary()
    assert s["run"]["policy"] == "pearl" and s["run"]["duration_s"] == 200.0
    assert s["read"]["records"] == len(FULL_LOG) and s["read"]["skipped"] == 0
    # 3 trajectories, 100 + 200 + 300 tokens, in 200 s
    tp = s["throughput"]
    assert tp["trajectories"] == 3 and tp["output_tokens"] == 600 and tp["turns"] == 6
    assert tp["throughput_traj_per_h"] == pytest.approx(3 / (200 / H))  # 54
    assert tp["tokens_per_s"] == pytest.approx(600 / 200)
    assert tp["peak_traj_per_min"] == 2  # minute 1 (60..120 s): x0 and x1
    # one step, 100 -> 130 s
    assert s["training"]["train_steps"] == 1
    assert s["training"]["train_steps_per_h"] == pytest.approx(1 / (200 / H))
    assert s["training"]["step_s"]["mean"] == 30.0
    # batches: 0 took 100 s (predicted 80), 1 took 80 s (predicted 100)
    b = s["batches"]
    assert b["completed"] == 2 and b["batch_time_s"]["mean"] == 90.0
    p = b["prediction"]
    assert p["n"] == 2 and p["mean_abs_error_s"] == 20.0 and p["mean_error_s"] == 0.0
    assert p["mape"] == pytest.approx((20 / 100 + 20 / 80) / 2)  # 0.225
    # GPU time: a/0 0..200 train; b/0 colocated 0..40, prefill 40..200;
    # c/0 idle 20..30, decode switching 30..40, decode ready 40..150
    g = s["gpu_hours"]
    assert g["by_role"] == pytest.approx(
        {"train": 200 / H, "colocated": 40 / H, "prefill": 160 / H, "decode": 120 / H,
         "idle": 10 / H}, abs=1e-6)  # fmt: skip
    assert g["present_gpu_hours"] == pytest.approx(530 / H, abs=1e-6)
    assert g["utilisation"] == pytest.approx((200 + 40 + 160 + 110) / 530, abs=1e-6)
    assert g["by_source"]["base"] == pytest.approx(400 / H, abs=1e-6)
    assert g["by_source"]["elastic"] == pytest.approx(130 / H, abs=1e-6)
    assert g["by_source"]["borrowed"] == pytest.approx(65 / H)  # 1 GPU lent 30..95
    # the transition: decided at 30, last step at 40 (predicted 8 s)
    pd = s["pd"]
    assert (pd["decisions"], pd["transitions"], pd["plan_steps"]) == (2, 1, 2)
    [tr] = pd["transition_list"]
    assert tr["measured_s"] == 10.0 and tr["predicted_s"] == 8.0 and tr["steps_done"] == 2
    assert tr["reason"] == "switch: yes: gain 30 s"
    assert tr["from"].startswith("colocated 1C") and tr["to"].startswith("disaggregated 1P:1D")
    configs = [(c["t"], c["mode"], c["P"], c["D"], c["C"], c["gpus"]) for c in pd["configurations"]]
    assert configs == [(0.0, "colocated", 0, 0, 1, 1), (40.0, "disaggregated", 1, 1, 0, 2)]
    # borrow: return decided at 90, back at 95 (by 100: not late); the step waited 5 s > 3 s
    bw = s["borrow"]
    assert bw["windows"] == 1 and bw["return_delay_s"]["mean"] == 5.0 and bw["late_returns"] == 0
    assert bw["trainer_wait"]["max_s"] == 5.0 and bw["trainer_wait"]["over_limit"] == 1
    # elastic: requested 10, granted 20, notice 120, gone 150; decode on it 30..150
    el = s["elastic"]
    assert (el["requests"], el["granted"], el["preempted"], el["released"]) == (1, 1, 1, 0)
    assert el["grant_wait_s"]["mean"] == 10.0
    assert el["requested_waiting_gpu_hours"] == pytest.approx(10 / H, abs=1e-6)
    assert el["granted_gpu_hours"] == pytest.approx(130 / H, abs=1e-6)
    assert el["used_gpu_hours"] == pytest.approx(120 / H, abs=1e-6)
    assert el["lost_to_preemption_gpu_hours"] == pytest.approx(30 / H, abs=1e-6)
    assert s["notes"] == []


def test_golden_summary_without_gpu_records(tmp_path: Path) -> None:
    """The simulator's logs have no GPU records: hours come from allocations and borrows."""
    gpu_types = {"gpu_added", "gpu_removed", "worker_phase"}
    log = write_log(tmp_path / "p" / "seed0.jsonl",
                    [r for r in FULL_LOG if r["type"] not in gpu_types])  # fmt: skip
    s = analyze_log(RunLog(log, "p/seed0")).summary()
    g = s["gpu_hours"]
    assert g["by_role"] is None and g["utilisation"] is None and g["by_source"]["base"] is None
    assert g["by_source"]["elastic"] == pytest.approx(130 / H, abs=1e-6)  # granted 20..150
    assert g["by_source"]["borrowed"] == pytest.approx(65 / H)
    assert s["elastic"]["used_gpu_hours"] is None
    assert any("no gpu_added" in n for n in s["notes"])
    assert any("max_return_delay_s unknown" in n for n in s["notes"])
    assert s["throughput"]["trajectories"] == 3  # the rest is unchanged


def test_timeline_marks_borrowed_and_preempted_gpus() -> None:
    tl = GpuTimeline()
    handlers = tl.handlers()
    handlers["gpu_added"](GpuAdded(t=0, gpu_id="x/0", node="x", gpu_type="h", source="elastic",
                                   allocation_id="e"))  # fmt: skip
    handlers["gpu_removed"](GpuRemoved(t=50, gpu_id="x/0", reason="reclaimed"))
    assert tl.all_segments(100) == [Segment("x/0", 0, 50, "idle", "ready", "elastic", False)]
    assert [(m.kind, m.t) for m in tl.markers] == [("added", 0), ("preempted", 50)]


def test_a_coordinator_log_its_releases_repeats_and_returns(tmp_path: Path) -> None:
    """The coordinator's records: an allocation ended with reason released is a release,
    not a preemption; a record repeated by a restarted writer changes nothing; a borrow
    window closes at its "returned"."""
    records: list[dict[str, Any]] = [
        {"t": 0, "type": "run_started", "run_id": "c1", "source": "coordinator",
         "policy": "pearl", "max_return_delay_s": 7.0},
        {"t": 0, "type": "gpu_added", "gpu_id": "a/0", "node": "a", "gpu_type": "h100",
         "source": "base-train", "allocation_id": "base"},
        {"t": 0, "type": "worker_phase", "worker_id": "t0", "kind": "trainer",
         "gpu_ids": ["a/0"], "role": "train", "phase": "ready"},
        {"t": 10, "type": "allocation", "allocation_id": "el1", "status": "pending",
         "gpu_type": "h20", "num_gpus": 2},
        {"t": 20, "type": "allocation", "allocation_id": "el1", "status": "granted",
         "gpu_type": "h20", "num_gpus": 2},
        {"t": 20, "type": "gpu_added", "gpu_id": "x/0", "node": "x", "gpu_type": "h20",
         "source": "elastic", "allocation_id": "el1"},
        # a restarted coordinator logs the same GPU again: no new segment
        {"t": 50, "type": "gpu_added", "gpu_id": "x/0", "node": "x", "gpu_type": "h20",
         "source": "elastic", "allocation_id": "el1"},
        {"t": 100, "type": "borrow", "kind": "lend", "gpu_ids": ["a/0"], "return_by_t": 300},
        {"t": 200, "type": "borrow", "kind": "return", "gpu_ids": ["a/0"], "return_by_t": 300},
        {"t": 220, "type": "borrow", "kind": "returned", "gpu_ids": ["a/0"]},
        {"t": 380, "type": "allocation", "allocation_id": "el1", "status": "ended",
         "gpu_type": "h20", "num_gpus": 2, "reason": "released"},
        {"t": 380, "type": "gpu_removed", "gpu_id": "x/0", "reason": "released"},
    ]  # fmt: skip
    log = write_log(tmp_path / "run" / "events.jsonl", records)
    s = analyze_log(RunLog(log, "run")).summary()
    assert s["run"]["duration_s"] == 380.0  # no run_ended: its last record
    el = s["elastic"]
    assert (el["released"], el["preempted"], el["lost_to_preemption_gpu_hours"]) == (1, 0, 0.0)
    assert el["granted_gpu_hours"] == pytest.approx(2 * 360 / H)  # 2 GPUs from 20 to 380
    # one GPU from 20 to 380 (the repeated add is no new GPU)
    assert s["gpu_hours"]["present_gpu_hours"] == pytest.approx((380 + 360) / H, abs=1e-6)
    assert s["gpu_hours"]["by_source"]["borrowed"] == pytest.approx(120 / H, abs=1e-6)
    assert s["borrow"]["return_delay_s"]["max"] == pytest.approx(20.0)
    assert s["borrow"]["trainer_wait"]["max_return_delay_s"] == 7.0  # from run_started
