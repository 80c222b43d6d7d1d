"""`pearl plan` as a user runs it: a real process, JSON on stdout, clear errors with status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples" / "states").glob("*.json"))


def run_pearl(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pearl.cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_every_example_is_shipped() -> None:
    names = {p.stem for p in EXAMPLES}
    assert {
        "small-homogeneous",
        "large",
        "heterogeneous",
        "waiting-trainer",
        "elastic-grant",
        "elastic-preempted",
    } <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_plan_prints_a_decision(path: Path) -> None:
    proc = run_pearl("plan", path)
    assert proc.returncode == 0, proc.stderr
    decision = json.loads(proc.stdout)
    assert decision["policy"] == "pearl"
    assert decision["selection"]["ranked"], "the logs must explain the choice"
    assert decision["selection"]["best"]["prediction"]["completion_s"] > 0
    assert "select:" in proc.stderr and "plan:" in proc.stderr


def test_waiting_trainer_lends_and_plans_it() -> None:
    decision = json.loads(run_pearl("plan", ROOT / "examples/states/waiting-trainer.json").stdout)
    assert decision["borrow"]["kind"] == "lend"
    actions = [s["action"] for s in decision["plan"]["steps"]]
    assert actions.index("offload") < actions.index("wake")


def test_elastic_grant_starts_engines() -> None:
    decision = json.loads(run_pearl("plan", ROOT / "examples/states/elastic-grant.json").stdout)
    assert decision["switch"]["mandatory"]
    started = [s for s in decision["plan"]["steps"] if s["action"] == "start"]
    assert any(s["node"] == "gpu-e01" for s in started)


def test_preempted_engines_leave_within_the_grace_period() -> None:
    decision = json.loads(run_pearl("plan", ROOT / "examples/states/elastic-preempted.json").stdout)
    steps = [s for s in decision["plan"]["steps"] if s["node"].startswith("elas")]
    assert steps
    assert all(
        200.0 + s["start_s"] + s["duration_s"] <= 260.0
        for s in steps
        if s["action"] in ("drain", "migrate")
    )


def _example() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((ROOT / "examples/states/small-homogeneous.json").read_text())
    return data


def _write(tmp_path: Path, data: Any, name: str = "in.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(data) if name.endswith(".json") else data)
    return p


def _bad_role(d: dict[str, Any]) -> None:
    d["state"]["workers"][0]["role"] = "juggler"


def _bad_count(d: dict[str, Any]) -> None:
    d["state"]["allocations"][0]["num_gpus"] = -3


def _bad_trajectory(d: dict[str, Any]) -> None:
    d["observation"]["workload"]["trajectories"][0]["remaining_turns"] = -1


@pytest.mark.parametrize(
    ("mutate", "field", "problem"),
    [
        pytest.param(_bad_role, "state.workers[0].role", "Input should be", id="unknown-role"),
        pytest.param(
            _bad_count,
            "state.allocations[0].num_gpus",
            "greater than or equal",
            id="negative-count",
        ),
        pytest.param(
            _bad_trajectory,
            "observation.workload.trajectories[0].remaining_turns",
            "greater than or equal",
            id="negative-turns",
        ),
    ],
)
def test_bad_documents_give_one_clear_line(
    tmp_path: Path, mutate: Any, field: str, problem: str
) -> None:
    data = _example()
    mutate(data)
    path = _write(tmp_path, data)
    proc = run_pearl("plan", path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith(f"pearl: error: {path}: {field}: ")
    assert problem in lines[0]


DEEP = "nested more than 32 deep"


@pytest.mark.parametrize(
    ("name", "content", "problem"),
    [
        pytest.param("in.json", "[" * 1500 + "]" * 1500, DEEP, id="deep-json"),
        pytest.param("in.yaml", "a: " + "[" * 40 + "]" * 40, DEEP, id="deep-yaml"),
        pytest.param("in.json", '{"state": {"time_s": NaN}}', "nan is not a finite", id="nan"),
        pytest.param("in.yaml", "state: {time_s: .inf}", "inf is not a finite", id="inf"),
        pytest.param("in.json", '{"x": 1e999}', "inf is not a finite number", id="overflow"),
    ],
)
def test_hostile_documents_give_one_clear_line(
    tmp_path: Path, name: str, content: str, problem: str
) -> None:
    """Every document pearl reads is read one way (``pearl.io.documents.read_document``):
    nesting, non-finite numbers and size are refused there, before any schema."""
    path = tmp_path / name
    path.write_text(content)
    proc = run_pearl("plan", path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"pearl: error: {path}: ") and problem in line, line


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        pytest.param("in.json", '{"state": ', "(document)", id="truncated-json"),
        pytest.param("in.yaml", "state: [unclosed\n", "malformed YAML", id="malformed-yaml"),
    ],
)
def test_malformed_files(tmp_path: Path, name: str, content: str, expected: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    proc = run_pearl("plan", path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert str(path) in proc.stderr and ("malformed" in proc.stderr or expected in proc.stderr)


def test_missing_file(tmp_path: Path) -> None:
    proc = run_pearl("plan", tmp_path / "nope.json")
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == f"pearl: error: {tmp_path / 'nope.json'}: (document): no such file"
    )


def test_profile_missing_a_field(tmp_path: Path) -> None:
    shipped = yaml.safe_load((ROOT / "pearl/profiles/qwen3-8b.yaml").read_text())
    del shipped["costs"]["wake_s"]
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(shipped))
    data = _example()
    data["profile"] = "p.yaml"
    proc = run_pearl("plan", _write(tmp_path, data))
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == f"pearl: error: {tmp_path / 'p.yaml'}: costs.wake_s: Field required"
    )


def test_unknown_policy_in_config(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("switching:\n  rule: sometimes\n")
    proc = run_pearl("plan", ROOT / "examples/states/small-homogeneous.json", "--config", cfg)
    assert proc.returncode == 2
    assert (
        f"{cfg}: switching.rule: unknown name 'sometimes' (known: always, margin, never)"
        in proc.stderr
    )


def test_config_field_error(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("borrowing:\n  max_return_delay_s: -5\n")
    proc = run_pearl("plan", ROOT / "examples/states/small-homogeneous.json", "--config", cfg)
    assert proc.returncode == 2
    assert f"{cfg}: borrowing.max_return_delay_s: Input should be greater than 0" in proc.stderr


def test_unknown_profile_is_reported_against_the_state_file(tmp_path: Path) -> None:
    data = _example()
    data["profile"] = "qwen9"
    path = _write(tmp_path, data)
    proc = run_pearl("plan", path)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"pearl: error: {path}: profile: 'qwen9' is neither a file")


def test_shipped_examples_are_what_the_generator_writes(tmp_path: Path) -> None:
    """examples/states/ is generated by examples/make_states.py; regenerate after changes."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_states", ROOT / "examples/make_states.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(tmp_path)
    for path in EXAMPLES:
        assert (tmp_path / path.name).read_text() == path.read_text(), path.name
