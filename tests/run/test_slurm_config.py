"""``pearl run``'s Slurm side, from the configuration to the job it submits (no cluster
needed: the dev-cluster runs are tests/run/test_pearl_run_on_slurm.py and
tests/slurm/test_templates.py): the shipped example loads; GPU types the profile cannot
cost and elastic types the cluster does not offer are one line naming the field, exit 2;
the run's job is what the config's ``slurm.job`` says; the agents' engines are the run's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pearl.io.documents import InputError
from pearl.run.config import load_run_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "runs" / "dev-cluster.yaml"


def refusal(*args: str) -> str:
    """``pearl run ARGS`` outside any Slurm job: it must refuse in one line with exit 2;
    the line."""
    done = subprocess.run(
        [sys.executable, "-m", "pearl.cli.main", "run", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
    )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    return line


def _with(tmp_path: Path, **changes: object) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = doc
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def test_the_example_loads_and_costs_its_elastic_gpus() -> None:
    from pearl.run.config import cluster_profile

    config, base = load_run_config(EXAMPLE)
    assert config.cluster == "slurm" and base == EXAMPLE.parent
    profile = cluster_profile(config, base, EXAMPLE)
    assert profile.gpus["h20"] == profile.gpus["cpu"]  # slurm.profile_gpu_types


@pytest.mark.parametrize(
    ("changes", "field", "problem"),
    [
        pytest.param(
            {"slurm__profile_gpu_types": {"h20": "h100"}},
            "slurm.profile_gpu_types.h20",
            "the profile has no GPU type 'h100'",
            id="alias-to-nothing",
        ),
        pytest.param(
            {"slurm__profile_gpu_types": {}},
            "coordinator.policy.elastic.gpu_type",
            "'h20' has no costs in profile 'tiny-cpu'",
            id="uncosted",
        ),
        pytest.param(
            {"slurm__gpus_per_node": {"h800": 8}},
            "coordinator.policy.elastic.gpu_type",
            "'h20' is not in slurm.gpus_per_node (h800)",
            id="not-offered",
        ),
        pytest.param(
            {"coordinator__enabled": False},
            "cluster",
            "slurm needs coordinator.enabled",
            id="no-coordinator",
        ),
    ],
)
def test_what_slurm_cannot_run_is_one_line_naming_the_field(
    tmp_path: Path, changes: dict[str, object], field: str, problem: str
) -> None:
    path = _with(tmp_path, **changes)
    with pytest.raises(InputError) as err:
        load_run_config(path)
    assert problem in str(err.value) and field in str(err.value)
    assert problem in refusal(str(path), "--print-config")


def test_the_runs_job_is_the_configs_and_runs_pearl_run_on_slurm(tmp_path: Path) -> None:
    pytest.importorskip("submitit")
    from pearl.cluster.child_job import sbatch_script
    from pearl.run.submit import run_job_spec

    spec, command = run_job_spec(str(EXAMPLE), tmp_path / "jobs")
    assert command == ("run", str(EXAMPLE), "--cluster", "slurm", "--json")
    script = sbatch_script(spec)
    for line in (
        "#SBATCH --job-name=pearl-base",  # pearl analyze --sacct-query: the base's devices
        "#SBATCH --partition=train",
        "#SBATCH --gres=gpu:h800:3",
        "#SBATCH --requeue",
        "#SBATCH --signal=USR2@120",
        "#SBATCH --time=60",
    ):
        assert line in script, script
    dry = subprocess.run(
        [sys.executable, str(REPO / "launch" / "submit.py"), str(EXAMPLE), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dry.returncode == 0 and "#SBATCH --job-name=pearl-base" in dry.stdout, dry.stderr


def test_the_elastic_agents_start_the_runs_engines_on_their_nodes_name(tmp_path: Path) -> None:
    from pearl.run.coordinated import coordinator_config
    from pearl.run.on_slurm import run_id

    config, _ = load_run_config(EXAMPLE)
    cfg = coordinator_config(config, tmp_path / "my run!", tmp_path / "model")
    assert cfg.backend == "slurm" and cfg.run_id == run_id(config, tmp_path / "my run!")
    assert cfg.run_id.startswith("my-run--")  # a Slurm job name's characters only
    assert run_id(config, tmp_path / "a" / "out") != run_id(config, tmp_path / "b" / "out")
    agents = cfg.agents
    assert agents is not None and agents.engine is not None
    assert agents.engine_host == "node" and agents.engine.model == str(tmp_path / "model")
    ((role, command),) = [c.split("=", 1) for c in agents.engine_commands("/py")]
    assert role == "*" and "--host {host}" in command and "--max-num-seqs 64" in command


def test_cluster_slurm_on_the_command_line_is_checked_as_the_file_would_be(
    tmp_path: Path,
) -> None:
    """``--cluster slurm`` over a local config: the same one-line errors, exit 2."""
    path = tmp_path / "local.yaml"
    path.write_text("coordinator: {enabled: false}\n", encoding="utf-8")
    line = refusal(str(path), "--cluster", "slurm")
    assert f"{path}: cluster: slurm needs coordinator.enabled" in line


def test_the_elastic_jobs_payload_takes_the_configs_grace_and_reconnect_wait(
    tmp_path: Path,
) -> None:
    pytest.importorskip("submitit")
    from pearl.cluster.agent_payload import AgentPayload
    from pearl.run.on_slurm import slurm_backend

    path = _with(tmp_path, slurm__reconnect_s=90, slurm__grace_s=12)
    config, _ = load_run_config(path)
    payload = slurm_backend(config, tmp_path / "out", tmp_path / "model").payload
    assert isinstance(payload, AgentPayload)
    assert (payload.reconnect_s, payload.grace_s, payload.engine_host) == (90.0, 12.0, "node")
    with pytest.raises(InputError, match=r"slurm\.reconnect_s"):
        load_run_config(_with(tmp_path, slurm__reconnect_s=-1))


@pytest.mark.parametrize(
    ("trainer", "field", "problem"),
    [
        ({"backend": "megatron", "process": False}, "trainer.process", "its own process"),
        ({"megatron": {"seed": 1}}, "trainer.megatron", "backend 'megatron' only"),
        ({"backend": "megatron", "megatron": {"compute_dtype": "float16"}}, "trainer", "float16"),
    ],
)
def test_the_megatron_trainer_is_configured_in_its_process(
    tmp_path: Path, trainer: dict[str, object], field: str, problem: str
) -> None:
    path = _with(tmp_path, **{f"trainer__{k}": v for k, v in trainer.items()})
    with pytest.raises(InputError) as err:
        load_run_config(path)
    assert field in str(err.value) and problem in str(err.value), err.value
    ok, _ = load_run_config(_with(tmp_path, trainer__backend="megatron"))
    assert ok.trainer.backend == "megatron" and ok.trainer.megatron.spec == "auto"


ROLLOUT = {"nodes": 2, "gpu_type": "h800", "gpus_per_node": 4}


def test_rollout_nodes_are_the_base_jobs_and_need_a_heterogeneous_job(tmp_path: Path) -> None:
    """``slurm.rollout``: its nodes join the base job's rollout as ``rollout-1..N``; its GPU
    type must be costed, its GPUs those Slurm gave; outside a heterogeneous job the run,
    ``--submit`` (submitit cannot submit one) and ``--rollout-agent`` each refuse in one
    line, exit 2."""
    pytest.importorskip("mpi4py")  # cluster: slurm needs the slurm extra first
    pytest.importorskip("submitit")
    from pearl.run.coordinated import coordinator_config
    from pearl.run.rollout_nodes import check_heterogeneous, rollout_agent

    with pytest.raises(InputError, match=r"slurm\.rollout\.gpu_type: 'h800' has no costs"):
        load_run_config(_with(tmp_path, slurm__rollout=ROLLOUT))
    types = {"h20": "cpu", "h800": "cpu"}
    path = _with(tmp_path, slurm__rollout=ROLLOUT, slurm__profile_gpu_types=types)
    config, _ = load_run_config(path)
    cfg = coordinator_config(config, tmp_path / "out", tmp_path / "model")
    nodes = [(n.name, n.gpu_type, n.num_gpus) for n in cfg.base.rollout]
    assert nodes == [("rollout", "cpu", 2), ("rollout-1", "h800", 4), ("rollout-2", "h800", 4)]
    check_heterogeneous(config, {"SLURM_JOB_NUM_NODES_HET_GROUP_1": "2"})
    with pytest.raises(InputError, match="has 1 nodes, not 2"):
        check_heterogeneous(config, {"SLURM_JOB_NUM_NODES_HET_GROUP_1": "1"})
    task = {"SLURM_NODEID": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    payload = rollout_agent(config, tmp_path / "out", tmp_path / "model", task)
    assert payload.node == "rollout-2" and payload.gpu_type == "h800"
    with pytest.raises(InputError, match="this node has 2 GPUs in the job"):
        rollout_agent(config, tmp_path, tmp_path, {**task, "CUDA_VISIBLE_DEVICES": "0,1"})
    assert payload.engine_host == "node" and "engine serve" in payload.engines[0]
    for extra, problem in (
        ((), "slurm.rollout: the run's job has no second component"),
        (("--submit",), "slurm.rollout: submitit cannot submit the heterogeneous job"),
        (("--rollout-agent",), "--rollout-agent: not a task of the job's second component"),
    ):
        line = refusal(str(path), "--steps", "1", *extra)
        assert problem in line, (extra, line)
