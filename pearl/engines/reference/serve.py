"""Running one reference-engine instance: the HTTP server and the KV side channel on one
event loop, the engine core on its own thread. SIGTERM and SIGINT stop it cleanly (uvicorn's
graceful shutdown: every in-flight request is aborted and answered with its tokens so far),
after which the engine thread is stopped."""

from __future__ import annotations

import asyncio

import uvicorn

from pearl.engines.reference import transfer
from pearl.engines.reference.instance import Instance, ServeOptions
from pearl.engines.reference.server import build_app

SHUTDOWN_S = 5  # what in-flight responses get to finish once a stop is asked


async def _abort_on_shutdown(inst: Instance, server: uvicorn.Server) -> None:
    """Once uvicorn is told to stop, abort every sequence, so that each in-flight
    response ends (``finish_reason: abort``, its tokens so far) instead of holding the
    shutdown."""
    while not server.should_exit:
        await asyncio.sleep(0.05)
    await inst.run(inst.core.abort_all)


async def _serve(inst: Instance, opts: ServeOptions) -> None:
    side = None
    if opts.kv_port is not None:

        async def take(request_id: str) -> transfer.Tensors:
            return await inst.run(lambda: inst.core.take_held(request_id))

        side = await asyncio.start_server(
            transfer.serve(inst.engine_id, take), opts.host, opts.kv_port
        )
    config = uvicorn.Config(
        build_app(inst),
        host=opts.host,
        port=opts.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=SHUTDOWN_S,
    )
    server = uvicorn.Server(config)
    stopping = asyncio.ensure_future(_abort_on_shutdown(inst, server))
    try:
        await server.serve()
    finally:
        stopping.cancel()
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
