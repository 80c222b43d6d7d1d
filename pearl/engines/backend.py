"""Which engine the node agents start, and the command templates that start it (no I/O).

The coordinator's ``agents.engine`` section (:class:`EngineSection`) names a backend, pearl's
CPU reference engine (``reference``, the default) or vLLM (``vllm``), and the model
directory both serve. :func:`engine_commands` renders it into the ``ROLE=CMD`` templates
the agent already takes (``pearl agent --engine``), one for every role (``*``), with the
placeholders the agent fills per worker: ``{port}`` (HTTP), ``{kv_port}`` (the KV side
channel) and ``{worker_id}`` (the engine id the KV connector announces).

- ``reference``: ``PYTHON -m pearl.cli.main engine serve --model M --port {port}
  --kv-port {kv_port} --engine-id {worker_id}`` and, when set, ``--max-model-len``,
  ``--kv-cache-tokens``, ``--max-num-seqs``.
- ``vllm``: ``env VLLM_NIXL_SIDE_CHANNEL_PORT={kv_port} VLLM_SERVER_DEV_MODE=1 vllm serve
  M ...`` as :func:`pearl.engines.vllm.render` writes it (NixlConnector, ``kv_both``,
  engine id ``{worker_id}``, sleep mode on), ``CUDA_VISIBLE_DEVICES`` left to the agent,
  which sets it to the worker's GPUs. The agent fills templates with ``str.format``, so the
  JSON's literal braces are doubled here.

``extra_args`` are appended to either command as given.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from pearl.core.limits import PositiveTokens
from pearl.core.state import Frozen
from pearl.engines.vllm import VllmServe, render, shell_line

PosInt = Annotated[int, Field(gt=0, le=1_000_000)]
Fraction = Annotated[float, Field(gt=0, le=1)]

# Stand-ins for the agent's placeholders while a command is rendered (no braces, so the
# rendered text can be brace-escaped before they become placeholders).
_STAND_INS = {
    "port": "@PEARL_PORT@",
    "kv_port": "@PEARL_KV_PORT@",
    "worker_id": "@PEARL_ID@",
    "host": "@PEARL_HOST@",
}
_VLLM_ONLY = ("tensor_parallel_size", "gpu_memory_utilization")
_REFERENCE_ONLY = ("kv_cache_tokens",)


class EngineSection(Frozen):
    """The engine every worker of the run starts (``agents.engine``)."""

    backend: Literal["reference", "vllm"] = Field(
        "reference", description="pearl's CPU reference engine, or vLLM (GPU)."
    )
    model: str = Field(
        min_length=1,
        description="Model directory (Hugging Face layout), absolute or relative to the "
        "configuration file; every node must see it (shared file system).",
    )
    max_model_len: PositiveTokens | None = Field(
        None, description="Longest prompt plus output in tokens (None: the model's)."
    )
    tensor_parallel_size: PosInt = Field(
        1, description="vllm only: GPUs per engine (the worker's GPUs must match)."
    )
    gpu_memory_utilization: Fraction | None = Field(
        None, description="vllm only: share of each GPU's memory vLLM takes (None: 0.9)."
    )
    kv_cache_tokens: PositiveTokens | None = Field(
        None, description="reference only: KV cache size in tokens (None: its default)."
    )
    max_num_seqs: PosInt | None = Field(
        None, description="Most sequences an engine runs at once (None: its default)."
    )
    extra_args: tuple[str, ...] = Field(
        (), description="Arguments appended to the engine's command as given."
    )

    @model_validator(mode="after")
    def _fields_of_the_backend(self) -> EngineSection:
        other = _REFERENCE_ONLY if self.backend == "vllm" else _VLLM_ONLY
        for name in other:
            if name in self.model_fields_set:
                raise ValueError(f"{name}: not an option of backend {self.backend!r}")
        return self


def reference_serve_argv(
    python: str,
    model: str | Path,
    *,
    port: int | str,
    engine_id: str,
    kv_port: int | str | None = None,
    threads: int | None = None,
    host: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """``pearl engine serve``'s command line (the CPU reference engine), as every launcher
    of it writes it: the agents' templates, the benchmarks' and tests' processes, ``pearl
    run``'s slots. ``port`` and ``kv_port`` may be placeholders."""
    argv = [python, "-m", "pearl.cli.main", "engine", "serve", "--model", str(model)]
    argv += ["--port", str(port)]
    if host is not None:
        argv += ["--host", host]
    if kv_port is not None:
        argv += ["--kv-port", str(kv_port)]
    argv += ["--engine-id", engine_id]
    if threads is not None:
        argv += ["--threads", str(threads)]
    return [*argv, *extra]


def engine_commands(section: EngineSection, python: str) -> dict[str, str]:
    """The agent's engine templates (role ``*``) for ``section``; ``python`` runs pearl."""
    if section.backend == "reference":
        argv = reference_serve_argv(
            python,
            section.model,
            port=_STAND_INS["port"],
            kv_port=_STAND_INS["kv_port"],
            engine_id=_STAND_INS["worker_id"],
            host=_STAND_INS["host"],
        )
        optional = [
            ("--max-model-len", section.max_model_len),
            ("--kv-cache-tokens", section.kv_cache_tokens),
            ("--max-num-seqs", section.max_num_seqs),
        ]
        argv += [a for flag, v in optional if v is not None for a in (flag, str(v))]
        line = shlex.join([*argv, *section.extra_args])
    else:
        spec = VllmServe(
            model=section.model,
            host=_STAND_INS["host"],
            port=_STAND_INS["port"],
            tensor_parallel_size=section.tensor_parallel_size,
            max_model_len=section.max_model_len,
            gpu_memory_utilization=section.gpu_memory_utilization,
            max_num_seqs=section.max_num_seqs,
            engine_id=_STAND_INS["worker_id"],
            kv_side_channel_port=_STAND_INS["kv_port"],
            extra_args=section.extra_args,
        )
        line = shell_line(*render(spec, ()))  # CUDA_VISIBLE_DEVICES: the agent's
    return {"*": _placeholders(line)}


def _placeholders(line: str) -> str:
    """``line`` with literal braces doubled and the stand-ins turned into placeholders."""
    line = line.replace("{", "{{").replace("}", "}}")
    for name, stand_in in _STAND_INS.items():
        line = line.replace(stand_in, "{" + name + "}")
    return line
