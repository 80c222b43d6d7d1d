"""The command every engine of a ``pearl run`` starts with: the run's own (its slots) and
the elastic nodes' agents' alike, from the ``engines`` section (no I/O).

Both go through the agents' one renderer (``pearl.engines.backend.engine_commands``), so a
slot's engine and an elastic one are the same program with the same options:

- ``reference``: ``pearl engine serve`` of the run's model with ``engines.threads`` and
  ``engines.max_num_seqs``;
- ``vllm``: ``vllm serve`` of the run's model (``engines.vllm``: memory share, context
  length, extra arguments; ``engines.max_num_seqs``), sleep mode on, NIXL for the KV of a
  disaggregated pair, and pearl's worker extension, through which every start, wake and
  ``sync_weights`` loads the trainer's latest published weights
  (``pearl.engines.vllm_weights``). One GPU per engine: a slot is one GPU.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from pearl.engines.backend import EngineSection, engine_commands
from pearl.run.config import RunConfig


def engine_section(config: RunConfig, model: Path) -> EngineSection:
    """The run's ``engines`` section as the agents' ``agents.engine``."""
    e = config.engines
    if e.backend == "vllm":
        v = e.vllm
        return EngineSection(
            backend="vllm",
            model=str(model),
            max_model_len=v.max_model_len,
            gpu_memory_utilization=v.gpu_memory_utilization,
            max_num_seqs=e.max_num_seqs,
            extra_args=v.extra_args,
        )
    return EngineSection(
        backend="reference",
        model=str(model),
        max_num_seqs=e.max_num_seqs,
        extra_args=("--threads", str(e.threads)),
    )


def engine_template(config: RunConfig, model: Path, python: str = sys.executable) -> list[str]:
    """The engine's argv template (``ProcessWorkers``' ``{port}``, ``{kv_port}``, ``{host}``,
    ``{worker_id}``), as the run's slots start it."""
    return shlex.split(engine_commands(engine_section(config, model), python)["*"])
