"""The fuzz suite over the files a run keeps and reads back: the rollout manager's journal
(a resumed run replays it), the spool's batch files (a resumed trainer reads its batch
again), the port file (an agent finds the coordinator by it), ``run.json`` and the
calibration (a requeued run starts from them), and profiles (named by every config).

Each case is a real file of that kind mutated (``mutation.mutated``) or mangled as text;
the property (``surfaces``): the file loads, or one ``InputError`` (a ``JournalError`` for
the journal: the run's command makes it exit 2) names it, never another exception, never
a case past ``HANG_S``. The journal is one a real manager wrote over a reference engine.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from fuzzing import FUZZ
from hypothesis import given
from hypothesis import strategies as st
from mutation import mangled, mutated
from surfaces import bounded, load_or_input_error

from pearl.agents.batches import read_batch
from pearl.agents.journal import JournalError
from pearl.agents.loop import Trajectory
from pearl.control.portfile import PortInfo, port_file_path, read_port_file, write_port_file
from pearl.coordinator.job import run_start_s
from pearl.io.documents import load_profile
from pearl.run.coordinated import read_calibration

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
PROFILE = yaml.safe_load((ROOT / "pearl" / "profiles" / "qwen3-8b.yaml").read_text())
PORT = {"v": 1, **PortInfo("tag#0$port#40000$description#n0$", "n0", 41234, "t" * 43, 7).__dict__}
RUN_JSON = {"started_at_unix_s": 1764000000.5, "slurm_job_ids": ["1234", "1240"]}
CALIBRATION = {"log_factor": 0.4, "batches": 12}


def _trajectory(i: int) -> Trajectory:
    t = Trajectory(f"t{i}", reward=float(i % 2), end_reason="answered")
    t.append([5, 6, 7], generated=False)
    t.append([8, 9], generated=True, logprobs=[-1.0, -2.0], versions=[0, 0])
    return t


BATCH = {
    "batch_id": 3, "policy_version": 2, "group_ids": [0, 0, 1, 1],
    "trajectories": [json.loads(json.dumps(_trajectory(i).__dict__)) for i in range(4)],
    "off_policy_tokens": 2, "max_staleness_versions": 1, "mean_staleness_versions": 0.5,
}  # fmt: skip


def _written(path: Path, doc: Any, *, mode: int = 0o600) -> Path:
    text = yaml.safe_dump(doc, allow_unicode=True) if path.suffix == ".yaml" else json.dumps(doc)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    os.chmod(path, mode)
    return path


def test_the_seed_files_are_valid(tmp_path: Path) -> None:
    """Mutations start from valid files (else every case tests one error)."""
    load_profile(str(_written(tmp_path / "p.yaml", PROFILE)))
    assert read_batch(_written(tmp_path / "batch-000003.json", BATCH)).batch_id == 3
    write_port_file(tmp_path, PortInfo(**{k: v for k, v in PORT.items() if k != "v"}))
    assert read_port_file(tmp_path).knock_port == 41234
    _written(tmp_path / "run.json", RUN_JSON)
    assert run_start_s(tmp_path) == RUN_JSON["started_at_unix_s"]
    assert read_calibration(_written(tmp_path / "c.json", CALIBRATION)).batches == 12


@FUZZ
@given(doc=mutated(PROFILE))
def test_a_mutated_profile_loads_or_names_its_problem(doc: Any, tmp_path: Path) -> None:
    path = _written(tmp_path / "profile.yaml", doc)
    load_or_input_error(lambda: load_profile(str(path)), path)


@FUZZ
@given(doc=mutated(BATCH))
def test_a_mutated_batch_file_loads_or_names_its_problem(doc: Any, tmp_path: Path) -> None:
    path = _written(tmp_path / "batch-000003.json", doc)
    load_or_input_error(lambda: read_batch(path), path)


@FUZZ
@given(data=mangled(json.dumps(BATCH).encode()))
def test_a_mangled_batch_file_loads_or_names_its_problem(data: bytes, tmp_path: Path) -> None:
    path = tmp_path / "batch-000003.json"
    path.write_bytes(data)
    load_or_input_error(lambda: read_batch(path), path)


@FUZZ
@given(doc=st.one_of(mutated(PORT), mangled(json.dumps(PORT).encode())))
def test_a_mutated_port_file_is_read_or_names_its_problem(doc: Any, tmp_path: Path) -> None:
    path = port_file_path(tmp_path)
    if isinstance(doc, bytes):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(doc)
        os.chmod(path, 0o600)
    else:
        _written(path, doc)
    info = load_or_input_error(lambda: read_port_file(tmp_path), path)
    if info is not None:
        assert 0 <= info.knock_port <= 65535 and info.token


@FUZZ
@given(doc=mutated(RUN_JSON))
def test_a_mutated_run_json_is_read_or_names_its_problem(doc: Any, tmp_path: Path) -> None:
    path = _written(tmp_path / "run.json", doc)
    load_or_input_error(lambda: run_start_s(tmp_path), path)


@FUZZ
@given(doc=mutated(CALIBRATION))
def test_a_mutated_calibration_is_read_or_names_its_problem(doc: Any, tmp_path: Path) -> None:
    path = _written(tmp_path / "calibration.json", doc)
    calibration = load_or_input_error(lambda: read_calibration(path), path)
    if calibration is not None:
        assert 0.25 <= calibration.factor <= 8.0 + 1e-9


# -- the rollout manager's journal ------------------------------------------------------


@pytest.fixture(scope="module")
def journal_lines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """The journal of a real manager over one reference engine: two batches taken, one
    update, trajectories running when it closed."""
    from agents.manager_setup import open_manager
    from engine_procs import running_engines

    from pearl.agents.manager import JOURNAL

    run_dir = tmp_path_factory.mktemp("journal-run")
    (run_dir / "logs").mkdir()

    async def run() -> None:
        with running_engines(tiny_model_dir, run_dir / "logs", ["e0"]) as (engine,):
            manager = await open_manager(tiny_model_dir, run_dir / "run", [engine.url])
            manager.start()
            try:
                for _ in range(2):
                    batch = await asyncio.wait_for(manager.next_batch(), 120)
                    await manager.updated(batch.policy_version + 1)
            finally:
                await manager.close()
                await manager.router.aclose()

    asyncio.run(run())
    text = (run_dir / "run" / JOURNAL).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines()]


def _resumed(run_dir: Path, tiny_model_dir: Path) -> None:
    """Open a manager on ``run_dir`` (it replays the journal) with no engine, and close it."""
    from agents.manager_setup import open_manager

    async def run() -> None:
        manager = await open_manager(tiny_model_dir, run_dir, [])
        await manager.close()
        await manager.router.aclose()

    asyncio.run(run())


def test_the_real_journal_replays(
    journal_lines: list[Any], tiny_model_dir: Path, tmp_path: Path
) -> None:
    kinds = {line["e"] for line in journal_lines}
    assert {"start", "admit", "turn", "finish", "batch", "updated"} <= kinds, kinds
    _write_journal(tmp_path, journal_lines)
    _resumed(tmp_path, tiny_model_dir)


def _write_journal(run_dir: Path, lines: list[Any]) -> Path:
    from pearl.agents.manager import JOURNAL

    path = run_dir / JOURNAL
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


@FUZZ
@given(data=st.data())
def test_a_resume_from_a_mutated_journal_replays_or_names_the_line(
    data: st.DataObject, journal_lines: list[Any], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """One event mutated (an interesting kind more often): the manager resumes, or one
    ``JournalError`` names the journal and the line; never another exception."""
    lines = list(journal_lines)
    i = data.draw(st.integers(min_value=0, max_value=len(lines) - 1))
    lines[i] = data.draw(mutated(lines[i]))
    run_dir = tmp_path / "run"
    path = _write_journal(run_dir, lines)
    with bounded(f"resuming from {path}"):
        try:
            _resumed(run_dir, tiny_model_dir)
        except JournalError as err:
            assert "\n" not in str(err) and str(err).startswith(f"{path}:"), str(err)
