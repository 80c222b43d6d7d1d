"""``pearl analyze``: the RUN_DIR rule, bad lines skipped and counted, exit 2 on bad input,
the report files, the benchmark's JSON, and ``pearl simulate`` then ``pearl analyze``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_analysis_golden import FULL_LOG, write_log

from pearl.analysis.runs import find_run_logs
from pearl.cli.main import main
from pearl.io.documents import InputError

PLOT_KINDS = ("gpu-timeline", "throughput", "pd", "batches", "borrow-elastic")
# A tiny scenario (as tests/sim/sim_fixtures.scenario_dict(elastic=True, batch=16)): one
# h800 trainer node, one h20 rollout node, synthetic elastic windows.
TINY_SCENARIO: dict[str, Any] = {
    "schema_version": 1,
    "name": "tiny",
    "profile": "qwen3-8b",
    "duration_s": 900.0,
    "seeds": 1,
    "cluster": {
        "trainer": {"nodes": 1, "gpu_type": "h800"},
        "rollout": {"nodes": 1, "gpu_type": "h20"},
    },
    "elastic": {
        "source": "synthetic",
        "synthetic": {
            "gpu_type": "h800",
            "arrivals_per_h": 12.0,
            "lifetime_median_s": 400.0,
            "lifetime_sigma": 0.5,
            "max_gpus": 16,
        },
        "queue_delay_median_s": 5.0,
        "queue_delay_sigma": 0.0,
        "grace_s": 30.0,
    },
    "rollout": {"batch_trajectories": 16, "staleness_versions": 1, "max_context_tokens": 32768},
    "training": {"train_step_s": 20.0},
    "policy": {
        "borrowing": {"max_return_delay_s": 30.0},
        "elastic": {"gpu_type": "h800", "gpus_per_allocation": 8, "max_allocations": 2},
    },
}


def _analyze(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["analyze", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_run_dir_rule(tmp_path: Path) -> None:
    sim = tmp_path / "sim"  # a pearl simulate --out folder
    for policy in ("pearl", "roll-fixed"):
        write_log(sim / policy / "seed0.jsonl", FULL_LOG)
    (sim / "summary.json").write_text("{}")
    coord = tmp_path / "coord"  # a coordinator run: its journal is not a run log
    write_log(coord / "events.jsonl", FULL_LOG)
    (coord / "journal.jsonl").write_text('{"state": 1}\n')
    names = [log.name for log in find_run_logs([sim, coord, sim / "pearl" / "seed0.jsonl"])]
    assert names == ["pearl/seed0", "roll-fixed/seed0", "coord"]  # each file once
    with pytest.raises(InputError, match="no run log"):
        find_run_logs([_journal_only(tmp_path)])


def _journal_only(tmp_path: Path) -> Path:
    d = tmp_path / "journal-only"
    d.mkdir()
    (d / "journal.jsonl").write_text('{"state": 1}\n')
    return d


def test_bad_lines_are_skipped_counted_and_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = write_log(tmp_path / "run" / "events.jsonl", FULL_LOG)
    good = log.read_text()
    bad = [
        "this is not json",
        json.dumps({"v": 1, "t": 5, "type": "gpu_exploded", "gpu_id": "a/0"}),  # unknown
        json.dumps({"v": 2, "t": 5, "type": "run_ended", "why": "v2"}),  # other version
        json.dumps({"v": 1, "t": 5, "type": "train_step", "step": 9}),  # missing fields
    ]
    truncated = '{"v":1,"t":201,"type":"trajectory_fin'  # the writer was killed mid-line
    log.write_text(good + "\n".join(bad) + "\n" + truncated, encoding="utf-8")
    out = tmp_path / "report"
    code, stdout, err = _analyze(capsys, str(log.parent), "--out", str(out), "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    read = summary["runs"][0]["read"]
    assert (read["malformed"], read["unknown_type"], read["other_version"], read["invalid"]) == (
        2,
        1,
        1,
        1,
    )
    assert read["skipped"] == 5 == summary["skipped_lines"]
    assert read["records"] == len(FULL_LOG)
    assert summary["runs"][0]["throughput"]["trajectories"] == 3  # the good lines still count
    report = (out / "report.md").read_text()
    assert "5 skipped (2 malformed or truncated, 1 of unknown type, 1 of another schema" in report


@pytest.mark.parametrize("which", ["empty", "missing", "journal-only"])
def test_nothing_to_analyze_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], which: str
) -> None:
    path = tmp_path / which
    if which == "empty":
        path.mkdir()
    elif which == "journal-only":
        path = _journal_only(tmp_path)
    code, stdout, err = _analyze(capsys, str(path), "--out", str(tmp_path / "out"))
    lines = err.strip().splitlines()
    assert code == 2 and stdout == ""
    assert len(lines) == 1 and str(path) in lines[0]
    assert not (tmp_path / "out").exists()


def test_the_report_script_exits_2_on_a_missing_dir(tmp_path: Path) -> None:
    """``python analysis/report.py RUN_DIR``, as a user runs it over job logs."""
    script = Path(__file__).resolve().parents[2] / "analysis" / "report.py"
    argv = [sys.executable, str(script), str(tmp_path / "nope")]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "nope" in done.stderr


def test_accounting_section_from_an_sacct_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = write_log(tmp_path / "run" / "events.jsonl", FULL_LOG)
    sacct = tmp_path / "sacct.txt"
    sacct.write_text(
        "JobID|JobName|Partition|State|Submit|Start|End|Elapsed|AllocTRES|NodeList\n"
        "11|pearl-base|gpu|COMPLETED|2025-01-01T00:00:00|2025-01-01T00:00:10|"
        "2025-01-01T01:00:10|01:00:00|cpu=8,gres/gpu=8|n1\n",
        encoding="utf-8",
    )
    out = tmp_path / "report"
    code, stdout, err = _analyze(capsys, str(log), "--out", str(out), "--sacct", str(sacct),
                                 "--json")  # fmt: skip
    assert code == 0, err
    accounting = json.loads(stdout)["accounting"]
    assert accounting["jobs"] == 1 and accounting["gpu_hours"]["total"] == pytest.approx(8.0)
    assert "Slurm accounting" in (out / "report.md").read_text()


def test_bench_analyze_prints_events_and_wall_time(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "analyze", "--events", "3000", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["events"] >= 3000 and result["records"] == result["events"]
    assert result["wall_s"] > 0 and result["read_s"] > 0


def _check_report(out: Path, names: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    for name in names:
        stem = name.replace("/", "-")
        for kind in PLOT_KINDS:
            png = out / f"{stem}-{kind}.png"
            assert png.read_bytes()[:4] == b"\x89PNG", png
    for report in ("report.md", "report.html"):
        text = (out / report).read_text()
        assert text.count("data:image/png;base64,") == len(summary["plots"])  # self-contained
    return summary


def test_simulate_then_analyze(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The analysis, computed from the logs alone, agrees with the simulator's own figures."""
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump(TINY_SCENARIO))
    sim_out = tmp_path / "sim"
    # rlboost-plus takes elastic GPUs in these 300 s, so their hours are compared non-zero
    argv = ["simulate", str(scenario), "--policies", "pearl,rlboost-plus", "--seeds", "1"]
    assert main([*argv, "--duration-s", "300", "--out", str(sim_out), "--json"]) == 0
    capsys.readouterr()
    out = tmp_path / "report"
    code, stdout, err = _analyze(capsys, str(sim_out), "--out", str(out), "--json")
    assert code == 0, err
    assert json.loads(stdout) == json.loads((out / "summary.json").read_text())
    names = ["pearl/seed0", "rlboost-plus/seed0"]
    summary = _check_report(out, names)
    assert {"compare-throughput.png", "compare-gpu-hours.png"} <= set(summary["plots"])
    sim = json.loads((sim_out / "summary.json").read_text())
    assert [r["name"] for r in summary["runs"]] == names
    for run in summary["runs"]:
        mine = sim["runs"][run["run"]["policy"]][0]
        assert run["read"]["skipped"] == 0 and run["run"]["duration_s"] == 300.0
        assert run["throughput"]["trajectories"] == mine["trajectories"] > 0
        assert run["throughput"]["throughput_traj_per_h"] == pytest.approx(
            mine["throughput_traj_per_h"]
        )
        # finished trajectories' tokens only; the simulator also counts finished turns of
        # trajectories still running at the end
        assert 0 < run["throughput"]["tokens_per_s"] <= mine["tokens_per_s"] + 1e-9
        assert run["training"]["train_steps_per_h"] == pytest.approx(mine["train_steps_per_h"])
        assert run["pd"]["transitions"] == mine["transitions"]
        src = run["gpu_hours"]["by_source"]
        assert src["base"] == pytest.approx(mine["gpu_hours"]["base"], abs=1e-5)  # 16 GPUs
        assert src["elastic"] == pytest.approx(mine["gpu_hours"]["elastic"], abs=1e-5)
        assert src["borrowed"] == pytest.approx(mine["gpu_hours"]["borrowed"], abs=1e-5)
        times = run["batches"]["batch_time_s"]
        if mine["batch_time_s"]["mean"] is None:
            assert times["mean"] is None
        else:
            assert times["mean"] == pytest.approx(mine["batch_time_s"]["mean"], abs=1e-5)
            assert times["p99"] == pytest.approx(mine["batch_time_s"]["p99"], abs=1e-5)
        # the report rounds seconds to microseconds (``analysis.metrics.rounded``)
        assert run["borrow"]["trainer_wait"]["max_s"] <= mine["max_trainer_wait_s"] + 5e-7
        assert run["borrow"]["trainer_wait"]["max_return_delay_s"] == 30.0  # from run_started
    assert max(sim["runs"]["rlboost-plus"][0]["gpu_hours"]["elastic"], 0) > 0


def test_a_pearl_run_directory_is_one_run_of_both_logs(tmp_path: Path) -> None:
    """``events.jsonl`` (the coordinator's) and ``rollout.jsonl`` (the rollout manager's) of
    one ``pearl run`` directory: one run, the records merged by time, the run's bounds the
    coordinator's; a named file is read alone; ``rollout.jsonl`` alone is a run too."""
    from pearl.analysis.runs import analyze_log

    run = tmp_path / "run"
    run.mkdir()
    start = {"v": 1, "type": "run_started", "run_id": "r", "policy": "pearl"}
    (run / "events.jsonl").write_text(
        json.dumps({**start, "t": 0.0, "source": "coordinator"})
        + "\n"
        + json.dumps({"v": 1, "t": 9.0, "type": "run_ended", "reason": "trained"})
        + "\n"
    )
    (run / "rollout.jsonl").write_text(
        json.dumps({**start, "t": 0.5, "source": "rollout"})
        + "\n"
        + json.dumps({"v": 1, "t": 8.0, "type": "run_ended", "reason": "trained"})
        + "\n"
    )
    (log,) = find_run_logs([run])
    assert log.path == run / "events.jsonl" and log.also == (run / "rollout.jsonl",)
    info = analyze_log(log).summary()["run"]
    assert info["source"] == "coordinator" and info["restarts"] == 0
    (alone,) = find_run_logs([run / "events.jsonl"])
    assert alone.also == ()
    (run / "events.jsonl").unlink()
    (rollout,) = find_run_logs([run])
    assert rollout.path == run / "rollout.jsonl" and rollout.name == "run"
