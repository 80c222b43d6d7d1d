"""``vllm serve`` for one engine: its argv and environment, rendered from a spec (no I/O).

:class:`VllmServe` names what pearl sets; :func:`render` turns it into the command line and
the environment: ``VLLM_SERVER_DEV_MODE=1`` (the sleep, pause, abort, RPC and weight-transfer
routes), ``CUDA_VISIBLE_DEVICES`` from the GPU indices given (none given: left to the
caller; the node agent sets it itself), and, with a KV connector, the NIXL side channel
(``VLLM_NIXL_SIDE_CHANNEL_PORT``/``_HOST``). ``--kv-transfer-config`` and
``--weight-transfer-config`` are compact JSON. A port or id may be a placeholder string
(``{port}``) that a later step fills in (:mod:`pearl.engines.backend`). :func:`shell_line`
writes both as one ``env VAR=... vllm serve ...`` line (the golden files are such lines).

Flags and variables as vLLM documents them (vllm-project/vllm, read with the search tool):
``docs/features/nixl_connector_usage.md`` (``--kv-transfer-config`` with ``kv_connector``
``NixlConnector``, ``kv_role`` ``kv_both``, ``VLLM_NIXL_SIDE_CHANNEL_PORT``/``HOST``, with
``--tensor-parallel-size`` and ``--port``; commit 026c83f9), ``docs/features/sleep_mode.md``
(``--enable-sleep-mode``, levels 1 and 2), ``docs/training/weight_transfer/README.md``
(``--weight-transfer-config '{"backend": "nccl"}'``, the four-phase routes and
``VLLM_SERVER_DEV_MODE=1``; commit 03180076), ``docs/training/async_rl.md`` (pause modes,
``/abort_requests``; commit 006ebac2), ``vllm/config/weight_transfer.py`` (``backend``), and
the engine arguments page of docs.vllm.ai (``--host``, ``--max-model-len``,
``--gpu-memory-utilization``, ``--served-model-name``, ``--seed``,
``--enable-prefix-caching``, ``--max-num-seqs``, ``--worker-extension-cls``: pearl's
weight sync from a directory, :mod:`pearl.engines.vllm_weights`); ``engine_id`` in the KV
transfer config
from ``vllm/config/kv_transfer.py`` (``../shared/REFERENCES.md``).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pearl.engines.vllm_weights import EXTENSION


@dataclass(frozen=True)
class VllmServe:
    """One ``vllm serve`` instance. Ports and ids may be placeholders (``"{port}"``)."""

    model: str  # a model directory (or a Hugging Face name)
    port: int | str = 8000
    host: str = "127.0.0.1"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None  # None: the model's own
    gpu_memory_utilization: float | None = None  # None: vLLM's default (0.9)
    max_num_seqs: int | None = None
    enable_sleep_mode: bool = True
    enable_prefix_caching: bool | None = None  # None: vLLM's default
    kv_connector: str | None = "NixlConnector"  # None: no disaggregated prefill
    kv_role: str = "kv_both"  # kv_producer | kv_consumer | kv_both (NIXL: a placeholder)
    engine_id: str | None = None  # the KV connector's engine id (None: vLLM draws one)
    kv_side_channel_port: int | str | None = None  # VLLM_NIXL_SIDE_CHANNEL_PORT (5600)
    kv_side_channel_host: str | None = None  # VLLM_NIXL_SIDE_CHANNEL_HOST (localhost)
    weight_transfer_backend: str | None = None  # "nccl": trainer-pushed weights; None: off
    # pearl's weight sync from a published directory (None: vLLM's workers as they are)
    worker_extension_cls: str | None = EXTENSION
    served_model_name: str | None = None
    seed: int | None = None
    extra_args: tuple[str, ...] = ()  # appended as given
    executable: str = "vllm"


def kv_transfer_config(spec: VllmServe) -> str | None:
    """The ``--kv-transfer-config`` JSON (compact), or None without a connector."""
    if spec.kv_connector is None:
        return None
    config = {"kv_connector": spec.kv_connector, "kv_role": spec.kv_role}
    if spec.engine_id is not None:
        config["engine_id"] = spec.engine_id
    return _compact(config)


def render(spec: VllmServe, gpu_indices: Sequence[int]) -> tuple[list[str], dict[str, str]]:
    """The argv and the environment variables (only those pearl sets) of ``spec`` on the
    local GPUs ``gpu_indices`` (empty: ``CUDA_VISIBLE_DEVICES`` is the caller's). A
    ``ValueError`` if the GPUs given are not ``tensor_parallel_size`` many."""
    if gpu_indices and len(gpu_indices) != spec.tensor_parallel_size:
        raise ValueError(
            f"{len(gpu_indices)} GPUs given for tensor_parallel_size {spec.tensor_parallel_size}"
        )
    argv = [spec.executable, "serve", spec.model, "--host", spec.host, "--port", str(spec.port)]
    argv += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    optional: list[tuple[str, object]] = [
        ("--max-model-len", spec.max_model_len),
        ("--gpu-memory-utilization", spec.gpu_memory_utilization),
        ("--max-num-seqs", spec.max_num_seqs),
        ("--served-model-name", spec.served_model_name),
        ("--seed", spec.seed),
    ]
    argv += [a for flag, value in optional if value is not None for a in (flag, str(value))]
    if spec.enable_sleep_mode:
        argv.append("--enable-sleep-mode")
    if spec.enable_prefix_caching is not None:
        argv.append(
            "--enable-prefix-caching"
            if spec.enable_prefix_caching
            else "--no-enable-prefix-caching"
        )
    kv = kv_transfer_config(spec)
    if kv is not None:
        argv += ["--kv-transfer-config", kv]
    if spec.weight_transfer_backend is not None:
        argv += ["--weight-transfer-config", _compact({"backend": spec.weight_transfer_backend})]
    if spec.worker_extension_cls is not None:
        argv += ["--worker-extension-cls", spec.worker_extension_cls]
    argv += spec.extra_args
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if gpu_indices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in gpu_indices)
    if kv is not None and spec.kv_side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.kv_side_channel_port)
    if kv is not None and spec.kv_side_channel_host is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.kv_side_channel_host
    return argv, env


def shell_line(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """``env VAR=VALUE ... ARGV`` as one shell-quoted line (``shlex.split`` gives it back)."""
    prefix = ["env", *(f"{k}={v}" for k, v in sorted(env.items()))] if env else []
    return shlex.join([*prefix, *argv])


def _compact(doc: object) -> str:
    return json.dumps(doc, separators=(",", ":"))
