"""The trainer in another process: the client of ``pearl trainer serve`` and the process.

:class:`RemoteTrainer` is a ``pearl.trainer.protocol.Trainer`` whose every call is a request
to the trainer's server (``pearl.trainer.server``): the trainer's loop, the weight sync
and the coordinator's offload and onload use it as they use a trainer in their own
process. Its calls block (they run in threads, as a local trainer's do).

:class:`TrainerProcess` starts ``pearl trainer serve`` as a child process (its output to
``LOG_DIR/trainer.log``, appended across restarts; through ``pearl.control.pdeath``, so it
dies with this process even when this one is SIGKILLed), waits for ``/health``, and
stops it (SIGTERM, then SIGKILL). ``restart()`` starts a new one on the same port after the old
one died: the state it had is the last checkpoint's, which the caller loads
(``pearl.trainer.loop.resume_and_publish``).

Errors: an answer of 4xx or 5xx is :class:`TrainerError` with the server's message; no
answer at all (the process died, or was killed, mid-call) is :class:`TrainerLost`, the
case a run recovers from by restarting the process.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from pearl.agents.batches import RolloutBatch, batch_text, first_error
from pearl.control import pdeath
from pearl.control.workers import free_port
from pearl.io.documents import InputError
from pearl.io.untrusted import MAX_DOCUMENT_BYTES, loads_json
from pearl.trainer.config import TrainerConfig
from pearl.trainer.protocol import TrainMetrics

START_TIMEOUT_S = 300.0


class TrainerError(RuntimeError):
    """The trainer's server answered with an error."""


class TrainerLost(RuntimeError):
    """The trainer's server gave no answer: its process is gone or unreachable."""


_METRICS = TypeAdapter(TrainMetrics)


def metrics_of(doc: object) -> TrainMetrics:
    """The metrics of a ``/train_step`` answer (NaN and infinities as JSON's ``NaN`` and
    ``Infinity``, which the server writes)."""
    try:
        return _METRICS.validate_python(doc)
    except ValidationError as err:
        raise TrainerError(f"the trainer's metrics: {first_error(err)}") from None


class RemoteTrainer:
    """A ``Trainer`` at ``url`` (the module docstring)."""

    def __init__(self, url: str, *, timeout_s: float = 3600.0) -> None:
        self.url = url.rstrip("/")
        self._client = httpx.Client(base_url=self.url, timeout=timeout_s)
        self._state: dict[str, Any] = {"version": 0, "offloaded": False}

    @property
    def version(self) -> int:
        return int(self._state["version"])

    @property
    def offloaded(self) -> bool:
        return bool(self._state["offloaded"])

    def _call(self, method: str, route: str, **kwargs: Any) -> dict[str, Any]:
        try:
            r = self._client.request(method, route, **kwargs)
        except httpx.TransportError as err:
            raise TrainerLost(f"trainer {self.url}{route}: no answer: {err}") from err
        try:
            doc = loads_json(r.content, max_bytes=MAX_DOCUMENT_BYTES)
        except ValueError:  # not JSON, or not within pearl.io.untrusted's bounds
            doc = None
        if r.status_code != 200:
            error = doc.get("error") if isinstance(doc, dict) else None
            message = error.get("message") if isinstance(error, dict) else r.text[:300]
            if r.status_code == 400:  # what it was given (a corrupt checkpoint, a batch)
                raise InputError.relayed(str(message), by=f"trainer {self.url}{route}")
            raise TrainerError(f"trainer {self.url}{route}: {r.status_code}: {message}")
        if not isinstance(doc, dict):
            raise TrainerError(f"trainer {self.url}{route}: the answer is not a JSON object")
        state = doc.get("state", doc if route == "/state" else None)
        if isinstance(state, dict) and "version" in state:
            self._state = state
        return doc

    def refresh(self) -> dict[str, Any]:
        """The server's state (version, offloaded), read anew."""
        return self._call("GET", "/state")

    def train_step(self, batch: RolloutBatch) -> TrainMetrics:
        doc = self._call(
            "POST",
            "/train_step",
            content=batch_text(batch),
            headers={"content-type": "application/json"},
        )
        return metrics_of(doc.get("metrics"))

    def export_weights(self, out_dir: Path) -> Path:
        return Path(self._call("POST", "/export_weights", json={"out_dir": str(out_dir)})["path"])

    def offload(self) -> None:
        self._call("POST", "/offload")

    def onload(self) -> None:
        self._call("POST", "/onload")

    def save_checkpoint(self, path: Path) -> None:
        self._call("POST", "/save_checkpoint", json={"path": str(path)})

    def load_checkpoint(self, path: Path) -> None:
        self._call("POST", "/load_checkpoint", json={"path": str(path)})

    def close(self) -> None:
        self._client.close()


def trainer_argv(
    model: Path,
    config_file: Path,
    port: int,
    backend: str = "reference",
    options_file: Path | None = None,
) -> list[str]:
    """``pearl trainer serve``'s command line; with ``options_file``, the Megatron
    trainer's options (``--megatron``)."""
    argv = [sys.executable, "-m", "pearl.cli.main", "trainer", "serve", "--model", str(model)]
    argv += ["--config", str(config_file), "--port", str(port)]
    if backend != "reference":
        argv += ["--backend", backend]
    if options_file is not None:
        argv += ["--megatron", str(options_file)]
    return argv


class TrainerProcess:
    """``pearl trainer serve`` as a child process of this one (the module docstring)."""

    def __init__(
        self,
        model: Path,
        config: TrainerConfig,
        log_dir: Path,
        backend: str = "reference",
        options: BaseModel | None = None,
    ) -> None:
        """``backend`` and its ``options`` (megatron: ``MegatronOptions``)."""
        log_dir.mkdir(parents=True, exist_ok=True)
        self.config_file = log_dir / "trainer-config.json"
        self.config_file.write_text(config.model_dump_json(indent=2) + "\n", encoding="utf-8")
        options_file = None
        if options is not None:
            options_file = log_dir / f"trainer-{backend}.json"
            options_file.write_text(options.model_dump_json(indent=2) + "\n", encoding="utf-8")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = trainer_argv(model, self.config_file, self.port, backend, options_file)
        self.log_path = log_dir / "trainer.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout_s: float = START_TIMEOUT_S) -> TrainerProcess:
        """Start the server (from a thread that outlives it: ``PR_SET_PDEATHSIG`` fires
        when the thread that started a child ends) and wait until it answers as a trainer;
        a server that does not is stopped."""
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen(  # it dies with this process, even by SIGKILL
                pdeath.command(self.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.proc = proc
        try:
            self._wait_healthy(proc, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the trainer exited with {proc.returncode}: {self.log_tail()}")
            try:
                r = httpx.get(f"{self.url}/state", timeout=2.0)
                if r.status_code == 200 and "backend" in r.json():  # a trainer, on our port
                    return
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the trainer not healthy after {timeout_s:.0f} s: {self.log_tail()}")

    def restart(self) -> None:
        """A new process in place of one that died (or is stopped first)."""
        self.stop()
        self.restarts += 1
        self.start()

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 15.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)
