"""``pearl run`` with the coordinator (``coordinator.enabled``): the real ``decide()`` on the
tiny-cpu profile places the engines, and, the rollout batch being long against the
trainer's update, lends the trainer's slot (an engine on it) while the trainer waits and
takes it back once the batch is ready, before the update; it asks for the elastic slot
(the shipped availability windows, compressed, open from the run's 5th second) and is
granted it (whether an engine starts there before the policy gives it back depends on how
far the batch is by then: not checked). The configuration allows these (an elastic
slot, the marginal-gain rule) and asks for none; the run log (``events.jsonl``, read with
``rollout.jsonl`` by ``pearl analyze``) shows them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from test_pearl_run import _pearl

RUN = """\
run_dir: out
rollout: {group_size: 4, batch_trajectories: 512, max_tokens: 64}
trainer: {steps: 2}
coordinator:
  enabled: true
  decision_interval_s: 0.5
  elastic_slots: 1
  policy: {elastic: {rule: marginal-gain, min_window_factor: 2.0}}
"""


def test_the_policy_lends_the_trainers_slot_between_updates(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text(RUN)
    done = _pearl("run", "run.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "out"
    records = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    borrows = [r for r in records if r["type"] == "borrow"]
    kinds = [b["kind"] for b in borrows]
    assert "lend" in kinds and "returned" in kinds, kinds
    steps = [r for r in records if r["type"] == "plan_step"]
    assert {"offload", "onload"} <= {s["action"] for s in steps}
    on_slot = [s["action"] for s in steps if s["worker_id"].startswith("e-trainer")]
    assert on_slot[:1] == ["start"], steps  # an engine on the trainer's slot
    # returned before the update after it: each update starts once the slot is back
    rollout = [json.loads(line) for line in (out / "rollout.jsonl").read_text().splitlines()]
    updates = [r for r in rollout if r["type"] == "train_step"]
    assert len(updates) == 2
    returned_t = next(b["t"] for b in borrows if b["kind"] == "returned")
    assert any(u["started_t"] >= returned_t - 1.0 for u in updates)
    granted = [r for r in records if r["type"] == "allocation" and r["status"] == "granted"]
    assert granted and granted[0]["gpu_type"] == "cpu"  # asked for, in a window
    report = _pearl("analyze", "out", "--json", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    summary = json.loads(report.stdout)
    run = summary["runs"][0] if "runs" in summary else summary
    assert run["borrow"]["windows"] >= 1 and run["pd"]["transitions"] >= 2
    assert run["training"]["train_steps"] == 2 and run["throughput"]["trajectories"] > 0
