"""The one fake engine: a tiny HTTP server that answers a few of vLLM's routes, for tests.

``python -m pearl.engines.fake --port N [--start-delay-s S]``. What it fakes, and nothing
more: ``GET /health`` (200 once listening), ``POST /sleep`` and ``POST /wake_up`` (a flag,
whatever the level or tags), ``GET /is_sleeping``, ``POST /collective_rpc`` (only
``{"method": "reload_weights"}``, counted; any other method answers 400 with an
``{"error": ...}`` body, and with ``--fail-reload`` every reload answers 500 with vLLM's
``{"error": {"message": ...}}``) and ``GET /metrics`` (Prometheus text: ``vllm:num_requests_running
0``, ``pearl_fake_sleeping``, ``pearl_fake_weight_reloads`` and ``pearl_fake_info`` with the
``CUDA_VISIBLE_DEVICES`` it was started with, so tests can check what the agent did). It
serves no tokens, holds no weights and no KV cache. ``--start-delay-s`` delays the listening
socket, like a slow model load; SIGTERM stops it cleanly. It needs only the standard
library.

It stays only for the tests that need an engine that misbehaves on purpose (a slow start, a
failing reload) or that must run without torch (the agent's and the Slurm tests); a test
that needs a real engine uses pearl's CPU reference engine (``pearl engine serve``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _State:
    sleeping = False
    weight_reloads = 0
    fail_reload = False


class _Handler(BaseHTTPRequestHandler):
    def _reply(self, code: int, body: str, ctype: str = "application/json") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/health":
            self._reply(200, "")
        elif path == "/is_sleeping":
            self._reply(200, json.dumps({"is_sleeping": _State.sleeping}))
        elif path == "/metrics":
            cvd = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            self._reply(
                200,
                "vllm:num_requests_running 0\n"
                f"pearl_fake_sleeping {int(_State.sleeping)}\n"
                f"pearl_fake_weight_reloads {_State.weight_reloads}\n"
                f'pearl_fake_info{{cuda_visible_devices="{cvd}"}} 1\n',
                "text/plain; version=0.0.4",
            )
        else:
            self._reply(404, "")

    def do_POST(self) -> None:
        path = self.path.split("?")[0]
        if path in ("/sleep", "/wake_up"):
            _State.sleeping = path == "/sleep"
            self._reply(200, "")
        elif path == "/collective_rpc":
            length = int(self.headers.get("Content-Length") or 0)
            try:
                method = json.loads(self.rfile.read(length) or b"{}").get("method")
            except (json.JSONDecodeError, AttributeError):
                method = None
            if method != "reload_weights":
                self._reply(400, json.dumps({"error": f"unsupported method {method!r}"}))
                return
            if _State.fail_reload:
                error = {"message": "reload_weights failed (--fail-reload)", "code": 500}
                self._reply(500, json.dumps({"error": error}))
                return
            _State.weight_reloads += 1
            self._reply(200, json.dumps({"results": [None]}))
        else:
            self._reply(404, "")

    def log_message(self, format: str, *args: Any) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--start-delay-s", type=float, default=0.0)
    ap.add_argument("--fail-reload", action="store_true", help="answer every reload with 500")
    args = ap.parse_args(argv)
    _State.fail_reload = args.fail_reload
    time.sleep(args.start_delay_s)
    server = ThreadingHTTPServer((args.host, args.port), _Handler)

    def stop(*_: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    server.serve_forever(poll_interval=0.05)
    server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
