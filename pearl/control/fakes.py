"""The one fake of the control plane: a tiny HTTP engine for integration tests.

Until the real engines exist, the agent's worker management is tested against this
process: ``python -m pearl.control.fakes --port N``. It answers vLLM's endpoints that the
agent uses: ``GET /health`` (200), ``POST /sleep`` and ``POST /wake_up`` (toggle sleep),
``GET /is_sleeping``, ``POST /collective_rpc`` (only ``{"method": "reload_weights"}``,
counted) and ``GET /metrics`` (Prometheus text with ``vllm:num_requests_running 0``,
``pearl_fake_sleeping``, ``pearl_fake_weight_reloads`` and the ``CUDA_VISIBLE_DEVICES`` it
was started with, so tests can check what the agent did). ``--start-delay-s`` delays the
listening socket, like a model load. SIGTERM stops it cleanly.
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
    args = ap.parse_args(argv)
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
