"""The coordinator's run log: one run across incarnations, borrow windows closed."""

from __future__ import annotations

from pathlib import Path

from pearl.bench.synth import Layout, build_state
from pearl.coordinator.runlog import CoordinatorLog
from pearl.core.observation import AllocationGranted, GrantedNode
from pearl.core.state import BorrowWindow
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
