"""A recording HTTP proxy in front of engines, for tests that check which calls a client
makes: one FastAPI app per engine, served by uvicorn on a free local port in a thread of
its own, forwarding every request (any method, path, query, body and header but the
connection's own) to its engine with httpx and recording it as a :class:`Call`.

Every call gets two stamps from one clock shared by all the proxies: when it arrived and
when its answer came back from the engine, so a test can tell that one call was sent only
after another had been answered, on whichever instance. A test can also hold the answer
of the next call to an instance and path (:meth:`RecordingProxies.hold`), to change
something while that call is in flight."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response

from pearl.control.workers import free_port

# what a call's record keeps of its request's headers (Starlette lowercases the names)
RECORDED_HEADERS = ("x-request-id", "authorization", "content-type")
# the connection's own headers: httpx and uvicorn set them for each hop
_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


@dataclass(frozen=True)
class Call:
    instance: str  # the name of the proxy (the engine) it went to
    method: str
    path: str
    query: str
    headers: dict[str, str]  # the RECORDED_HEADERS the request carried
    body: Any  # the request's JSON body (None if it had none, the text if not JSON)
    status: int
    response: Any  # the answer's JSON (SSE: the list of events' JSON), else None
    arrived: int  # the shared clock when the request came in
    answered: int  # and when the engine's answer came back

    @property
    def kv_transfer_params(self) -> Any:
        """The answer's ``kv_transfer_params`` (a stream's: the last event's that has it)."""
        docs = self.response if isinstance(self.response, list) else [self.response]
        found = None
        for doc in docs:
            if isinstance(doc, dict) and doc.get("kv_transfer_params") is not None:
                found = doc["kv_transfer_params"]
        return found


@dataclass(eq=False)
class Gate:
    """The next call to ``instance`` at ``path`` is answered by its engine, then held:
    ``reached`` is set, and its answer goes back once ``release`` is set."""

    instance: str
    path: str
    reached: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


def _json_or_text(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def _response_doc(r: httpx.Response) -> Any:
    kind = r.headers.get("content-type", "")
    if kind.startswith("application/json"):
        return _json_or_text(r.content)
    if kind.startswith("text/event-stream"):
        events = []
        for line in r.text.splitlines():
            data = line[5:].strip() if line.startswith("data:") else ""
            if data and data != "[DONE]":
                events.append(_json_or_text(data.encode()))
        return events
    return None


class RecordingProxies:
    """Proxies named as ``upstreams`` (name -> engine URL); ``urls[name]`` is where to
    point a client instead of the engine. A context manager: started on entry, stopped on
    exit."""

    def __init__(self, upstreams: dict[str, str], timeout_s: float = 120.0) -> None:
        self.upstreams = dict(upstreams)
        self.timeout_s = timeout_s
        self.ports = {name: free_port() for name in self.upstreams}
        self.urls = {name: f"http://127.0.0.1:{port}" for name, port in self.ports.items()}
        self._calls: list[Call] = []
        self._lock = threading.Lock()
        self._clock = itertools.count()
        self._gates: list[Gate] = []
        self._servers: list[uvicorn.Server] = []
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None

    # -- the record ----------------------------------------------------------------------

    def take(self) -> list[Call]:
        """The calls recorded since the last take, in the order they arrived; cleared."""
        with self._lock:
            calls, self._calls = self._calls, []
        return sorted(calls, key=lambda c: c.arrived)

    def peek(self) -> list[Call]:
        with self._lock:
            return sorted(self._calls, key=lambda c: c.arrived)

    def hold(self, instance: str, path: str) -> Gate:
        """Hold the answer of the next call to ``instance`` at ``path`` (see :class:`Gate`)."""
        gate = Gate(instance, path)
        with self._lock:
            self._gates.append(gate)
        return gate

    def _gate(self, instance: str, path: str) -> Gate | None:
        with self._lock:
            for gate in self._gates:
                if (gate.instance, gate.path) == (instance, path):
                    self._gates.remove(gate)
                    return gate
        return None

    def _tick(self) -> int:
        with self._lock:
            return next(self._clock)

    # -- the apps --------------------------------------------------------------------------

    def _app(self, name: str, client: httpx.AsyncClient) -> FastAPI:
        app = FastAPI()

        @app.api_route("/{path:path}", methods=METHODS)
        async def forward(path: str, request: Request) -> Response:
            arrived = self._tick()
            raw = await request.body()
            headers = {k: v for k, v in request.headers.items() if k not in _HOP_HEADERS}
            upstream = await client.request(
                request.method,
                request.url.path,
                params=request.query_params,
                content=raw,
                headers=headers,
            )
            answered = self._tick()
            gate = self._gate(name, request.url.path)
            if gate is not None:
                gate.reached.set()
                await asyncio.to_thread(gate.release.wait, self.timeout_s)
            call = Call(
                instance=name,
                method=request.method,
                path=request.url.path,
                query=request.url.query,
                headers={k: request.headers[k] for k in RECORDED_HEADERS if k in request.headers},
                body=_json_or_text(raw),
                status=upstream.status_code,
                response=_response_doc(upstream),
                arrived=arrived,
                answered=answered,
            )
            with self._lock:
                self._calls.append(call)
            kind = upstream.headers.get("content-type")
            return Response(upstream.content, upstream.status_code, media_type=kind)

        return app

    # -- serving ---------------------------------------------------------------------------

    def _serve(self) -> None:
        async def main() -> None:
            async with contextlib.AsyncExitStack() as stack:
                for name, url in self.upstreams.items():
                    client = await stack.enter_async_context(
                        httpx.AsyncClient(base_url=url, timeout=self.timeout_s)
                    )
                    config = uvicorn.Config(
                        self._app(name, client),
                        host="127.0.0.1",
                        port=self.ports[name],
                        log_level="warning",
                        lifespan="off",
                    )
                    self._servers.append(uvicorn.Server(config))
                await asyncio.gather(*(s.serve() for s in self._servers))

        try:
            asyncio.run(main())
        except BaseException as err:  # surfaced by start()
            self._failed = err

    def start(self, timeout_s: float = 20.0) -> RecordingProxies:
        self._thread = threading.Thread(target=self._serve, name="recording-proxies", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while len(self._servers) < len(self.upstreams) or not all(s.started for s in self._servers):
            if self._failed is not None or not self._thread.is_alive():
                raise RuntimeError(f"the recording proxies did not start: {self._failed!r}")
            if time.monotonic() > deadline:
                raise RuntimeError("the recording proxies did not start in time")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        with self._lock:
            for gate in self._gates:
                gate.release.set()
        for s in self._servers:
            s.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> RecordingProxies:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
