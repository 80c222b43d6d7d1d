"""The sbatch templates on the dev cluster: the coordinator job requeues itself on Slurm's
warning and resumes its journal; the heterogeneous base job starts both components."""

from __future__ import annotations

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


def test_pearl_run_sbatch_trains_and_requeues_itself_on_the_warning(
    cluster: DevCluster, tmp_path: Path
) -> None:
    """``sbatch slurm/pearl-run.sbatch CONFIG``: the run trains in its job; Slurm's warning
    (USR2) after its first update stops it cleanly and requeues the job; the next
    incarnation resumes and trains the rest, every update once."""
    for module in ("torch", "mpi4py", "submitit"):
        pytest.importorskip(module)
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run_dir": "out",
                "cluster": "slurm",
                "env": {"name": "single_digit", "operators": "+", "max_turns": 1},
                "rollout": {"group_size": 4, "batch_trajectories": 64, "max_tokens": 16},
                "trainer": {"steps": 3},
                "coordinator": {"decision_interval_s": 0.5},  # elastic rule: never
            }
        ),
        encoding="utf-8",
    )
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
