"""Running one reference-engine instance: the HTTP server and the KV side channel on one
event loop, the engine core on its own thread. SIGTERM and SIGINT stop it cleanly (uvicorn's
graceful shutdown), after which the engine thread is stopped."""

from __future__ import annotations

import asyncio

import uvicorn

from pearl.engines.reference import transfer
from pearl.engines.reference.instance import Instance, ServeOptions
from pearl.engines.reference.server import build_app


async def _serve(inst: Instance, opts: ServeOptions) -> None:
    side = None
    if opts.kv_port is not None:

        async def take(request_id: str) -> transfer.Tensors:
            return await inst.run(lambda: inst.core.take_held(request_id))

        side = await asyncio.start_server(
            transfer.serve(inst.engine_id, take), opts.host, opts.kv_port
        )
    config = uvicorn.Config(
        build_app(inst), host=opts.host, port=opts.port, log_level="warning", access_log=False
    )
    try:
        await uvicorn.Server(config).serve()
    finally:
        if side is not None:
            side.close()


def serve(opts: ServeOptions) -> int:
    inst = Instance(opts)
    inst.core.start()
    try:
        asyncio.run(_serve(inst, opts))
    finally:
        inst.core.shutdown()
    return 0
