"""An OpenAI-compatible front on the router, so that an agent written against the OpenAI
SDK runs through pearl (as AReaL allows): ``POST /v1/chat/completions`` and
``POST /v1/completions``, routed turn by turn like pearl's own agent loop.

The calls of one trajectory are tied together by the header ``X-Session-Id`` (the OpenAI
SDK sends it with ``extra_headers``; without it each call is a trajectory of its own, not
recorded): the
router keeps the session's home instance, and the front records every turn of the session
(prompt token ids, generated token ids, their logprobs and weight versions), which
``GET /sessions/{id}`` returns and ``DELETE /sessions/{id}`` hands over and forgets. The
chat route applies the model's chat template and parses Hermes-style tool calls, as the
engines' own chat route does; generation itself always goes through the router's
completions, so routing, PD and migration are the same for both. Not supported yet (a
400 says so): ``stream`` and stop strings. An engine's 4xx comes back as it is; a turn the
router gave up on is a 503. The coordinator's plan steps reach the instance table through
the admin routes under ``/pearl/`` (``pearl.router.admin``; ``app.state.plan_steps`` is
the :class:`~pearl.router.plan_steps.PlanSteps` they apply).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Coroutine
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pearl.engines.client import EngineError
from pearl.engines.protocol import (
    MAX_BODY_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    RequestRejected,
    error_response,
    install_guards,
    usage,
)
from pearl.engines.reference.tokenizer import Tokenizer
from pearl.engines.reference.tool_calls import parse_tool_calls
from pearl.router.admin import admin_routes
from pearl.router.plan_steps import PlanSteps
from pearl.router.router import Router, Sampling, Turn, TurnFailed, TurnOutput

T = TypeVar("T")
SESSION_HEADER = "x-session-id"
DEFAULT_MAX_TOKENS = 256
MAX_SESSION_ID_CHARS = 256  # of X-Session-Id (the engines take request ids of 512)
MAX_SESSIONS = 65_536  # recorded sessions at once; past it a new one is a 429
OFFLOAD_CHARS = 16_384  # prompt text this long is tokenized off the event loop
DISCONNECT_POLL_S = 0.5  # how often a turn in progress checks that its caller is still there
# the longest prompt routed: its ids (up to 7 bytes each, as JSON) fit an engine's body limit
MAX_PROMPT_TOKENS = MAX_BODY_BYTES // 8


@dataclass
class RecordedTurn:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str | None
    served_by: list[str]


@dataclass
class Session:
    session_id: str
    turns: list[RecordedTurn] = field(default_factory=list)


def build_front(
    router: Router, tokenizer: Tokenizer, model_name: str, steps: PlanSteps | None = None
) -> FastAPI:
    app = FastAPI(title="pearl router")
    install_guards(app)
    sessions: dict[str, Session] = {}
    app.state.plan_steps = steps = steps or PlanSteps(router)
    app.include_router(admin_routes(steps))

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, err: EngineError) -> JSONResponse:
        status = err.status if 400 <= err.status < 500 else 502
        return error_response(err.message, status)

    @app.exception_handler(TurnFailed)
    async def _failed(_: Request, err: TurnFailed) -> JSONResponse:
        return error_response(str(err), 503)

    def _session(request: Request) -> Session:
        """The call's session: the header's, or a new one that is not kept (no later call
        could name it)."""
        sid = request.headers.get(SESSION_HEADER)
        if sid is None:
            return Session(uuid.uuid4().hex)
        if not 0 < len(sid) <= MAX_SESSION_ID_CHARS:
            raise RequestRejected(
                400, f"X-Session-Id: 1 to {MAX_SESSION_ID_CHARS} characters", "X-Session-Id"
            )
        if sid not in sessions and len(sessions) >= MAX_SESSIONS:
            raise RequestRejected(
                429,
                f"X-Session-Id: {MAX_SESSIONS} sessions are open; end one "
                "(DELETE /sessions/{id}) before starting another",
                "X-Session-Id",
            )
        return sessions.setdefault(sid, Session(sid))

    def _unsupported(body: CompletionRequest | ChatCompletionRequest) -> JSONResponse | None:
        if body.stream:
            return error_response("stream: not supported by the router", 400, "stream")
        if body.stops():
            return error_response("stop: use stop_token_ids", 400, "stop")
        return None

    async def _encode(text: str) -> list[int]:
        """``text``'s token ids; a long one on a worker thread (the tokenizers library's
        batch call lets the GIL go), so the event loop goes on routing."""
        if len(text) <= OFFLOAD_CHARS:
            return tokenizer.encode(text)
        (one,) = await asyncio.to_thread(
            tokenizer.backend.encode_batch, [text], add_special_tokens=False
        )
        return list(one.ids)

    async def _run(
        request: Request,
        session: Session,
        prompt: list[int],
        body: CompletionRequest | ChatCompletionRequest,
    ) -> TurnOutput:
        if len(prompt) > MAX_PROMPT_TOKENS:
            raise RequestRejected(
                400,
                f"prompt: {len(prompt)} tokens, more than the {MAX_PROMPT_TOKENS} routed",
                "prompt",
            )
        max_tokens = body.max_tokens
        if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        sampling = Sampling(
            max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids),
            ignore_eos=body.ignore_eos,
        )
        turn_id = f"{session.session_id}-t{len(session.turns)}"
        turn = Turn(session.session_id, tuple(prompt), sampling, turn_id)
        out = await _while_connected(request, router.generate(turn))
        session.turns.append(
            RecordedTurn(
                prompt, out.token_ids, out.logprobs, out.versions, out.finish_reason, out.served_by
            )
        )
        return out

    def _answer(
        kind: str, obj: str, choice: dict[str, Any], prompt: list[int], out: TurnOutput
    ) -> JSONResponse:
        return JSONResponse(
            {
                "id": f"{kind}-{uuid.uuid4().hex}",
                "created": int(time.time()),
                "model": model_name,
                "object": obj,
                "choices": [choice],
                "usage": usage(len(prompt), len(out.token_ids)),
            }
        )

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> JSONResponse:
        if (refused := _unsupported(body)) is not None:
            return refused
        p = body.prompt
        if isinstance(p, str):
            prompt = await _encode(p)
        elif p and all(isinstance(x, int) for x in p):
            prompt = [int(x) for x in p]  # type: ignore[arg-type]
        else:
            return error_response("prompt: one prompt per request", 400, "prompt")
        out = await _run(request, _session(request), prompt, body)
        choice = {
            "index": 0,
            "text": tokenizer.decode(out.token_ids),
            "logprobs": {"token_logprobs": out.logprobs} if body.logprobs is not None else None,
            "finish_reason": out.finish_reason,
            "token_ids": out.token_ids,
            "weight_versions": out.versions,
        }
        return _answer("cmpl", "text_completion", choice, prompt, out)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> JSONResponse:
        if (refused := _unsupported(body)) is not None:
            return refused
        try:  # on a worker thread: a long conversation takes a while to render
            text = await asyncio.to_thread(
                tokenizer.apply_chat_template, body.messages, tools=body.tools
            )
        except Exception as err:  # the template refused the conversation
            return error_response(f"messages: {str(err)[:200]}", 400, "messages")
        prompt = await _encode(text)
        out = await _run(request, _session(request), prompt, body)
        content: str | None = tokenizer.decode(out.token_ids)
        calls: list[dict[str, Any]] = []
        if body.tools and body.tool_choice != "none" and content is not None:
            content, calls = parse_tool_calls(content)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        choice = {
            "index": 0,
            "message": message,
            "finish_reason": "tool_calls" if calls else out.finish_reason,
            "token_ids": out.token_ids,
            "weight_versions": out.versions,
        }
        return _answer("chatcmpl", "chat.completion", choice, prompt, out)

    def _record(session_id: str, s: Session | None) -> JSONResponse:
        if s is None:
            return error_response(f"session_id: no session {session_id[:80]!r}", 404, "session_id")
        return JSONResponse({"session_id": s.session_id, "turns": [asdict(t) for t in s.turns]})

    @app.get("/sessions/{session_id}")
    async def get_session(session_id: str) -> JSONResponse:
        return _record(session_id, sessions.get(session_id))

    @app.delete("/sessions/{session_id}")
    async def end_session(session_id: str) -> JSONResponse:
        router.forget(session_id)
        return _record(session_id, sessions.pop(session_id, None))

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"instances": sum(1 for i in router.table if i.accepting)})

    return app


async def _while_connected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result; cancelled if the caller goes away first (its turn's request to
    the engine is dropped, and the engine aborts it), answered 499 to nobody."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise RequestRejected(499, "the client went away", None)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
