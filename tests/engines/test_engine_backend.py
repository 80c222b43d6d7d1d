"""The engine section (``agents.engine``) and the agent commands it renders
(``pearl.engines.backend``), and its place in the coordinator's configuration."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from pearl.coordinator.config import CoordinatorConfig, load_config
from pearl.coordinator.job import make_backend
from pearl.engines.backend import EngineSection, engine_commands
from pearl.io.documents import InputError, parse

PY = "/opt/py/bin/python"


def _filled(template: str) -> list[str]:
    """The argv the agent runs for worker ``w3`` (as ``pearl.control.workers`` fills it)."""
    fill = {"port": 8100, "kv_port": 5601, "role": "decode", "worker_id": "w3", "host": "n1"}
    return [a.format(**fill) for a in shlex.split(template)]


def test_the_reference_engine_command() -> None:
    section = EngineSection(model="/m/tiny", max_model_len=512, kv_cache_tokens=4096)
    commands = engine_commands(section, PY)
    assert list(commands) == ["*"]
    assert _filled(commands["*"]) == [
        *(PY, "-m", "pearl.cli.main", "engine", "serve", "--model", "/m/tiny"),
        *("--port", "8100", "--host", "n1", "--kv-port", "5601", "--engine-id", "w3"),
        *("--max-model-len", "512", "--kv-cache-tokens", "4096"),
    ]
    bare = EngineSection(model="/m/my model", max_num_seqs=8, extra_args=("--seed", "1"))
    assert _filled(engine_commands(bare, PY)["*"])[6:] == [
        *("/m/my model", "--port", "8100", "--host", "n1", "--kv-port", "5601"),
        *("--engine-id", "w3"),
        *("--max-num-seqs", "8", "--seed", "1"),
    ]


def test_the_vllm_command_leaves_the_gpus_to_the_agent() -> None:
    section = EngineSection(
        backend="vllm", model="/m/tiny", tensor_parallel_size=2, gpu_memory_utilization=0.8
    )
    argv = _filled(engine_commands(section, PY)["*"])
    assert argv[:3] == ["env", "VLLM_NIXL_SIDE_CHANNEL_PORT=5601", "VLLM_SERVER_DEV_MODE=1"]
    assert not any(a.startswith("CUDA_VISIBLE_DEVICES") for a in argv)
    assert argv[3:6] == ["vllm", "serve", "/m/tiny"]
    assert argv[argv.index("--port") + 1] == "8100"
    assert argv[argv.index("--host") + 1] == "n1"  # the agent's --engine-host
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.8"
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": "w3"}
    assert "--enable-sleep-mode" in argv


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        pytest.param(
            {"tensor_parallel_size": 2},
            "tensor_parallel_size: not an option of backend 'reference'",
            id="tp-on-reference",
        ),
        pytest.param(
            {"backend": "vllm", "kv_cache_tokens": 100},
            "kv_cache_tokens: not an option of backend 'vllm'",
            id="kv-tokens-on-vllm",
        ),
        pytest.param({"backend": "sglang"}, "Input should be 'reference' or 'vllm'", id="name"),
    ],
)
def test_options_of_the_other_backend_are_refused(fields: dict[str, object], problem: str) -> None:
    with pytest.raises(InputError, match=problem):
        parse(EngineSection, {"model": "/m", **fields}, "c.yaml", "agents.engine")


def _doc(agents: dict[str, object]) -> dict[str, object]:
    return {
        "schema_version": 1,
        "run_id": "t1",
        "run_dir": "run",
        "profile": "qwen3-8b",
        "backend": "local",
        "gpus_per_node": {"h800": 8},
        "base": {"trainer": [{"name": "n0", "gpu_type": "h800", "num_gpus": 8}]},
        "policy": {"elastic": {"gpu_type": "h800"}},
        "agents": agents,
    }


def test_engines_and_engine_are_exclusive() -> None:
    both = {"engines": ["*=python -m pearl.engines.fake --port {port}"], "engine": {"model": "/m"}}
    with pytest.raises(InputError) as err:
        parse(CoordinatorConfig, _doc(both), "c.yaml")
    assert str(err.value) == (
        "c.yaml: agents: engines and engine are exclusive: give the commands or the engine"
    )


def test_the_coordinator_passes_the_rendered_commands_to_its_agents(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.yaml"
    path.write_text(yaml.safe_dump(_doc({"engine": {"model": "models/tiny"}})), encoding="utf-8")
    config, run_dir = load_config(path)
    assert config.agents is not None and config.agents.engine is not None
    model = str(tmp_path / "models" / "tiny")  # relative to the configuration file
    assert config.agents.engine.model == model
    backend = make_backend(config, run_dir)
    payload = backend.payload  # type: ignore[attr-defined]
    (engine,) = payload.engines
    role, _, template = engine.partition("=")
    assert role == "*"
    assert _filled(template)[:7] == [
        *(sys.executable, "-m", "pearl.cli.main", "engine", "serve", "--model", model)
    ]
    given = ("decode=python -m pearl.engines.fake --port {port}",)
    path.write_text(yaml.safe_dump(_doc({"engines": list(given)})), encoding="utf-8")
    config, run_dir = load_config(path)
    assert make_backend(config, run_dir).payload.engines == given  # type: ignore[attr-defined]
