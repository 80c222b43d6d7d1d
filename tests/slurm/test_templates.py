"""The sbatch templates on the dev cluster: the coordinator job requeues itself on Slurm's
warning and resumes its journal; the heterogeneous base job starts both components."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from slurm_cluster import REPO, DevCluster, dev_cluster, wait_for

from pearl.coordinator.journal import replay


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    for c in dev_cluster(tmp_path_factory, port_base="24800"):
        c.env["PEARL"] = str(REPO / ".venv" / "bin" / "pearl")  # the templates' $PEARL
        c.env["PEARL_PYTHON"] = str(REPO / ".venv" / "bin" / "python")
        yield c


def test_coordinator_sbatch_requeues_itself_on_the_warning(
    cluster: DevCluster, tmp_path: Path
) -> None:
    config = tmp_path / "coordinator.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "schema_version": 1,
                "run_id": "tpl",
                "run_dir": "run",
                "profile": "qwen3-8b",
                "backend": "local",
                "gpus_per_node": {"h800": 8},
                "decision_interval_s": 0.5,
                "base": {"trainer": [{"name": "h800-1", "gpu_type": "h800", "num_gpus": 4}]},
                "policy": {"elastic": {"rule": "never"}, "borrowing": {"rule": "never"}},
            }
        ),
        encoding="utf-8",
    )
    job_id = cluster.sbatch(
        "-o",
        str(tmp_path / "coord-%j.out"),
        str(REPO / "slurm" / "coordinator.sbatch"),
        str(config),
    )
    journal = tmp_path / "run" / "journal.jsonl"
    wait_for(lambda: journal.exists() and replay(journal).num_records >= 1, 60, "a tick", cluster)
    before = replay(journal).num_records
    # Slurm's warning, as before the time limit or at a preemption (--signal=B:USR2)
    cluster.run("scancel", "--batch", "--signal=USR2", job_id)
    cluster.start_requeued(job_id)
    wait_for(lambda: cluster.restarts(job_id) >= 1, 60, "the next incarnation", cluster)
    wait_for(lambda: replay(journal).num_records > before, 60, "its journal records", cluster)
    assert replay(journal).state is not None
    cluster.run("scancel", job_id)


def test_base_job_starts_both_components(cluster: DevCluster, tmp_path: Path) -> None:
    job_id = cluster.sbatch(
        "-o",
        str(tmp_path / "base-%j.out"),
        str(REPO / "slurm" / "base-job.sbatch"),
        str(tmp_path / "run"),
    )
    wait_for(
        lambda: cluster.run("squeue", "-h", "-j", job_id, "-o", "%i %T").count("RUNNING") == 2,
        30,
        "both components running",
        cluster,
    )
    components = cluster.run("squeue", "-h", "-j", job_id, "-o", "%i %N").split()
    assert f"{job_id}+0" in components and f"{job_id}+1" in components
    cluster.run("scancel", job_id)


def _run_config(tmp_path: Path, **sections: object) -> Path:
    """A small ``pearl run`` on the dev cluster (elastic rule: never), with ``sections``."""
    doc = {
        "run_dir": "out",
        "cluster": "slurm",
        "env": {"name": "single_digit", "operators": "+", "max_turns": 1},
        "rollout": {"group_size": 4, "batch_trajectories": 64, "max_tokens": 16},
        "coordinator": {"decision_interval_s": 0.5},
        **sections,
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return config


def test_pearl_run_sbatch_trains_and_requeues_itself_on_the_warning(
    cluster: DevCluster, tmp_path: Path
) -> None:
    """``sbatch slurm/pearl-run.sbatch CONFIG``: the run trains in its job; Slurm's warning
    (USR2) after its first update stops it cleanly and requeues the job; the next
    incarnation resumes and trains the rest, every update once."""
    for module in ("torch", "mpi4py", "submitit"):
        pytest.importorskip(module)
    config = _run_config(tmp_path, trainer={"steps": 3})
    job_id = cluster.sbatch(
        "-o",
        str(tmp_path / "run-%j.out"),
        str(REPO / "slurm" / "pearl-run.sbatch"),
        str(config),
    )
    rollout = tmp_path / "out" / "rollout.jsonl"

    def versions() -> list[int]:
        text = rollout.read_text() if rollout.exists() else ""
        lines = [line for line in text.splitlines() if '"train_step"' in line]
        return [int(line.split('"policy_version":')[1].split(",")[0]) for line in lines]

    wait_for(lambda: versions(), 180, "the first update", cluster)
    cluster.run("scancel", "--batch", "--signal=USR2", job_id)  # Slurm's warning
    cluster.start_requeued(job_id)
    wait_for(lambda: cluster.restarts(job_id) >= 1, 60, "the next incarnation", cluster)
    state = cluster.wait_sacct(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240)
    out = "".join(p.read_text(errors="replace") for p in tmp_path.glob("run-*.out"))
    assert state == "COMPLETED", out[-3000:]
    assert versions() == [1, 2, 3], out[-3000:]
    assert "stopped by SIGUSR2; the same command resumes it" in out


def _records(path: Path) -> list[dict[str, object]]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):  # a line being written
            out.append(json.loads(line))
    return out


def test_pearl_run_sbatch_as_a_heterogeneous_job_serves_on_its_rollout_node(
    cluster: DevCluster, tmp_path: Path
) -> None:
    """``sbatch [run] : [rollout] slurm/pearl-run.sbatch CONFIG`` with ``slurm.rollout``: the
    second component's node runs an agent (``--rollout-agent``), the plans start engines
    there (``rollout-1``) and they serve turns while the run trains; then ``scancel`` ends
    the run for good (``run_ended``: cancelled) instead of leaving it to a requeue."""
    for module in ("torch", "mpi4py", "submitit"):
        pytest.importorskip(module)
    rollout = {"nodes": 1, "gpu_type": "h800", "gpus_per_node": 2}
    config = _run_config(
        tmp_path,
        trainer={"steps": 50},  # scancel comes first
        slurm={"profile_gpu_types": {"h20": "cpu", "h800": "cpu"}, "rollout": rollout},
    )
    run = ("-w", "h800-1", "--gres=gpu:h800:3", "-o", str(tmp_path / "run-%j.out"))
    nodes = ("-p", "train", "-w", "h800-2", "--gres=gpu:h800:2", "-o", str(tmp_path / "agent.out"))
    script = (str(REPO / "slurm" / "pearl-run.sbatch"), str(config))
    job_id = cluster.sbatch(*run, ":", *nodes, *script)
    out = tmp_path / "out"

    def served_there() -> int:
        turns = [r for r in _records(out / "rollout.jsonl") if r["type"] == "turn_ended"]
        there = {"e-rollout-1-0", "e-rollout-1-1"}  # not a base slot's (e-rollout-1, -1-2, ..)
        return sum(bool(there.intersection(t["served_by"])) for t in turns)  # type: ignore[arg-type]

    def trained() -> int:
        return sum(r["type"] == "train_step" for r in _records(out / "rollout.jsonl"))

    wait_for(lambda: served_there() > 0 and trained() > 0, 240, "turns on rollout-1", cluster)
    agents = json.loads((out / "agents.json").read_text())
    assert any(a["node"] == "rollout-1" and a["state"] == "alive" for a in agents), agents
    cluster.run("scancel", job_id)
    state = cluster.wait_sacct(job_id, {"CANCELLED", "COMPLETED", "FAILED"}, timeout=60)
    assert state == "CANCELLED"
    wait_for(lambda: _records(out / "events.jsonl")[-1]["type"] == "run_ended", 30, "its end")
    assert _records(out / "events.jsonl")[-1]["reason"] == "cancelled"
    print(f"rollout-1 served {served_there()} turns; {trained()} updates before the scancel")
