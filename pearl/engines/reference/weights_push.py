"""Weights pushed by the trainer: vLLM's weight-transfer routes, with an HTTP body on CPU.

vLLM's flow (``docs/training/async_rl.md``): ``POST /init_weight_transfer_engine
{"init_info"}`` once, then per update ``POST /start_weight_update``, one or more ``POST
/update_weights``, and ``POST /finish_weight_update {"weight_version"}``. On GPUs the
tensors travel over NCCL and ``/update_weights`` carries only their names, dtypes and
shapes (``update_info``). The reference engine's equivalent is the same four routes with
the tensors in the body of ``/update_weights``: ``Content-Type: application/octet-stream``,
a safetensors file of Hugging Face names (any subset of the weights; each is checked
against the model's names and shapes when it arrives). The staged tensors take effect
together at ``/finish_weight_update``, between two engine steps: running requests go on
under the new weights, their later tokens carrying the new version.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
from fastapi import FastAPI, Request
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from pearl.engines.reference.engine import EngineCore
from pearl.engines.reference.errors import BadRequestError, weight_version_of
from pearl.engines.reference.model import CausalLM, WeightError

T = TypeVar("T")


class Host(Protocol):
    """What the routes need of the serving instance (``instance.Instance``)."""

    model: CausalLM
    core: EngineCore

    async def run(self, fn: Callable[[], T]) -> T: ...
    async def json_body(self, request: Request) -> dict[str, Any]: ...


BACKENDS = ("http",)


class WeightPush:
    def __init__(self, inst: Host) -> None:
        self.inst = inst
        self.backend: str | None = None
        self.staged: dict[str, torch.Tensor] | None = None

    def attach(self, app: FastAPI) -> None:
        inst = self.inst

        @app.post("/init_weight_transfer_engine")
        async def init_weight_transfer_engine(request: Request) -> dict[str, Any]:
            body = await inst.json_body(request)
            info = body.get("init_info") or {}
            backend = info.get("backend", "http") if isinstance(info, dict) else None
            if backend not in BACKENDS:
                raise BadRequestError(
                    f"init_info.backend: {backend!r}; the reference engine takes weights "
                    "over HTTP ('http')",
                    "init_info",
                )
            self.backend = backend
            return {"backend": backend}

        @app.post("/start_weight_update")
        async def start_weight_update() -> dict[str, Any]:
            self.staged = {}
            return {"started": True}

        @app.post("/update_weights")
        async def update_weights(request: Request) -> dict[str, Any]:
            if self.staged is None:
                raise BadRequestError("no weight update started (POST /start_weight_update)")
            if request.headers.get("content-type", "").split(";")[0] != (
                "application/octet-stream"
            ):
                raise BadRequestError(
                    "the reference engine takes the tensors in the body "
                    "(application/octet-stream, a safetensors file), not update_info",
                    "update_info",
                )
            try:
                tensors = st_load(await request.body())
            except (SafetensorError, ValueError) as err:
                raise BadRequestError(f"the body is not a safetensors file: {err}") from None
            shapes = inst.model.shapes
            if "lm_head.weight" in tensors and "lm_head.weight" not in shapes:
                tensors.pop("lm_head.weight")  # a tied model's head is its embedding
            for name, t in tensors.items():
                if name not in shapes:
                    raise BadRequestError(f"update_weights: unknown weight {name!r}")
                if tuple(t.shape) != shapes[name]:
                    raise BadRequestError(
                        f"update_weights: {name} has shape {tuple(t.shape)}, expected "
                        f"{shapes[name]}"
                    )
            self.staged.update(tensors)
            return {"staged": len(self.staged)}

        @app.post("/finish_weight_update")
        async def finish_weight_update(request: Request) -> dict[str, Any]:
            body = await inst.json_body(request)
            version = weight_version_of(body.get("weight_version"), "weight_version")
            if self.staged is None:
                raise BadRequestError("no weight update started (POST /start_weight_update)")
            staged, self.staged = self.staged, None
            try:
                v = await inst.run(lambda: inst.core.load_weights(staged, version, partial=True))
            except WeightError as err:
                raise BadRequestError(f"finish_weight_update: {err}") from None
            return {"weight_version": v}
