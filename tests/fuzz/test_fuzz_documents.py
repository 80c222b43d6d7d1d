"""The fuzz suite over pearl's input documents: plan states and policy configs (through
``pearl plan``), scenarios, coordinator configs, run configs, the coordinator's journal
and ``pearl``'s flags.

Each case is a valid shipped or test document mutated (``mutation.mutated``) or mangled
as text; the property (``surfaces``): exit 0, or exit 2 with one line naming the file
(for a loader: the document, or one ``InputError`` naming it), never a traceback, never a
case past ``HANG_S``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from fuzzing import FUZZ
from hypothesis import given
from hypothesis import strategies as st
from mutation import mangled, mutated
from sim.sim_fixtures import scenario_dict
from surfaces import assert_one_line_error, load_or_input_error, run_pearl

from pearl.bench.synth import Layout, build_state
from pearl.coordinator.config import initial_state, load_config
from pearl.coordinator.journal import Journal, replay
from pearl.core.config import PolicyConfig
from pearl.io.scenarios import load_scenario_and_profile
from pearl.run.config import RunConfig, load_run_config

ROOT = Path(__file__).resolve().parents[2]
STATES = sorted(p for p in (ROOT / "examples" / "states").glob("*.json") if p.stem != "large")

COORDINATOR: dict[str, Any] = {
    "schema_version": 1,
    "run_id": "t1",
    "run_dir": "run",
    "profile": "qwen3-8b",
    "backend": "local",
    "gpus_per_node": {"h800": 8},
    "base": {
        "trainer": [{"name": "n0", "gpu_type": "h800", "num_gpus": 8}],
        "rollout": [{"name": "n1", "gpu_type": "h20", "num_gpus": 8}],
    },
    "policy": {"elastic": {"rule": "greedy", "gpu_type": "h800", "max_allocations": 1}},
}
SCENARIO = scenario_dict(duration_s=300.0, elastic=True)  # tiny: 1 trainer, 1 rollout node


def _write(path: Path, doc: Any) -> Path:
    if path.suffix == ".json":
        path.write_text(json.dumps(doc), encoding="utf-8")  # NaN, Infinity as JSON has them
    else:
        path.write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    return path


def _write_text(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


STATE_DOCS = [json.loads(p.read_text()) for p in STATES]


def test_the_seed_documents_are_valid(tmp_path: Path) -> None:
    """Mutations start from valid documents (else every case tests one error)."""
    for state in STATES:
        assert run_pearl(["plan", str(state)]).code == 0, state
    load_scenario_and_profile(_write(tmp_path / "scenario.yaml", SCENARIO))
    initial_state(load_config(_write(tmp_path / "coordinator.yaml", COORDINATOR))[0])
    load_run_config(_write(tmp_path / "run.yaml", RunConfig().model_dump(mode="json")))
    policy = _write(tmp_path / "policy.yaml", PolicyConfig().model_dump(mode="json"))
    assert run_pearl(["plan", str(STATES[0]), "--config", str(policy)]).code == 0


@FUZZ
@given(doc=st.sampled_from(STATE_DOCS).flatmap(mutated))
def test_plan_on_a_mutated_state(doc: Any, tmp_path: Path) -> None:
    path = _write(tmp_path / "state.json", doc)
    assert_one_line_error(run_pearl(["plan", str(path)]), path)


@FUZZ
@given(data=st.sampled_from([p.read_bytes() for p in STATES]).flatmap(mangled))
def test_plan_on_a_mangled_state_file(data: bytes, tmp_path: Path) -> None:
    path = _write_text(tmp_path / "state.json", data)
    assert_one_line_error(run_pearl(["plan", str(path)]), path)


@FUZZ
@given(doc=mutated(PolicyConfig().model_dump(mode="json")))
def test_plan_with_a_mutated_policy_config(doc: Any, tmp_path: Path) -> None:
    path = _write(tmp_path / "policy.yaml", doc)
    outcome = run_pearl(["plan", str(STATES[0]), "--config", str(path)])
    assert_one_line_error(outcome, path)


@FUZZ
@given(doc=mutated(SCENARIO))
def test_a_mutated_scenario_loads_or_names_its_problem(doc: Any, tmp_path: Path) -> None:
    path = _write(tmp_path / "scenario.yaml", doc)
    load_or_input_error(lambda: load_scenario_and_profile(path), path)


@FUZZ
@given(doc=mutated(COORDINATOR))
def test_a_mutated_coordinator_config_loads_or_names_its_problem(doc: Any, tmp_path: Path) -> None:
    path = _write(tmp_path / "coordinator.yaml", doc)
    loaded = load_or_input_error(lambda: load_config(path), path)
    if loaded is not None:
        initial_state(loaded[0])  # what the coordinator builds first from it


@FUZZ
@given(doc=mutated(RunConfig().model_dump(mode="json")))
def test_a_mutated_run_config_loads_or_names_its_problem(doc: Any, tmp_path: Path) -> None:
    path = _write(tmp_path / "run.yaml", doc)
    load_or_input_error(lambda: load_run_config(path), path)


def _journal(path: Path) -> bytes:
    state = build_state(Layout(1, 2, 1))
    with Journal(path) as j:
        j.state(state, t=0.0)
        j.intent("a1", "submit", t=1.0, allocation_id="el0001", num_gpus=8)
        j.done("a1", t=3.0)
        j.state(state.evolve(time_s=5.0, policy_version=3), t=5.0)
    return path.read_bytes()


@pytest.fixture(scope="module")
def journal_lines(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    data = _journal(tmp_path_factory.mktemp("journal") / "journal.jsonl")
    return [json.loads(line) for line in data.splitlines()]


@FUZZ
@given(data=st.data())
def test_replay_of_a_mutated_journal(
    data: st.DataObject, journal_lines: list[Any], tmp_path: Path
) -> None:
    """A corrupt record is one ``InputError`` naming the journal and the line; a torn last
    line is dropped (the crash-while-writing case, documented as tolerated)."""
    lines = list(journal_lines)
    i = data.draw(st.integers(min_value=0, max_value=len(lines) - 1))
    lines[i] = data.draw(mutated(lines[i]))
    text = "".join(json.dumps(line) + "\n" for line in lines).encode()
    if data.draw(st.booleans()):
        text = data.draw(mangled(text))
    path = _write_text(tmp_path / "journal.jsonl", text)
    load_or_input_error(lambda: replay(path), path)


FLAG_VALUES = ["nan", "inf", "-1", "1e300", "0", "1e9", "x", "", "10" * 30]


@FUZZ
@given(
    command=st.sampled_from(
        [
            ["simulate", "SCENARIO", "--duration-s"],
            ["simulate", "SCENARIO", "--seeds"],
            ["bench", "sim", "--gpus"],
            ["bench", "sim", "--sim-hours"],
            ["bench", "decide", "--gpus"],
            ["bench", "decide", "--repeats"],
            ["coordinator", "CONFIG", "--max-runtime-s"],
            ["run", "--steps"],
            ["engine", "serve", "--model", "m", "--port"],
            ["model", "init", "OUT", "--layers"],
        ]
    ),
    value=st.sampled_from(FLAG_VALUES),
)
def test_bad_flag_values_are_one_line_and_exit_2(command: list[str], value: str) -> None:
    """Refused at parsing, before the command starts: nothing runs (``--duration-s nan``
    once ran the simulator forever)."""
    if (command[-1], value) == ("--port", "0"):
        return  # in bounds (any free port): the command would run
    outcome = run_pearl([*command, value])
    assert outcome.code == 2, outcome
    assert len(outcome.err.splitlines()) == 1, outcome.err
    assert command[-1] in outcome.err
