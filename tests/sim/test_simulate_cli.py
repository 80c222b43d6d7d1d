"""``pearl simulate`` end to end on a small scenario: JSON on stdout, summary, logs, errors."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import sim_fixtures as F
import yaml

from pearl.cli.main import main
from pearl.io.documents import InputError
from pearl.runlog.jsonl import ReadStats, read_records
from pearl.sim.baselines import REPORTED
from pearl.sim.predictions import Prediction, prediction_errors
from pearl.sim.report import runs_needed

ENTRY_KEYS = {
    "throughput_traj_per_h",
    "tokens_per_s",
    "train_steps_per_h",
    "gpu_hours",
    "traj_per_gpu_hour",
    "batch_time_s",
    "transitions",
    "max_trainer_wait_s",
    "oracle_fraction",
}


def _scenario_file(tmp_path: Path, **changes: object) -> Path:
    doc = F.scenario_dict(elastic=True, batch=16)
    doc.update(changes)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def test_simulate_json_summary_and_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = _scenario_file(tmp_path)
    out = tmp_path / "out"
    argv = ["simulate", str(scenario), "--seeds", "1", "--duration-s", "300"]
    code = main([*argv, "--out", str(out), "--json", "--jobs", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = captured.out.strip().splitlines()
    assert len(lines) == 1  # one JSON object and nothing else
    result = json.loads(lines[0])
    assert result["scenario"] == "tiny"
    assert list(result["policies"]) == list(REPORTED)
    for name, entry in result["policies"].items():
        if name == "oracle":
            assert entry["oracle_fraction"] == 1.0 and entry["throughput_traj_per_h"] > 0
            continue
        assert set(entry) >= ENTRY_KEYS, name
        assert set(entry["gpu_hours"]) >= {"base", "borrowed", "elastic"}
        assert set(entry["batch_time_s"]) >= {"mean", "p99"}
        # base GPU-hours: 16 GPUs for 300 s
        assert entry["gpu_hours"]["base"] == pytest.approx(16 * 300 / 3600)
        assert 0.0 <= entry["oracle_fraction"] <= 1.0
        assert entry["throughput_traj_per_h"] > 0

    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert summary["policies"] == result["policies"]
    assert summary["duration_s"] == 300.0 and summary["seeds"] == 1
    for name in runs_needed(list(REPORTED)):
        log = out / name / "seed0.jsonl"
        stats = ReadStats()
        records = list(read_records(log, stats))
        assert stats.records == stats.lines > 2, name
        assert (stats.malformed, stats.unknown_type, stats.other_version, stats.invalid) == (
            0,
            0,
            0,
            0,
        )
        assert records[0].type == "run_started" and records[0].policy == name
        assert records[-1].type == "run_ended" and records[-1].t == 300.0
        finished = sum(1 for r in records if r.type == "trajectory_finished")
        assert finished == summary["runs"][name][0]["trajectories"]

    # the same run in this process: the same figures, whatever the processes
    alone = tmp_path / "alone"
    assert main([*argv, "--out", str(alone), "--json", "--jobs", "1", "--policies", "pearl"]) == 0
    serial = json.loads(capsys.readouterr().out)
    assert serial["policies"]["pearl"] == result["policies"]["pearl"]
    assert serial["predictor"] == result["predictor"] and result["predictor"]["n"] > 0
    pearl_log = "pearl/seed0.jsonl"
    assert (alone / pearl_log).read_bytes() == (out / pearl_log).read_bytes()


def test_unknown_policy_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = _scenario_file(tmp_path)
    code = main(["simulate", str(scenario), "--policies", "nope", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 2
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "--policies" in err[0] and "nope" in err[0]
    assert captured.out == ""


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"duration_s": -5}, "duration_s"), ({"surprise": 1}, "surprise")],
)
def test_a_bad_scenario_field_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], changes: dict[str, object], field: str
) -> None:
    scenario = _scenario_file(tmp_path, **changes)
    code = main(["simulate", str(scenario), "--out", str(tmp_path / "out"), "--json"])
    captured = capsys.readouterr()
    assert code == 2
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and str(scenario) in err[0] and field in err[0]
    assert captured.out == ""
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("flag", "value"), [("--seeds", "0"), ("--duration-s", "-1")])
def test_bad_numbers_on_the_command_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    scenario = _scenario_file(tmp_path)
    with pytest.raises(SystemExit) as refused:  # at parsing (pearl.cli.flags)
        main(["simulate", str(scenario), flag, value, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(err) == 1 and flag in err[0]
    assert not (tmp_path / "out").exists()


def test_an_input_error_crosses_a_process_pool_as_one_line() -> None:
    """A run in a worker of ``pearl simulate --jobs`` that meets a bad input raises it to
    the parent, which prints it (``tests/sim/test_data_files.py`` goes through the CLI)."""
    for err in (
        InputError("w.json", "prompt_tokens.values", "-3 is not > 0"),
        InputError.relayed("t.yaml: steps: must be >= 1", by="trainer"),
    ):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is InputError and str(back) == str(err)
        assert (back.path, back.field, back.problem) == (err.path, err.field, err.problem)


def test_bench_predictor_reports_the_error_of_every_decision(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = _scenario_file(tmp_path)
    code = main(["bench", "predictor", str(scenario), "--duration-s", "600", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(captured.out)
    assert result["n"] > 0
    assert 0.0 <= result["mape"] < 10.0
    assert result["scenario"] == "tiny"
    largest = result["largest"]
    assert 1 <= len(largest) <= min(3, result["n"])
    ape = [abs(x["predicted_s"] - x["actual_s"]) / x["actual_s"] for x in largest]
    assert ape == sorted(ape, reverse=True) and ape[0] >= result["mape"]
    # each names its decision: the seed's run, and a time inside it
    assert all(x["seed"] == 0 and 0 <= x["decided_s"] < 600 for x in largest)
    # pearl simulate's predictor entry: the same figures from its own pearl runs
    argv = ["simulate", str(scenario), "--seeds", "1", "--duration-s", "600", "--json"]
    assert main([*argv, "--policies", "pearl", "--out", str(tmp_path / "sim")]) == 0
    predictor = json.loads(capsys.readouterr().out)["predictor"]
    assert predictor == {k: v for k, v in result.items() if k in predictor}


def test_a_decision_at_its_batchs_completion_is_excluded_from_the_error() -> None:
    """An actual time of 0 (the decision fell on the completion) has no relative error;
    counted in ``excluded``, it no longer makes the mean infinite."""
    errors = prediction_errors(
        [
            (0, Prediction(2.0, 0.0, 5.0)),
            (0, Prediction(2.0, 1.0, 9.0)),
            (1, Prediction(3.0, 3.0, 4.0)),
        ]
    )
    assert (errors["n"], errors["excluded"]) == (2, 1)
    assert errors["mape"] == pytest.approx(0.5) and errors["median_ape"] == pytest.approx(0.5)
    assert errors["mean_ratio_predicted_to_actual"] == pytest.approx(1.5)
    assert errors["largest"][0] == {
        "seed": 0,
        "predicted_s": 2.0,
        "actual_s": 1.0,
        "decided_s": 9.0,
    }
    assert prediction_errors([(0, Prediction(1.0, 0.0, 2.0))])["mape"] is None


def test_bench_sim_reports_speed(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "sim", "--gpus", "32", "--sim-hours", "0.02", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(captured.out)
    assert result["gpus"] == 32 and result["sim_hours"] == 0.02
    assert result["wall_s"] > 0 and result["events_per_s"] > 0
    assert result["engine_model"] == "fluid" and result["cpu_s"] > 0
    step = ["bench", "sim", "--gpus", "32", "--sim-hours", "0.02", "--engine-model", "step"]
    assert main([*step, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["engine_model"] == "step"
    assert main(["bench", "sim", "--gpus", "8", "--json"]) == 2
