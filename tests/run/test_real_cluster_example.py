"""``examples/runs/real-cluster.yaml``, the run on a real cluster (vLLM engines, Megatron-
core's trainer), checked as far as a machine without a GPU can: it loads and costs its
GPUs; the run's slots and the elastic nodes' agents start the same ``vllm serve`` (sleep
mode, NIXL, pearl's weight sync), with the config's options and one GPU each; the trainer is
``pearl trainer serve --backend megatron`` with the config's options; the run's job asks
for the config's devices; and without vLLM the run refuses in one line, exit 2. Running
it for real needs the GPUs: ``scripts/device-check`` (docs/slurm-run.md)."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest
from test_slurm_config import refusal

from pearl.run.config import cluster_profile, load_run_config
from pearl.run.engine_command import engine_template

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "runs" / "real-cluster.yaml"
FILL = {"port": 8123, "kv_port": 5601, "host": "gpu-17", "worker_id": "e-rollout-3"}


def test_it_loads_and_costs_its_gpus() -> None:
    config, base = load_run_config(EXAMPLE)
    assert config.cluster == "slurm"
    assert (config.engines.backend, config.trainer.backend) == ("vllm", "megatron")
    profile = cluster_profile(config, base, EXAMPLE)
    assert profile.gpus["cpu"] == profile.gpus["h800"]  # the run's own slots
    assert "h20" in profile.gpus  # the elastic nodes'


def test_the_slots_and_the_elastic_agents_start_the_same_vllm_serve(tmp_path: Path) -> None:
    from pearl.run.coordinated import coordinator_config

    config, _ = load_run_config(EXAMPLE)
    model = Path("/shared/models/Qwen3-1.7B")
    argv = [a.format(**FILL) for a in engine_template(config, model, "/py")]
    env = dict(a.split("=", 1) for a in argv[1 : argv.index("vllm")])
    assert argv[0] == "env" and env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and "CUDA_VISIBLE_DEVICES" not in env  # the agent's
    serve = argv[argv.index("vllm") :]
    assert serve[:3] == ["vllm", "serve", str(model)]
    options = dict(zip(serve[3::2], serve[4::2], strict=False))
    for flag, value in {
        "--host": "gpu-17",
        "--port": "8123",
        "--tensor-parallel-size": "1",
        "--gpu-memory-utilization": "0.85",
        "--max-model-len": "8192",
        "--max-num-seqs": "256",
    }.items():
        assert options.get(flag) == value, (flag, serve)
    assert "--enable-sleep-mode" in serve
    kv = serve[serve.index("--kv-transfer-config") + 1]
    assert '"engine_id":"e-rollout-3"' in kv and '"kv_connector":"NixlConnector"' in kv
    extension = serve[serve.index("--worker-extension-cls") + 1]
    assert extension == "pearl.engines.vllm_weights.PublishedWeights"
    cfg = coordinator_config(config, tmp_path / "run", model)
    assert cfg.agents is not None
    ((role, line),) = [c.split("=", 1) for c in cfg.agents.engine_commands("/py")]
    assert role == "*" and shlex.split(line) == engine_template(config, model, "/py")


def test_the_trainer_is_megatron_with_the_configs_options(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from pearl.run.local import trainer_process
    from pearl.trainer.megatron.config import MegatronOptions

    config, _ = load_run_config(EXAMPLE)
    proc = trainer_process(config, tmp_path / "model", tmp_path / "run")
    flag = proc.argv.index("--backend")
    assert proc.argv[flag : flag + 2] == ["--backend", "megatron"]
    options = Path(proc.argv[proc.argv.index("--megatron") + 1]).read_text()
    parsed = MegatronOptions.model_validate_json(options)
    assert (parsed.spec, parsed.compute_dtype) == ("te", "bfloat16")


def test_the_runs_job_asks_for_the_configs_devices(tmp_path: Path) -> None:
    pytest.importorskip("submitit")
    from pearl.cluster.child_job import sbatch_script
    from pearl.run.submit import run_job_spec

    spec, command = run_job_spec(str(EXAMPLE), tmp_path / "jobs")
    assert command == ("run", str(EXAMPLE), "--cluster", "slurm", "--json")
    script = sbatch_script(spec)
    for line in ("#SBATCH --gres=gpu:h800:8", "#SBATCH --cpus-per-task=32", "#SBATCH --time=1440"):
        assert line in script, script


def test_without_vllm_the_run_refuses_in_one_line() -> None:
    pytest.importorskip("mpi4py")  # cluster: slurm needs the slurm extra first
    pytest.importorskip("submitit")
    if shutil.which("vllm") is not None:
        pytest.skip("vllm is installed here: the refusal is for machines without it")
    assert "vllm: `vllm` is not on PATH" in refusal(str(EXAMPLE), "--steps", "1")
