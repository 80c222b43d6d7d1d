"""``pearl engine serve``: the reference engine's HTTP server, on vLLM's routes.

FastAPI + uvicorn, as vLLM's own OpenAI-compatible server. The routes (``docs/engines.md``
lists them with their fields):

- ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed or not; PD by
  ``kv_transfer_params`` on both), ``GET /v1/models``, ``GET /health``, ``GET /version``,
  ``GET /metrics``;
- vLLM's sleep mode: ``POST /sleep?level=1|2``, ``POST /wake_up?tags=...``,
  ``GET /is_sleeping``;
- vLLM's RL routes: ``POST /pause?mode=abort|wait|keep``, ``POST /resume``,
  ``GET /is_paused``, ``POST /abort_requests``, ``POST /reset_prefix_cache``,
  ``POST /collective_rpc`` (``reload_weights``, and ``load_published_weights``, the method
  pearl's worker extension adds to vLLM: both take ``weights_path`` and
  ``weight_version``), and the weight push
  (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``; see :mod:`.weights_push`).

A bad request gets 400 with vLLM's JSON error body, and the server goes on serving; the
guards in front of the routes (a body limit, JSON parsed as untrusted, 404 and 405 in the
same body) are ``pearl.engines.protocol.install_guards``'s, every bound of a request field
the request models'. A prompt's tokenization and a chat template's rendering run off the
event loop, so one large request does not hold the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import torch
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from safetensors import SafetensorError

from pearl.engines.protocol import (
    MAX_ABORT_IDS,
    MAX_ID_CHARS,
    ChatCompletionRequest,
    CompletionRequest,
    KVTransferParams,
    error_response,
    install_guards,
    usage,
)
from pearl.engines.reference.errors import BadRequestError, weight_version_of
from pearl.engines.reference.generation import (
    Generation,
    chat_logprobs,
    completion_logprobs,
    text_of,
)
from pearl.engines.reference.instance import Instance
from pearl.engines.reference.sequence import RemoteKV, SamplingParams, Seq
from pearl.engines.reference.streaming import deltas
from pearl.engines.reference.tool_calls import parse_tool_calls
from pearl.engines.reference.transfer import TransferError, pull
from pearl.engines.vllm_weights import METHOD as PUBLISHED_WEIGHTS_METHOD
from pearl.io.documents import InputError

RPC_METHODS = ("reload_weights", PUBLISHED_WEIGHTS_METHOD)  # of POST /collective_rpc
PUSH_HEADER_BYTES = 64 * 2**20  # a weight push's safetensors header, over its tensors' bytes
SHOWN_CHARS = 80  # of a rejected value in an error message


def push_limit_bytes(inst: Instance) -> int:
    """The body limit of ``POST /update_weights``: every weight of the model in float32,
    and room for the safetensors header."""
    params = sum(math.prod(shape) for shape in inst.model.shapes.values())
    return 4 * params + PUSH_HEADER_BYTES


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def _sse(obj: Any) -> bytes:
    import json

    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def build_app(inst: Instance) -> FastAPI:
    app = FastAPI(title="pearl reference engine")
    install_guards(app, route_limits={"/update_weights": push_limit_bytes(inst)})

    @app.exception_handler(BadRequestError)
    async def _bad(_: Request, err: BadRequestError) -> JSONResponse:
        return error_response(str(err), 400, err.param)

    @app.exception_handler(InputError)
    async def _bad_file(_: Request, err: InputError) -> JSONResponse:
        return error_response(str(err), 400, err.field or None)

    # -- generation --------------------------------------------------------------------

    async def _remote_kv(kv: KVTransferParams, prompt: list[int]) -> RemoteKV | None:
        if not kv.pulls():
            if kv.do_remote_prefill:
                raise BadRequestError(
                    "kv_transfer_params: a remote prefill needs remote_engine_id, "
                    "remote_request_id, remote_block_ids, remote_host and remote_port",
                    "kv_transfer_params",
                )
            return None
        assert kv.remote_host and kv.remote_port and kv.remote_engine_id and kv.remote_request_id
        t0 = time.monotonic()
        try:
            (keys, values, logits), size = await pull(
                kv.remote_host,
                kv.remote_port,
                kv.remote_engine_id,
                kv.remote_request_id,
                max_bytes=inst.kv_transfer_bytes(len(prompt)),
            )
        except TransferError as err:
            raise BadRequestError(f"kv_transfer_params: {err}", "kv_transfer_params") from None
        except (KeyError, TypeError, ValueError, OverflowError, SafetensorError) as err:
            problem = f"the peer's answer is not a held prefill: {type(err).__name__}: {err}"
            raise BadRequestError(f"kv_transfer_params: {problem}", "kv_transfer_params") from None
        inst.metrics.kv_transfer_time.observe(time.monotonic() - t0)
        inst.metrics.kv_transfer_bytes.inc(size)
        expected = inst.kv_shape(len(prompt))
        if tuple(keys.shape) != expected or tuple(logits.shape) != (inst.vocab_size,):
            raise BadRequestError(
                f"kv_transfer_params: the remote KV has shape {tuple(keys.shape)}, this "
                f"instance needs {expected} for a prompt of {len(prompt)} tokens",
                "kv_transfer_params",
            )
        floats = all(t.is_floating_point() for t in (keys, values, logits))
        if not floats or not bool(torch.isfinite(logits).all()):
            raise BadRequestError(
                "kv_transfer_params: the remote KV is not finite floating-point numbers",
                "kv_transfer_params",
            )
        return RemoteKV(keys, values, logits)

    async def _start(
        rid: str, prompts: list[list[int]], params: SamplingParams, kv: KVTransferParams | None
    ) -> tuple[list[Generation], list[Seq]]:
        loop = asyncio.get_running_loop()
        if kv is not None and (kv.do_remote_decode or kv.do_remote_prefill) and len(prompts) > 1:
            raise BadRequestError("kv_transfer_params: one prompt per request", "prompt")
        if rid in inst.live_ids or rid in inst.core.held:
            raise BadRequestError(f"X-Request-Id: {rid!r} is already in use", "X-Request-Id")
        gens, seqs = [], []
        for i, prompt in enumerate(prompts):
            remote = await _remote_kv(kv, prompt) if kv is not None else None
            g = Generation(loop, on_finish=partial(inst.live_ids.discard, rid))
            sid = rid if len(prompts) == 1 else f"{rid}#{i}"
            hold = kv is not None and kv.do_remote_decode
            seq = Seq(sid, prompt, params, g.emit, time.monotonic(), hold_kv=hold, remote=remote)
            gens.append(g)
            seqs.append(seq)
        inst.live_ids.add(rid)
        for seq in seqs:
            inst.core.submit(seq)
        return gens, seqs

    def _abort(seqs: list[Seq]) -> None:
        inst.core.call(lambda: inst.core.abort([s.request_id for s in seqs]))

    async def _finish_all(request: Request, gens: list[Generation], seqs: list[Seq]) -> None:
        """Every generation to its finish; abort them if the client goes away."""
        done = asyncio.ensure_future(asyncio.gather(*(g.finished() for g in gens)))
        try:
            while not done.done():
                await asyncio.wait([done], timeout=0.5)
                if not done.done() and await request.is_disconnected():
                    _abort(seqs)
                    await done
        except asyncio.CancelledError:
            _abort(seqs)
            raise

    def _kv_params(g: Generation, sid: str) -> dict[str, Any] | None:
        if g.kv_transfer_params is None:
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": g.kv_transfer_params["remote_block_ids"],
            "remote_engine_id": inst.engine_id,
            "remote_request_id": sid,
            "remote_host": inst.kv_host,
            "remote_port": inst.kv_port,
            "tp_size": 1,
        }

    def _rid(request: Request) -> str:
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        if len(rid) > MAX_ID_CHARS:
            raise BadRequestError(
                f"X-Request-Id: at most {MAX_ID_CHARS} characters ({len(rid)} given)",
                "X-Request-Id",
            )
        return rid

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        rid = _rid(request)
        prompts = await inst.completion_prompts(body)
        params = inst.sampling(body, max(len(p) for p in prompts), default_max_tokens=16)
        if body.stream and len(prompts) > 1:
            raise BadRequestError("stream with several prompts is not supported", "prompt")
        gens, seqs = await _start(rid, prompts, params, body.kv_transfer_params)
        as_ids = body.return_tokens_as_token_ids
        want_ids = body.return_token_ids or as_ids
        head = {"id": f"cmpl-{rid}", "created": int(time.time()), "model": inst.served_name}
        if body.stream:
            return StreamingResponse(
                _stream_completion(request, head, body, gens[0], seqs, want_ids),
                media_type="text/event-stream",
            )
        await _finish_all(request, gens, seqs)
        choices = []
        for i, (g, seq) in enumerate(zip(gens, seqs, strict=True)):
            choice: dict[str, Any] = {
                "index": i,
                "text": text_of(inst.tokenizer, g.token_ids, g.stop_reason),
                "logprobs": (
                    completion_logprobs(inst.tokenizer, g, 0, as_ids)
                    if body.logprobs is not None
                    else None
                ),
                "finish_reason": g.finish_reason,
                "stop_reason": g.stop_reason,
                "weight_versions": g.versions,
            }
            if want_ids:
                choice["token_ids"] = g.token_ids
                choice["prompt_token_ids"] = seq.prompt_ids
            choices.append(choice)
        n_prompt = sum(len(p) for p in prompts)
        n_out = sum(len(g.token_ids) for g in gens)
        return JSONResponse(
            {
                **head,
                "object": "text_completion",
                "choices": choices,
                "usage": usage(n_prompt, n_out),
                "kv_transfer_params": _kv_params(gens[0], seqs[0].request_id),
            }
        )

    async def _stream_completion(
        request: Request,
        head: dict[str, Any],
        body: CompletionRequest,
        g: Generation,
        seqs: list[Seq],
        want_ids: bool,
    ) -> AsyncIterator[bytes]:
        as_ids = body.return_tokens_as_token_ids
        try:
            async for d in deltas(g, inst.tokenizer, body.stops()):
                choice: dict[str, Any] = {
                    "index": 0,
                    "text": d.text,
                    "logprobs": (
                        completion_logprobs(inst.tokenizer, g, d.start, as_ids)
                        if body.logprobs is not None
                        else None
                    ),
                    "finish_reason": g.finish_reason,
                    "stop_reason": g.stop_reason,
                    "weight_versions": g.versions[d.start :],
                }
                if want_ids:
                    choice["token_ids"] = g.token_ids[d.start :]
                chunk = {**head, "object": "text_completion", "choices": [choice]}
                if d.finished:
                    chunk["kv_transfer_params"] = _kv_params(g, seqs[0].request_id)
                yield _sse(chunk)
            if body.stream_options and body.stream_options.include_usage:
                n_prompt = len(seqs[0].prompt_ids)
                yield _sse(
                    {
                        **head,
                        "object": "text_completion",
                        "choices": [],
                        "usage": usage(n_prompt, len(g.token_ids)),
                    }
                )
            yield b"data: [DONE]\n\n"
        finally:
            if g.finish_reason is None:  # the client went away
                _abort(seqs)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        rid = _rid(request)
        prompt = await inst.chat_prompt(body)
        params = inst.sampling(body, len(prompt), default_max_tokens=None)
        gens, seqs = await _start(rid, [prompt], params, body.kv_transfer_params)
        g, seq = gens[0], seqs[0]
        as_ids = body.return_tokens_as_token_ids
        head = {"id": f"chatcmpl-{rid}", "created": int(time.time()), "model": inst.served_name}
        if body.stream:
            return StreamingResponse(
                _stream_chat(head, body, g, seqs), media_type="text/event-stream"
            )
        await _finish_all(request, gens, seqs)
        text = text_of(inst.tokenizer, g.token_ids, g.stop_reason)
        content: str | None = text
        tool_calls: list[dict[str, Any]] = []
        if body.tools and body.tool_choice != "none":
            content, tool_calls = parse_tool_calls(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": chat_logprobs(inst.tokenizer, g, 0, as_ids) if body.logprobs else None,
            "finish_reason": "tool_calls" if tool_calls else g.finish_reason,
            "stop_reason": g.stop_reason,
            "weight_versions": g.versions,
        }
        if body.return_token_ids or as_ids:
            choice["token_ids"] = g.token_ids
        return JSONResponse(
            {
                **head,
                "object": "chat.completion",
                "choices": [choice],
                "usage": usage(len(prompt), len(g.token_ids)),
                "prompt_token_ids": seq.prompt_ids if body.return_token_ids else None,
                "kv_transfer_params": _kv_params(g, seq.request_id),
            }
        )

    async def _stream_chat(
        head: dict[str, Any], body: ChatCompletionRequest, g: Generation, seqs: list[Seq]
    ) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk"
        as_ids = body.return_tokens_as_token_ids
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        try:
            yield _sse({**head, "object": obj, "choices": [first]})
            async for d in deltas(g, inst.tokenizer, body.stops()):
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": {"content": d.text},
                    "logprobs": (
                        chat_logprobs(inst.tokenizer, g, d.start, as_ids) if body.logprobs else None
                    ),
                    "finish_reason": g.finish_reason,
                    "stop_reason": g.stop_reason,
                    "weight_versions": g.versions[d.start :],
                }
                if body.return_token_ids or as_ids:
                    choice["token_ids"] = g.token_ids[d.start :]
                chunk = {**head, "object": obj, "choices": [choice]}
                if d.finished:
                    chunk["kv_transfer_params"] = _kv_params(g, seqs[0].request_id)
                yield _sse(chunk)
            if body.stream_options and body.stream_options.include_usage:
                u = usage(len(seqs[0].prompt_ids), len(g.token_ids))
                yield _sse({**head, "object": obj, "choices": [], "usage": u})
            yield b"data: [DONE]\n\n"
        finally:
            if g.finish_reason is None:
                _abort(seqs)

    # -- the rest of vLLM's routes -----------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=500 if inst.core.error else 200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": inst.version}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [inst.model_card()]}

    @app.get("/metrics")
    async def metrics() -> Response:
        with contextlib.suppress(TimeoutError):  # not a step behind the last operation
            await asyncio.wait_for(inst.run(inst.core.publish_metrics), 5.0)
        return Response(generate_latest(inst.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/sleep")
    async def sleep(level: int = Query(1, ge=1, le=2)) -> Response:
        await inst.run(lambda: inst.core.sleep(level))
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags")
        wanted = set(tags or ("weights", "kv_cache"))
        unknown = wanted - {"weights", "kv_cache"}
        if unknown:
            raise BadRequestError(f"tags: unknown tag(s) {sorted(unknown)}", "tags")
        if "weights" in wanted and not inst.core.model.loaded:
            await inst.reload(None, inst.dir_version)  # the directory's weights, their version
        if "kv_cache" in wanted:
            await inst.run(inst.core.wake_kv)
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": inst.core.asleep}

    @app.post("/pause")
    async def pause(mode: str = Query("abort"), clear_cache: bool = Query(True)) -> dict[str, Any]:
        if mode not in ("abort", "wait", "keep"):
            raise BadRequestError(f"mode: {mode!r} is not one of abort, wait, keep", "mode")
        await inst.pause(mode, clear_cache)
        return {"is_paused": True}

    @app.post("/resume")
    async def resume() -> dict[str, Any]:
        await inst.run(inst.resume_now)
        return {"is_paused": False}

    @app.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": inst.paused}

    @app.post("/abort_requests")
    async def abort_requests(request: Request) -> dict[str, Any]:
        body = await inst.json_body(request)
        ids = body.get("request_ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise BadRequestError("request_ids: a list of request ids is required", "request_ids")
        if len(ids) > MAX_ABORT_IDS:
            raise BadRequestError(
                f"request_ids: at most {MAX_ABORT_IDS} in one call ({len(ids)} given)",
                "request_ids",
            )
        n = await inst.run(lambda: inst.core.abort(ids))
        return {"aborted": n}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        await inst.run(inst.core.reset_prefix_cache)
        return Response(status_code=200)

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> dict[str, Any]:
        body = await inst.json_body(request)
        method = body.get("method")
        if method not in RPC_METHODS:
            known = " and ".join(RPC_METHODS)
            raise BadRequestError(
                f"method: {_shown(method)} is not supported ({known} are)", "method"
            )
        kwargs = body.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise BadRequestError("kwargs: an object is required", "kwargs")
        path, ver = kwargs.get("weights_path"), kwargs.get("weight_version")
        if path is not None and not isinstance(path, str):
            raise BadRequestError("kwargs.weights_path: a directory's path is required", "kwargs")
        version = await inst.reload(path, weight_version_of(ver, "kwargs.weight_version"))
        return {"results": [{"weight_version": version}]}

    inst.push.attach(app)
    return app
