"""``vllm serve`` as pearl renders it (``pearl.engines.vllm``), against golden files.

Each case's command line is ``tests/engines/golden/<id>.txt``; ``PEARL_UPDATE_GOLDEN=1``
rewrites them (then review the diff)."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from pearl.engines.vllm import VllmServe, render, shell_line

GOLDEN = Path(__file__).parent / "golden"
MODEL = "/models/qwen3-tiny"
CASES = [
    pytest.param(VllmServe(MODEL, port=8100), (0,), id="colocated_tp1"),
    pytest.param(
        VllmServe(
            MODEL,
            port=8200,
            host="0.0.0.0",
            tensor_parallel_size=2,
            max_model_len=4096,
            gpu_memory_utilization=0.85,
            engine_id="decode-0",
            kv_side_channel_port=5601,
            kv_side_channel_host="10.0.0.7",
            weight_transfer_backend="nccl",
            served_model_name="policy",
            seed=7,
            enable_prefix_caching=True,
        ),
        (2, 3),
        id="nixl_tp2",
    ),
    pytest.param(
        VllmServe(
            MODEL,
            port=8300,
            enable_sleep_mode=False,
            kv_connector=None,
            kv_side_channel_port=5602,  # no connector: no side channel either
            max_num_seqs=64,
            extra_args=("--enforce-eager",),
        ),
        (),
        id="no_sleep_mode",
    ),
]


@pytest.mark.parametrize(("spec", "gpus"), CASES)
def test_rendered_command_lines_match_the_golden_files(
    spec: VllmServe, gpus: tuple[int, ...], request: pytest.FixtureRequest
) -> None:
    line = shell_line(*render(spec, gpus)) + "\n"
    path = GOLDEN / f"{request.node.callspec.id}.txt"
    if os.environ.get("PEARL_UPDATE_GOLDEN") == "1":
        path.write_text(line, encoding="utf-8")
    assert line == path.read_text(encoding="utf-8")


def test_the_environment_and_the_kv_config() -> None:
    spec = VllmServe(MODEL, engine_id="p0", kv_side_channel_port=5600)
    argv, env = render(spec, (1,))
    assert env == {
        "VLLM_SERVER_DEV_MODE": "1",
        "CUDA_VISIBLE_DEVICES": "1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600",
    }
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": "p0"}
    assert "--enable-sleep-mode" in argv and argv[:3] == ["vllm", "serve", MODEL]
    assert "CUDA_VISIBLE_DEVICES" not in render(spec, ())[1]  # the caller's to set


def test_a_line_splits_back_into_its_argv_and_env() -> None:
    argv, env = render(CASES[1].values[0], (2, 3))  # type: ignore[arg-type]
    words = shlex.split(shell_line(argv, env))
    assert words[0] == "env" and words[1 + len(env) :] == argv
    assert dict(w.split("=", 1) for w in words[1 : 1 + len(env)]) == env


def test_the_gpus_must_match_the_tensor_parallel_size() -> None:
    with pytest.raises(ValueError, match="1 GPUs given for tensor_parallel_size 2"):
        render(VllmServe(MODEL, tensor_parallel_size=2), (0,))
