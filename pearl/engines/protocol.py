"""vLLM's HTTP protocol as pearl speaks it: request bodies, response bodies, errors, and the
guards every pearl HTTP server (the reference engine, the router, the trainer) puts in
front of its routes.

Pydantic models of the request bodies of ``/v1/completions`` and ``/v1/chat/completions``
with the fields vLLM takes that pearl uses (OpenAI's, plus vLLM's ``stop_token_ids``,
``ignore_eos``, ``min_tokens``, ``return_tokens_as_token_ids``, ``return_token_ids``,
``kv_transfer_params``), and the functions that build the response bodies and error
bodies as vLLM returns them. Unknown fields are accepted and ignored, as vLLM does. One
field is pearl's own: each choice carries ``weight_versions``, the weight version that
generated each of its tokens (AReaL's ``output_versions``), so that a trajectory
interrupted by a weight update knows which tokens are stale.

Errors: every error of a pearl server has vLLM's body ``{"error": {"message", "type",
"param", "code"}}``: ``code`` is the status, ``type`` its name (``BadRequestError`` 400,
``NotFoundError`` 404, ``MethodNotAllowedError`` 405, ``RequestEntityTooLargeError`` 413,
``InternalServerError`` 500, ...), ``param`` the field at fault (a dotted path; ``body``
for the body as a whole, ``query.NAME`` for a query parameter) or null, and a message
that starts with that field. A bad request is a 400 (vLLM's status, not FastAPI's 422).

Limits (``install_guards``; docs/engines.md, "Bad requests and limits"): a body at most
``MAX_BODY_BYTES`` (a route may take more: the engine's weight push, the trainer's
batches), refused with a 413 from its ``Content-Length`` before it is read, or as soon as a
chunked body passes the limit; a JSON body parsed by ``pearl.io.untrusted`` (nesting,
finite numbers, UTF-8); and every number of the request models finite and bounded (the
``MAX_*`` constants below).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine, Mapping
from http import HTTPStatus
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pearl.io.untrusted import UntrustedInput, loads_json

MAX_BODY_BYTES = 8 * 2**20  # a request body (a 1M-token prompt as ids is about 7 MiB)
INT64_MAX = 2**63 - 1  # every integer of a request is an int64, as vLLM's seed
MAX_TEMPERATURE = 100.0  # far past uniform: a larger one samples the same
MIN_TEMPERATURE = 0.01  # a smaller positive one is raised to it, as vLLM does (inf logits)
MAX_PROMPTS = 256  # prompts in one completions request
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024  # of one stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_ID_CHARS = 512  # a request id (X-Request-Id), a KV transfer's engine and request ids
MAX_HOST_CHARS = 255  # a DNS name
MAX_BLOCK_IDS = 2**20  # remote_block_ids of one KV transfer
MAX_ABORT_IDS = 65_536  # request_ids of one POST /abort_requests
OFFLOAD_BYTES = 256 * 2**10  # a JSON body this large is parsed off the event loop

Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
StopStrings = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]


class KVTransferParams(BaseModel):
    """``kv_transfer_params`` of vLLM's disaggregated prefill (NixlConnector)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    remote_request_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    remote_block_ids: list[Count] | None = Field(None, max_length=MAX_BLOCK_IDS)
    remote_host: str | None = Field(None, min_length=1, max_length=MAX_HOST_CHARS)
    remote_port: int | None = Field(None, ge=1, le=65535)
    tp_size: int | None = Field(None, ge=1, le=65535)

    @field_validator("remote_host")
    @classmethod
    def _host(cls, host: str | None) -> str | None:
        if host is not None and (not host.isprintable() or " " in host):
            raise ValueError("a host name or address (printable, no spaces)")
        return host

    def pulls(self) -> bool:
        """A decode whose prompt's KV is to be pulled: vLLM does the transfer only when
        every one of these is given."""
        return self.do_remote_prefill and None not in (
            self.remote_engine_id,
            self.remote_request_id,
            self.remote_block_ids,
            self.remote_host,
            self.remote_port,
        )


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    max_tokens: Count | None = None
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: Int64 | None = None
    n: int = Field(1, ge=1, le=INT64_MAX)
    stop: StopString | StopStrings | None = None
    stop_token_ids: list[TokenId] = Field([], max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: Count = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    kv_transfer_params: KVTransferParams | None = None
    return_token_ids: bool = False

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("n > 1 is not supported (send one request per sample)")
        return n

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Count | None = None
    echo: bool = False
    return_tokens_as_token_ids: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompts(
        cls, prompt: str | list[int] | list[str] | list[list[int]]
    ) -> str | list[int] | list[str] | list[list[int]]:
        # a list of token ids may be long (up to the body's limit); a list of prompts not
        several = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        if several and len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: Count | None = None
    max_completion_tokens: Count | None = None
    add_generation_prompt: bool = True
    return_tokens_as_token_ids: bool = False


def error_type(status: int) -> str:
    """vLLM's name of an error status: ``BadRequestError`` (400), ``NotFoundError`` (404),
    ``InternalServerError`` (500), ..."""
    try:
        words = HTTPStatus(status).phrase.replace("-", " ").split()
    except ValueError:
        return "InternalServerError" if status >= 500 else "BadRequestError"
    name = "".join(w[:1].upper() + w[1:] for w in words)
    return name if name.endswith("Error") else f"{name}Error"


def error_body(message: str, *, status: int = 400, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": error_type(status), "param": param, "code": status}
    }


def error_response(
    message: str,
    status: int = 400,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, status=status, param=param), status, headers=headers)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


FinishReason = Literal["stop", "length", "abort", "tool_calls"] | None


# -- the guards of every pearl HTTP server ---------------------------------------------------


class RequestRejected(HTTPException):
    """A request refused before (or as) its route reads it: a status, the message (which
    starts with ``param``) and the field at fault. An ``HTTPException``, so FastAPI's own
    body parsing passes it on unchanged to the handler ``install_guards`` installs."""

    def __init__(
        self, status: int, message: str, param: str | None = "body", *, close: bool = False
    ) -> None:
        super().__init__(status, message, headers={"connection": "close"} if close else None)
        self.param = param


_LIMIT_KEY = "pearl.max_body_bytes"  # the scope's key for the route's limit (BodyLimit sets it)


def too_large(limit_bytes: int, declared_bytes: int | None = None) -> str:
    size = "more" if declared_bytes is None else f"{declared_bytes} bytes (its Content-Length)"
    return f"body: {size}, and this route takes at most {limit_bytes} bytes"


class BodyLimit:
    """ASGI middleware: a request whose body is over its path's limit is a 413 with vLLM's
    error body, from its ``Content-Length`` before the route runs (nothing of the body is
    read), or, for a body without one (chunked), as soon as what has arrived passes the
    limit (``RequestRejected`` from ``receive``: the route that reads the body answers it)."""

    def __init__(
        self, app: ASGIApp, max_body_bytes: int, route_limits: Mapping[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.route_limits = dict(route_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.route_limits.get(scope["path"], self.max_body_bytes)
        scope[_LIMIT_KEY] = limit
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            body = json.dumps(error_body(too_large(limit, declared), status=413, param="body"))
            await _send_json(send, 413, body.encode())
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise RequestRejected(413, too_large(limit), close=True)
            return message

        await self.app(scope, limited, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses it before we get here
    return None


async def _send_json(send: Send, status: int, body: bytes) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),  # the unread body is not worth reading
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def parse_json_body(data: bytes, max_bytes: int) -> Any:
    """A request body as one JSON value, parsed as pearl parses every untrusted text
    (``pearl.io.untrusted.loads_json``: nesting, finite numbers, UTF-8); a large one on a
    worker thread, so the event loop goes on serving. ``RequestRejected`` (400) naming the
    field otherwise."""
    try:
        if len(data) > OFFLOAD_BYTES:
            return await asyncio.to_thread(loads_json, data, max_bytes=max_bytes)
        return loads_json(data, max_bytes=max_bytes)
    except UntrustedInput as err:
        field = err.field if err.field and not err.field.startswith("line ") else "body"
        where = f" ({err.field})" if err.field.startswith("line ") else ""
        raise RequestRejected(400, f"{field}: {err.problem}{where}", field) from None
    except ValueError as err:  # an integer of more than 4300 digits
        raise RequestRejected(400, f"body: malformed JSON: {err}", "body") from None


class _UntrustedJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_untrusted_json"):
            limit = self.scope.get(_LIMIT_KEY, MAX_BODY_BYTES)
            self._untrusted_json = await parse_json_body(await self.body(), limit)
        return self._untrusted_json


class UntrustedJSONRoute(APIRoute):
    """A route whose JSON body FastAPI reads through ``parse_json_body``: set it as the
    route class of an app or ``APIRouter`` before its routes are added."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handler(request: Request) -> Response:
            return await handle(_UntrustedJSONRequest(request.scope, request.receive))

        return handler


def validation_error(err: RequestValidationError) -> JSONResponse:
    """A 400 naming the first field that failed its model's checks."""
    errors = err.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx")
        problem = ctx.get("error", "invalid") if isinstance(ctx, dict) else "invalid"
        return error_response(f"body: malformed JSON: {problem}", 400, "body")
    where = _field_of(first.get("loc", ()))
    # a field of several types (``stop``: a string or a list) has an error per type: the
    # one that is not "should be a TYPE" says what is wrong (a list too long, say)
    same = [e for e in errors if _field_of(e.get("loc", ())) == where]
    told = next((e for e in same if not str(e.get("type", "")).endswith("_type")), first)
    return error_response(f"{where}: {told.get('msg')}", 400, where)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "tuple", "none"})


def _field_of(loc: Any) -> str:
    """A validation error's field, as a dotted path: without ``body`` and without the
    tags pydantic adds for the types of a union (``str``, ``list[int]``, ...)."""
    parts = [
        str(p)
        for p in loc
        if p != "body" and (isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS))
    ]
    return ".".join(parts) or "body"


def install_guards(
    app: FastAPI,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    route_limits: Mapping[str, int] | None = None,
) -> None:
    """What every pearl server answers before and around its routes (the module
    docstring): the body limit (``route_limits``: a path's own), JSON parsed as untrusted,
    and every error in vLLM's body: a validation failure 400, an unknown route 404 (a path
    with a trailing slash too: no redirects), a wrong method 405, anything unexpected 500
    (and its traceback in the log). Call it before the routes are added."""
    app.router.route_class = UntrustedJSONRoute
    app.router.redirect_slashes = False  # ``/v1/completions/`` is a 404, not a redirect
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes, route_limits=route_limits)

    async def rejected(_: Request, err: Exception) -> Response:
        assert isinstance(err, HTTPException)
        param = getattr(err, "param", None)
        return error_response(str(err.detail), err.status_code, param, err.headers)

    async def invalid(_: Request, err: Exception) -> Response:
        assert isinstance(err, RequestValidationError)
        return validation_error(err)

    async def failed(_: Request, err: Exception) -> Response:
        return error_response(f"{type(err).__name__}: {err}", 500)

    app.add_exception_handler(HTTPException, rejected)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(Exception, failed)
