"""The coordinator's run log: one run across incarnations, borrow windows closed."""

from __future__ import annotations

from pathlib import Path

from pearl.analysis.decisions import PdTimeline
from pearl.bench.synth import Layout, build_state
from pearl.coordinator.runlog import CoordinatorLog
from pearl.core.config import PolicyConfig
from pearl.core.decide import decide
from pearl.core.observation import AllocationGranted, GrantedNode, Observation
from pearl.core.state import BorrowWindow
from pearl.io.documents import load_profile
from pearl.runlog.jsonl import ReadStats, read_records


def test_a_borrow_window_that_closes_is_logged_returned_and_a_restart_appends(
    tmp_path: Path,
) -> None:
    path = tmp_path / "events.jsonl"
    state = build_state(Layout(1, 1, 0))
    lent = tuple(g.gpu_id for g in state.gpus if g.source.value == "base-train")[:2]
    window = BorrowWindow(gpu_ids=lent, lent_at_s=10.0, return_by_s=90.0)
    log = CoordinatorLog(path, "r1", "qwen3-8b", None, 0.0, max_return_delay_s=30.0)
    log.state(state, 0.0)
    log.state(state.evolve(last_pd_switch_s=1.0).model_copy(update={"borrow": window}), 10.0)
    log.state(state.evolve(time_s=60.0), 60.0)  # the trainer has its GPUs back
    log.close(60.0, None)
    again = CoordinatorLog(path, "r1", "qwen3-8b", state, 70.0)  # the next incarnation
    again.close(80.0, "max runtime reached")
    stats = ReadStats()
    records = list(read_records(path, stats))
    assert stats.records == stats.lines
    assert [r.type for r in records].count("run_started") == 1
    assert records[0].max_return_delay_s == 30.0  # type: ignore[union-attr]
    (returned,) = [r for r in records if r.type == "borrow"]
    assert (returned.kind, returned.gpu_ids, returned.t) == ("returned", lent, 60.0)  # type: ignore[union-attr]
    assert records[-1].type == "run_ended" and records[-1].t == 80.0


def test_slurms_grant_is_logged_when_it_happens_and_only_once(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    state = build_state(Layout(1, 1, 1))  # el0000 granted in the state
    grant = AllocationGranted(
        allocation_id="el0009", nodes=(GrantedNode(node="x9", gpu_type="h20", num_gpus=2),)
    )
    log = CoordinatorLog(path, "r1", "qwen3-8b", None, 0.0)
    log.state(state, 0.0)
    log.granted(grant, 5.0)  # held back until its agents join: logged now all the same
    log.granted(grant.model_copy(update={"allocation_id": "el0000"}), 6.0)  # known: no
    log.close(7.0, None)
    granted = [r for r in read_records(path, ReadStats()) if r.type == "allocation"]
    assert [(r.allocation_id, r.status, r.t, r.num_gpus) for r in granted][-1] == (  # type: ignore[union-attr]
        "el0009",
        "granted",
        5.0,
        2,
    )
    assert [r.allocation_id for r in granted].count("el0000") == 1  # type: ignore[union-attr]


def test_every_decides_wall_time_is_logged_the_quiet_ones_with_the_next_record(
    tmp_path: Path,
) -> None:
    path = tmp_path / "events.jsonl"
    state = build_state(Layout(1, 1, 0))
    quiet = decide(state, Observation(), PolicyConfig(), load_profile("qwen3-8b"), 1.0)
    assert quiet.plan.empty and not quiet.elastic.requests
    log = CoordinatorLog(path, "r1", "qwen3-8b", None, 0.0, quiet_decision_interval_s=60.0)
    timed = ((1.0, 0.010), (2.0, 0.002), (3.0, 0.003), (61.0, 0.005), (62.0, 0.004))
    for t, spent_s in timed:
        log.decision(quiet, t, spent_s)  # logged at 1 s, then quiet until 61 s, then 62 s
    log.close(63.0, None)  # writes the last quiet one, with its time
    decisions = [r for r in read_records(path, ReadStats()) if r.type == "decision"]
    assert [(r.t, r.decide_calls) for r in decisions] == [(1.0, 1), (61.0, 3), (62.0, 1)]  # type: ignore[union-attr]
    assert [round(r.decide_s, 6) for r in decisions] == [0.010, 0.010, 0.004]  # type: ignore[union-attr]
    pd = PdTimeline()
    for r in decisions:
        pd.handlers()["decision"](r)
    summary = pd.summary(duration_s=63.0)
    assert (summary["decide_calls"], summary["decide_s"]) == (5, 0.024)
    assert summary["decide_ms_mean"] == 4.8 and summary["decide_share"] == round(0.024 / 63, 4)
