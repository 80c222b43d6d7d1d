"""Reference-engine server processes for the engine, router and agent tests: started as
``pearl engine serve`` subprocesses on free local ports by ``pearl.bench.engine_proc``
(the benchmarks' launcher), waited on together (``/health``), stopped (SIGTERM, then kill);
each writes its output to a log file that a failing test can print. An ``EngineProc``
without a process names an engine already running elsewhere (``--engine-url``)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pearl.bench.engine_proc import EngineProcess
from pearl.control.workers import free_port

START_TIMEOUT_S = 60.0


@dataclass
class EngineProc:
    """One engine: its URL, and when this process started it, its process."""

    url: str
    name: str
    kv_port: int | None = None
    model_dir: Path | None = None
    process: EngineProcess | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        proc = self.process.proc if self.process is not None else None
        return None if proc is None else proc.pid

    @property
    def local(self) -> bool:
        """Started here (the reference engine): its pid and ``pearl:`` metrics are ours."""
        return self.process is not None

    def log_tail(self) -> str:
        if self.process is None:
            return ""
        return f"--- {self.process.log_path} ({self.name})\n{self.process.log_tail()}"

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


def start_engine(
    model_dir: Path, log_dir: Path, name: str, *args: str, threads: int = 1
) -> EngineProc:
    """Start ``pearl engine serve`` for ``model_dir`` (engine id ``name``, a KV side
    channel) with the extra command-line ``args``; it is not waited on (see
    :func:`wait_healthy`)."""
    kv_port = free_port()
    process = EngineProcess(
        model_dir, kv_port=kv_port, engine_id=name, threads=threads, extra=args, log_dir=log_dir
    ).start()
    return EngineProc(process.url, name, kv_port, model_dir, process)


@contextmanager
def running_engines(
    model_dir: Path, log_dir: Path, names: Iterable[str]
) -> Iterator[list[EngineProc]]:
    """Reference engines named ``names``, started side by side and healthy, stopped after
    (a module fixture's body: ``with running_engines(...) as procs: yield procs``)."""
    procs = [start_engine(model_dir, log_dir, name) for name in names]
    try:
        wait_healthy(procs)
        yield procs
    finally:
        for p in procs:
            p.stop()


def wait_healthy(engines: list[EngineProc], timeout_s: float = START_TIMEOUT_S) -> None:
    """Until every engine started here answers ``/health``; RuntimeError (with its log's
    tail) if one exits or the time runs out. They start side by side: each wait takes
    what is left of the one deadline."""
    deadline = time.monotonic() + timeout_s
    for e in engines:
        if e.process is not None:
            e.process.wait_healthy(max(0.1, deadline - time.monotonic()))


def rss_bytes(pid: int) -> int:
    """The resident set size of process ``pid`` (``VmRSS`` of ``/proc/PID/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def model_config(model_dir: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    return doc


def kv_bytes_per_token(model_dir: Path) -> int:
    """Keys and values of one token over every layer, from the model's config."""
    c = model_config(model_dir)
    layers, kv_heads = int(c["num_hidden_layers"]), int(c["num_key_value_heads"])
    head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // int(c["num_attention_heads"]))
    size = _DTYPE_BYTES[str(c.get("torch_dtype", "float32"))]
    return int(2 * layers * kv_heads * head_dim * size)


def weights_nbytes(model_dir: Path) -> int:
    """The bytes of the model's weights as loaded (every tensor of its safetensors)."""
    from pearl.engines.reference.weights import read_weights

    return int(sum(t.numel() * t.element_size() for t in read_weights(model_dir).values()))
