"""``pearl run`` end to end on small settings: engines, router, rollout manager and trainer
as the command runs them; the run directory's files; the run log that ``pearl analyze``
reads; a second command on the same folder resumes where the first stopped; a bad
configuration is one line and exit status 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from pearl.runlog.jsonl import read_records

SMALL = """\
rollout: {group_size: 4, batch_trajectories: 8, max_tokens: 8}
engines: {count: 2}
trainer: {steps: 3}
coordinator: {enabled: false}
"""


def _pearl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pearl.cli.main", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_pearl_run_trains_logs_and_resumes(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text(SMALL + "run_dir: out\n", encoding="utf-8")
    first = _pearl("run", "run.yaml", "--json", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    doc = json.loads(first.stdout)
    assert doc["steps"] == 3 and len(doc["reward_mean_per_step"]) == 3
    out = tmp_path / "out"
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == "step-000003"
    assert (out / "weights" / "v000003" / "model.safetensors").exists()
    assert (out / "workload.json").exists() and (out / "logs").is_dir()
    steps = [r for r in read_records(out / "rollout.jsonl") if r.type == "train_step"]
    assert [(s.step, s.policy_version) for s in steps] == [(0, 1), (1, 2), (2, 3)]
    assert all(s.reward_mean is not None and s.loss is not None for s in steps)
    assert [round(s.reward_mean or 0, 4) for s in steps] == doc["reward_mean_per_step"]

    again = _pearl("run", "run.yaml", "--steps", "5", "--json", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout)["steps"] == 2  # steps 3 and 4: it resumed
    steps = [r for r in read_records(out / "rollout.jsonl") if r.type == "train_step"]
    assert [s.policy_version for s in steps] == [1, 2, 3, 4, 5]

    analyzed = _pearl("analyze", str(out / "rollout.jsonl"), "--json", cwd=tmp_path)
    assert analyzed.returncode == 0, analyzed.stderr[-3000:]
    (run,) = json.loads(analyzed.stdout)["runs"]
    assert run["rollout_turns"]["turns"] > 0

    # a corrupt latest checkpoint: named in one line, exit 2, and nothing is removed
    weights = out / "checkpoints" / "step-000005" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    corrupt = _pearl("run", "run.yaml", "--steps", "6", "--json", cwd=tmp_path)
    assert corrupt.returncode == 2, corrupt.stderr[-3000:]
    assert corrupt.stderr.strip().count("\n") == 0, corrupt.stderr
    assert f"{weights}: (document): not a safetensors file" in corrupt.stderr
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == ["step-000004", "step-000005"]


def _trainer_pid(config_file: Path) -> int | None:
    """The pid of the ``pearl trainer serve`` process started with ``config_file``."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and str(config_file).encode() in argv:
            return int(proc.name)
    return None


def test_a_killed_trainer_process_is_restarted_and_no_update_is_lost(tmp_path: Path) -> None:
    """SIGKILL to the trainer's process mid-run: the run starts another, which resumes
    from the last checkpoint and trains every step once (the versions 1..6, in order)."""
    (tmp_path / "run.yaml").write_text(
        SMALL.replace("steps: 3", "steps: 6") + "run_dir: out\n", encoding="utf-8"
    )
    out = tmp_path / "out"
    err = (tmp_path / "stderr.txt").open("wb")  # a file, not a pipe nobody reads meanwhile
    run = subprocess.Popen(
        [sys.executable, "-m", "pearl.cli.main", "run", "run.yaml", "--json"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoints" / "step-000002").exists():
            assert run.poll() is None and time.monotonic() < deadline, "no step 2"
            time.sleep(0.1)
        pid = _trainer_pid(out / "logs" / "trainer-config.json")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        stdout, _ = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
        err.close()
    stderr = (tmp_path / "stderr.txt").read_text(errors="replace")
    assert run.returncode == 0, stderr[-3000:]
    doc = json.loads(stdout)
    assert doc["trainer_restarts"] == 1 and "trainer's process was lost" in stderr
    steps = [r for r in read_records(out / "rollout.jsonl") if r.type == "train_step"]
    assert [s.policy_version for s in steps] == [1, 2, 3, 4, 5, 6]
    assert _trainer_pid(out / "logs" / "trainer-config.json") is None  # stopped at the end


def test_a_resume_under_another_seed_is_refused_in_one_line(tmp_path: Path) -> None:
    """The rollout's journal keeps the run's seed: a resume that changes it is refused
    before any engine starts, naming the field."""
    (tmp_path / "run.yaml").write_text(SMALL + "run_dir: out\n", encoding="utf-8")
    journal = tmp_path / "out" / "rollout" / "journal.jsonl"
    journal.parent.mkdir(parents=True)
    start = {"e": "start", "t": 0.0, "run_started_unix_s": 1.0, "seed": 5}
    journal.write_text(json.dumps(start) + "\n", encoding="utf-8")
    bad = _pearl("run", "run.yaml", "--json", cwd=tmp_path)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "journal.jsonl:1: field 'rules'" in bad.stderr
    assert not (tmp_path / "out" / "logs").exists()  # no engine started


def test_a_bad_run_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("rollout: {group_size: 3, batch_trajectories: 8}\n")
    bad = _pearl("run", "bad.yaml", cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "bad.yaml: rollout" in bad.stderr and "multiple of group_size" in bad.stderr
    (tmp_path / "env.yaml").write_text("env: {name: no_such_env}\n")
    bad = _pearl("run", "env.yaml", cwd=tmp_path)
    assert bad.returncode == 2 and "env.yaml: env.name: unknown environment" in bad.stderr


def test_every_config_field_is_documented() -> None:
    """docs/run.md's table names every field of the configuration (and no other)."""
    from pearl.run.config import RunConfig

    def fields(model: type, prefix: str = "") -> set[str]:
        out = set()
        for name, info in model.model_fields.items():  # type: ignore[attr-defined]
            sub = info.annotation
            if hasattr(sub, "model_fields") and name != "optimizer":
                out |= fields(sub, f"{prefix}{name}.")
            else:
                out.add(f"{prefix}{name}")
        return out

    doc = (Path(__file__).parents[2] / "docs" / "run.md").read_text(encoding="utf-8")
    table = {line.split("`")[1] for line in doc.splitlines() if line.startswith("| `")}
    assert table == fields(RunConfig)
