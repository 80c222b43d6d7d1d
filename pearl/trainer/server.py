"""``pearl trainer serve``: a trainer backend in a process of its own, over HTTP.

The routes are the ``pearl.trainer.protocol.Trainer`` protocol, one each, so that the run
(``pearl run``, or a coordinator on another node) drives the trainer the way it drives
an engine: by its URL (``pearl.trainer.remote.RemoteTrainer`` is the client). The model,
the optimizer and the memory an offload frees are this process's.

    GET  /health                                   200 once the model is loaded
    GET  /state                                    {"version", "offloaded", "backend"}
    POST /train_step       a RolloutBatch (JSON)   {"metrics": TrainMetrics, "state"}
    POST /export_weights   {"out_dir"}             {"path", "state"}
    POST /offload, /onload                         {"state"}
    POST /save_checkpoint  {"path"}                {"state"}
    POST /load_checkpoint  {"path"}                {"state"}

One call at a time (a lock): an offload asked during an update waits for its end. A bad
request (a batch that does not parse, a checkpoint that is not there or not this model's,
a missing field) is 400 with vLLM's JSON error body; any other failure is 500 with the
same body. The guards are the engines' (``pearl.engines.protocol.install_guards``): a
body at most ``protocol.MAX_BODY_BYTES`` (a batch ``MAX_BATCH_BYTES``), else 413; an
unknown route 404, a wrong method 405, in the same body. FastAPI + uvicorn, as the
engines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from pearl.agents.batches import batch_of
from pearl.engines.protocol import error_response, install_guards
from pearl.io.documents import InputError
from pearl.trainer.config import TrainerConfig
from pearl.trainer.protocol import Trainer


class _Failed(Exception):
    """The trainer raised: a 500 with the error's body (a handler of its own, so the
    connection stays up: Starlette re-raises what only its catch-all handles)."""


MAX_BATCH_BYTES = 2**30  # the body of POST /train_step (any other: protocol.MAX_BODY_BYTES)
MAX_PATH_CHARS = 4096  # Linux's PATH_MAX


class _Path(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1, max_length=MAX_PATH_CHARS)


class _OutDir(BaseModel):
    model_config = ConfigDict(extra="forbid")
    out_dir: str = Field(min_length=1, max_length=MAX_PATH_CHARS)


def build_app(trainer: Trainer, backend: str = "reference") -> FastAPI:
    """The routes over ``trainer``; a batch that cannot be trained on (its own check,
    ``pearl.agents.batches.batch_problem``, or the trainer's: a token outside the
    vocabulary) is a 400 naming the field."""
    app = FastAPI(title="pearl trainer")
    install_guards(app, route_limits={"/train_step": MAX_BATCH_BYTES})
    lock = threading.Lock()

    def state() -> dict[str, Any]:
        return {
            "version": trainer.version,
            "offloaded": bool(getattr(trainer, "offloaded", False)),
            "backend": backend,
        }

    def locked(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        with lock:
            try:
                out = fn()
            except (InputError, ValueError):
                raise
            except (
                FileNotFoundError,
                NotADirectoryError,
                IsADirectoryError,
                PermissionError,
            ) as err:
                raise ValueError(f"{type(err).__name__}: {err}") from None  # the path asked: 400
            except Exception as err:  # answered 500, and the server goes on serving
                raise _Failed(f"{type(err).__name__}: {err}") from err
            return out | {"state": state()}

    @app.exception_handler(InputError)
    async def _input(_: Request, err: InputError) -> JSONResponse:
        return error_response(str(err), 400, err.field or None)

    @app.exception_handler(ValueError)
    async def _value(_: Request, err: ValueError) -> JSONResponse:
        return error_response(str(err), 400)

    @app.exception_handler(_Failed)
    async def _failed(_: Request, err: _Failed) -> JSONResponse:
        return error_response(str(err), 500)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/state")
    def get_state() -> dict[str, Any]:
        with lock:
            return state()

    @app.post("/train_step")
    async def train_step(request: Request) -> Response:
        text = (await request.body()).decode("utf-8", errors="replace")
        batch = batch_of(text, "request body")  # a ValueError naming the field: 400

        def step() -> dict[str, Any]:
            return {"metrics": dataclasses.asdict(trainer.train_step(batch))}

        out = await asyncio.to_thread(locked, step)  # a NaN loss stays NaN (not null)
        return Response(json.dumps(out, allow_nan=True), media_type="application/json")

    @app.post("/export_weights")
    def export_weights(body: _OutDir) -> dict[str, Any]:
        return locked(lambda: {"path": str(trainer.export_weights(Path(body.out_dir)))})

    @app.post("/offload")
    def offload() -> dict[str, Any]:
        return locked(lambda: _done(trainer.offload))

    @app.post("/onload")
    def onload() -> dict[str, Any]:
        return locked(lambda: _done(trainer.onload))

    @app.post("/save_checkpoint")
    def save_checkpoint(body: _Path) -> dict[str, Any]:
        return locked(lambda: _done(lambda: trainer.save_checkpoint(Path(body.path))))

    @app.post("/load_checkpoint")
    def load_checkpoint(body: _Path) -> dict[str, Any]:
        path = Path(body.path)
        if not path.is_dir():
            raise InputError(path, "path", "no such checkpoint directory")
        return locked(lambda: _done(lambda: trainer.load_checkpoint(path)))

    return app


def _done(fn: Callable[[], None]) -> dict[str, Any]:
    fn()
    return {}


def serve(
    model_dir: Path,
    config: TrainerConfig,
    host: str = "127.0.0.1",
    port: int = 8100,
    backend: str = "reference",
    options: Any = None,
) -> int:
    """The trainer of ``backend`` (reference, megatron: with its ``MegatronOptions``) on
    ``model_dir``, served until SIGTERM or SIGINT."""
    import uvicorn

    trainer: Trainer
    if backend == "megatron":
        from pearl.trainer.megatron.trainer import MegatronTrainer

        trainer = MegatronTrainer.start(model_dir, config, options)
    else:
        from pearl.trainer.reference import ReferenceTrainer

        trainer = ReferenceTrainer(model_dir, config)

    app = build_app(trainer, backend)
    uvicorn.run(  # idle connections outlive the client's (httpx drops its own after 5 s)
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=75,
        timeout_graceful_shutdown=5,
    )
    return 0
