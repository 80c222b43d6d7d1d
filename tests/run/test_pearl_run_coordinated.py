"""``pearl run`` with the coordinator (``coordinator.enabled``): the real ``decide()`` on the
tiny-cpu profile places the engines, and, the rollout batch being long against the
trainer's update, lends the trainer's slot (waking the engine asleep on it) while the
trainer waits and takes it back before the update; nothing in the configuration asks for
that. The elastic slot (the shipped availability windows, compressed 100 times: the first
opens at the run's 5th second and stays open longer than the run, however late a slow
machine's plans let the coordinator poll) is asked for by the ``greedy`` elastic rule, which
this configuration sets to test the path (pearl's ``marginal-gain`` asks only when it
predicts a gain), and granted (whether an engine starts there is not checked). The run log
(``events.jsonl``, read with ``rollout.jsonl`` by ``pearl analyze``) shows them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from lent_slot import LEAVES, ON_SLOT, check_returns
from test_pearl_run import _pearl

RUN = """\
run_dir: out
env: {name: single_digit, operators: "+", max_turns: 1}
rollout: {group_size: 4, batch_trajectories: 512, max_tokens: 64}
trainer: {steps: 2}
coordinator:
  enabled: true
  decision_interval_s: 0.5
  elastic_slots: 1
  elastic_time_scale: 100
  policy: {elastic: {rule: greedy}}
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
    assert on_slot[:1] == ["wake"], steps  # the asleep engine on the trainer's slot
    # returned before the update after it: each update starts once the slot is back
    rollout = [json.loads(line) for line in (out / "rollout.jsonl").read_text().splitlines()]
    updates = [r for r in rollout if r["type"] == "train_step"]
    assert len(updates) == 2
    returned_t = next(b["t"] for b in borrows if b["kind"] == "returned")
    assert any(u["started_t"] >= returned_t - 1.0 for u in updates)
    granted = [r for r in records if r["type"] == "allocation" and r["status"] == "granted"]
    assert granted and granted[0]["gpu_type"] == "cpu"  # asked for, in a window
    # the return takes the slot back with turns in flight on it: each of them goes on
    # elsewhere (migrated: served by the slot's engine, then another), none stays there
    # past the step that takes the engine off the slot, none is lost
    assert any(s["action"] in LEAVES and s["worker_id"].startswith(ON_SLOT) for s in steps)
    served, moved = check_returns(steps, rollout)
    assert not [r for r in rollout if r["type"] == "trajectory_lost"]
    print(
        f"the lent slot served {served} turns; {moved} in flight at its return "
        f"went on elsewhere; returns: {[b['kind'] for b in borrows if 'return' in b['kind']]}"
    )
    report = _pearl("analyze", "out", "--json", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    summary = json.loads(report.stdout)
    run = summary["runs"][0] if "runs" in summary else summary
    assert run["borrow"]["windows"] >= 1 and run["pd"]["transitions"] >= 2
    assert run["training"]["train_steps"] == 2 and run["throughput"]["trajectories"] > 0


def test_the_embedded_default_runs_with_the_coordinator(tmp_path: Path) -> None:
    """``pearl run`` with no file, shortened to two updates: the coordinator is on, the
    trainer's slot holds an engine put to sleep before the first decision, the first
    plan starts the rollout's engines, and every batch's duration is logged beside its
    prediction, which ``pearl analyze`` scores."""
    done = _pearl("run", "--steps", "2", "--run-dir", "out", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["steps"] == 2
    out = tmp_path / "out"
    records = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    started = {
        r["worker_id"] for r in records if r["type"] == "plan_step" and r["action"] == "start"
    }
    assert {"e-rollout-0", "e-rollout-1"} <= started and "e-trainer-0" not in started
    phases = [r for r in records if r["type"] == "worker_phase" and r["worker_id"] == "e-trainer-0"]
    assert phases and phases[0]["role"] == "idle", phases  # asleep from the start
    rollout = [json.loads(line) for line in (out / "rollout.jsonl").read_text().splitlines()]
    batches = [r for r in rollout if r["type"] == "batch_completed"]
    pairs = [(r["predicted_s"], r["t"] - r["started_t"]) for r in batches]
    assert any(p is not None for p, _ in pairs), pairs  # a decision predicted a batch
    # within a factor of ten of what it took (a prediction from the snapshot of the batch
    # before, ~0 s, or of an empty rollout, the plan's makespan, would not be)
    assert all(0.1 < p / a < 10 for p, a in pairs if p is not None and a > 1.0), pairs
    report = _pearl("analyze", "out", "--json", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    run = json.loads(report.stdout)["runs"][0]
    assert run["batches"]["prediction"]["n"] >= 1


def _children_of_run(run_dir: Path) -> list[str]:
    """The command lines of processes started for ``run_dir`` (engines and the trainer
    name its model or its files)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "serve" in argv and any(a.startswith(str(run_dir)) for a in argv):
            found.append(" ".join(argv))
    return found


def test_a_run_killed_with_sigkill_leaves_no_process_and_resumes(tmp_path: Path) -> None:
    """The embedded default, SIGKILLed after its first update: its engines and its
    trainer die with it (``pearl.control.pdeath``), and the same command resumes the
    rollout, the trainer and the coordinator from their journals and checkpoints and
    trains to the end, every update committed once, in order."""
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "pearl.cli.main", "run", "--steps", "3", "--run-dir", "out"]
    err = (tmp_path / "stderr.txt").open("wb")  # a file, not a pipe nobody reads meanwhile
    run = subprocess.Popen([*argv, "--json"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoints" / "step-000001").exists():
            assert run.poll() is None and time.monotonic() < deadline, "no first update"
            time.sleep(0.1)
        assert _children_of_run(out)
        run.kill()
        run.wait(timeout=30)
    finally:
        if run.poll() is None:
            run.kill()
        err.close()
    deadline = time.monotonic() + 20
    while _children_of_run(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _children_of_run(out), _children_of_run(out)
    logged = len((out / "events.jsonl").read_text().splitlines())
    again = _pearl(*argv[3:], "--json", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == "step-000003"
    rollout = [json.loads(line) for line in (out / "rollout.jsonl").read_text().splitlines()]
    versions = [r["policy_version"] for r in rollout if r["type"] == "train_step"]
    assert versions == [1, 2, 3], versions  # (one logged at the resume, if unreported)
    taken = [r["batch_id"] for r in rollout if r["type"] == "batch_consumed"]
    assert sorted(set(taken)) == [0, 1, 2], taken  # each batch taken (again from the spool)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    resumed = [r for r in events[logged:] if r["type"] == "decision"]
    assert resumed and resumed[0]["mandatory"], resumed[:1]  # engines placed again
