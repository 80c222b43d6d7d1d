"""Reference-engine server processes for the protocol tests: started as ``pearl engine
serve`` subprocesses on free local ports, waited on (``/health``), stopped (SIGTERM, then
kill); each writes its output to a log file that a failing test can print."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pearl.control.workers import free_ports

START_TIMEOUT_S = 60.0


@dataclass
class EngineProc:
    """One engine: its URL, and when this process started it, its pid and log."""

    url: str
    name: str
    kv_port: int | None = None
    model_dir: Path | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    log: Path | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def local(self) -> bool:
        """Started here (the reference engine): its pid and ``pearl:`` metrics are ours."""
        return self.proc is not None

    def log_tail(self, lines: int = 60) -> str:
        if self.log is None or not self.log.exists():
            return ""
        text = self.log.read_text(errors="replace").splitlines()[-lines:]
        return f"--- last lines of {self.log} ({self.name})\n" + "\n".join(text)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def start_engine(
    model_dir: Path, log_dir: Path, name: str, *args: str, threads: int = 1
) -> EngineProc:
    """Start ``pearl engine serve`` for ``model_dir`` (engine id ``name``, a KV side
    channel) with the extra command-line ``args``; it is not waited on (see
    :func:`wait_healthy`)."""
    port, kv_port = free_ports(2)
    log = log_dir / f"engine-{name}.log"
    argv = [
        sys.executable,
        "-m",
        "pearl.cli.main",
        "engine",
        "serve",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kv-port",
        str(kv_port),
        "--engine-id",
        name,
        "--threads",
        str(threads),
        *args,
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    return EngineProc(f"http://127.0.0.1:{port}", name, kv_port, model_dir, proc, log)


def wait_healthy(engines: list[EngineProc], timeout_s: float = START_TIMEOUT_S) -> None:
    """Until every engine answers ``/health`` with 200; RuntimeError (with the log's tail)
    if one exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    pending = list(engines)
    while pending:
        for e in list(pending):
            if e.proc is not None and e.proc.poll() is not None:
                raise RuntimeError(f"engine {e.name} exited ({e.proc.returncode})\n{e.log_tail()}")
            try:
                if httpx.get(f"{e.url}/health", timeout=1.0).status_code == 200:
                    pending.remove(e)
            except httpx.TransportError:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(
                f"engines {[e.name for e in pending]} not healthy after {timeout_s:.0f} s\n"
                + "\n".join(e.log_tail() for e in pending)
            )
        if pending:
            time.sleep(0.1)


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
