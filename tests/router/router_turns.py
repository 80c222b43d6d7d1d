"""Helpers of the router tests: a router over given engines, multi-turn trajectories
through it, the greedy check against a direct run, and the front served on a free port.

Greedy decoding makes a turn's output independent of where it runs, so a turn routed,
handed from prefill to decode, switched or migrated must equal the same prompt run
directly on one engine."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine_procs import EngineProc
from fastapi import FastAPI

from pearl.core.roles import Role
from pearl.engines.client import EngineClient
from pearl.engines.reference.tokenizer import Tokenizer
from pearl.router.router import Router, Sampling, Turn

T = TypeVar("T")
GREEDY = Sampling(max_tokens=12, temperature=0.0, ignore_eos=True)

Turns = list[tuple[list[int], list[int], list[str]]]  # prompt, output, where each part ran


def router_over(engines: list[EngineProc], roles: list[Role]) -> Router:
    """A router whose table holds ``engines``, ready in ``roles``."""
    r = Router()
    for e, role in zip(engines, roles, strict=True):
        r.table.serve(e.name, e.url, role)
    return r


async def direct(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    async with EngineClient(url) as c:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        body |= {"ignore_eos": True, "return_token_ids": True}
        resp = await c.completions(body)
    return [int(t) for t in resp["choices"][0]["token_ids"]]


async def trajectory(
    r: Router, traj: str, first: list[int], turns: int, sampling: Sampling = GREEDY
) -> Turns:
    """``turns`` turns; each prompt is the last one + its output + a short observation.
    Where a turn ran lists its prefill instance (disaggregated) and its decode ones."""
    prompt, out = list(first), []
    for t in range(turns):
        got = await r.generate(Turn(traj, tuple(prompt), sampling, f"{traj}-{t}"))
        out.append((prompt, got.token_ids, [*got.prefilled_by, *got.served_by]))
        prompt = [*prompt, *got.token_ids, 11, 12 + t]
    r.forget(traj)
    return out


def check_greedy(url: str, turns: Turns) -> None:
    for prompt, tokens, _ in turns:
        assert tokens == asyncio.run(direct(url, prompt, len(tokens))), "a token changed"


@dataclass
class Front:
    """The router's front, served by uvicorn on its own thread and event loop."""

    url: str
    app: FastAPI | None = None
    server: object = None
    loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        """Run a coroutine on the front's loop (where its router lives) and wait for it."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)


@contextmanager
def serving_front(
    make_router: Callable[[], Router], tokenizer: Tokenizer, model_name: str = "tiny"
) -> Iterator[Front]:
    """The front of the router ``make_router`` builds (on the front's own loop) at a free
    port, until the block ends."""
    import uvicorn

    from pearl.control.workers import free_port
    from pearl.router.front import build_front

    port = free_port()
    front = Front(f"http://127.0.0.1:{port}")

    def serve() -> None:
        async def main() -> None:
            r = make_router()
            front.app = build_front(r, tokenizer, model_name)
            front.loop = asyncio.get_running_loop()
            server = uvicorn.Server(uvicorn.Config(front.app, port=port, log_level="warning"))
            front.server = server
            await server.serve()
            await r.aclose()

        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        end = time.monotonic() + 20
        while front.server is None or not front.server.started:  # type: ignore[attr-defined]
            assert time.monotonic() < end and thread.is_alive(), "the front did not start"
            time.sleep(0.05)
        yield front
    finally:
        if front.server is not None:
            front.server.should_exit = True  # type: ignore[attr-defined]
        thread.join(timeout=10)
