"""The coordinator's run log: one run across incarnations, borrow windows closed."""

from __future__ import annotations

from pathlib import Path

from pearl.coordinator.runlog import CoordinatorLog
from pearl.core.state import BorrowWindow
from pearl.io.runlog import ReadStats, read_records
from pearl.synth import Layout, build_state


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
