"""One async client for a rollout engine's HTTP routes, for both backends.

vLLM's OpenAI server (dev-mode routes with ``VLLM_SERVER_DEV_MODE=1``) and pearl's CPU
reference engine answer the same routes, so one :class:`EngineClient` drives either: health
and identity (``/health``, ``/v1/models``, ``/version``), generation (``/v1/completions``,
``/v1/chat/completions``, plain or server-sent events), sleep (``/sleep``, ``/wake_up``,
``/is_sleeping``), the RL routes (``/pause``, ``/resume``, ``/is_paused``,
``/abort_requests``, ``/collective_rpc``, ``/reset_prefix_cache``), the four-phase weight
push (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``) and Prometheus metrics (``/metrics``, parsed by
``prometheus_client``).

Errors: an answer that is not 2xx raises :class:`EngineError` with the status and the
message of the engine's JSON error body (vLLM's ``{"error": {"message": ...}}``, or a
top-level ``message``, an ``error`` string, FastAPI's ``detail``; else the body's first
line or the reason phrase); no answer at all (refused, reset, timed out) raises
:class:`EngineUnreachable`, status 0. An error event inside a stream raises
:class:`EngineError` too.

The node agent's workers are synchronous threads: :func:`call` runs one coroutine on a
fresh client under ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pearl.engines.vllm_weights import METHOD as PUBLISHED_WEIGHTS_METHOD
from pearl.io.untrusted import UntrustedInput, loads_json

JsonDict = dict[str, Any]
T = TypeVar("T")
MAX_ANSWER_BYTES = 256 * 2**20  # one answer or stream event (the largest: prompt logprobs)
PauseMode = Literal["abort", "wait", "keep"]


class EngineError(RuntimeError):
    """An engine answered with an error status (or, status 0, did not answer)."""

    def __init__(self, status: int, message: str, url: str) -> None:
        where = f"HTTP {status}" if status else "unreachable"
        super().__init__(f"{where}: {message}")
        self.status, self.message, self.url = status, message, url


class EngineUnreachable(EngineError):
    """No answer from the engine: connection refused or reset, or a timeout."""

    def __init__(self, message: str, url: str) -> None:
        super().__init__(0, message, url)


def error_message(body: bytes, reason: str) -> str:
    """The message of an engine's error body (see the module docstring)."""
    try:
        doc = loads_json(body, max_bytes=MAX_ANSWER_BYTES)
    except ValueError:
        text = body.decode(errors="replace").strip()
        return text.splitlines()[0] if text else reason
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        for value in (err, doc.get("message"), doc.get("detail")):
            if isinstance(value, str):
                return value
    return reason


def sample_sums(text: str) -> dict[str, float]:
    """Prometheus text as sample name -> value summed over its labels (``_total``, ``_sum``,
    ``_count`` keep their suffix); histogram buckets and ``_created`` stamps are left out."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            sums[s.name] = sums.get(s.name, 0.0) + s.value
    return sums


def histogram_buckets(text: str, name: str) -> list[tuple[float, float]]:
    """A histogram's cumulative buckets ``(le, count)``, summed over its other labels and
    sorted by ``le`` (``+Inf`` last); ``name`` with or without ``_bucket``."""
    wanted = name if name.endswith("_bucket") else f"{name}_bucket"
    counts: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == wanted and "le" in s.labels:
                le = float(s.labels["le"])
                counts[le] = counts.get(le, 0.0) + s.value
    return sorted(counts.items())


class EngineClient:
    """An engine at ``base_url`` (``http://HOST:PORT``); an async context manager."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        # verify=False: plain HTTP needs no certificates, and loading them costs a
        # noticeable share of a short call.
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=timeout_s,
            transport=transport,
            verify=not self.base_url.startswith("http://"),
        )

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # --- the one place requests are sent -------------------------------------------

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: object = None,
        content: bytes | None = None,
        params: httpx.QueryParams | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        url = f"{self.base_url}{path}"
        try:
            r = await self._http.request(
                method,
                path,
                json=json_body,
                content=content,
                params=params,
                headers=headers,
                timeout=self.timeout_s if timeout_s is None else timeout_s,
            )
        except httpx.TransportError as err:
            raise EngineUnreachable(_transport_message(err), url) from None
        if not r.is_success:
            raise EngineError(r.status_code, error_message(r.content, r.reason_phrase), url)
        return r

    async def _json(self, method: str, path: str, **kw: Any) -> JsonDict:
        r = await self._request(method, path, **kw)
        if not r.content:
            return {}
        try:
            doc = loads_json(r.content, max_bytes=MAX_ANSWER_BYTES)
        except UntrustedInput as err:
            raise EngineError(502, f"the engine's answer: {err}", str(r.url)) from None
        return doc if isinstance(doc, dict) else {"result": doc}

    async def _stream(
        self, path: str, body: JsonDict, request_id: str | None
    ) -> AsyncIterator[JsonDict]:
        url = f"{self.base_url}{path}"
        try:
            async with self._http.stream(
                "POST", path, json={**body, "stream": True}, headers=_request_id(request_id)
            ) as r:
                if not r.is_success:
                    text = await r.aread()
                    raise EngineError(r.status_code, error_message(text, r.reason_phrase), url)
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, event names
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    try:
                        event = loads_json(data, max_bytes=MAX_ANSWER_BYTES)
                    except UntrustedInput as bad:
                        raise EngineError(502, f"the engine's event: {bad}", url) from None
                    if isinstance(event, dict) and "error" in event:
                        err = event["error"]
                        code = err.get("code") if isinstance(err, dict) else None
                        status = code if isinstance(code, int) else 500
                        raise EngineError(status, error_message(data.encode(), "error"), url)
                    yield event
        except httpx.TransportError as err:
            raise EngineUnreachable(_transport_message(err), url) from None

    # --- health and identity ----------------------------------------------------------

    async def health(self) -> bool:
        """True if ``GET /health`` answers 2xx; False on an error status or no answer."""
        try:
            await self._request("GET", "/health")
        except EngineError:
            return False
        return True

    async def models(self) -> JsonDict:
        return await self._json("GET", "/v1/models")

    async def version(self) -> str:
        return str((await self._json("GET", "/version")).get("version", ""))

    # --- generation -------------------------------------------------------------------

    async def completions(self, body: JsonDict, *, request_id: str | None = None) -> JsonDict:
        return await self._json(
            "POST", "/v1/completions", json_body=body, headers=_request_id(request_id)
        )

    def stream_completions(
        self, body: JsonDict, *, request_id: str | None = None
    ) -> AsyncIterator[JsonDict]:
        """The events of ``POST /v1/completions`` with ``stream: true``, up to ``[DONE]``."""
        return self._stream("/v1/completions", body, request_id)

    async def chat_completions(self, body: JsonDict, *, request_id: str | None = None) -> JsonDict:
        return await self._json(
            "POST", "/v1/chat/completions", json_body=body, headers=_request_id(request_id)
        )

    def stream_chat_completions(
        self, body: JsonDict, *, request_id: str | None = None
    ) -> AsyncIterator[JsonDict]:
        return self._stream("/v1/chat/completions", body, request_id)

    # --- sleep, pause, abort ----------------------------------------------------------

    async def sleep(self, level: int = 1) -> None:
        """Level 1 offloads the weights to host memory and drops the KV cache; level 2
        drops both."""
        await self._request("POST", "/sleep", params=httpx.QueryParams(level=level))

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wake ``tags`` (``weights``, ``kv_cache``); all of them when None."""
        await self._request(
            "POST", "/wake_up", params=httpx.QueryParams([("tags", t) for t in tags or ()])
        )

    async def is_sleeping(self) -> bool:
        return bool((await self._json("GET", "/is_sleeping")).get("is_sleeping"))

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Pause generation: abort in-flight requests, wait for them, or keep them frozen."""
        await self._request("POST", "/pause", params=httpx.QueryParams(mode=mode))

    async def resume(self) -> None:
        await self._request("POST", "/resume")

    async def is_paused(self) -> bool:
        return bool((await self._json("GET", "/is_paused")).get("is_paused"))

    async def abort_requests(self, request_ids: Sequence[str]) -> None:
        await self._request("POST", "/abort_requests", json_body={"request_ids": list(request_ids)})

    async def reset_prefix_cache(self) -> None:
        await self._request("POST", "/reset_prefix_cache")

    # --- weights ----------------------------------------------------------------------

    async def collective_rpc(
        self,
        method: str,
        *,
        args: Sequence[object] = (),
        kwargs: dict[str, object] | None = None,
        timeout_s: float | None = None,
    ) -> JsonDict:
        """``POST /collective_rpc``: ``method`` on every worker of the engine; the answer
        (vLLM's ``{"results": [...]}``). ``timeout_s`` is the engine's own deadline; the
        HTTP request waits at least as long."""
        body: JsonDict = {"method": method}
        if args:
            body["args"] = list(args)
        if kwargs is not None:
            body["kwargs"] = kwargs
        wait_s = self.timeout_s
        if timeout_s is not None:
            body["timeout"] = timeout_s
            wait_s = max(wait_s, timeout_s)
        return await self._json("POST", "/collective_rpc", json_body=body, timeout_s=wait_s)

    async def reload_weights(
        self, weights_path: str | None = None, weight_version: int | None = None
    ) -> JsonDict:
        """The engine reloads its weights: from its model path (vLLM's ``reload_weights``),
        or from ``weights_path``, a directory the trainer published (``load_published_weights``,
        pearl's worker extension in vLLM, :mod:`pearl.engines.vllm_weights`; the reference
        engine answers both)."""
        if weights_path is None:
            return await self.collective_rpc("reload_weights")
        kwargs: dict[str, object] = {"weights_path": weights_path}
        if weight_version is not None:
            kwargs["weight_version"] = weight_version
        return await self.collective_rpc(PUBLISHED_WEIGHTS_METHOD, kwargs=kwargs)

    async def init_weight_transfer_engine(self, init_info: JsonDict) -> None:
        await self._request(
            "POST", "/init_weight_transfer_engine", json_body={"init_info": init_info}
        )

    async def start_weight_update(self) -> None:
        await self._request("POST", "/start_weight_update", json_body={})

    async def update_weights(
        self, update_info: JsonDict | None = None, *, data: bytes | None = None
    ) -> None:
        """One batch of weights: vLLM's ``{"update_info": ...}`` (the tensors travel over
        the transfer backend), or ``data``, safetensors bytes in the body (pearl's reference
        engine). Not both."""
        if data is not None:
            if update_info is not None:
                raise ValueError("update_weights takes update_info or data, not both")
            await self._request(
                "POST",
                "/update_weights",
                content=data,
                headers={"Content-Type": "application/octet-stream"},
            )
            return
        await self._request("POST", "/update_weights", json_body={"update_info": update_info or {}})

    async def finish_weight_update(self, weight_version: int | str) -> None:
        await self._request(
            "POST", "/finish_weight_update", json_body={"weight_version": weight_version}
        )

    # --- metrics ----------------------------------------------------------------------

    async def metrics_text(self) -> str:
        return (await self._request("GET", "/metrics")).text

    async def metrics(self) -> dict[str, float]:
        """Every sample by name, summed over its labels (:func:`sample_sums`)."""
        return sample_sums(await self.metrics_text())

    async def histogram(self, name: str) -> list[tuple[float, float]]:
        """The cumulative buckets of histogram ``name`` (:func:`histogram_buckets`)."""
        return histogram_buckets(await self.metrics_text(), name)

    async def num_requests_running(self) -> float:
        """``vllm:num_requests_running`` over all labels (0 if the engine has none)."""
        return (await self.metrics()).get("vllm:num_requests_running", 0.0)


def call(
    coro_fn: Callable[[EngineClient], Awaitable[T]], base_url: str, timeout_s: float = 30.0
) -> T:
    """``coro_fn`` on a fresh client, from synchronous code (a thread without a running
    event loop): ``call(lambda c: c.sleep(1), url, 5.0)``."""

    async def run() -> T:
        async with EngineClient(base_url, timeout_s=timeout_s) as client:
            return await coro_fn(client)

    return asyncio.run(run())


def _request_id(request_id: str | None) -> dict[str, str] | None:
    return None if request_id is None else {"X-Request-Id": request_id}


def _transport_message(err: httpx.TransportError) -> str:
    detail = str(err) or "no detail"
    return f"{type(err).__name__}: {detail}"
