"""Helpers of the engine benchmarks: a reference-engine process, free ports, prompts.

:class:`EngineProcess` starts ``pearl engine serve`` as a child process (its output to a
log file; through ``pearl.control.pdeath``, so that it dies with its parent even by
SIGKILL), waits for ``/health`` and always stops it (terminate, then kill) on exit, so a
benchmark or a run leaves no engine behind even when it fails.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx

from pearl.control import pdeath
from pearl.control.workers import free_port
from pearl.engines.backend import reference_serve_argv

START_TIMEOUT_S = 180.0


def random_prompts(count: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``tokens`` random ids, none a special token (ids 256..vocab-16
    are ordinary BPE merges of the tiny tokenizer; any id of a real model's vocabulary
    body works as well); distinct first blocks, so no prompt hits another's prefix cache."""
    rng = random.Random(seed)
    lo, hi = min(256, vocab // 4), max(vocab - 16, min(256, vocab // 4) + 1)
    return [[rng.randrange(lo, hi) for _ in range(tokens)] for _ in range(count)]


class EngineProcess:
    """``pearl engine serve --model DIR --port P ...`` as a context manager."""

    def __init__(
        self,
        model: str | Path,
        *,
        kv_port: int | None = None,
        engine_id: str = "0",
        threads: int | None = None,
        extra: tuple[str, ...] = (),
        log_dir: str | Path | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = reference_serve_argv(
            sys.executable,
            model,
            port=self.port,
            engine_id=engine_id,
            kv_port=kv_port,
            threads=threads,
            extra=extra,
        )
        folder = Path(log_dir) if log_dir else Path(tempfile.gettempdir())
        self.log_path = folder / f"pearl-engine-{engine_id}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> EngineProcess:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(  # it dies with this process, even by SIGKILL
                pdeath.command(self.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"engine not healthy after {timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        if exc_type is None:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)
