"""pearl's data files: the shipped ones (sources, size, the wheel, what the raw traces give),
the formats' one-line errors, and scenarios that name their own files or the raw traces."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import sim_fixtures as F
import yaml
from trace_files import traces_or_skip

from pearl.cli.main import main
from pearl.io.data_files import (
    COMPONENTS,
    SHIPPED_WINDOWS,
    SHIPPED_WORKLOAD,
    read_windows,
    read_workload_samples,
    shipped,
)
from pearl.io.documents import InputError
from pearl.io.scenarios import load_scenario_and_profile
from pearl.io.simulation import run_inputs, trace_windows, trajectory_model
from pearl.io.traces import HELIOS_VC, fit_trajectory_model_from, helios_windows
from pearl.sim.availability import open_gpus_at
from pearl.sim.trajectories import fit_trajectory_model, means

REPO = Path(__file__).resolve().parents[2]
DERIVE = REPO / "benchmarks" / "derive_data.py"
SHIPPED = (SHIPPED_WORKLOAD, SHIPPED_WINDOWS)
RAW = "the shipped data is compared with what the raw traces give"
REDISTRIBUTABLE = {"MIT", "CC-BY-4.0", "Apache-2.0"}


# --- the shipped files -------------------------------------------------------------------


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_files_name_sources_licences_and_their_command(name: str) -> None:
    doc = json.loads(shipped(name).read_text(encoding="utf-8"))
    assert doc["sources"], name
    for source in doc["sources"]:
        assert source["licence"] in REDISTRIBUTABLE, source
        assert source["repository"].count("/") == 1 and len(source["commit"]) >= 8, source
    assert doc["regenerate"].split()[1] == "benchmarks/derive_data.py" and DERIVE.is_file()


def test_shipped_data_is_compact() -> None:
    total_bytes = sum(shipped(name).stat().st_size for name in SHIPPED)
    assert total_bytes < 300_000  # the "a few hundred KB in all at most"


def test_shipped_helios_windows_are_the_documented_ones() -> None:
    windows = read_windows(shipped(SHIPPED_WINDOWS), gpu_type="v100", min_duration_s=600.0)
    assert len(windows) == 42  # docs/simulator.md, the scenarios' [helios]
    assert all(w.num_gpus % 8 == 0 and w.duration_s >= 600.0 for w in windows)
    every = read_windows(shipped(SHIPPED_WINDOWS), gpu_type="v100", min_duration_s=0.0)
    assert len(every) > len(windows)
    # never more than the 56 GPUs of the virtual cluster open at once
    assert max(open_gpus_at(every, w.start_s) for w in every) <= 56


def test_shipped_workload_has_the_documented_observations() -> None:
    observed = read_workload_samples(shipped(SHIPPED_WORKLOAD))
    counts = {name: observed[kw].size for name, kw in COMPONENTS.items()}
    # docs/simulator.md "Trajectories": 48 sessions, 31,397 requests, 272 observations, 27 calls
    assert counts == {
        "turns_per_trajectory": 48,
        "prompt_tokens": 31_397,
        "observation_tokens": 272,
        "output_tokens": 31_397,
        "tool_latency_s": 27,
    }
    model = fit_trajectory_model(**observed)
    assert means(model).turns_per_trajectory == pytest.approx(6.3125)


def test_an_installed_wheel_carries_the_data(tmp_path: Path) -> None:
    """Build the wheel from a copy of the sources: pearl/data is package data."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for package in ("pearl", "analysis"):
        shutil.copytree(REPO / package, src / package, ignore=ignore)
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    done = subprocess.run([*argv, "-w", str(tmp_path), str(src)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("pearl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"pearl/data/{name}" for name in SHIPPED} <= names
    assert "pearl/profiles/qwen3-8b.yaml" in names
    assert "pearl/data/tokenizer_corpus.txt" in names  # pearl model init trains on it


# --- equal to what the raw traces give (skipped without them) ----------------------------


def test_shipped_files_are_what_derive_data_writes(tmp_path: Path) -> None:
    traces = traces_or_skip(RAW)
    argv = [sys.executable, str(DERIVE), "--traces-dir", str(traces), "--out", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    for name in SHIPPED:
        assert (tmp_path / name).read_bytes() == shipped(name).read_bytes(), name
    # --check says so, and catches a file that differs
    check = [sys.executable, str(DERIVE), "--traces-dir", str(traces), "--check"]
    assert subprocess.run([*check, "--out", str(tmp_path)], capture_output=True).returncode == 0
    (tmp_path / SHIPPED_WINDOWS).write_text("{}\n")
    assert subprocess.run([*check, "--out", str(tmp_path)], capture_output=True).returncode == 1


def test_shipped_data_gives_the_raw_traces_model_and_windows() -> None:
    traces = traces_or_skip(RAW)
    observed = read_workload_samples(shipped(SHIPPED_WORKLOAD))
    assert fit_trajectory_model(**observed) == fit_trajectory_model_from(traces)
    for min_duration_s in (0.0, 60.0, 600.0, 3600.0):
        kw: dict[str, Any] = {"gpu_type": "h800", "min_duration_s": min_duration_s}
        from_file = read_windows(shipped(SHIPPED_WINDOWS), **kw)
        assert from_file == helios_windows(traces / HELIOS_VC, **kw), min_duration_s


def test_a_scenario_can_read_the_raw_traces(tmp_path: Path) -> None:
    traces = traces_or_skip(RAW)
    doc = _trace_scenario()
    doc["rollout"]["traces_dir"] = "$PEARL_TRACES"
    doc["elastic"]["trace"]["idle_series_file"] = f"$PEARL_TRACES/{HELIOS_VC}"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PEARL_TRACES", str(traces))
        research = _load(tmp_path, doc)
    default = _load(tmp_path, _trace_scenario())
    assert research.rollout.traces_dir == str(traces.resolve())
    assert trajectory_model(research.rollout) == trajectory_model(default.rollout)
    assert research.elastic.trace is not None and default.elastic.trace is not None
    assert trace_windows(research.elastic.trace) == trace_windows(default.elastic.trace)


# --- users' own files ----------------------------------------------------------------------


def _trace_scenario() -> dict[str, Any]:
    doc = F.scenario_dict(elastic=True, batch=16)
    doc["elastic"] = {
        "source": "trace",
        "trace": {"gpu_type": F.ELASTIC_GPU, "min_duration_s": 60.0},
        "queue_delay_median_s": 5.0,
        "grace_s": 30.0,
    }
    return doc


def _load(tmp_path: Path, doc: dict[str, Any], name: str = "scenario.yaml") -> Any:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return load_scenario_and_profile(path)[0]


def _samples(values: list[float], counts: list[int] | None = None) -> dict[str, Any]:
    return {"values": values, "counts": counts or [1] * len(values)}


def _workload_doc() -> dict[str, Any]:
    return {
        "format": "pearl.workload_samples",
        "schema_version": 1,
        "turns_per_trajectory": _samples([2, 3], [3, 1]),
        "prompt_tokens": _samples([100, 300]),
        "observation_tokens": _samples([20, 60]),
        "output_tokens": _samples([40, 80]),
        "tool_latency_s": _samples([0.5, 1.5]),
    }


def _windows_doc(*rows: tuple[float, float, int]) -> dict[str, Any]:
    return {
        "format": "pearl.availability_windows",
        "schema_version": 1,
        "windows": [{"start_s": a, "end_s": b, "num_gpus": n} for a, b, n in rows],
    }


def test_a_scenario_reads_its_own_files_relative_to_itself(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "mine.json").write_text(json.dumps(_workload_doc()))
    windows = _windows_doc((0.0, 50.0, 8), (100.0, 400.0, 16), (1000.0, 5000.0, 8))
    (data / "sacct-windows.json").write_text(json.dumps(windows))
    doc = _trace_scenario()
    doc["rollout"]["workload_file"] = "data/mine.json"
    doc["elastic"]["trace"].update(windows_file="data/sacct-windows.json", offset_s=200.0)
    scenario = _load(tmp_path, doc)
    inputs = run_inputs(scenario, F.profile(), seed=0)
    # the 50 s window is below min_duration_s; the others move to run time (offset 200 s),
    # the last one open past the run's end (900 s): the end is not its owner's reclaim
    assert [(w.start_s, w.end_s, w.num_gpus) for w in inputs.windows] == [
        (0.0, 200.0, 16),
        (800.0, 4800.0, 8),
    ]
    m = means(inputs.trajectory_model)
    assert m.turns_per_trajectory == pytest.approx(2.25)  # (3 x 2 + 3) / 4
    assert 200.0 <= m.prompt_tokens < 300.0  # the body's mean, plus the capped tail's share


def test_simulate_runs_on_a_users_own_files(tmp_path: Path) -> None:
    (tmp_path / "w.json").write_text(json.dumps(_workload_doc()))
    (tmp_path / "a.json").write_text(json.dumps(_windows_doc((0.0, 4000.0, 8))))
    doc = _trace_scenario()
    doc["rollout"]["workload_file"] = "w.json"
    doc["elastic"]["trace"]["windows_file"] = str(tmp_path / "a.json")
    path = tmp_path / "own.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    argv = ["simulate", str(path), "--policies", "pearl", "--seeds", "1", "--duration-s", "300"]
    assert main([*argv, "--out", str(tmp_path / "out"), "--json"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["runs"]["pearl"][0]["trajectories"] > 0


# --- one-line errors -----------------------------------------------------------------------


def _broken(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    *parents, last = path.split(".")
    node = doc
    for key in parents:
        node = node[key]
    node[last] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "field", "problem"),
    [
        pytest.param("format", "nope", "format", "expected 'pearl.workload_samples'", id="format"),
        pytest.param(
            "prompt_tokens.counts", [1], "prompt_tokens.counts", "1 counts for 2", id="misaligned"
        ),
        pytest.param(
            "output_tokens.values", [40.5, 80], "output_tokens.values[0]", "whole", id="fraction"
        ),
        pytest.param(
            "tool_latency_s.values",
            [0.5, float("nan")],
            "tool_latency_s.values[1]",
            "finite",
            id="nan",
        ),
        pytest.param(
            "tool_latency_s.values",
            [1.0, 1.0],
            "tool_latency_s.values",
            "2 distinct",
            id="constant",
        ),
        pytest.param(
            "prompt_tokens.counts",
            [0, 1],
            "prompt_tokens.counts[0]",
            "greater than or equal to 1",
            id="zero-count",
        ),
        pytest.param(
            "turns_per_trajectory.counts",
            [10**7, 10**7],
            "turns_per_trajectory.counts",
            "more than 10,000,000",
            id="too-many",
        ),
    ],
)
def test_a_bad_workload_file_names_file_and_field(
    tmp_path: Path, path: str, value: Any, field: str, problem: str
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_broken(_workload_doc(), path, value)))
    with pytest.raises(InputError) as err:
        read_workload_samples(bad)
    assert err.value.path == str(bad) and err.value.field == field
    assert problem in err.value.problem and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("row", "field", "problem"),
    [
        pytest.param((10.0, 5.0, 8), "windows[0].end_s", "not after start_s", id="backwards"),
        pytest.param((0.0, 5.0, 12), "windows[0].num_gpus", "multiple of 8", id="partial-node"),
        pytest.param(
            (-1.0, 5.0, 8), "windows[0].start_s", "greater than or equal to 0", id="negative"
        ),
    ],
)
def test_a_bad_windows_file_names_file_and_field(
    tmp_path: Path, row: tuple[float, float, int], field: str, problem: str
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_windows_doc(row)))
    with pytest.raises(InputError) as err:
        read_windows(bad, gpu_type="h800", min_duration_s=0.0)
    assert err.value.field == field and problem in err.value.problem


@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        pytest.param(
            ("rollout", "workload_file", "missing.json"),
            "rollout.workload_file",
            "no such file",
            id="missing",
        ),
        pytest.param(
            ("rollout", "traces_dir", "$PEARL_NOT_SET_HERE"),
            "rollout.traces_dir",
            "not set",
            id="unset-variable",
        ),
        pytest.param(
            ("trace", "idle_series_file", "x.csv"),
            "elastic.trace.idle_series_file",
            "given with windows_file",
            id="two-sources",
        ),
    ],
)
def test_a_bad_data_path_is_one_line_and_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    change: tuple[str, str, str],
    field: str,
    problem: str,
) -> None:
    doc = _trace_scenario()
    section, key, value = change
    if section == "trace":
        doc["elastic"]["trace"].update({key: value, "windows_file": "w.json"})
    else:
        doc["rollout"][key] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    code = main(["simulate", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert str(path) in err[0] and field in err[0] and problem in err[0], err[0]


@pytest.mark.parametrize(
    "command",
    [
        ["simulate", "--jobs", "1"],
        ["simulate", "--jobs", "2"],  # read in a worker of the pool: the line crosses back
        ["sweep", "--jobs", "2", "--vary", "seeds=1", "--duration-s", "60"],
    ],
    ids=["simulate-serial", "simulate-pool", "sweep-pool"],
)
def test_a_broken_shipped_style_file_reached_from_the_cli_exits_2(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "w.json"
    bad.write_text(json.dumps(_broken(_workload_doc(), "prompt_tokens.values", [100, -3])))
    doc = _trace_scenario()
    doc["rollout"]["workload_file"] = "w.json"
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    code = main([command[0], str(path), *command[1:], "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert str(bad) in err[0] and "prompt_tokens.values[1]" in err[0]
