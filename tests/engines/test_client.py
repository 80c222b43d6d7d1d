"""The engine client (``pearl.engines.client``) against a real HTTP server: a small FastAPI
app in this module that answers a few of vLLM's routes as vLLM shapes them (JSON, error
bodies, server-sent events, Prometheus text), served by uvicorn on a free local port."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from pearl.control.workers import free_port
from pearl.engines.client import EngineClient, EngineError, EngineUnreachable, call

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 120.0
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.5",model_name="tiny"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="tiny"} 3.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 4.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="0.5",model_name="tiny"} 0.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="1.0",model_name="tiny"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="+Inf",model_name="tiny"} 1.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="tiny"} 3.5
vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny"} 4.0
"""


def _app(seen: list[dict[str, Any]]) -> FastAPI:
    app = FastAPI()
    state = {"sleeping": False, "paused": False}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": "0.0-test"}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        seen.append({"path": "/v1/completions", "body": body, **request.headers})
        if body.get("max_tokens", 1) < 0:
            error = {"message": "max_tokens must be at least 0", "type": "BadRequestError"}
            return JSONResponse({"error": {**error, "code": 400}}, status_code=400)
        if not body.get("stream"):
            return JSONResponse({"id": "cmpl-1", "choices": [{"text": "hi", "index": 0}]})

        async def events() -> AsyncIterator[bytes]:
            for text in ("a", "b", "c"):
                yield f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        async def events() -> AsyncIterator[bytes]:
            yield b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
            yield b'data: {"error": {"message": "engine died", "code": 503}}\n\n'

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/sleep")
    async def sleep(level: int = 1) -> Response:
        seen.append({"path": "/sleep", "level": level})
        state["sleeping"] = True
        return Response()

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        seen.append({"path": "/wake_up", "tags": request.query_params.getlist("tags")})
        state["sleeping"] = False
        return Response()

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": state["sleeping"]}

    @app.post("/pause")
    async def pause(mode: str = "abort") -> Response:
        if mode not in ("abort", "wait", "keep"):
            return JSONResponse({"message": f"unknown mode {mode}"}, status_code=422)
        state["paused"] = True
        return Response()

    @app.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": state["paused"]}

    @app.post("/abort_requests")
    @app.post("/collective_rpc")
    @app.post("/finish_weight_update")
    async def echo(request: Request) -> dict[str, Any]:
        seen.append({"path": request.url.path, "body": await request.json()})
        return {"results": [None]}

    @app.post("/update_weights")
    async def update_weights(request: Request) -> Response:
        ctype = request.headers.get("content-type", "")
        seen.append({"path": "/update_weights", "type": ctype, "body": await request.body()})
        if "octet-stream" in ctype and not await request.body():
            return JSONResponse({"error": "empty body"}, status_code=400)
        return Response()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(METRICS)

    @app.get("/broken")
    async def broken() -> PlainTextResponse:
        return PlainTextResponse("Internal Server Error\ntrace...", status_code=500)

    return app


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []
    port = free_port()
    config = uvicorn.Config(_app(seen), host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    end = time.monotonic() + 10
    while not srv.started and time.monotonic() < end:
        time.sleep(0.01)
    assert srv.started
    yield f"http://127.0.0.1:{port}", seen
    srv.should_exit = True
    thread.join(timeout=5)


def _run(url: str, coro_fn: Any) -> Any:
    async def go() -> Any:
        async with EngineClient(url, timeout_s=5.0) as client:
            return await coro_fn(client)

    return asyncio.run(go())


def test_json_routes_and_the_request_id(server: tuple[str, list[dict[str, Any]]]) -> None:
    url, seen = server

    async def go(c: EngineClient) -> tuple[bool, str, dict[str, Any]]:
        return (
            await c.health(),
            await c.version(),
            await c.completions({"prompt": [1, 2], "max_tokens": 4}, request_id="req-7"),
        )

    healthy, version, answer = _run(url, go)
    assert healthy and version == "0.0-test"
    assert answer["choices"][0]["text"] == "hi"
    assert seen[-1]["x-request-id"] == "req-7" and seen[-1]["body"]["prompt"] == [1, 2]


def test_an_error_body_is_an_engine_error_with_its_message(
    server: tuple[str, list[dict[str, Any]]],
) -> None:
    url, _ = server
    with pytest.raises(EngineError) as err:
        _run(url, lambda c: c.completions({"prompt": "x", "max_tokens": -1}))
    assert (err.value.status, err.value.message) == (400, "max_tokens must be at least 0")
    assert err.value.url == f"{url}/v1/completions"
    assert str(err.value) == "HTTP 400: max_tokens must be at least 0"
    with pytest.raises(EngineError, match="HTTP 422: unknown mode sideways"):
        _run(url, lambda c: c.pause("sideways"))
    with pytest.raises(EngineError, match="HTTP 400: empty body"):
        _run(url, lambda c: c.update_weights(data=b""))
    with pytest.raises(EngineError, match=r"^HTTP 404: Not Found$"):  # FastAPI's detail
        _run(url, lambda c: c.reset_prefix_cache())
    with pytest.raises(EngineError, match=r"^HTTP 500: Internal Server Error$"):  # first line
        _run(url, lambda c: c._request("GET", "/broken"))


def test_streams_are_parsed_up_to_done(server: tuple[str, list[dict[str, Any]]]) -> None:
    url, seen = server

    async def texts(c: EngineClient) -> list[str]:
        events = c.stream_completions({"prompt": "x"}, request_id="s1")
        return [e["choices"][0]["text"] async for e in events]

    assert _run(url, texts) == ["a", "b", "c"]
    assert seen[-1]["body"]["stream"] is True and seen[-1]["x-request-id"] == "s1"

    async def chat(c: EngineClient) -> list[dict[str, Any]]:
        return [e async for e in c.stream_chat_completions({"messages": []})]

    with pytest.raises(EngineError) as err:
        _run(url, chat)
    assert (err.value.status, err.value.message) == (503, "engine died")


def test_control_and_weight_routes_send_what_vllm_reads(
    server: tuple[str, list[dict[str, Any]]],
) -> None:
    url, seen = server

    async def go(c: EngineClient) -> tuple[bool, bool, bool]:
        await c.sleep(2)
        asleep = await c.is_sleeping()
        await c.wake_up(["weights", "kv_cache"])
        await c.pause("keep")
        await c.abort_requests(["a", "b"])
        await c.collective_rpc("reload_weights", kwargs={"path": "/m"}, timeout_s=9.0)
        await c.update_weights(data=b"\x00\x01")
        await c.finish_weight_update(3)
        return asleep, await c.is_sleeping(), await c.is_paused()

    assert _run(url, go) == (True, False, True)
    by_path = {s["path"]: s for s in seen}
    assert by_path["/sleep"]["level"] == 2
    assert by_path["/wake_up"]["tags"] == ["weights", "kv_cache"]
    assert by_path["/abort_requests"]["body"] == {"request_ids": ["a", "b"]}
    rpc = {"method": "reload_weights", "kwargs": {"path": "/m"}, "timeout": 9.0}
    assert by_path["/collective_rpc"]["body"] == rpc
    update = by_path["/update_weights"]
    assert (update["type"], update["body"]) == ("application/octet-stream", b"\x00\x01")
    assert by_path["/finish_weight_update"]["body"] == {"weight_version": 3}


def test_metrics_and_histograms(server: tuple[str, list[dict[str, Any]]]) -> None:
    url, _ = server
    values = _run(url, lambda c: c.metrics())
    assert values["vllm:num_requests_running"] == 3.0  # summed over the engines
    assert values["vllm:prompt_tokens_total"] == 120.0
    assert values["vllm:e2e_request_latency_seconds_count"] == 4.0
    assert not any(name.endswith("_bucket") for name in values)
    buckets = _run(url, lambda c: c.histogram("vllm:e2e_request_latency_seconds"))
    assert buckets == [(0.5, 1.0), (1.0, 4.0), (float("inf"), 5.0)]
    assert _run(url, lambda c: c.num_requests_running()) == 3.0


def test_an_unreachable_engine() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(EngineUnreachable) as err:
        call(lambda c: c.version(), url, 1.0)
    assert err.value.status == 0 and str(err.value).startswith("unreachable: ConnectError")
    assert call(lambda c: c.health(), url, 1.0) is False


def test_call_from_threads(server: tuple[str, list[dict[str, Any]]]) -> None:
    url, _ = server
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: call(lambda c: c.version(), url, 5.0), range(8)))
    assert got == ["0.0-test"] * 8
